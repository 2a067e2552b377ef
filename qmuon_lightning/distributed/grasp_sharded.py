"""grasp4 momentum of dim-0 sharded (FSDP2 ``Shard(0)``) parameters.

grasp4 (:mod:`qmuon_lightning.quant.grasp`) stores ``M ~ P^q (R^q)^T + GRID_4(M_res)``. Under row
sharding each rank holds rows ``[a, b)`` of ``M``; the pieces split as:

* row-local (``Shard(0)`` over rows): ``P`` codes / absmax, the 4-bit residual codes and
  ``grid_row_max``;
* tile-local (``Shard(0)`` over *row tiles*): ``grid_col_max`` -- one row per ``grid_block`` rows, so
  every rank's first row must be a multiple of ``grid_block`` (:func:`check_grasp_layout`);
* per matrix, replicated (``Replicate()`` DTensors, saved once by DCP): ``R`` codes / absmax;
  ``grid_scale`` is a plain 0-d tensor, identical on every rank.

One optimizer step for all sharded grasp4 parameters (three collectives in all, each over one flat
buffer holding every parameter's piece):

1. local: decode the old momentum of the own rows, ``M_new = beta M + (1 - beta) G`` (and the NS
   input), ``Y_a = M_new[a:b] ColNorm(R_prev)`` (``R_prev`` replicated, or the seeded Gaussian
   keyed by ``(seed, key)``: identical on every rank);
2. **all-gather** ``Y`` (``rows x k``, ``k = 4``: 16 bytes per row, padded to the chunk size);
   every rank runs the *same* Householder QR on the full ``Y`` and keeps its rows of ``P``. This is
   single-process QMuon's QR on the same ``Y`` (the rows of ``M Q`` do not depend on the sharding
   beyond GEMM blocking), so ``P`` matches it to rounding. Cholesky-QR with an all-reduced ``k x k``
   Gram matrix would move fewer bytes but squares the condition number of ``Y``; the trailing
   columns of a one-step power iteration are often nearly dependent, where Cholesky-QR loses
   orthogonality or fails, and the gathered ``Y`` is tiny next to the Newton-Schulz all-to-all;
3. **all-reduce SUM** ``R = sum_ranks M_new[a:b]^T P[a:b]`` (``cols x k``). The summation order
   differs from the single-process ``M^T P`` GEMM, so ``R`` agrees to fp32 rounding (relative
   ~1e-6), not bit for bit; its int8 codes can then differ by one step where a value sits on a
   rounding boundary;
4. local: ``P^q``, ``R^q`` (8-bit, the same stochastic-rounding streams as single-process, keyed by
   the global row), ``M_res = M_new - P^q (R^q)^T`` and its local absmax; **all-reduce MAX** gives
   the per-matrix ``amax``, ``t = amax / 448``, and each rank grid-quantizes its rows with that
   ``t`` (:func:`grid_quantize4_with_scale`).
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..ops import reference as ref
from ..ops import reference_4bit as ref4
from ..quant import grasp as G
from ..quant.state import FormatOptions
from .sharding import RowLayout, chunk_ranges, row_layout

__all__ = ["check_grasp_layout", "grid_quantize4_with_scale", "grasp_update_sharded"]


def check_grasp_layout(p: DTensor, opts: FormatOptions, where: str = "parameter") -> RowLayout:
    """Raise a clear error unless the row shards of ``p`` fit grasp4's tile layout: every rank's first
    row a multiple of ``grid_block`` (so the ``grid_col_max`` tile rows split with the row shards)
    and at least ``k = min(rank, rows, cols)`` rows on every rank (the ``P`` codes are ``rows x k``)."""
    lay = row_layout(p)
    s = opts.grid_block
    k = max(1, min(opts.rank, lay.rows, lay.cols))
    bad = [(r, a) for r, (a, b) in enumerate(lay.ranges) if b > a and a % s]
    few = [(r, b - a) for r, (a, b) in enumerate(lay.ranges) if b - a < k]
    if bad or few:
        why = (f"rank {bad[0][0]}'s first row is {bad[0][1]}, not a multiple of grid_block={s}" if bad
               else f"rank {few[0][0]} holds {few[0][1]} rows, fewer than the rank k={k} of the grasp4 factors")
        raise ValueError(
            f"QMuon: grasp4 momentum of the sharded {where} (shape {tuple(p.shape)}, rows split "
            f"{[b - a for a, b in lay.ranges]} over {lay.world} ranks): {why}. grasp4's tile column maxima span "
            f"grid_block rows, so each shard must start on a tile boundary: use a world size that makes "
            f"ceil(rows / world) a multiple of grid_block (e.g. 768 rows on 2, 4 or 8 ranks with grid_block=32), a "
            f"grid_block dividing ceil({lay.rows} / {lay.world}) = {-(-lay.rows // lay.world)}, or a row-local "
            f"state_format (int4, int8) for this parameter")
    tiles = ref.num_blocks(lay.rows, s)
    want = chunk_ranges(tiles, lay.world)
    got = [(a // s, -(-b // s)) if b > a else None for a, b in lay.ranges]
    assert all(g is None or g == w for g, w in zip(got, want)), (got, want)  # follows from the alignment
    return lay


def grid_quantize4_with_scale(x: Tensor, s: int, t: Tensor, stream: int = -1,
                              row_offset: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`qmuon_lightning.ops.reference_4bit.grid_quantize4` of some rows of a matrix with the
    *matrix's* maxima scale ``t`` (``amax / 448`` of the whole matrix, 1 for a zero matrix) instead of
    the one computed from ``x``: (packed codes, UE4M3 row maxima, UE4M3 column maxima of ``x``'s tiles).
    Row-local apart from ``t``; ``x``'s first row must be a tile boundary."""
    rows, cols = x.shape
    x = x.float()
    row_max, col_max = ref4._grid_maxima(x, s)
    row_bits = ref4.ue4m3_encode(row_max / t, round_up=True)
    col_bits = ref4.ue4m3_encode(col_max / t, round_up=True)
    den = ref4._grid_denominator(ref4.ue4m3_decode(row_bits) * t, ref4.ue4m3_decode(col_bits) * t, s, rows, cols)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    noise = None if stream < 0 else ref.uniform_noise(rows, cols, stream, row_offset, x.device)
    q = ref4._round_codes(x / safe * ref4.QMAX4, noise)
    q = torch.where(den > 0, q, torch.zeros_like(q))
    return ref4.pack_int4(q.to(torch.int8)), row_bits, col_bits


def _flat(ts: list[Tensor], device: torch.device) -> Tensor:
    return torch.cat([t.reshape(-1).float() for t in ts]) if ts else torch.zeros(0, device=device)


def grasp_update_sharded(
    params: list[DTensor], states: list[dict[str, Tensor]], grads2d: list[Tensor], block_sums: list[Tensor], *,
    beta: float, nesterov: bool, opts: FormatOptions, streams: list[int], offsets: list[int], keys: list[int],
    seed: int, group: dist.ProcessGroup,
) -> None:
    """The grasp4 momentum update of sharded parameters (collective: every rank of ``group`` calls it
    with the same parameters in the same order). ``states`` hold the *local* tensors (views of the
    DTensors' storage: rows / tiles of this rank, the full replicated ``R``); ``grads2d`` the local
    gradient rows, overwritten with the NS input like :meth:`Grasp4Format.update`."""
    if not params:
        return
    device = grads2d[0].device
    world = dist.get_world_size(group)
    lays = [row_layout(p) for p in params]
    m_new, r_prev, y = [], [], []
    for st, g2, out in zip(states, grads2d, block_sums):
        m_old = G.grasp_decode(st, opts)
        mn, ns = ref._q8_momentum_and_ns_input(m_old, g2.float(), beta, nesterov)
        m_new.append(mn)
        g2.copy_(ns)
        out.copy_(ref.block_sumsq(ns, opts.block_size))
    for st, mn, lay, key in zip(states, m_new, lays, keys):
        _, rp = G.grasp_factors(st)
        if not bool((st[G.R_ABSMAX] > 0).any()):  # R is replicated: every rank decides alike
            rp = G._random_q(lay.cols, st[G.R_CODES].shape[1], seed, key, device)
        r_prev.append(rp)
        y.append(mn @ G._col_normalize(rp))
    # 2. all-gather Y (padded to the chunk size), the same Householder QR on every rank
    chunks = [max(b - a for a, b in lay.ranges) for lay in lays]
    send = torch.cat([torch.cat([yi, yi.new_zeros(c - yi.shape[0], yi.shape[1])]).reshape(-1)
                      for yi, c in zip(y, chunks)])
    recv = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(recv, send, group=group)
    p_loc, r_part = [], []
    off = 0
    for yi, c, lay, mn in zip(y, chunks, lays, m_new):
        k = yi.shape[1]
        full = torch.cat([recv[r][off: off + c * k].view(c, k)[: b - a] for r, (a, b) in enumerate(lay.ranges)])
        off += c * k
        pq, _ = torch.linalg.qr(full, mode="reduced")
        pl = pq[lay.start: lay.start + lay.local_rows].contiguous()
        p_loc.append(pl)
        r_part.append(mn.T @ pl)
    # 3. R = sum over ranks of M_a^T P_a
    r_flat = _flat(r_part, device)
    dist.all_reduce(r_flat, op=dist.ReduceOp.SUM, group=group)
    r_full, off = [], 0
    for rp in r_part:
        r_full.append(r_flat[off: off + rp.numel()].view(rp.shape))
        off += rp.numel()
    # 4. quantize the factors, residual, per-matrix amax (MAX), grid-quantize with it
    enc, res, amax = [], [], []
    for pl, r, mn, stream, row0 in zip(p_loc, r_full, m_new, streams, offsets):
        pc, pa = G.q8_rows(pl, G._substream(stream, 0x5A17), row0)
        rc, ra = G.q8_rows(r, G._substream(stream, 0x3C96), 0)
        low = G.dq8_rows(pc, pa) @ G.dq8_rows(rc, ra).T
        rs = mn - low
        res.append(rs)
        amax.append(rs.abs().amax() if rs.numel() else torch.zeros((), device=device))
        enc.append({G.P_CODES: pc, G.P_ABSMAX: pa, G.R_CODES: rc, G.R_ABSMAX: ra})
    a_flat = torch.stack([a.float() for a in amax])
    dist.all_reduce(a_flat, op=dist.ReduceOp.MAX, group=group)
    for st, e, rs, a, stream, row0 in zip(states, enc, res, a_flat, streams, offsets):
        t = a / torch.full_like(a, ref4.UE4M3_MAX)
        t = torch.where((t > 0) & torch.isfinite(t), t, torch.ones_like(t)).reshape(())
        packed, row_bits, col_bits = grid_quantize4_with_scale(rs, opts.grid_block, t, stream, row0)
        e.update({G.PACKED: packed, G.GRID_ROW: row_bits, G.GRID_COL: col_bits, G.GRID_SCALE: t})
        for k, v in e.items():
            st[k].copy_(v)

