"""Pure-PyTorch reference implementations of the quantized-momentum kernels.

These functions are the readable specification of every op in ``torch.ops.qmuon``. The compiled
kernels (``csrc/``) must reproduce them: identical codes and scales, and sums of squares equal up to
fp32 summation order. Everything here works on any device PyTorch supports and on non-contiguous
inputs.

State layout ("row blocks")
---------------------------
A momentum matrix of shape ``(rows, cols)`` is cut into blocks of ``block_size`` consecutive
elements *within each row*; the last block of a row may be partial. Codes have the matrix's shape
and the per-block absmax scales have shape ``(rows, ceil(cols / block_size))``.

The prototype used flat blocks over the flattened tensor, so one block could straddle two rows. Row
blocks make every row range block-aligned: a dim-0 shard of the weight (FSDP2, ``Shard(0)``) owns
exactly the codes *and* the scales of its rows, and a fused QKV part (a row range) never shares a
block with another part. The price is a partial block at the end of each row when ``cols`` is not a
multiple of ``block_size`` (GPT-shaped matrices have ``cols`` in multiples of 256, so none).

Quantization (8-bit, symmetric absmax)
--------------------------------------
For a block ``x`` with ``a = max|x|``::

    inv   = (1 / a) * 127            (fp32, two roundings; a == 0 -> a := 1, codes are 0)
    code  = clamp(round_half_even(x * inv), -127, 127)          nearest
    code  = clamp(floor(x * inv + u), -127, 127), u ~ U[0, 1)  stochastic
    x_hat = code * (a / 127)         (a / 127: one true fp32 division)

Every fp32 step above (and in the momentum update below) is one separately rounded operation, and
the reference spells each one out, so that it gives the same bits on every device and the compiled
kernels (``csrc/``, built without FMA contraction) can reproduce it exactly. (Written naively,
``127 / t`` is ``t.reciprocal() * 127`` and, on CUDA, ``t / 127`` is ``t * (1 / 127)``.)

``uint8`` stores ``code + 128`` (so 128 means zero and 1..255 are used), ``int8`` stores ``code``.
A NaN in ``x * inv`` (only possible for non-finite blocks or an absmax below 2**-128) gives code 0.

Stochastic rounding noise
-------------------------
``u`` comes from a counter-based hash so that it is reproducible after a resume and identical in the
CPU, CUDA and reference paths: ``u = (fmix32(global_index ^ stream) >> 8) * 2**-24`` where
``global_index = (row_offset + row) * cols + col`` counts elements of the *unsharded* matrix (so a
dim-0 shard draws the same numbers as the full tensor) and ``stream`` mixes seed, step and a stable
per-parameter key (see :func:`noise_stream`).
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

__all__ = [
    "fmix32",
    "noise_stream",
    "uniform_noise",
    "num_blocks",
    "quantize_rows",
    "dequantize_rows",
    "block_sumsq",
    "q8_momentum_update_",
    "dense_momentum_update_",
]

QMAX = 127.0
_MASK32 = 0xFFFFFFFF


def fmix32(h: Tensor | int) -> Tensor | int:
    """MurmurHash3's 32-bit finalizer, on Python ints or int64 tensors holding values < 2**32.

    int64 products wrap in two's complement; masking keeps the low 32 bits, which equal the uint32
    product the C++/CUDA code computes.
    """
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def noise_stream(seed: int, step: int | Tensor, key: int) -> int | Tensor:
    """32-bit stream id for one (seed, step, parameter key) triple. ``step`` may be a 0-d int64
    tensor (a capturable step's device counter): the stream is then a tensor too, nothing is read."""
    h = fmix32((seed & _MASK32) ^ fmix32((key * 0x9E3779B9 + 0x632BE5AB) & _MASK32))
    out = fmix32((h ^ ((step * 0x85EBCA77) & _MASK32)) & _MASK32)
    return out if isinstance(out, Tensor) else int(out)


def uniform_noise(rows: int, cols: int, stream: int, row_offset: int, device: torch.device) -> Tensor:
    """U[0, 1) fp32 noise of shape ``(rows, cols)``, a pure function of position and stream."""
    r = torch.arange(row_offset, row_offset + rows, device=device, dtype=torch.int64)
    c = torch.arange(cols, device=device, dtype=torch.int64)
    idx = r[:, None] * cols + c[None, :]
    # Fold the high word in so tensors over 2**32 elements do not repeat noise.
    h = fmix32(((idx & _MASK32) ^ (idx >> 32) * 0x27D4EB2F ^ stream) & _MASK32)
    return (h >> 8).to(torch.float32) * (1.0 / 16777216.0)


def num_blocks(cols: int, block_size: int) -> int:
    return (cols + block_size - 1) // block_size


def _blocked(x: Tensor, block_size: int) -> Tensor:
    """View ``(rows, cols)`` as ``(rows, nb, block_size)``, zero-padding the last block of a row."""
    rows, cols = x.shape
    nb = num_blocks(cols, block_size)
    pad = nb * block_size - cols
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(rows, nb, block_size)


def quantize_rows(
    x: Tensor,
    block_size: int,
    *,
    signed: bool = True,
    noise: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Quantize a 2-D fp32 tensor into (codes, absmax) in the row-block layout.

    ``noise`` (same shape as ``x``, values in [0, 1)) selects stochastic rounding.
    Returns int8 (``signed``) or uint8 codes shaped like ``x`` and fp32 absmax ``(rows, nb)``.
    """
    rows, cols = x.shape
    xb = _blocked(x.float(), block_size)
    absmax = xb.abs().amax(dim=-1)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    inv = torch.reciprocal(safe) * QMAX
    scaled = xb * inv[..., None]
    if noise is None:
        q = torch.round(scaled)
    else:
        q = torch.floor(scaled + _blocked(noise, block_size))
    # NaN (0 * inf: a block holding inf, or an absmax below 2**-128 whose reciprocal overflows)
    # becomes code 0, so that codes are always in [-127, 127] and the same on every device.
    q = q.clamp_(-QMAX, QMAX).nan_to_num_(nan=0.0)
    q = q.reshape(rows, q.shape[1] * block_size)[:, :cols]  # (not -1: rows may be 0)
    codes = q.to(torch.int8) if signed else (q + 128.0).to(torch.uint8)
    return codes, absmax


def dequantize_rows(codes: Tensor, absmax: Tensor, block_size: int) -> Tensor:
    """Inverse of :func:`quantize_rows`: fp32 tensor shaped like ``codes``."""
    rows, cols = codes.shape
    c = codes.float() if codes.dtype == torch.int8 else codes.float() - 128.0
    # A true division on every device (a Python-scalar divisor becomes a reciprocal multiply on CUDA).
    scale = absmax / torch.full_like(absmax, QMAX)
    xb = _blocked(c, block_size) * scale[..., None]
    return xb.reshape(rows, xb.shape[1] * block_size)[:, :cols].contiguous()


def block_sumsq(x: Tensor, block_size: int) -> Tensor:
    """Sum of squares of each row block, fp32 ``(rows, nb)``."""
    xb = _blocked(x.float(), block_size)
    return (xb * xb).sum(dim=-1)


# ----------------------------------------------------------------------------- skip flags
# The state-mutating ops take an optional ``skip``: device-side flags (one per matrix) that leave a flagged
# matrix's tensors untouched, so that an optimizer can act on a non-finite gradient without reading a flag
# back to the host. The references run the update as without flags and then restore, bit for bit, what a
# flagged matrix held (a select on the device, no host read).
def check_skip(skip: Tensor | None, n: int | None, device: torch.device | None, op: str) -> None:
    """Raise ``ValueError`` (before anything is written) unless ``skip`` is None or holds ``n`` flags (one per
    matrix of a multi-tensor update; ``n`` None: one flag, a single-matrix op) on ``device`` (None: any).
    The flags may have any dtype here (nonzero skips); the compiled kernels take bool or uint8."""
    if skip is None:
        return
    want = 1 if n is None else n
    if skip.numel() == want and (device is None or skip.device == device):
        return
    where = "" if device is None else f" on {device}"
    if n is None:
        raise ValueError(
            f"qmuon::{op}: skip must be a one-element tensor{where}, got {skip.numel()} element(s) on {skip.device}; "
            "pass a bool or uint8 tensor of shape (1,) on the device of the op's tensors (nonzero: the call writes "
            "nothing), or skip=None")
    raise ValueError(
        f"qmuon::{op}: skip must hold one flag per matrix ({n}){where}, got {skip.numel()} element(s) on "
        f"{skip.device}; pass a bool or uint8 tensor of shape ({n},) on the matrices' device (nonzero leaves that "
        "matrix untouched), or skip=None")


def skip_flags(skip: Tensor | None) -> Tensor | None:
    """``skip`` as a flat bool tensor (on its device; nonzero: skip), or None."""
    return None if skip is None else skip.reshape(-1) != 0


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_view(t: Tensor) -> Tensor:
    """``t`` viewed as integers of its element size (a view of any strides: same-size dtypes)."""
    dtype = _INT_OF_SIZE[t.element_size()]
    return t if t.dtype == dtype else t.view(dtype)


def snapshot(flag: Tensor | None, tensors: tuple[Tensor, ...]) -> list[Tensor] | None:
    """Copies of ``tensors`` (their bits) to :func:`restore` from, or None without a flag."""
    return None if flag is None else [t.clone() for t in tensors]


def restore(flag: Tensor | None, tensors: tuple[Tensor, ...], saved: list[Tensor] | None) -> None:
    """``t <- saved where flag`` for each tensor (``flag``: a 0-d bool tensor on their device), bit for bit
    (a select on integer views: NaN payloads survive); nothing without a flag."""
    if flag is None or saved is None:
        return
    for t, old in zip(tensors, saved):
        if t.numel():
            bits = _bits_view(t)
            bits.copy_(torch.where(flag, _bits_view(old), bits))


def _momentum_and_ns_input(m_old: Tensor, grad32: Tensor, beta: float, nesterov: bool) -> tuple[Tensor, Tensor]:
    """Muon's momentum convention (identical to ``torch.optim.Muon``)::

        m_new    = lerp(m_old, g, 1 - beta) = beta * m_old + (1 - beta) * g
        ns_input = lerp(g, m_new, beta)      if nesterov else m_new
    """
    m_new = torch.lerp(m_old, grad32, 1.0 - beta)
    ns_input = torch.lerp(grad32, m_new, beta) if nesterov else m_new
    return m_new, ns_input


def _fp32(x: float | Tensor) -> float | Tensor:
    """``x`` rounded to the nearest fp32 value (as a Python float; ``struct`` rounds to nearest even,
    as ``torch.tensor(x, dtype=torch.float32)`` does, without making a tensor to read back). A 0-d
    tensor (a capturable step's device scalar) is cast on its device, nothing read."""
    if isinstance(x, Tensor):
        return x.to(torch.float32)
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # rounds to +-inf in fp32
        return math.copysign(math.inf, x)


def _lerp_fp32(start: Tensor, end: Tensor, weight: float) -> Tensor:
    """``torch.lerp(start, end, weight)``'s formula with every fp32 operation rounded separately::

        w = fp32(weight)
        |w| < 0.5:  start + w * (end - start)
        otherwise:  end - (end - start) * (1 - w)        (1 - w in fp32)

    ``torch.lerp`` itself fuses the multiply-add on some CPU code paths (and CUDA contracts it), so
    its last bit depends on the device and the tensor's size; this does not, and the compiled
    kernels compute exactly this.
    """
    w = _fp32(weight)
    diff = end - start
    if abs(w) < 0.5:
        return start + diff * w
    return end - diff * _fp32(1.0 - w)  # 1 - w is exact in fp32 for w in [0.5, 2]


def _q8_momentum_and_ns_input(m_old: Tensor, grad32: Tensor, beta: float, nesterov: bool) -> tuple[Tensor, Tensor]:
    """:func:`_momentum_and_ns_input` with :func:`_lerp_fp32` (device-independent bits)."""
    m_new = _lerp_fp32(m_old, grad32, 1.0 - beta)
    ns_input = _lerp_fp32(grad32, m_new, beta) if nesterov else m_new
    return m_new, ns_input


def q8_momentum_update_(
    codes: Tensor,
    absmax: Tensor,
    grad: Tensor,
    *,
    beta: float,
    nesterov: bool,
    block_size: int,
    stream: int | None = None,
    row_offset: int = 0,
) -> Tensor:
    """One fused pass for one matrix: dequantize, update, requantize, write the NS input.

    ``codes``/``absmax`` are updated in place; ``grad`` (any float dtype, any strides) is
    overwritten with the Newton-Schulz input. ``stream`` not None selects stochastic rounding.
    Returns the per-block sum of squares of the NS input (fp32, ``(rows, nb)``), computed from
    the fp32 value before it is cast to ``grad``'s dtype.
    """
    m_old = dequantize_rows(codes, absmax, block_size)
    m_new, ns_input = _q8_momentum_and_ns_input(m_old, grad.float(), beta, nesterov)
    noise = None if stream is None else uniform_noise(*codes.shape, stream, row_offset, codes.device)
    new_codes, new_absmax = quantize_rows(m_new, block_size, signed=codes.dtype == torch.int8, noise=noise)
    codes.copy_(new_codes)
    absmax.copy_(new_absmax)
    grad.copy_(ns_input)
    return block_sumsq(ns_input, block_size)


def _round_to_bf16(x: Tensor, noise: Tensor | None) -> Tensor:
    """fp32 -> bf16, nearest-even or stochastic (add noise to the 16 dropped mantissa bits)."""
    if noise is None:
        return x.to(torch.bfloat16)
    bits = x.view(torch.int32).to(torch.int64) & _MASK32
    r = (noise * 65536.0).to(torch.int64)  # uniform integer in [0, 65536)
    finite = torch.isfinite(x)
    rounded = ((bits + r) & 0xFFFF0000) & _MASK32
    # back to int32 bit pattern (values >= 2**31 are negative floats)
    rounded = torch.where(rounded >= 2**31, rounded - 2**32, rounded).to(torch.int32)
    out = torch.where(finite, rounded.view(torch.float32), x)
    return out.to(torch.bfloat16)


def dense_momentum_update_(
    buf: Tensor,
    grad: Tensor,
    *,
    beta: float,
    nesterov: bool,
    block_size: int,
    stream: int | None = None,
    row_offset: int = 0,
) -> Tensor:
    """Same contract as :func:`q8_momentum_update_` for an fp32 or bf16 momentum buffer.

    fp32 buffers are updated exactly as ``torch.optim.Muon`` does (``buf.lerp_(grad, 1 - beta)``);
    bf16 buffers are updated in fp32 and rounded back (stochastically when ``stream`` is given).
    """
    if buf.dtype == torch.float32:
        buf.lerp_(grad.float(), 1.0 - beta)
        m_new = buf
    else:
        m_new, _ = _momentum_and_ns_input(buf.float(), grad.float(), beta, False)
        noise = None if stream is None else uniform_noise(*buf.shape, stream, row_offset, buf.device)
        buf.copy_(_round_to_bf16(m_new, noise))
    grad32 = grad.float()
    ns_input = torch.lerp(grad32, m_new, beta) if nesterov else m_new
    grad.copy_(ns_input)
    return block_sumsq(ns_input, block_size)


def bytes_per_element(state_format: str, cols: int, block_size: int | None, *, rows: int | None = None,
                      rank: int = 4, grid_block: int = 32) -> float:
    """Persistent state bytes per momentum element for a matrix with ``cols`` columns (momentum
    tensors only, ``step`` excluded). ``block_size=None`` is the format's default (256; int4 128).
    grasp4 (and e0m3's 4-byte tensor scale) depend on ``rows`` too (default: square)."""
    rows = cols if rows is None else rows
    if block_size is None:
        block_size = 128 if state_format == "int4" else 256
    packed = ((cols + 1) // 2) / cols
    if state_format == "fp32":
        return 4.0
    if state_format == "bf16":
        return 2.0
    if state_format == "int4":
        return packed + 4.0 * num_blocks(cols, block_size) / cols
    if state_format == "e0m3":
        return packed + num_blocks(cols, 16) / cols + 4.0 / (rows * cols)
    if state_format == "grasp4":
        k = max(1, min(rank, rows, cols))
        factors = (rows + cols) * (k + 2)  # int8 codes + bf16 per-row absmax, for P and R
        grid = rows * num_blocks(cols, grid_block) + num_blocks(rows, grid_block) * cols + 4  # UE4M3 maxima + scale
        return packed + (factors + grid) / (rows * cols)
    return 1.0 + 4.0 * num_blocks(cols, block_size) / cols
