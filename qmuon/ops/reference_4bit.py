"""Pure-PyTorch reference implementations of the 4-bit momentum codecs and updates.

Like :mod:`.reference` (the 8-bit row-block layout), these functions are the readable specification
of ``torch.ops.qmuon.*`` 4-bit ops; they run on any device and on non-contiguous inputs.

Nibble packing
--------------
Every 4-bit format stores sign-magnitude codes ``c`` in ``-7..7`` (the E0M3 grid: a sign bit and a
3-bit magnitude; ``-0`` is never written). Nibble ``n = (c < 0) << 3 | |c|``. Two consecutive
elements of a row share one byte: column ``2j`` in the low nibble, column ``2j + 1`` in the high
nibble; an odd last column gets a zero high nibble. Packed shape: ``(rows, ceil(cols / 2))`` uint8,
so a dim-0 shard of the weight owns exactly the bytes of its rows.

int4 (naive blockwise absmax)
-----------------------------
The 8-bit row-block layout with ``QMAX = 7``: ``code = round(x * (1 / a) * 7)`` per row block of
``block_size`` elements, one fp32 absmax ``a`` per block, ``x_hat = code * (a / 7)``.

e0m3 (E0M3 elements, UE4M3 per-16 block scales, fp32 tensor scale)
------------------------------------------------------------------
Blocks of :data:`E0M3_BLOCK` = 16 consecutive elements of a row. UE4M3 is an unsigned 8-bit
mini-float (4 exponent bits, bias 7, 3 mantissa bits; the bit pattern of a non-negative
``float8_e4m3fn``): normal range ``[2**-6, 448]``, subnormals down to ``2**-9``, ``0x7F`` = NaN (never
written). Two-level scaling::

    t       = max_block_amax / (7 * 448)               (fp32 per-tensor scale; 1 when the tensor is 0)
    s_blk   = ue4m3_ceil(block_amax / 7 / t)           (UE4M3 block scale, rounded *up*)
    code    = clamp(round(x / (s_blk * t)), -7, 7)
    x_hat   = code * (s_blk * t)

so the largest block scale lands at the top of UE4M3's range and momentum of magnitude 1e-6..1e-3
never meets the subnormal floor ``2**-9`` (which a single-level ``t = 1`` would: see
:func:`e0m3_quantize` with ``two_level=False``). Rounding the scale up keeps ``|x| / scale <= 7``, so
no element is clipped and the nearest-rounding error is at most half a step of the decoded scale.
The per-tensor scale is the only non-row-local piece: under row sharding ``max_block_amax`` needs a
max all-reduce (:func:`e0m3_momentum_amax`, then :func:`e0m3_momentum_update_` with ``new_tensor_scale``).

Grid quantization (GRASP residual)
----------------------------------
``s x s`` tiles; within a tile every entry is divided by ``min(row max, column max)`` of the tile
(Li et al., "Memory Efficient Optimizers with 4-bit States", rank-1 normalization), so
``|x| / min(...) <= 1`` and ``code = round(7 x / min(r_i, c_j))``. Row maxima have shape
``(rows, ceil(cols / s))``, column maxima ``(ceil(rows / s), cols)``; both are stored as UE4M3 (8 bits,
rounded up) relative to one fp32 scale ``amax / 448`` per matrix (bf16 maxima would cost 4 / s
bytes per element instead of 2 / s), and the codes use the decoded maxima. The per-matrix scale needs
a MAX all-reduce under sharding (:func:`grid_scale_from_amax`, :func:`grid_quantize4_with_scale`).

Stochastic rounding uses :func:`.reference.uniform_noise` (counter-based, reproducible on resume).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import _blocked, _q8_momentum_and_ns_input, block_sumsq, num_blocks, uniform_noise

__all__ = [
    "pack_int4",
    "unpack_int4",
    "ue4m3_encode",
    "ue4m3_decode",
    "int4_quantize",
    "int4_dequantize",
    "e0m3_tensor_scale_from_amax",
    "e0m3_quantize",
    "e0m3_dequantize",
    "grid_scale_from_amax",
    "grid_quantize4",
    "grid_quantize4_with_scale",
    "grid_dequantize4",
    "int4_momentum_update_",
    "e0m3_momentum_amax",
    "e0m3_momentum_update_",
]

QMAX4 = 7.0
E0M3_BLOCK = 16
UE4M3_MAX = 448.0
UE4M3_MIN_NORMAL = 2.0**-6
UE4M3_MIN_SUBNORMAL = 2.0**-9


# ----------------------------------------------------------------------------- nibbles
def _round_codes(scaled: Tensor, noise: Tensor | None) -> Tensor:
    q = torch.round(scaled) if noise is None else torch.floor(scaled + noise)
    return q.clamp_(-QMAX4, QMAX4).nan_to_num_(nan=0.0)


def pack_int4(codes: Tensor) -> Tensor:
    """int8 codes in ``-7..7``, shape ``(rows, cols)`` -> packed uint8 ``(rows, ceil(cols / 2))``."""
    rows, cols = codes.shape
    c = codes.to(torch.int16)
    nib = torch.where(c < 0, 8 - c, c)  # sign-magnitude: 8 | |c| for negatives
    if cols % 2:
        nib = torch.nn.functional.pad(nib, (0, 1))
    nib = nib.reshape(rows, (cols + 1) // 2, 2)
    return (nib[..., 0] | (nib[..., 1] << 4)).to(torch.uint8)


def unpack_int4(packed: Tensor, cols: int) -> Tensor:
    """Inverse of :func:`pack_int4`: int8 codes ``(rows, cols)``."""
    p = packed.to(torch.int16)
    nib = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(packed.shape[0], 2 * packed.shape[1])[:, :cols]
    mag = nib & 7
    return torch.where(nib >= 8, -mag, mag).to(torch.int8)


# ----------------------------------------------------------------------------- UE4M3
def ue4m3_decode(bits: Tensor) -> Tensor:
    """uint8 UE4M3 bit patterns -> fp32 (exact)."""
    return bits.contiguous().view(torch.float8_e4m3fn).to(torch.float32)


def ue4m3_encode(x: Tensor, *, round_up: bool = False) -> Tensor:
    """Non-negative fp32 -> UE4M3 bit patterns (uint8), saturating at 448.

    Nearest-even by default; ``round_up`` gives the smallest UE4M3 value >= ``x`` (what block scales
    use, so that no element is clipped). Values below half the smallest subnormal (2**-10) become 0
    with nearest rounding, the smallest subnormal 2**-9 with ``round_up``. NaN -> 0.
    """
    x = x.float().nan_to_num(nan=0.0).clamp(0.0, UE4M3_MAX)
    bits = x.to(torch.float8_e4m3fn).view(torch.uint8)
    if round_up:
        below = ue4m3_decode(bits) < x
        bits = torch.where(below, bits + 1, bits)  # positive floats: bit order == value order
    return bits


# ----------------------------------------------------------------------------- int4
def int4_quantize(x: Tensor, block_size: int, *, noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """fp32 ``(rows, cols)`` -> (packed uint8 ``(rows, ceil(cols/2))``, fp32 absmax ``(rows, nb)``)."""
    rows, cols = x.shape
    xb = _blocked(x.float(), block_size)
    absmax = xb.abs().amax(dim=-1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    inv = torch.reciprocal(safe) * QMAX4
    nz = None if noise is None else _blocked(noise, block_size)
    q = _round_codes(xb * inv[..., None], nz)
    q = q.reshape(rows, q.shape[1] * block_size)[:, :cols]
    return pack_int4(q.to(torch.int8)), absmax


def int4_dequantize(packed: Tensor, absmax: Tensor, block_size: int, cols: int) -> Tensor:
    rows = packed.shape[0]
    c = unpack_int4(packed, cols).float()
    scale = absmax / torch.full_like(absmax, QMAX4)
    xb = _blocked(c, block_size) * scale[..., None]
    return xb.reshape(rows, xb.shape[1] * block_size)[:, :cols].contiguous()


# ----------------------------------------------------------------------------- e0m3
def _amax(x: Tensor) -> Tensor:
    """max |x| as a 0-d fp32 tensor (0 for an empty tensor; NaN if x holds one)."""
    return x.float().abs().amax() if x.numel() else torch.zeros((), device=x.device)


def _scale_from_amax(amax: Tensor, divisor: float) -> Tensor:
    # A tensor divisor: a Python-scalar divisor becomes a reciprocal multiply on CUDA (other bits).
    t = amax / torch.full_like(amax, divisor)
    return torch.where((t > 0) & torch.isfinite(t), t, torch.ones_like(t))


def e0m3_tensor_scale_from_amax(amax: Tensor) -> Tensor:
    """``amax / (7 * 448)``, or 1 where that is not a positive finite number: the e0m3 tensor scale
    of a matrix whose max |x| is ``amax`` (under row sharding, the MAX all-reduce of the shards')."""
    return _scale_from_amax(amax, QMAX4 * UE4M3_MAX)


def e0m3_tensor_scale(x: Tensor) -> Tensor:
    """The fp32 per-tensor scale that maps the largest block scale to 448 (0-d; 1 for a zero or
    non-finite tensor)."""
    return e0m3_tensor_scale_from_amax(_amax(x))


def e0m3_quantize_with_scale(x: Tensor, t: Tensor, *, noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`e0m3_quantize` with the tensor scale ``t`` given (0-d fp32): (packed uint8, UE4M3
    scales). Row-local, so a row shard encoded with its matrix's ``t`` gives the matrix's bytes."""
    rows, cols = x.shape
    xb = _blocked(x.float(), E0M3_BLOCK)
    amax = xb.abs().amax(dim=-1)
    s_bits = ue4m3_encode(amax / (QMAX4 * t), round_up=True)
    step = ue4m3_decode(s_bits) * t
    safe = torch.where(step > 0, step, torch.ones_like(step))
    nz = None if noise is None else _blocked(noise, E0M3_BLOCK)
    q = _round_codes(xb / safe[..., None], nz)
    q = torch.where(step[..., None] > 0, q, torch.zeros_like(q))
    q = q.reshape(rows, q.shape[1] * E0M3_BLOCK)[:, :cols]
    return pack_int4(q.to(torch.int8)), s_bits


def e0m3_quantize(
    x: Tensor, *, two_level: bool = True, noise: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 ``(rows, cols)`` -> (packed uint8, UE4M3 scales uint8 ``(rows, ceil(cols/16))``, fp32
    0-d tensor scale). ``two_level=False`` uses tensor scale 1 (single-level UE4M3, for comparison)."""
    t = e0m3_tensor_scale(x) if two_level else torch.ones((), dtype=torch.float32, device=x.device)
    packed, s_bits = e0m3_quantize_with_scale(x, t, noise=noise)
    return packed, s_bits, t.reshape(()).to(torch.float32)


def e0m3_dequantize(packed: Tensor, scales: Tensor, tensor_scale: Tensor, cols: int) -> Tensor:
    rows = packed.shape[0]
    c = unpack_int4(packed, cols).float()
    step = ue4m3_decode(scales) * tensor_scale.float()
    xb = _blocked(c, E0M3_BLOCK) * step[..., None]
    return xb.reshape(rows, xb.shape[1] * E0M3_BLOCK)[:, :cols].contiguous()


# ----------------------------------------------------------------------------- grid (GRASP residual)
def _grid_maxima(x: Tensor, s: int) -> tuple[Tensor, Tensor]:
    rows, cols = x.shape
    a = x.abs()
    row_max = _blocked(a, s).amax(dim=-1)  # (rows, ceil(cols/s))
    col_max = _blocked(a.T.contiguous(), s).amax(dim=-1).T.contiguous()  # (ceil(rows/s), cols)
    return row_max, col_max


def _grid_denominator(row_max: Tensor, col_max: Tensor, s: int, rows: int, cols: int) -> Tensor:
    r = row_max.repeat_interleave(s, dim=1)[:, :cols]
    c = col_max.repeat_interleave(s, dim=0)[:rows, :]
    return torch.minimum(r, c)


def grid_scale_from_amax(amax: Tensor) -> Tensor:
    """``amax / 448``, or 1 where that is not a positive finite number: the grid maxima scale of a
    matrix whose max |x| is ``amax`` (under row sharding, the MAX all-reduce of the shards')."""
    return _scale_from_amax(amax, UE4M3_MAX)


def grid_quantize4_with_scale(
    x: Tensor, s: int, t: Tensor, *, noise: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`grid_quantize4` with the maxima scale ``t`` given (0-d fp32): (packed codes, UE4M3 row
    maxima, UE4M3 column maxima of ``x``'s tiles). Row-local apart from ``t``; the column maxima
    cover ``s``-row tiles starting at ``x``'s first row, so a row shard must start on a tile boundary."""
    rows, cols = x.shape
    x = x.float()
    row_max, col_max = _grid_maxima(x, s)
    row_bits = ue4m3_encode(row_max / t, round_up=True)
    col_bits = ue4m3_encode(col_max / t, round_up=True)
    den = _grid_denominator(ue4m3_decode(row_bits) * t, ue4m3_decode(col_bits) * t, s, rows, cols)
    safe = torch.where(den > 0, den, torch.ones_like(den))
    q = _round_codes(x / safe * QMAX4, noise)
    q = torch.where(den > 0, q, torch.zeros_like(q))
    return pack_int4(q.to(torch.int8)), row_bits, col_bits


def grid_quantize4(
    x: Tensor, s: int, *, noise: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp32 ``(rows, cols)`` -> (packed uint8 codes, UE4M3 row maxima ``(rows, ceil(cols/s))``, UE4M3
    column maxima ``(ceil(rows/s), cols)``, fp32 0-d maxima scale ``t``).

    Maxima are stored as UE4M3 bit patterns of ``max / t`` rounded *up* (``t = amax / 448``, so the
    largest maximum sits at the top of UE4M3's range), and every entry is scaled by
    ``7 / min(decoded tile row max, decoded tile column max)``: ``|x| / min(...) <= 1``, no clipping.
    """
    t = grid_scale_from_amax(_amax(x)).reshape(())
    return (*grid_quantize4_with_scale(x, s, t, noise=noise), t.to(torch.float32))


def grid_dequantize4(packed: Tensor, row_bits: Tensor, col_bits: Tensor, t: Tensor, s: int, cols: int) -> Tensor:
    rows = packed.shape[0]
    c = unpack_int4(packed, cols).float()
    tt = t.float()
    den = _grid_denominator(ue4m3_decode(row_bits) * tt, ue4m3_decode(col_bits) * tt, s, rows, cols)
    return (c * (den / torch.full_like(den, QMAX4))).contiguous()


# ----------------------------------------------------------------------------- fused updates
def int4_momentum_update_(
    packed: Tensor, absmax: Tensor, grad: Tensor, *, beta: float, nesterov: bool, block_size: int,
    stream: int | None = None, row_offset: int = 0,
) -> Tensor:
    """:func:`.reference.q8_momentum_update_` for int4 state (packed codes + fp32 absmax)."""
    cols = grad.shape[1]
    m_old = int4_dequantize(packed, absmax, block_size, cols)
    m_new, ns_input = _q8_momentum_and_ns_input(m_old, grad.float(), beta, nesterov)
    noise = None if stream is None else uniform_noise(grad.shape[0], cols, stream, row_offset, grad.device)
    new_packed, new_absmax = int4_quantize(m_new, block_size, noise=noise)
    packed.copy_(new_packed)
    absmax.copy_(new_absmax)
    grad.copy_(ns_input)
    return block_sumsq(ns_input, block_size)


def _e0m3_new_momentum(packed: Tensor, scales: Tensor, tensor_scale: Tensor, grad: Tensor, beta: float,
                       nesterov: bool) -> tuple[Tensor, Tensor]:
    m_old = e0m3_dequantize(packed, scales, tensor_scale, grad.shape[1])
    return _q8_momentum_and_ns_input(m_old, grad.float(), beta, nesterov)


def e0m3_momentum_amax(packed: Tensor, scales: Tensor, tensor_scale: Tensor, grad: Tensor, *, beta: float) -> Tensor:
    """max |m_new| of the new momentum ``m_new = beta * m_old + (1 - beta) * g`` (0-d fp32; 0 for an
    empty matrix, NaN if ``m_new`` holds one): the first half of :func:`e0m3_momentum_update_`, which
    a row shard needs before it can encode (the tensor scale is that of the whole matrix)."""
    m_new, _ = _e0m3_new_momentum(packed, scales, tensor_scale, grad, beta, False)
    a = _amax(m_new)
    # One NaN bit pattern (amax would pass on whichever NaN it met), so that kernels can match it.
    return torch.where(torch.isnan(a), torch.full_like(a, float("nan")), a)


def e0m3_momentum_update_(
    packed: Tensor, scales: Tensor, tensor_scale: Tensor, grad: Tensor, *, beta: float, nesterov: bool,
    block_size: int, stream: int | None = None, row_offset: int = 0, new_tensor_scale: Tensor | None = None,
) -> Tensor:
    """The same for e0m3 state; ``block_size`` is only the granularity of the returned sums.

    ``new_tensor_scale`` (0-d fp32) replaces the scale computed from the new momentum (a row shard
    passes its matrix's, from the all-reduced :func:`e0m3_momentum_amax`); either way
    ``tensor_scale`` holds the scale used afterwards."""
    m_new, ns_input = _e0m3_new_momentum(packed, scales, tensor_scale, grad, beta, nesterov)
    noise = None if stream is None else uniform_noise(*grad.shape, stream, row_offset, grad.device)
    if new_tensor_scale is None:
        new_packed, new_scales, new_t = e0m3_quantize(m_new, noise=noise)
    else:
        new_t = new_tensor_scale.reshape(())
        new_packed, new_scales = e0m3_quantize_with_scale(m_new, new_t, noise=noise)
    packed.copy_(new_packed)
    scales.copy_(new_scales)
    tensor_scale.copy_(new_t)
    grad.copy_(ns_input)
    return block_sumsq(ns_input, block_size)


def packed_cols(cols: int) -> int:
    return (cols + 1) // 2


def e0m3_num_blocks(cols: int) -> int:
    return num_blocks(cols, E0M3_BLOCK)
