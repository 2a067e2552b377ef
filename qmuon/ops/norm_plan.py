"""Norm groups for the fused update: which row blocks share one Frobenius norm.

Muon normalizes each logical matrix before Newton-Schulz. A fused QKV weight holds three logical
matrices (row ranges), and a tensor-parallel shard holds a piece of one. The update kernel produces
a sum of squares per row block; a :class:`QuantizedMuonNormPlan` maps every block of every tensor
to a logical group, so the per-group sums (and, after an optional all-reduce, the norms) follow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from .reference import num_blocks

__all__ = [
    "QuantizedMuonNormSegment",
    "QuantizedMuonNormPlan",
    "build_quantized_muon_norm_plan",
    "reduce_block_sumsq",
]


@dataclass(frozen=True)
class QuantizedMuonNormSegment:
    """Elements ``[start, start + length)`` of tensor ``tensor_index`` (row-major flat index)
    belong to norm group ``group_id``. Both ends must fall on row-block boundaries."""

    tensor_index: int
    start: int
    length: int
    group_id: int


@dataclass(frozen=True)
class QuantizedMuonNormPlan:
    """``block_group_ids``: int64, one entry per row block of every tensor, in tensor order then
    row-major block order (the order in which the update op returns block sums)."""

    block_group_ids: Tensor
    num_groups: int
    blocks_per_tensor: tuple[int, ...]

    def to(self, device: torch.device) -> "QuantizedMuonNormPlan":
        return QuantizedMuonNormPlan(self.block_group_ids.to(device), self.num_groups, self.blocks_per_tensor)


def _shape2d(state_or_shape) -> tuple[int, int]:
    data = getattr(state_or_shape, "data", state_or_shape)
    shape = tuple(data.shape) if isinstance(data, Tensor) else tuple(data)
    if len(shape) != 2:
        raise ValueError(f"norm plans need 2-D tensors, got shape {shape}")
    return shape  # type: ignore[return-value]


def build_quantized_muon_norm_plan(
    states: Sequence,
    segments: Sequence[QuantizedMuonNormSegment],
    num_groups: int | None = None,
    *,
    block_size: int | None = None,
) -> QuantizedMuonNormPlan:
    """Build the block -> group map. ``states`` are objects with ``.data`` (codes) and
    ``.block_size``, or plain 2-D shapes together with ``block_size``.

    Every block must be covered by exactly one segment; a segment boundary inside a block is an
    error (the kernel reduces whole blocks, so such a split cannot be honoured in one pass).
    """
    per_tensor: list[Tensor] = []
    counts: list[int] = []
    by_tensor: dict[int, list[QuantizedMuonNormSegment]] = {}
    for seg in segments:
        if not 0 <= seg.tensor_index < len(states):
            raise ValueError(f"segment {seg} names tensor {seg.tensor_index}, but there are {len(states)} tensors")
        if seg.length <= 0 or seg.start < 0 or seg.group_id < 0:
            raise ValueError(f"segment {seg} needs start >= 0, length > 0 and group_id >= 0")
        by_tensor.setdefault(seg.tensor_index, []).append(seg)
    max_gid = -1
    for t, st in enumerate(states):
        rows, cols = _shape2d(st)
        bs = getattr(st, "block_size", None) or block_size
        if bs is None:
            raise ValueError("pass block_size= when states are plain shapes")
        nb = num_blocks(cols, bs)
        cb = torch.arange(nb, dtype=torch.int64)
        r = torch.arange(rows, dtype=torch.int64)
        bstart = (r[:, None] * cols + cb[None, :] * bs).flatten()
        bend = (r[:, None] * cols + torch.clamp((cb[None, :] + 1) * bs, max=cols)).flatten()
        gid = torch.full_like(bstart, -1)
        for seg in by_tensor.get(t, []):
            end = seg.start + seg.length
            if end > rows * cols:
                raise ValueError(f"segment {seg} ends at {end}, past tensor {t}'s {rows * cols} elements")
            inside = (bstart >= seg.start) & (bstart < end)
            partial = inside & (bend > end) | (bstart < seg.start) & (bend > seg.start)
            if bool(partial.any()):
                raise ValueError(
                    f"segment {seg} splits a {bs}-element row block of tensor {t} (shape {rows}x{cols}); "
                    "segment boundaries must fall on row-block boundaries"
                )
            if bool((gid[inside] >= 0).any()):
                raise ValueError(f"segment {seg} overlaps another segment of tensor {t}")
            gid[inside] = seg.group_id
            max_gid = max(max_gid, seg.group_id)
        if bool((gid < 0).any()):
            raise ValueError(f"tensor {t} (shape {rows}x{cols}) has row blocks that no segment covers")
        per_tensor.append(gid)
        counts.append(nb * rows)
    n = max_gid + 1 if num_groups is None else num_groups
    if max_gid >= n:
        raise ValueError(f"group id {max_gid} >= num_groups={n}")
    ids = torch.cat(per_tensor) if per_tensor else torch.zeros(0, dtype=torch.int64)
    return QuantizedMuonNormPlan(ids, n, tuple(counts))


def reduce_block_sumsq(block_sums: Sequence[Tensor], plan: QuantizedMuonNormPlan) -> Tensor:
    """Per-block sums (as the update ops return them) -> fp32 per-group sums ``(num_groups,)``."""
    flat = torch.cat([s.reshape(-1) for s in block_sums])
    if flat.numel() != plan.block_group_ids.numel():
        raise ValueError(f"plan covers {plan.block_group_ids.numel()} blocks but the update produced {flat.numel()}")
    out = torch.zeros(plan.num_groups, dtype=torch.float32, device=flat.device)
    return out.index_add_(0, plan.block_group_ids.to(flat.device), flat)
