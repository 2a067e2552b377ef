"""Where each parameter's elements live under each ZeRO stage, and which rank owns each Muon matrix.

Pure bookkeeping (no communication): the engine readers take DeepSpeed's ZeRO optimizer and return,
per parameter and rank, the slice that rank's flat fp32 partition holds (:class:`_Segment`).

- stages 1/2 (:func:`partition_segments`): each parameter group is one flat buffer cut into ``N``
  equal partitions whose boundaries ignore parameter boundaries;
- stage 3 (:func:`zero3_segments`): every parameter is cut on its own into ``N`` pieces of
  ``ceil(numel / N)`` elements (the last ones padded), and rank ``r``'s flat partition of a
  sub-group is its pieces of the sub-group's parameters, one after another.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...core.plan import MatrixPart

@dataclass(frozen=True)
class _Segment:
    """The elements ``[start, start + length)`` of a parameter (flattened row-major) held by one rank,
    at offset ``local`` of that rank's flat partition (or of the parameter itself at stage 0)."""

    start: int
    length: int
    local: int


@dataclass
class _Param:
    index: int  # global index over all groups (QMuon's stochastic-rounding key)
    group: int
    pos: int  # position in its group
    shape: torch.Size  # the full shape (ZeRO-3 partitioned parameters: their ds_shape)
    numel: int
    muon: bool
    parts: tuple[MatrixPart, ...] = ()  # the matrices of a Muon parameter (QMuon's plan)
    owner: int = 0
    subgroup: int = 0  # ZeRO-3: the sub-group whose flat partition holds it
    holders: list[_Segment | None] = dataclasses.field(default_factory=list)  # per rank

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.numel // self.shape[0]


def assign_owners(sizes: list[int], world_size: int) -> list[int]:
    """Deal matrices to ranks: largest first, each to the currently least loaded rank (ties: lowest
    rank, then lowest index). Deterministic, so every rank computes the same table. The greedy
    longest-processing-time rule keeps the heaviest rank within 4/3 of the optimum."""
    load = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += sizes[i]
    return owners


def partition_segments(offset: int, numel: int, partition_size: int, world_size: int) -> list[_Segment | None]:
    """Which slice of a parameter at flat offset ``offset`` each rank's ZeRO partition holds.

    Rank ``r``'s partition is ``[r * partition_size, (r + 1) * partition_size)`` of the group's flat
    buffer (``DeepSpeedZeroOptimizer.get_data_parallel_partitions``); a parameter is one contiguous
    range of that buffer, so each rank holds at most one contiguous slice of it.
    """
    out: list[_Segment | None] = []
    for r in range(world_size):
        lo, hi = r * partition_size, (r + 1) * partition_size
        a, b = max(offset, lo), min(offset + numel, hi)
        out.append(_Segment(a - offset, b - a, a - lo) if b > a else None)
    return out


def _part_runs(part: MatrixPart, cols: int, start: int, length: int) -> list[tuple[int, int, int, int, int]]:
    """The elements of ``part`` in the flat slice ``[start, start + length)`` of its row-major
    ``(rows, cols)`` parameter, as runs ``(offset, n, width, c0, c1)``: the slice's elements
    ``[offset, offset + n * width)`` seen as ``n x width`` hold the part in columns ``[c0, c1)``.
    At most three runs: a partial first row, whole rows, a partial last row (ZeRO partitions cut
    parameters anywhere)."""
    lo, hi = max(part.r0 * cols, start), min(part.r1 * cols, start + length)
    pieces = []  # (first row, rows, first column, last column + 1) of the parameter
    while lo < hi:
        row, col = divmod(lo, cols)
        if col or hi - lo < cols:  # a partial row
            end = min(hi, (row + 1) * cols)
            pieces.append((row, 1, col, end - row * cols))
            lo = end
        else:
            n = (hi - lo) // cols
            pieces.append((row, n, 0, cols))
            lo += n * cols
    out = []
    for row, n, a, b in pieces:
        c0, c1 = max(a, part.c0), min(b, part.c1)
        if c1 > c0:
            out.append((row * cols + a - start, n, b - a, c0 - a, c1 - a))
    return out


def _apply_parts(parts: tuple[MatrixPart, ...], where: str) -> tuple[MatrixPart, ...]:
    """The parts :meth:`WholeMatrixZeroOptimizer._apply_update` applies, as ranges of the stored
    ``(rows, cols)`` matrix. A bank member's parts (gate and up of one expert; gpt-oss interleaves
    them) share the member's range, which then gets one scaled update: their lr factors must agree
    (equal fused parts; always so for transformers' experts)."""
    out: dict[tuple[int, int, int, int], MatrixPart] = {}
    for part in parts:
        key = (part.r0, part.r1, part.c0, part.c1)
        seen = out.setdefault(key, part)
        if seen.lr_scale != part.lr_scale:
            raise NotImplementedError(
                f"parameter {where!r}: the fused parts of one bank member have different lr adjustments "
                f"({seen.lr_scale} and {part.lr_scale}); under DeepSpeed a bank member's parts must have equal "
                "shapes. Use equal parts or FSDP2 (qmuon_fsdp)")
    return tuple(out.values())


def row_pieces(shape: torch.Size, start: int, length: int) -> list[tuple[int, int, int]]:
    """A flat slice ``[start, start + length)`` of a parameter of ``shape`` (flattened row-major) cut
    on row boundaries, as ``(offset in the slice, rows, width)`` pieces, each a contiguous
    ``(rows, width)`` matrix: a partial first row, the whole rows, a partial last row (at most three;
    1-D parameters are ``(n, 1)``: one piece). How a slice whose AdamW moments are elementwise (fp32)
    is stepped when its weights are bf16: each piece is written through ``bf16_update`` with the
    rounding counter of its first element in the whole parameter, in bounded row blocks."""
    cols = math.prod(int(s) for s in shape[1:]) if len(shape) > 1 else 1
    pieces: list[tuple[int, int, int]] = []
    pos, end = start, start + length
    while pos < end:
        c = pos % cols
        if c == 0 and end - pos >= cols:
            k = (end - pos) // cols
            pieces.append((pos - start, k, cols))
            pos += k * cols
            continue
        stop = min(end, pos - c + cols)
        pieces.append((pos - start, 1, stop - pos))
        pos = stop
    return pieces


def _placeholder(shape: torch.Size, device: torch.device) -> Tensor:
    """A tensor of ``shape`` backed by one element: what an idle proxy looks like (never written)."""
    return torch.zeros(1, dtype=torch.float32, device=device).expand(shape)


def zero3_segments(numel: int, partition_numel: int, local: int, world_size: int) -> list[_Segment | None]:
    """Which slice of a parameter each rank holds under ZeRO stage 3.

    DeepSpeed cuts every parameter on its own (``partition_parameters._partition_param``): rank ``r``
    holds its flattened elements ``[r * partition_numel, (r + 1) * partition_numel)`` with
    ``partition_numel = ceil(numel / N)``, the last ranks' pieces padded (a rank may hold only
    padding). Its piece sits at offset ``local`` of the rank's flat fp32 partition of the sub-group,
    the same offset on every rank (every piece is ``partition_numel`` long, padding included).
    """
    out: list[_Segment | None] = []
    for r in range(world_size):
        start = r * partition_numel
        n = min(partition_numel, numel - start)
        out.append(_Segment(start, n, local) if n > 0 else None)
    return out


# ------------------------------------------------------------------------------ engine readers
def read_zero12_layout(zero: Any, params: list[_Param], world_size: int) -> None:
    """Fill ``holders`` of every parameter from a ``DeepSpeedZeroOptimizer`` (stages 1/2): its
    storage offset in the group's flat buffer (DeepSpeed points each model parameter at a view of
    it), cross-checked against DeepSpeed's own record of the offsets."""
    by_group: dict[int, list[_Param]] = defaultdict(list)
    for info in params:
        by_group[info.group].append(info)
    for gi, infos in by_group.items():
        flat = zero.bit16_groups_flat[gi]
        psize = int(zero.partition_size[gi])
        if psize * world_size != flat.numel():
            raise RuntimeError(f"group {gi}: partition size {psize} x {world_size} ranks != flat size {flat.numel()}")
        model_params = zero.bit16_groups[gi]
        if len(model_params) != len(infos):
            raise RuntimeError(f"group {gi}: DeepSpeed flattened {len(model_params)} parameters, QMuon has {len(infos)}")
        declared = {}
        for p, off in zip(getattr(zero, "round_robin_bit16_groups", [[]] * (gi + 1))[gi],
                          getattr(zero, "round_robin_bit16_offsets", [[]] * (gi + 1))[gi]):
            declared[id(p)] = int(off)
        for info, p in zip(infos, model_params):
            if p.shape != info.shape:
                raise RuntimeError(f"group {gi}: parameter order differs from DeepSpeed's ({tuple(p.shape)} vs "
                                   f"{tuple(info.shape)})")
            delta = p.data_ptr() - flat.data_ptr()
            if delta % flat.element_size() or not 0 <= delta // flat.element_size() <= flat.numel() - info.numel:
                raise RuntimeError(f"group {gi}: a parameter is not a view of DeepSpeed's flat buffer")
            off = delta // flat.element_size()
            if id(p) in declared and declared[id(p)] != off:
                raise RuntimeError(f"group {gi}: flat offset {off} disagrees with DeepSpeed's {declared[id(p)]}")
            info.holders = partition_segments(off, info.numel, psize, world_size)


def read_zero3_layout(zero: Any, params: list[_Param], world_size: int) -> list[Tensor]:
    """Fill ``holders`` and ``subgroup`` of every parameter from a ``DeepSpeedZeroOptimizer_Stage3``
    and return its flat fp32 partitions (one per sub-group; the tensors DeepSpeed hands to ``step``).

    DeepSpeed splits each parameter group into sub-groups (``sub_group_size`` elements of partitions
    each, in the group's order); a parameter's piece sits in its sub-group's flat partition after the
    pieces (``partition_numel()`` each, padding included) of the parameters before it. The offsets are
    cross-checked against where DeepSpeed put each piece (``ds_tensor`` is a view of the sub-group's
    flat low-precision buffer) and the true shapes (``ds_shape``) against QMuon's."""
    by_group: dict[int, list[_Param]] = defaultdict(list)
    for info in params:
        by_group[info.group].append(info)
    seen: dict[int, list[Any]] = defaultdict(list)  # group -> DeepSpeed's parameters, sub-group by sub-group
    where: dict[int, list[tuple[int, int]]] = defaultdict(list)  # group -> (sub-group, local offset)
    flats = list(zero.fp32_partitioned_groups_flat)
    for sg, sub in enumerate(zero.fp16_groups):
        gi = int(zero.sub_group_to_group_id[sg])
        low = zero.fp16_partitioned_groups_flat[sg] if sg < len(zero.fp16_partitioned_groups_flat) else None
        local = 0
        for p in sub:
            if int(p.partition_numel()) * world_size < int(p.ds_numel):
                raise RuntimeError(f"sub-group {sg}: a parameter's pieces ({p.partition_numel()} x {world_size}) do "
                                   f"not cover its {p.ds_numel} elements")
            if low is not None and p.ds_tensor.numel():
                delta = p.ds_tensor.data_ptr() - low.data_ptr()
                if delta != local * low.element_size():
                    raise RuntimeError(f"sub-group {sg}: a partition sits at byte {delta} of the flat buffer, expected "
                                       f"{local * low.element_size()}")
            seen[gi].append(p)
            where[gi].append((sg, local))
            local += int(p.partition_numel())
        if flats[sg].numel() != local:
            raise RuntimeError(f"sub-group {sg}: flat fp32 partition has {flats[sg].numel()} elements, its pieces {local}")
    for gi, infos in by_group.items():
        if len(seen[gi]) != len(infos):
            raise RuntimeError(f"group {gi}: DeepSpeed partitioned {len(seen[gi])} parameters, QMuon has {len(infos)}")
        for info, p, (sg, local) in zip(infos, seen[gi], where[gi]):
            if tuple(p.ds_shape) != tuple(info.shape):
                raise RuntimeError(f"group {gi}: parameter order differs from DeepSpeed's ({tuple(p.ds_shape)} vs "
                                   f"{tuple(info.shape)})")
            info.subgroup = sg
            info.holders = zero3_segments(info.numel, int(p.partition_numel()), local, world_size)
    return flats



#: The DeepSpeed optimizers that wrap a client optimizer and whose layout the wrapper reads.
ZERO_WRAPPERS = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "FP16_UnfusedOptimizer")


def find_zero_wrapper(client: Any) -> Any:
    """The DeepSpeed optimizer whose ``.optimizer`` is ``client``, found among the objects that refer
    to it, or ``client`` itself when none wraps it (ZeRO stage 0 with fp32 weights: the engine steps
    the client directly). For a ``deepspeed.initialize`` called by someone else (Accelerate, under
    ``transformers.Trainer``), where no engine is handed back; run once, at the first call."""
    import gc

    for ref in gc.get_referrers(client):
        owners = [ref]
        if isinstance(ref, dict):  # an instance's __dict__: its owner refers to it
            owners = [o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref]
        for o in owners:
            if type(o).__name__ in ZERO_WRAPPERS and getattr(o, "optimizer", None) is client:
                return o
    return client
