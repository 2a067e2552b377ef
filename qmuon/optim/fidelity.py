"""Fidelity of quantized momentum: how close is a quantized-state Muon update to the fp32-state one?

:func:`per_layer_update_cosine` runs one :class:`~qmuon.QMuon` per state format on clones of
the same parameters, feeds every optimizer the same gradient sequence and compares each step's
update (the parameter change, with ``lr=1`` and no weight decay, i.e. the orthogonalized update)
with the fp32-state update, per layer. The metrics and the synthetic gradients it is used with are
in :mod:`qmuon.quant.fidelity`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from ..quant.fidelity import cosine
from .qmuon import QMuon

__all__ = ["per_layer_update_cosine"]


def per_layer_update_cosine(
    params: Sequence[Tensor | tuple[int, int]],
    grads: Sequence[Sequence[Tensor]],
    formats: Sequence[str] = ("int8", "int4", "e0m3", "grasp4"),
    *,
    reference: str = "fp32",
    reduce: str = "mean",
    skip: int = 0,
    **qmuon_kwargs: Any,
) -> dict[str, list[float]]:
    """Per-layer cosine between each format's Muon update and the ``reference``-state update.

    Args:
        params: the matrices (their values are cloned; the originals are untouched) or shapes.
        grads: ``grads[t][i]`` is parameter ``i``'s gradient at step ``t`` (same for every format).
        formats: state formats to compare.
        reduce: ``"mean"`` over steps ``skip..`` or ``"last"``.
        qmuon_kwargs: passed to every :class:`~qmuon.QMuon` (``momentum``, ``state={"block_size": 32}``,
            ``update={"nesterov": False}``, ...).

    Returns ``{format: [cosine per layer]}``.
    """
    if reduce not in ("mean", "last"):
        raise ValueError(f"reduce must be 'mean' or 'last', got {reduce!r}")
    init = [torch.zeros(p) if isinstance(p, tuple) else p.detach().float() for p in params]
    kw = {"lr": 1.0, "weight_decay": 0.0, **qmuon_kwargs}

    def updates(fmt: str) -> list[list[Tensor]]:
        ps = [torch.nn.Parameter(p.clone()) for p in init]
        opt = QMuon(ps, state_format=fmt, **kw)
        out = []
        for step_grads in grads:
            before = [p.detach().clone() for p in ps]
            for p, g in zip(ps, step_grads, strict=True):
                p.grad = g.detach().clone().to(p.dtype)
            opt.step()
            out.append([b - p.detach() for b, p in zip(before, ps)])
        return out

    ref_updates = updates(reference)
    result: dict[str, list[float]] = {}
    for fmt in formats:
        upd = updates(fmt)
        steps = range(len(grads) - 1, len(grads)) if reduce == "last" else range(skip, len(grads))
        result[fmt] = [
            sum(cosine(upd[t][i], ref_updates[t][i]) for t in steps) / len(steps) for i in range(len(init))
        ]
    return result
