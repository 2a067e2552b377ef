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

Sharding: P's rows, the residual codes and ``grid_row_max`` go with the weight's rows;
``grid_col_max`` goes with row *tiles*, so row shards must be aligned to ``grid_block``;
``grid_scale`` is a per-matrix max (MAX all-reduce). R (and Q)
are per matrix: under row sharding ``R = M^T P`` is a sum over the shards and needs an all-reduce
(SUM), and the QR of the row-sharded ``M Q`` needs a distributed (TSQR or Cholesky-QR) step.
This module implements the single-process case; the row-sharded one (all-gathered ``M Q`` for the
QR, all-reduced ``R`` and ``grid_scale``) is :mod:`qmuon_lightning.distributed.grasp_sharded`.

Defaults (``rank=4``, ``grid_block=32``) and why
------------------------------------------------
Measured with :func:`qmuon_lightning.quant.fidelity.per_layer_update_cosine` (update cosine vs the
fp32-state Muon update, mean over steps 4..11, 256x256 / 768x256 matrices, synthetic low-rank +
noise gradients with 1/16 outlier rows and columns x10, nearest rounding)::

    int8 (block 256)             0.994 / 0.994      int4 (block 128)   0.553 / 0.553
    e0m3                         0.809 / 0.824      int4 (block 32)    0.62 / 0.68 (stochastic)
    grasp4 rank 1 / 4 / 8, s=128, bf16 maxima   0.650 / 0.695 / 0.774    0.733 / 0.758 / 0.805
    grasp4 rank 1 / 4 / 8, s=64,  bf16 maxima   0.740 / 0.778 / 0.841    0.821 / 0.839 / 0.873
    grasp4 rank 1 / 4 / 8, s=32,  bf16 maxima   0.858 / 0.884 / 0.915    0.912 / 0.921 / 0.936
    grasp4 rank 2 / 4 / 8, s=32,  UE4M3 maxima  0.849 / 0.870 / 0.904    0.904 / 0.909 / 0.927

The tile size matters most; rank helps steadily. Stochastic rounding lowers every 4-bit format's
update cosine by 0.05..0.1 on this test (more variance), so nearest is the default. bf16 maxima at
s=32 would cost 4/32 = 0.125 B/elem; UE4M3 maxima cost 2/32 = 0.0625 and lose ~0.01 cosine. With bf16
per-row absmax for P and R, rank 4 fits the budget on every GPT-small shape (bytes per element,
every stored tensor counted): 768x768 0.5782, 2304x768 0.5729, 3072x768 / 768x3072 0.5723
(int4 0.5312, e0m3 0.5625, int8 1.0156). rank 8 would give 0.594 on 768x768 (over 0.58).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import reference as ref
from ..ops import reference_4bit as ref4
from .state import PACKED, FormatOptions, FormatSpec, StateFormat, StateFormatError

__all__ = ["Grasp4Format", "power_iteration", "grasp_encode", "grasp_decode", "DEFAULT_RANK", "DEFAULT_GRID_BLOCK"]

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
    g = torch.Generator().manual_seed(ref.noise_stream(seed, 0, key))
    return torch.randn(cols, k, generator=g, dtype=torch.float32).to(device)


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


def grasp_encode(m: Tensor, q: Tensor, opts: FormatOptions, *, stream: int = -1, row_offset: int = 0,
                 iters: int = 1) -> dict[str, Tensor]:
    """fp32 momentum -> grasp4 tensors, starting the power iteration from ``q`` (cols x k)."""
    m = m.float()
    p, r = power_iteration(m, q)
    for _ in range(iters - 1):
        p, r = power_iteration(m, r)
    pc, pa = q8_rows(p, _substream(stream, 0x5A17), row_offset)
    rc, ra = q8_rows(r, _substream(stream, 0x3C96), 0)
    low = dq8_rows(pc, pa) @ dq8_rows(rc, ra).T
    res = m - low
    packed, row_max, col_max, t = torch.ops.qmuon.grid_quantize4(res, opts.grid_block, stream, row_offset)
    return {P_CODES: pc, P_ABSMAX: pa, R_CODES: rc, R_ABSMAX: ra, PACKED: packed, GRID_ROW: row_max,
            GRID_COL: col_max, GRID_SCALE: t}


def grasp_factors(state: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Dequantized (P, R) of a grasp4 state."""
    return dq8_rows(state[P_CODES], state[P_ABSMAX]), dq8_rows(state[R_CODES], state[R_ABSMAX])


def grasp_decode(state: dict[str, Tensor], opts: FormatOptions) -> Tensor:
    p, r = grasp_factors(state)
    cols = r.shape[0]
    res = torch.ops.qmuon.grid_dequantize4(
        state[PACKED], state[GRID_ROW], state[GRID_COL], state[GRID_SCALE], opts.grid_block, cols)
    return (p @ r.T + res).contiguous()


class Grasp4Format(StateFormat):
    spec = FormatSpec("grasp4", "grasp4", torch.uint8, (P_CODES, P_ABSMAX, R_CODES, R_ABSMAX, PACKED, GRID_ROW, GRID_COL,
                                                      GRID_SCALE))

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

    def update(self, states, grads2d, block_sums, *, beta, nesterov, opts, streams, offsets, keys, seed):
        for st, g2, out, stream, off, key in zip(states, grads2d, block_sums, streams, offsets, keys, strict=True):
            rows, cols = g2.shape
            m_old = grasp_decode(st, opts)
            m_new, ns_input = ref._q8_momentum_and_ns_input(m_old, g2.float(), beta, nesterov)
            _, r_prev = grasp_factors(st)
            if not bool((st[R_ABSMAX] > 0).any()):
                r_prev = _random_q(cols, st[R_CODES].shape[1], seed, key, g2.device)
            new = grasp_encode(m_new, r_prev, opts, stream=stream, row_offset=off)
            for k, v in new.items():
                st[k].copy_(v)
            g2.copy_(ns_input)
            out.copy_(ref.block_sumsq(ns_input, opts.block_size))

    def dequantize(self, state, opts, cols=None):
        return grasp_decode(state, opts)

    def encode(self, m, opts):
        rows, cols = m.shape
        q = _random_q(cols, _rank(rows, cols, opts), 0, 0, m.device)
        return grasp_encode(m, q, opts, iters=CONVERT_ITERS)

    def owns(self, state):
        return P_CODES in state

    def validate(self, state, rows, cols, opts, where):
        for key in self.spec.keys:
            if key not in state:
                raise StateFormatError(f"{where}: grasp4 state lacks {key}; the checkpoint is incomplete")
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
