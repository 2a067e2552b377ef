"""Whole matrices over flat partitions: each rank holds a flat element range of each parameter
(DeepSpeed ZeRO's partitions), which cuts a row-major matrix anywhere: a partial first row, whole
rows, a partial last row (:func:`row_pieces`). Every Muon matrix has an owner, dealt by the sharded
step's planner (:func:`deal_owners`), that runs Newton-Schulz on it whole.

:class:`FlatExchange` moves each rank's slice of a matrix's NS input to the owner through
``newton_schulz.comm_carrier`` (with the fp32 per-row-block sums of squares of the slice's rows
when the ranks keep the momentum of their slices, as FSDP2's ranks keep their rows'; at ZeRO stage 0
every rank holds the averaged gradient and nothing travels) and the result back through
``comm_return``: the sharded step's carriers (:mod:`.carrier`), row-local, applied per row piece and
to every piece, the owner's own included (as under FSDP2: the update does not depend on which rank
owns a matrix), fp32 when nothing crosses a process boundary. With ``fp32`` carriers (``bf16`` for
bf16 gradients) the step is single-process QMuon's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.plan import MatrixPart
from .carrier import Carrier, get_carrier
from .plan import comm_figures, plan_owners

__all__: list[str] = []


@dataclass(frozen=True)
class Segment:
    """The elements ``[start, start + length)`` of a parameter (flattened row-major) held by one rank,
    at offset ``local`` of that rank's flat partition (or of the parameter itself at stage 0)."""

    start: int
    length: int
    local: int


@dataclass
class FlatParam:
    """One parameter of a flat layout: where every rank's slice of it sits."""

    index: int  # global index over all groups (QMuon's stochastic-rounding key)
    group: int
    pos: int  # position in its group
    shape: torch.Size  # the full shape (ZeRO-3 partitioned parameters: their ds_shape)
    numel: int
    muon: bool
    parts: tuple[MatrixPart, ...] = ()  # the matrices of a Muon parameter (QMuon's plan)
    owner: int = 0
    subgroup: int = 0  # ZeRO-3: the sub-group whose flat partition holds it
    holders: list[Segment | None] = dataclasses.field(default_factory=list)  # per rank

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.numel // self.shape[0] if len(self.shape) > 1 else 1

    def n_of(self, r: int) -> int:
        """Elements rank ``r`` holds (the planner's tie-break: the owner holding most moves least)."""
        seg = self.holders[r]
        return 0 if seg is None else seg.length


def deal_owners(params: list[FlatParam], world: int) -> None:
    """Set the owner of every Muon parameter with the sharded step's planner (every rank computes
    the same plan)."""
    muon = [p for p in params if p.muon]
    for p, owner in zip(muon, plan_owners(muon, world)):
        p.owner = owner


def row_pieces(cols: int, start: int, length: int) -> list[tuple[int, int, int]]:
    """A flat slice ``[start, start + length)`` of a row-major parameter with ``cols`` elements per
    row (``numel // shape[0]``; 1 for 1-D parameters) cut on row boundaries, as ``(offset in the
    slice, rows, width)`` pieces, each a contiguous
    ``(rows, width)`` matrix: a partial first row, the whole rows, a partial last row (at most three;
    1-D parameters are ``(n, 1)``: one piece). The carriers encode these pieces; AdamW slices with
    elementwise moments and bf16 weights are written piece by piece."""
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


def part_runs(part: MatrixPart, cols: int, start: int, length: int) -> list[tuple[int, int, int, int, int]]:
    """The elements of ``part`` in the flat slice ``[start, start + length)`` of its row-major
    ``(rows, cols)`` parameter, as runs ``(offset, n, width, c0, c1)``: the slice's elements
    ``[offset, offset + n * width)`` seen as ``n x width`` hold the part in columns ``[c0, c1)``."""
    out = []
    for off, n, width in row_pieces(cols, start, length):
        a = (start + off) % cols  # the piece's first column in the parameter
        row = (start + off) // cols
        if row + n <= part.r0 or row >= part.r1:
            continue
        r0, r1 = max(row, part.r0), min(row + n, part.r1)
        c0, c1 = max(a, part.c0), min(a + width, part.c1)
        if c1 > c0:
            out.append((off + (r0 - row) * width, r1 - r0, width, c0 - a, c1 - a))
    return out


class FlatExchange:
    """The Newton-Schulz exchange of a flat layout over ``group`` (see the module docstring).

    Per optimizer step: :meth:`gather` (ZeRO 1-3) and :meth:`scatter` per call, then
    :attr:`comm_stats` holds the step's figures (a step may take several calls: DeepSpeed steps one
    parameter group, or ZeRO-3 sub-group, per call)."""

    def __init__(self, group: Any, world: int, rank: int, comm_carrier: str, comm_return: str) -> None:
        self.group, self.world, self.rank = group, world, rank
        lossless = world == 1  # nothing crosses a process boundary: the step is plain QMuon's
        self.fwd: Carrier = get_carrier("fp32" if lossless else comm_carrier)
        self.ret: Carrier = get_carrier("fp32" if lossless else comm_return)
        self.comm_stats: dict[str, float] = {}
        #: Muon index -> the block size of the fp32 per-row-block sums of squares that ride with its
        #: forward pieces (set when the ranks keep the momentum of their slices; the same on every rank).
        self.sum_blocks: dict[int, int] = {}
        self._acc = [0.0] * 7  # sent, wire, elements, bf16 wire, whole-matrix bytes, owned, flag bytes

    def start(self, first_call: bool) -> None:
        """Start a call; the first call of an optimizer step starts the step's figures."""
        if first_call:
            self._acc = [0.0] * 7

    def _sum_cols(self, p: FlatParam, at: int, width: int) -> tuple[int, int]:
        """The first block and the number of blocks of the sums that ride with a row piece starting at
        element ``at`` of ``p`` (``width`` columns); ``(0, 0)`` when no sums travel with ``p``."""
        bs = self.sum_blocks.get(p.index, 0)
        if not bs:
            return 0, 0
        a = at % p.cols
        return a // bs, (a + width - 1) // bs - a // bs + 1

    def _bytes(self, carrier: Carrier, p: FlatParam, seg: Segment, forward: bool = False) -> int:
        return sum(carrier.nbytes(r, w) + (4 * r * self._sum_cols(p, seg.start + off, w)[1] if forward else 0)
                   for off, r, w in row_pieces(p.cols, seg.start, seg.length))

    def _all_to_all(self, send: Tensor, send_sizes: list[int], recv_sizes: list[int]) -> Tensor:
        self._acc[0] += send.numel() - send_sizes[self.rank]  # this rank's bytes to other ranks
        if self.world == 1:
            return send
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)
        return recv

    def _trip(self, carrier: Carrier, by_owner: dict[int, list[FlatParam]], to_owner: bool,
              source: Callable[[FlatParam, Segment, int], Tensor], device: torch.device,
              sums: dict[int, Tensor] | None = None) -> Tensor:
        """One all-to-all: to the owners (each rank's slices of their matrices, with the sums of
        :attr:`sum_blocks` matrices: ``sums``, the slice's rows' ``(rows, blocks)``) or back (the owned
        matrices' slices of each holder), every slice encoded piece by piece; returns what arrived."""
        me, world = self.rank, self.world
        def size(s: int, d: int) -> int:  # bytes rank s sends rank d
            owner, holder = (d, s) if to_owner else (s, d)
            return sum(self._bytes(carrier, p, p.holders[holder], to_owner) for p in by_owner.get(owner, ())
                       if p.holders[holder] is not None)
        send_sizes = [size(me, d) for d in range(world)]
        send = torch.empty(sum(send_sizes), dtype=torch.uint8, device=device)
        at = 0
        for d in range(world):
            for p in by_owner.get(d if to_owner else me, ()):
                seg = p.holders[me if to_owner else d]
                if seg is None:
                    continue
                flat = source(p, seg, d)
                first_row = seg.start // p.cols
                for off, r, w in row_pieces(p.cols, seg.start, seg.length):
                    n = carrier.nbytes(r, w)
                    carrier.encode_into(flat.narrow(0, off, r * w).view(r, w), send[at: at + n])
                    at += n
                    b0, nb = self._sum_cols(p, seg.start + off, w) if to_owner else (0, 0)
                    if nb:
                        row = (seg.start + off) // p.cols - first_row
                        send[at: at + 4 * r * nb].view(torch.float32).view(r, nb).copy_(
                            sums[p.index][row: row + r, b0: b0 + nb])
                        at += 4 * r * nb
        return self._all_to_all(send, send_sizes, [size(s, me) for s in range(world)])

    def _decode(self, carrier: Carrier, buf: Tensor, at: int, p: FlatParam, seg: Segment, dest: Tensor,
                grid: Tensor | None = None) -> int:
        """Decode one slice's pieces from ``buf[at:]`` into the flat ``dest`` (the slice's elements),
        adding the sums that ride with them into the whole matrix's ``grid`` ``(rows, blocks)``;
        returns the offset after them."""
        for off, r, w in row_pieces(p.cols, seg.start, seg.length):
            n = carrier.nbytes(r, w)
            dest.narrow(0, off, r * w).view(r, w).copy_(carrier.decode(buf[at: at + n], r, w))
            at += n
            b0, nb = self._sum_cols(p, seg.start + off, w) if grid is not None else (0, 0)
            if nb:
                # a block cut by a slice end arrives as one partial sum per holder; every other block
                # once, so 0 + x keeps its bits (the whole matrix's sum of squares is single-process QMuon's)
                row = (seg.start + off) // p.cols
                grid[row: row + r, b0: b0 + nb] += buf[at: at + 4 * r * nb].view(torch.float32).view(r, nb)
                at += 4 * r * nb
        return at

    def gather(self, by_owner: dict[int, list[FlatParam]], flats: dict[int, Tensor], dtype: torch.dtype,
               device: torch.device, sums: dict[int, Tensor] | None = None) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
        """Whole flat NS inputs (``dtype``) of the matrices this rank owns, from every holder's slice
        (``flats``: this rank's flat slice of each matrix it holds a slice of, by parameter index), and
        for the :attr:`sum_blocks` matrices their whole ``(rows, blocks)`` sums of squares, assembled
        from the holders' ``sums`` (this rank's: the rows its slice touches). ``by_owner``: every matrix
        of this call by owner rank, the same on every rank."""
        recv = self._trip(self.fwd, by_owner, True, lambda p, seg, d: flats[p.index], device, sums)
        out, grids, at = {}, {}, 0
        for p in by_owner.get(self.rank, ()):
            out[p.index] = torch.empty(p.numel, dtype=dtype, device=device)
            bs = self.sum_blocks.get(p.index)
            if bs:
                grids[p.index] = torch.zeros((p.rows, -(-p.cols // bs)), dtype=torch.float32, device=device)
        for s in range(self.world):
            for p in by_owner.get(self.rank, ()):
                seg = p.holders[s]
                if seg is not None:
                    at = self._decode(self.fwd, recv, at, p, seg, out[p.index].narrow(0, seg.start, seg.length),
                                      grids.get(p.index))
        return out, grids

    def scatter(self, by_owner: dict[int, list[FlatParam]], results: dict[int, Tensor], device: torch.device,
                apply: Callable[[FlatParam, Segment, Tensor], None]) -> None:
        """Send every holder its slice of each owned matrix's result (``results``: flat, by parameter
        index) and ``apply(param, segment, flat slice of the result)`` to this rank's slices."""
        recv = self._trip(self.ret, by_owner, False, lambda p, seg, d: results[p.index].narrow(0, seg.start, seg.length),
                          device)
        at = 0
        for d in range(self.world):
            for p in by_owner.get(d, ()):
                seg = p.holders[self.rank]
                if seg is None:
                    continue
                o = torch.empty(seg.length, dtype=self.ret.out_dtype, device=device)
                at = self._decode(self.ret, recv, at, p, seg, o)
                apply(p, seg, o)

    def count(self, muon: list[FlatParam], forward: bool, flag_bytes: int) -> None:
        """Add this call's figures to :attr:`comm_stats`, from the layout, which every rank knows:
        each slice held by a rank that does not own its matrix crosses to the owner (``forward``:
        ZeRO 1-3) and back. The bytes this rank sent are counted from the buffers it handed over."""
        acc = self._acc
        for p in muon:
            for s, seg in enumerate(p.holders):
                if seg is not None and s != p.owner:
                    acc[1] += self._bytes(self.ret, p, seg) + (self._bytes(self.fwd, p, seg, True) if forward else 0)
                    acc[3] += 2 * seg.length * (1 + int(forward))
            whole = Segment(0, p.numel, 0)
            acc[4] += self._bytes(self.fwd, p, whole, True) + self._bytes(self.ret, p, whole)
            acc[2] += p.numel
            acc[5] += int(p.owner == self.rank)
        acc[6] += flag_bytes
        self.comm_stats = comm_figures({"flags_bytes": acc[6]}, acc[0], acc[1], acc[2], acc[3], acc[4], acc[5])
