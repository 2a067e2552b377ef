"""The quantized-momentum ops and their prototype-named functional API.

Everything dispatches through ``torch.ops.qmuon.*`` (each op declared once in :mod:`._library`, with
its pure-PyTorch reference in :mod:`.reference` / :mod:`.reference_4bit` and, where it builds, a
compiled CPU / CUDA kernel from ``csrc/``; :func:`backend` says which runs).

The ``quantized_muon_*`` functions keep the names of the cppmega prototype design doc so that its
users can switch: they are thin wrappers of ``torch.ops.qmuon.q8_momentum_update_multi_`` on
:class:`QuantizedMuonState` lists (stream ids from ``(seed, step, index)``, block sums reduced to one
global norm or to the norm groups of a :class:`QuantizedMuonNormPlan`). New code can call the ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from . import _library  # noqa: F401  (registers torch.ops.qmuon.*)
from . import reference, reference_4bit
from ._library import empty_block_sumsq
from .norm_plan import (
    QuantizedMuonNormPlan,
    QuantizedMuonNormSegment,
    build_quantized_muon_norm_plan,
    reduce_block_sumsq,
)

__all__ = [
    "QuantizedMuonState",
    "QuantizedMuonNormSegment",
    "QuantizedMuonNormPlan",
    "build_quantized_muon_norm_plan",
    "reduce_block_sumsq",
    "empty_block_sumsq",
    "quantized_muon_momentum_update_multi_",
    "quantized_muon_momentum_update_multi_and_normalize_",
    "quantized_muon_momentum_update_multi_and_normalize_groups_",
    "backend",
    "reference",
    "reference_4bit",
]


def backend() -> str:
    """Which implementation ``torch.ops.qmuon`` runs: ``"reference"`` (pure PyTorch),
    ``"cpu-extension"`` or ``"cpu+cuda-extension"`` (compiled kernels from ``csrc/``; arguments a
    kernel does not support still run the reference). Builds the extension if it is not built yet
    (see :mod:`._extension`; ``QMUON_BACKEND=reference`` skips it)."""
    from ._extension import backend as _backend

    return _backend()


@dataclass
class QuantizedMuonState:
    """8-bit momentum of one matrix in the row-block layout (see :mod:`.reference`).

    ``data``: int8 or uint8 codes shaped like the matrix; ``absmax``: fp32 ``(rows, ceil(cols /
    block_size))``.
    """

    data: Tensor
    absmax: Tensor
    block_size: int = 256

    @classmethod
    def zeros(cls, rows: int, cols: int, *, dtype: torch.dtype = torch.int8, block_size: int = 256,
              device: torch.device | str | None = None) -> "QuantizedMuonState":
        if dtype not in (torch.int8, torch.uint8):
            raise ValueError(f"8-bit momentum codes must be torch.int8 or torch.uint8, got {dtype}")
        zero = 0 if dtype == torch.int8 else 128
        data = torch.full((rows, cols), zero, dtype=dtype, device=device)
        absmax = torch.zeros((rows, reference.num_blocks(cols, block_size)), dtype=torch.float32, device=device)
        return cls(data, absmax, block_size)

    def dequantize(self) -> Tensor:
        return torch.ops.qmuon.dequantize_rows(self.data, self.absmax, self.block_size)


def _update(
    states: Sequence[QuantizedMuonState],
    grads: Sequence[Tensor],
    beta: float,
    nesterov: bool,
    rounding: str,
    seed: int,
    step: int,
    row_offsets: Sequence[int] | None,
) -> list[Tensor]:
    if len(states) != len(grads):
        raise ValueError(f"got {len(states)} states but {len(grads)} grads")
    if not states:
        return []
    bs = {s.block_size for s in states}
    if len(bs) != 1:
        raise ValueError(f"all states in one call must share block_size, got {sorted(bs)}")
    if rounding not in ("nearest", "stochastic"):
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    for i, (s, g) in enumerate(zip(states, grads)):
        if tuple(g.shape) != tuple(s.data.shape):
            raise ValueError(f"grad {i} has shape {tuple(g.shape)} but its state has {tuple(s.data.shape)}")
    streams = [reference.noise_stream(seed, step, i) if rounding == "stochastic" else -1 for i in range(len(states))]
    offsets = list(row_offsets) if row_offsets is not None else [0] * len(states)
    block_size = int(bs.pop())
    codes = [s.data for s in states]
    sums = empty_block_sumsq(codes, block_size)
    torch.ops.qmuon.q8_momentum_update_multi_(
        codes, [s.absmax for s in states], list(grads), sums,
        float(beta), bool(nesterov), block_size, streams, offsets,
    )
    return sums


def quantized_muon_momentum_update_multi_(
    states: Sequence[QuantizedMuonState],
    grads: Sequence[Tensor],
    *,
    beta: float,
    nesterov: bool = False,
    rounding: str = "nearest",
    seed: int = 0,
    step: int = 0,
    row_offsets: Sequence[int] | None = None,
) -> None:
    """``m = beta * m + (1 - beta) * g`` on 8-bit state, for many tensors in one call (the prototype's
    name for ``torch.ops.qmuon.q8_momentum_update_multi_``).

    Each grad is overwritten with the updated momentum (or the Nesterov blend
    ``lerp(g, m, beta)`` when ``nesterov``), which is the Newton-Schulz input.
    """
    _update(states, grads, beta, nesterov, rounding, seed, step, row_offsets)


def quantized_muon_momentum_update_multi_and_normalize_(
    states: Sequence[QuantizedMuonState],
    grads: Sequence[Tensor],
    *,
    beta: float,
    eps: float = 1e-7,
    nesterov: bool = False,
    rounding: str = "nearest",
    seed: int = 0,
    step: int = 0,
) -> Tensor:
    """Update, then divide every grad by one global Frobenius norm over the whole list (the
    prototype's contract). Returns that norm (clamped at ``eps``)."""
    sums = _update(states, grads, beta, nesterov, rounding, seed, step, None)
    if not sums:
        return torch.zeros(())
    norm = torch.stack([s.sum() for s in sums]).sum().sqrt().clamp(min=eps)
    torch._foreach_mul_(list(grads), (1.0 / norm).to(grads[0].dtype))
    return norm


def quantized_muon_momentum_update_multi_and_normalize_groups_(
    states: Sequence[QuantizedMuonState],
    grads: Sequence[Tensor],
    plan: QuantizedMuonNormPlan,
    *,
    beta: float,
    eps: float = 1e-7,
    nesterov: bool = False,
    normalize: bool = True,
    tp_group: "torch.distributed.ProcessGroup | None" = None,
    rounding: str = "nearest",
    seed: int = 0,
    step: int = 0,
    row_offsets: Sequence[int] | None = None,
) -> Tensor:
    """Update and reduce a sum of squares per logical norm group (fused QKV parts, shards).

    With ``tp_group`` the ``num_groups`` sums are all-reduced so every rank sees global norms.
    With ``normalize`` every block of every grad is divided by its group's norm; with
    ``normalize=False`` the grads keep the raw NS input and the caller folds ``1 / norm`` into
    Newton-Schulz (what :class:`qmuon.QMuon` does). Returns the per-group sums of squares.
    """
    sums = _update(states, grads, beta, nesterov, rounding, seed, step, row_offsets)
    group_sumsq = reduce_block_sumsq(sums, plan)
    if tp_group is not None:
        torch.distributed.all_reduce(group_sumsq, group=tp_group)
    if normalize:
        inv = group_sumsq.sqrt().clamp(min=eps).reciprocal()
        ids = plan.block_group_ids.to(inv.device)
        offset = 0
        for s, g in zip(states, grads):
            rows, cols = s.data.shape
            nb = s.absmax.shape[1]
            block_inv = inv[ids[offset: offset + rows * nb]].reshape(rows, nb)
            offset += rows * nb
            per_col = block_inv.repeat_interleave(s.block_size, dim=1)[:, :cols]
            g.mul_(per_col.to(g.dtype))
    return group_sumsq
