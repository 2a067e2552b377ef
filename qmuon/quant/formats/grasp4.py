"""GRASP 4-bit momentum (GRid And Subspace Preserving; Wu et al., ICLR 2026).

The momentum ``M`` (``rows x cols``) is stored as a rank-``k`` factor ``P R^T`` in 8 bits plus a
4-bit residual::

    Q     = ColNorm(R_prev)                 (warm start; seeded Gaussian on the first step)
    P     = Orthonormalize(M Q)             (one power iteration, Householder QR, rows x k)
    R     = M^T P                           (cols x k)
    P^q   = QUANT_8(P), R^q = QUANT_8(R)    (int8 codes, bf16 absmax per row of P / of R)
    M_res = M - P^q (R^q)^T                 (residual against the *stored* factors, so their
                                             rounding error is absorbed by the residual)
    M_res^q = GRID_4(M_res)                 (s x s tiles, each entry / min(tile row max, tile col max))

and read back as ``P^q (R^q)^T + M_res^q``. Muon's Newton-Schulz maps all singular values to ~1, so
quantization error that rotates the top singular vectors survives orthogonalization; keeping the
top subspace in 8-bit factors turns most 4-bit error into harmless rescaling.

State tensors (all plain, rows first)::

    grasp_p_codes   int8  (rows, k)       grasp_p_absmax  bf16 (rows, 1)   (rounded up)
    grasp_r_codes   int8  (cols, k)       grasp_r_absmax  bf16 (cols, 1)
    momentum_packed uint8 (rows, ceil(cols/2))             4-bit residual codes
    grid_row_max    uint8 (rows, ceil(cols/s))             UE4M3 of max / grid_scale, rounded up
    grid_col_max    uint8 (ceil(rows/s), cols)             UE4M3
    grid_scale      fp32  ()                               amax(residual) / 448

with ``k = min(rank, rows, cols)`` and ``s = grid_block``.

Sharding (FSDP2 ``Shard(0)``; :meth:`Grasp4Format.placement`)
-------------------------------------------------------------
Each rank holds rows ``[a, b)`` of ``M``; the pieces split as:

* ``"rows"`` (``Shard(0)`` over rows): ``P`` codes / absmax, the 4-bit residual codes and
  ``grid_row_max``;
* ``"tiles"`` (``Shard(0)`` over *row tiles*): ``grid_col_max``, one row per ``grid_block`` rows, so
  every rank's first row must be a multiple of ``grid_block`` (:meth:`Grasp4Format.check_sharded_layout`);
* ``"replicate"`` (``Replicate()`` DTensors, saved once by DCP): ``R`` codes / absmax;
  ``"scalar"``: ``grid_scale``, a plain 0-d tensor identical on every rank.

One optimizer step for all sharded grasp4 parameters (:meth:`Grasp4Format.update_sharded`; three
collectives in all, each over one flat buffer holding every parameter's piece):

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
   ``t`` (the compiled ``torch.ops.qmuon.grid_quantize4_with_scale``, which single-process
   ``grid_quantize4`` matches when ``t`` is the matrix's own).

Defaults: ``rank=4``, ``grid_block=32``: the tile size matters most for the update's fidelity and
rank 4 keeps every GPT-small shape under 0.58 bytes per element (the measurements behind both are
in docs/formats.md, "grasp4 defaults").
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ...ops import reference as ref
from ...ops import reference_4bit as ref4
from ..layout import RowLayout, chunk_ranges, row_layout
from .base import PACKED, FormatOptions, FormatSpec, StateFormat

__all__ = ["Grasp4Format"]

P_CODES, P_ABSMAX = "grasp_p_codes", "grasp_p_absmax"
R_CODES, R_ABSMAX = "grasp_r_codes", "grasp_r_absmax"
GRID_ROW, GRID_COL, GRID_SCALE = "grid_row_max", "grid_col_max", "grid_scale"

DEFAULT_RANK = 4
DEFAULT_GRID_BLOCK = 32
#: power iterations used when converting a full-precision momentum (no warm start) into grasp4
CONVERT_ITERS = 6


def _rank(rows: int, cols: int, opts: FormatOptions) -> int:
    return max(1, min(opts.rank, rows, cols))


def _substream(stream: int, salt: int) -> int:
    return -1 if stream < 0 else int(ref.fmix32((stream ^ salt) & 0xFFFFFFFF))


def _random_q(cols: int, k: int, seed: int, key: int, device: torch.device) -> Tensor:
    """The seeded Gaussian ``cols x k`` start of the power iteration: Box-Muller on the counter-based
    noise of (``seed``, ``key``) (:func:`~qmuon.ops.reference.uniform_noise`), made on the device with
    torch ops only, so it is the same on every device and rank and inside a compiled step (a
    ``torch.Generator`` can be neither traced nor made on the device without a copy)."""
    u = ref.uniform_noise(2 * cols, k, ref.noise_stream(seed, 0, key), 0, torch.device(device))
    radius = torch.sqrt(-2.0 * torch.log(1.0 - u[:cols]))  # 1 - u in (0, 1]
    return radius * torch.cos((2.0 * math.pi) * u[cols:])


def _col_normalize(r: Tensor) -> Tensor:
    return r / r.norm(dim=0, keepdim=True).clamp(min=1e-30)


def power_iteration(m: Tensor, q: Tensor) -> tuple[Tensor, Tensor]:
    """One warm-started power (subspace) iteration: ``P = QR(M ColNorm(Q)).Q``, ``R = M^T P``."""
    y = m @ _col_normalize(q)
    p, _ = torch.linalg.qr(y, mode="reduced")
    return p, m.T @ p


def _bf16_round_up(a: Tensor) -> Tensor:
    """Non-negative finite fp32 -> the smallest bf16 >= it (as bf16)."""
    bits = a.float().contiguous().view(torch.int32)
    up = torch.where((bits & 0xFFFF) != 0, (bits | 0xFFFF) + 1, bits)
    return torch.where(torch.isfinite(a), up.view(torch.float32), a).to(torch.bfloat16)


def q8_rows(x: Tensor, stream: int = -1, row_offset: int = 0) -> tuple[Tensor, Tensor]:
    """Symmetric int8 codes per row with a bf16 absmax (rounded up, so no code clips):
    ``code = round(x * (127 / a))``, ``x_hat = code * (a / 127)``."""
    a = _bf16_round_up(x.abs().amax(dim=1, keepdim=True) if x.shape[1] else x.new_zeros(x.shape[0], 1))
    af = a.float()
    safe = torch.where(af > 0, af, torch.ones_like(af))
    scaled = x.float() * (torch.full_like(safe, 127.0) / safe)
    if stream < 0:
        q = torch.round(scaled)
    else:
        q = torch.floor(scaled + ref.uniform_noise(*x.shape, stream, row_offset, x.device))
    q = q.clamp_(-127.0, 127.0).nan_to_num_(nan=0.0)
    return q.to(torch.int8), a


def dq8_rows(codes: Tensor, absmax: Tensor) -> Tensor:
    return codes.float() * (absmax.float() / torch.full_like(absmax, 127.0, dtype=torch.float32))


def _factors_q(p: Tensor, r: Tensor, stream: int, row_offset: int) -> dict[str, Tensor]:
    pc, pa = q8_rows(p, _substream(stream, 0x5A17), row_offset)
    rc, ra = q8_rows(r, _substream(stream, 0x3C96), 0)
    return {P_CODES: pc, P_ABSMAX: pa, R_CODES: rc, R_ABSMAX: ra}


def _low_rank(fq: dict[str, Tensor]) -> Tensor:
    return dq8_rows(fq[P_CODES], fq[P_ABSMAX]) @ dq8_rows(fq[R_CODES], fq[R_ABSMAX]).T


#: Elements per row chunk of the in-place update's scratch (256 KiB in fp32): the update's transient
#: memory is one fp32 copy of the matrix (the momentum) plus a chunk, not several full copies.
_CHUNK_ELEMENTS = 1 << 16


def _row_chunks(rows: int, cols: int) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // max(cols, 1))
    return [(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def _add_low_rank_(m: Tensor, p: Tensor, r: Tensor, alpha: float) -> Tensor:
    """``m += alpha * (p @ r.T)`` row chunk by row chunk (each chunk's product is exactly those rows
    of the full product, and the addition is elementwise), without a full-size temporary."""
    rt = r.T
    for r0, r1 in _row_chunks(*m.shape):
        low = p[r0:r1] @ rt
        if alpha == 1.0:
            m[r0:r1].add_(low)
        else:
            m[r0:r1].sub_(low)
        del low  # else the next chunk's product is made while this one is still bound: two chunks alive
    return m


def grasp_encode(m: Tensor, q: Tensor, opts: FormatOptions, *, stream: int = -1, row_offset: int = 0,
                 iters: int = 1, consume: bool = False) -> dict[str, Tensor]:
    """fp32 momentum -> grasp4 tensors, starting the power iteration from ``q`` (cols x k).

    ``consume=True``: ``m`` (fp32, the caller's scratch) is overwritten with the residual instead
    of a new full-size tensor being allocated for it (same values)."""
    m = m.float()
    p, r = power_iteration(m, q)
    for _ in range(iters - 1):
        p, r = power_iteration(m, r)
    out = _factors_q(p, r, stream, row_offset)
    pq, rq = dq8_rows(out[P_CODES], out[P_ABSMAX]), dq8_rows(out[R_CODES], out[R_ABSMAX])
    res = _add_low_rank_(m if consume else m.clone(), pq, rq, -1.0)  # M - P^q (R^q)^T
    packed, row_max, col_max, t = torch.ops.qmuon.grid_quantize4(res, opts.grid_block, stream, row_offset)
    out.update({PACKED: packed, GRID_ROW: row_max, GRID_COL: col_max, GRID_SCALE: t})
    return out


def grasp_factors(state: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Dequantized (P, R) of a grasp4 state."""
    return dq8_rows(state[P_CODES], state[P_ABSMAX]), dq8_rows(state[R_CODES], state[R_ABSMAX])


def grasp_decode(state: dict[str, Tensor], opts: FormatOptions) -> Tensor:
    p, r = grasp_factors(state)
    cols = r.shape[0]
    res = torch.ops.qmuon.grid_dequantize4(
        state[PACKED], state[GRID_ROW], state[GRID_COL], state[GRID_SCALE], opts.grid_block, cols)
    return _add_low_rank_(res, p, r, 1.0)  # = P R^T + res (fp32 addition commutes), no full-size temporary


def _lerp_into(start: Tensor, end: Tensor, dest: Tensor, weight: float, scratch: Tensor) -> None:
    """``dest = ref._lerp_fp32(start, end, weight)`` with every fp32 operation rounded as there, using
    ``scratch`` (same shape) instead of temporaries; ``dest`` may be ``start`` or ``end``."""
    w = ref._fp32(weight)
    torch.sub(end, start, out=scratch)  # diff
    if abs(w) < 0.5:
        torch.add(start, scratch.mul_(w), out=dest)
    else:
        torch.sub(end, scratch.mul_(ref._fp32(1.0 - w)), out=dest)




def _r_prev(st: dict[str, Tensor], cols: int, seed: int, key: int, device: torch.device) -> Tensor:
    """``R`` of the last step, or the seeded Gaussian on the first (R is replicated under sharding,
    so every rank decides alike). Chosen on the device (``torch.where`` on "some R scale is
    nonzero"), so the step reads nothing back; the Gaussian is ``cols x rank``, a few columns."""
    start = _random_q(cols, st[R_CODES].shape[1], seed, key, device)
    return torch.where((st[R_ABSMAX] > 0).any(), grasp_factors(st)[1], start)


class Grasp4Format(StateFormat):
    """GRASP: 8-bit rank-``rank`` factors + 4-bit grid-quantized residual (see the module docstring)."""

    layout_options = ("rank", "grid_block")
    row_local = False
    order = 40
    promotes_to = "int8"
    guard_threshold = 0.4
    spec = FormatSpec("grasp4", "grasp4", torch.uint8, (P_CODES, P_ABSMAX, R_CODES, R_ABSMAX, PACKED, GRID_ROW,
                                                      GRID_COL, GRID_SCALE))

    def init(self, rows, cols, opts, device):
        k, s = _rank(rows, cols, opts), opts.grid_block
        return {
            P_CODES: torch.zeros((rows, k), dtype=torch.int8, device=device),
            P_ABSMAX: torch.zeros((rows, 1), dtype=torch.bfloat16, device=device),
            R_CODES: torch.zeros((cols, k), dtype=torch.int8, device=device),
            R_ABSMAX: torch.zeros((cols, 1), dtype=torch.bfloat16, device=device),
            PACKED: torch.zeros((rows, ref4.packed_cols(cols)), dtype=torch.uint8, device=device),
            GRID_ROW: torch.zeros((rows, ref.num_blocks(cols, s)), dtype=torch.uint8, device=device),
            GRID_COL: torch.zeros((ref.num_blocks(rows, s), cols), dtype=torch.uint8, device=device),
            GRID_SCALE: torch.ones((), dtype=torch.float32, device=device),
        }

    def validate_options(self, opts):
        if not isinstance(opts.rank, int) or opts.rank < 1:
            raise ValueError(f"rank must be a positive int, got {opts.rank!r}")
        if not isinstance(opts.grid_block, int) or opts.grid_block < 2 or opts.grid_block > 4096:
            raise ValueError(f"grid_block must be an int in [2, 4096], got {opts.grid_block!r}")

    # ------------------------------------------------------------------ update
    @staticmethod
    def _momentum(st, g2, out, beta, nesterov, opts) -> Tensor:
        """New fp32 momentum of ``st``'s rows; the NS input goes into ``g2``, its block sums into ``out``.

        The arithmetic of :func:`~qmuon.ops.reference._q8_momentum_and_ns_input` and
        :func:`~qmuon.ops.reference.block_sumsq`, op for op (the same bits), done in the
        decoded momentum and a row-chunk scratch: one fp32 copy of the matrix at a time instead of six,
        which is what keeps grasp4's step within a few MiB of its state."""
        m = grasp_decode(st, opts)  # a fresh fp32 tensor: becomes m_new in place
        rows, cols = m.shape
        bs = opts.block_size
        chunks = _row_chunks(rows, cols)
        chunk_elems = (chunks[0][1] - chunks[0][0]) * cols if chunks else 0
        scratch = torch.empty(chunk_elems, dtype=torch.float32, device=m.device)
        # a bf16 gradient is widened one row chunk at a time (not a whole fp32 copy of the gradient
        # plus another of the NS input): the chunk holds the fp32 gradient, then the fp32 NS input
        # (whose block sums are taken before it is rounded back into g2), as g2 itself does for fp32
        wide = None if g2.dtype == torch.float32 else torch.empty(chunk_elems, dtype=torch.float32, device=m.device)
        # a row whose width is not a multiple of the block is zero-padded to whole blocks for its sums,
        # as ref.block_sumsq does, but into one reused buffer (squared in place) instead of a padded
        # copy and its square per chunk: the same values through the same ops, so the same bits
        nb = ref.num_blocks(cols, bs)
        padded = None
        if cols % bs and chunks:
            padded = torch.zeros((chunks[0][1] - chunks[0][0]) * nb * bs, dtype=torch.float32, device=m.device)
        for r0, r1 in chunks:  # rows are independent: momentum, blend and row-block sums
            sc = scratch[: (r1 - r0) * cols].view(r1 - r0, cols)
            if wide is None:
                gc = g2[r0:r1]
            else:
                gc = wide[: (r1 - r0) * cols].view(r1 - r0, cols)
                gc.copy_(g2[r0:r1])
            mc, nc = m[r0:r1], gc
            _lerp_into(mc, gc, mc, 1.0 - beta, sc)  # m_new = lerp(m_old, g, 1 - beta)
            if nesterov:
                _lerp_into(gc, mc, nc, beta, sc)  # ns = lerp(g, m_new, beta)
            else:
                nc.copy_(mc)
            if cols % bs == 0:  # square into the scratch (no padding needed)
                xb = nc.view(r1 - r0, -1, bs)
                out[r0:r1].copy_(torch.mul(xb, xb, out=sc.view(xb.shape)).sum(dim=-1))
            else:
                assert padded is not None
                pb = padded[: (r1 - r0) * nb * bs].view(r1 - r0, nb * bs)
                pb[:, :cols].copy_(nc)
                pb[:, cols:].zero_()  # the previous chunk's squares
                xb = pb.view(r1 - r0, nb, bs)
                out[r0:r1].copy_(xb.mul_(xb).sum(dim=-1))
            if wide is not None:
                g2[r0:r1].copy_(nc)
        return m

    def update_workspace_nbytes(self, rows, cols, opts, grad_bytes=4):
        """The decoded fp32 momentum (updated in place, then consumed as the residual) beside the
        largest of what the update holds with it:

        * :meth:`_momentum`: one row chunk of scratch (:func:`_row_chunks`), for a gradient
          narrower than fp32 one more row chunk (its fp32 rows), and for a row width that is not a
          multiple of ``block_size`` the chunk's rows padded to whole blocks (their block sums);
        * decoding and encoding: one row chunk of the low-rank product ``P R^T``
          (:func:`_add_low_rank_`);
        * the end of :func:`grasp_encode`: the freshly encoded state, before it is copied in.

        (The power iteration's ``rows x k`` / ``cols x k`` factors are a few columns; the
        momentum's ``rows x 1`` block sums are the caller's.)"""
        chunk_rows = min(rows, max(1, _CHUNK_ELEMENTS // max(cols, 1)))
        chunk = chunk_rows * cols * 4
        momentum = chunk * (1 if grad_bytes == 4 else 2)
        if cols % opts.block_size:
            momentum += chunk_rows * ref.num_blocks(cols, opts.block_size) * opts.block_size * 4
        return 4 * rows * cols + max(momentum, chunk, self.nbytes(rows, cols, opts))

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed, skip=None):
        for j, (st, g2, out, stream, off, key) in enumerate(
                zip(states, grads2d, block_sums, streams, offsets, keys, strict=True)):
            m_new = self._momentum(st, g2, out, beta, nesterov, opts)
            new = grasp_encode(m_new, _r_prev(st, g2.shape[1], seed, key, g2.device), opts, stream=stream, row_offset=off,
                               consume=True)
            for k, v in new.items():
                # a skipped matrix keeps its state: selected on the device, bit for bit
                st[k].copy_(v if skip is None else torch.where(skip[j], st[k], v))
            # unbound here, not when the next matrix's are assigned: the next decode would otherwise
            # run beside this matrix's fp32 momentum and encoded state
            del m_new, new

    def update_sharded(self, params, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys,
                       seed, process_group):
        if not params:
            return
        import torch.distributed as dist

        device = grads2d[0].device
        world = dist.get_world_size(process_group)
        lays = [row_layout(p) for p in params]
        # 1. local: new momentum of the own rows, Y_a = M_new[a:b] ColNorm(R_prev)
        m_new = [self._momentum(st, g2, out, beta, nesterov, opts) for st, g2, out in zip(states, grads2d, block_sums)]
        y = [mn @ _col_normalize(_r_prev(st, lay.cols, seed, key, device))
             for st, mn, lay, key in zip(states, m_new, lays, keys)]
        # 2. all-gather Y (padded to the chunk size), the same Householder QR on every rank
        chunks = [max(b - a for a, b in lay.ranges) for lay in lays]
        send = torch.cat([torch.cat([yi, yi.new_zeros(c - yi.shape[0], yi.shape[1])]).reshape(-1)
                          for yi, c in zip(y, chunks)])
        recv = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(recv, send, group=process_group)
        p_loc, r_part, off = [], [], 0
        for yi, c, lay, mn in zip(y, chunks, lays, m_new):
            k = yi.shape[1]
            full = torch.cat([recv[r][off: off + c * k].view(c, k)[: b - a] for r, (a, b) in enumerate(lay.ranges)])
            off += c * k
            pq, _ = torch.linalg.qr(full, mode="reduced")
            pl = pq[lay.start: lay.start + lay.local_rows].contiguous()
            p_loc.append(pl)
            r_part.append(mn.T @ pl)
        # 3. R = sum over ranks of M_a^T P_a
        r_flat = torch.cat([r.reshape(-1).float() for r in r_part])
        dist.all_reduce(r_flat, op=dist.ReduceOp.SUM, group=process_group)
        r_full = list(torch.split(r_flat, [r.numel() for r in r_part]))
        # 4. quantize the factors, residual, per-matrix amax (MAX), grid-quantize with it
        enc, res = [], []
        for pl, r, rp, mn, stream, row0 in zip(p_loc, r_full, r_part, m_new, streams, offsets):
            fq = _factors_q(pl, r.view(rp.shape), stream, row0)
            enc.append(fq)
            res.append(mn - _low_rank(fq))
        amax = torch.stack([rs.abs().amax() if rs.numel() else torch.zeros((), device=device) for rs in res]).float()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=process_group)
        for st, fq, rs, t, stream, row0 in zip(states, enc, res, ref4.grid_scale_from_amax(amax), streams, offsets):
            packed, row_max, col_max = torch.ops.qmuon.grid_quantize4_with_scale(
                rs.contiguous(), opts.grid_block, t, stream, row0)
            fq.update({PACKED: packed, GRID_ROW: row_max, GRID_COL: col_max, GRID_SCALE: t})
            for k, v in fq.items():
                st[k].copy_(v)

    # ------------------------------------------------------------------ sharding
    def placement(self, key):
        if key in (R_CODES, R_ABSMAX):
            return "replicate"
        if key == GRID_COL:
            return "tiles"
        if key == GRID_SCALE:
            return "scalar"
        return super().placement(key)

    def tile_rows(self, opts):
        return int(opts.grid_block)

    def check_sharded_layout(self, layout: RowLayout, opts: FormatOptions, where: str) -> None:
        """Every rank's first row a multiple of ``grid_block`` (so the ``grid_col_max`` tile rows split
        with the row shards) and at least ``k = min(rank, rows, cols)`` rows on every rank (the ``P``
        codes are ``rows x k``)."""
        lay, s = layout, opts.grid_block
        k = _rank(lay.rows, lay.cols, opts)
        bad = [(r, a) for r, (a, b) in enumerate(lay.ranges) if b > a and a % s]
        few = [(r, b - a) for r, (a, b) in enumerate(lay.ranges) if b - a < k]
        if bad or few:
            why = (f"rank {bad[0][0]}'s first row is {bad[0][1]}, not a multiple of grid_block={s}" if bad
                   else f"rank {few[0][0]} holds {few[0][1]} rows, fewer than the rank k={k} of the grasp4 factors")
            raise ValueError(
                f"QMuon: grasp4 momentum of the sharded {where} (shape {lay.global_shape}, rows split "
                f"{[b - a for a, b in lay.ranges]} over {lay.world} ranks): {why}. grasp4's tile column maxima span "
                f"grid_block rows, so each shard must start on a tile boundary: use a world size that makes "
                f"ceil(rows / world) a multiple of grid_block (e.g. 768 rows on 2, 4 or 8 ranks with grid_block=32), "
                f"a grid_block dividing ceil({lay.rows} / {lay.world}) = {-(-lay.rows // lay.world)}, or a row-local "
                f"state_format (int4, int8) for this parameter")
        tiles = ref.num_blocks(lay.rows, s)
        want = chunk_ranges(tiles, lay.world)
        got = [(a // s, -(-b // s)) if b > a else None for a, b in lay.ranges]
        assert all(g is None or g == w for g, w in zip(got, want)), (got, want)  # follows from the alignment

    # ------------------------------------------------------------------ codec
    def dequantize(self, state, opts, cols=None):
        return grasp_decode(state, opts)

    def encode(self, m, opts):
        rows, cols = m.shape
        q = _random_q(cols, _rank(rows, cols, opts), 0, 0, m.device)
        return grasp_encode(m, q, opts, iters=CONVERT_ITERS)

    def owns(self, state):
        return P_CODES in state

    def validate(self, state, rows, cols, opts, where):
        self._require_keys(state, where)
        k, s = _rank(rows, cols, opts), opts.grid_block
        hint_k = f" for rank={opts.rank}"
        self._check(state, PACKED, (rows, ref4.packed_cols(cols)), torch.uint8, where,
                    f" for a {rows}x{cols} parameter (two 4-bit codes per byte)")
        self._check(state, P_CODES, (rows, k), torch.int8, where, hint_k)
        self._check(state, P_ABSMAX, (rows, 1), torch.bfloat16, where)
        self._check(state, R_CODES, (cols, k), torch.int8, where, hint_k)
        self._check(state, R_ABSMAX, (cols, 1), torch.bfloat16, where)
        self._check(state, GRID_ROW, (rows, ref.num_blocks(cols, s)), torch.uint8, where, f" for grid_block={s}")
        self._check(state, GRID_COL, (ref.num_blocks(rows, s), cols), torch.uint8, where, f" for grid_block={s}")
        self._check(state, GRID_SCALE, (), torch.float32, where)


FORMATS = (Grasp4Format(),)
