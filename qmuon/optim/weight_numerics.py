"""Which bf16 weights lose their updates under nearest rounding.

A bf16 weight ``w`` has 8 significant bits: the gap to its neighbours is ``ulp(w) = 2**(e(w) - 7)``,
about ``|w| / 128``. Nearest rounding keeps an update only if it exceeds half of that; an AdamW
step (about ``lr``) at lr 3e-4 is lost on every weight above ~0.08 in magnitude, a Muon step
(``lr * sqrt(max(1, m/n)) * O``, ``|O|`` about ``1 / sqrt(n)``) on weights above ~``512 lr / sqrt(n)``.
``bf16_update="stochastic"`` or ``"ecc8"`` keeps them (:mod:`qmuon.core.apply`).

:func:`bf16_stall_report` runs one real optimizer step while counting, for every bf16 parameter,
the elements whose update nearest rounding would drop (``bf16(x) == w`` though ``x != w``), and
returns the parameters above a share, worst first. :class:`~qmuon_lightning.callbacks.BF16StallMonitor`
runs it every N steps in a Lightning run.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from ..core.apply import StallCounts, record_stalls

__all__ = ["bf16_stall_report", "stall_shares"]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def stall_shares(counts: StallCounts, named_params: Iterable[tuple[str, Tensor]]) -> list[dict[str, Any]]:
    """``[{"param", "numel", "moved", "stalled", "share"}]`` for the parameters ``counts`` saw,
    ``share`` = stalled / elements that received an update, sorted worst first (this rank's rows
    for sharded parameters)."""
    out = []
    for name, p in named_params:
        ptr = _local(p).untyped_storage().data_ptr()
        if ptr not in counts.numel:
            continue
        moved, stalled = counts.moved[ptr], counts.stalled[ptr]
        out.append({"param": name, "numel": counts.numel[ptr], "moved": moved, "stalled": stalled,
                    "share": stalled / moved if moved else 0.0})
    return sorted(out, key=lambda r: -r["share"])


def bf16_stall_report(optimizer: torch.optim.Optimizer, named_params: Iterable[tuple[str, Tensor]],
                      closure: Callable[[], Any] | None = None, *, min_share: float = 0.0) -> list[dict[str, Any]]:
    """Run ``optimizer.step(closure)`` (a real step, applied with the optimizer's own rule) and
    report the bf16 parameters whose update nearest rounding would lose on more than ``min_share``
    of their updated elements (see :func:`stall_shares`). ``named_params``: e.g.
    ``model.named_parameters()``. fp32 parameters never appear (their writes are exact)."""
    named = list(named_params)
    with record_stalls() as counts:
        optimizer.step(closure)
    return [r for r in stall_shares(counts, named) if r["share"] > min_share]
