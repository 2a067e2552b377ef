"""Pure-PyTorch reference of the quantized AdamW moments: the codecs and the fused moment update.

The compiled kernels (``csrc/cpu/adamw_cpu.cpp``, ``csrc/cuda/adamw_cuda.cu``, per-block maths in
``csrc/qmuon/adamw_math.h``) reproduce these functions bit for bit: every fp32 operation below is
one correctly rounded IEEE operation in the order written (no fused multiply-add), and the fp32
constants are rounded from Python doubles the way the C++ code casts them.

Layout (as the Muon momentum's, :mod:`.reference`): a moment of a ``rows x cols`` matrix is stored
in blocks of ``block_size`` consecutive elements *of one row*, each with one fp32 scale; a row's
last block may be short. So a row shard (FSDP2 ``Shard(0)``) owns whole blocks and its codes and
scales are plain row slices.

Maps (``kind``; :data:`MOMENT_KINDS`):

=====  ======  =====================================================================================
kind   bits    map
=====  ======  =====================================================================================
0      8       first moment ``m``: ``u = m / absmax`` (absmax of the block), companded
               ``c = 2u / (1 + |u|)`` (softsign, as FlashOptim), code ``rint(127 c)`` in int8
1      8       second moment ``v``: ``s = sqrt(v)``, ``t = s / max(s)``, code ``rint(256 t) - 1`` clamped
               to [0, 255] in uint8, decoded as ``s = (code + 1) / 256 * max(s)``: no zero code, so a
               stored ``v`` is never 0 unless its whole block is (1 / sqrt(v) cannot blow up)
2      4       first moment, softsign as kind 0 with code ``rint(7 c)`` in [-7, 7], stored as the
               nibble ``code + 8``, two per byte (even column in the low nibble)
3      4       second moment: ``s = v ** (1/4)`` (``sqrt(sqrt(v))``), code ``rint(16 t) - 1`` in
               [0, 15], decoded ``s = (code + 1) / 16 * max(s)``, ``v = (s s)(s s)``; no zero code
=====  ======  =====================================================================================

The scale stored per block is ``max |m|`` (kinds 0, 2) or ``max s`` (kinds 1, 3); a block whose
scale is 0 decodes to exact zeros (a fresh state, an embedding row no token has touched).

Rounding of the codes: nearest, or stochastic (``stream`` >= 0): between the two codes around the
moment ``x``, the upper with probability ``(x - x_lo) / (x_hi - x_lo)`` of their *decoded* values, so
``E[decode(code)] = x`` through the non-linear maps (unbiased in the moment itself, which is what
the exponential averages accumulate). A ``v`` below its block's smallest code (no zero code) rounds
up, as nearest does. The noise of an element is the counter hash of :mod:`.reference`
(``fmix32(global index ^ stream)``) keyed by its index in the whole parameter (``index0 + r * cols +
c``), with one stream per moment (:func:`moment_stream`) derived from the step's
:func:`adamw_noise_stream` (distinct from the Muon momentum's and the bf16 weights' streams): a
resumed run, a row shard and a DeepSpeed partition draw the bits of the single-process run.

Overflow: a finite gradient whose square overflows fp32 (``|g| > ~1.8e19``) would make ``v``
infinite and its block scale infinite, which freezes every element of the block for good; the new
moments are clamped to ``+-FLT_MAX`` (:data:`FLT_MAX`) instead.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import _MASK32, _blocked, _fp32, _lerp_fp32, fmix32, noise_stream, num_blocks


def bias_terms(step: float, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """``(-lr / (1 - beta1^t), sqrt(1 - beta2^t))``, computed as ``torch.optim.AdamW`` does (Python floats)."""
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return -(lr / bias_correction1), bias_correction2**0.5


def bias_terms_on_device(step: Tensor, lr: Tensor, beta1: float, beta2: float) -> tuple[Tensor, Tensor]:
    """:func:`bias_terms` from a 0-d step counter and lr on the device (a capturable step), in fp64 as
    Python computes them (``torch.pow`` in place of ``**``: the same libm pow on CPU; on CUDA within an
    ulp of fp64, invisible once the terms are rounded to fp32 for the update)."""
    t = step.to(torch.float64)
    bias_correction1 = 1 - torch.pow(beta1, t)
    bias_correction2 = 1 - torch.pow(beta2, t)
    return -(lr.to(torch.float64) / bias_correction1), torch.sqrt(bias_correction2)

__all__ = [
    "M8",
    "V8",
    "M4",
    "V4",
    "moment_bits",
    "moment_code_cols",
    "encode_moment",
    "decode_moment",
    "adamw_q_update_",
    "adamw_noise_stream",
]

#: The largest finite fp32 (the new moments are clamped to +-FLT_MAX).
FLT_MAX = float(torch.finfo(torch.float32).max)
#: Mixed into the AdamW moments' stream: distinct from the Muon momentum's (no salt) and the bf16
#: weights' (``reference_weight.WEIGHT_STREAM_SALT``) streams of the same (seed, step, key).
ADAMW_STREAM_SALT = 0x7F4A7C15
#: Per-moment salts (``kAdamMStreamSalt`` / ``kAdamVStreamSalt`` of csrc/qmuon/adamw_math.h).
_M_SALT, _V_SALT = 0x68E31DA4, 0xB5297A4D

M8, V8, M4, V4 = 0, 1, 2, 3
#: kind -> (bits, signed)
MOMENT_KINDS = {M8: (8, True), V8: (8, False), M4: (4, True), V4: (4, False)}


def moment_bits(kind: int) -> int:
    if kind not in MOMENT_KINDS:
        raise ValueError(f"unknown AdamW moment kind {kind}; expected one of {sorted(MOMENT_KINDS)}")
    return MOMENT_KINDS[kind][0]


def moment_code_cols(kind: int, cols: int) -> int:
    """Columns of the stored code tensor: ``cols`` (8-bit) or ``ceil(cols / 2)`` (two nibbles a byte)."""
    return cols if moment_bits(kind) == 8 else (cols + 1) // 2


def adamw_noise_stream(seed: int, key: int, step: int) -> int:
    """32-bit stream of the AdamW moments' stochastic rounding of parameter ``key`` at ``step`` (the
    op's ``stream``; each moment then draws from :func:`moment_stream`)."""
    return int(fmix32((noise_stream(seed, step, key) ^ ADAMW_STREAM_SALT) & _MASK32))


def moment_stream(stream: int, kind: int) -> int:
    """The stream of moment ``kind`` (m or v) from the op's ``stream``."""
    return int(fmix32((stream ^ (_M_SALT if MOMENT_KINDS[kind][1] else _V_SALT)) & _MASK32))


def moment_noise(rows: int, cols: int, stream: int, index0: int, device: torch.device) -> Tensor:
    """U[0, 1) fp32 ``(rows, cols)``: the noise of element ``(r, c)``, global index ``index0 + r * cols + c``."""
    r = torch.arange(rows, device=device, dtype=torch.int64) * cols + int(index0)
    idx = r[:, None] + torch.arange(cols, device=device, dtype=torch.int64)[None, :]
    h = fmix32(((idx & _MASK32) ^ (idx >> 32) * 0x27D4EB2F ^ stream) & _MASK32)
    return (h >> 8).to(torch.float32) * (1.0 / 16777216.0)


def _levels(kind: int) -> float:
    return {M8: 127.0, V8: 256.0, M4: 7.0, V4: 16.0}[kind]


def _sqrt(x: Tensor) -> Tensor:
    """The correctly rounded fp32 square root (IEEE ``sqrtf``, what the kernels compute).

    ``torch.sqrt`` of fp32 on CPU is not correctly rounded in its vectorized path (measured: ~0.7% of
    elements one ulp off with torch 2.13's AVX-512 build); the float64 root rounded to fp32 is
    (a double holds more than twice fp32's precision, so the double rounding is innocuous)."""
    return torch.sqrt(x.double()).float()


def _transform(x: Tensor, kind: int) -> Tensor:
    """The stored quantity: ``m`` itself (signed kinds), ``sqrt(v)`` or ``v ** (1/4)``."""
    if kind in (M8, M4):
        return x
    s = _sqrt(x)
    return _sqrt(s) if kind == V4 else s


def _pack(codes: Tensor) -> Tensor:
    """uint8 ``(rows, cols)`` nibbles -> ``(rows, ceil(cols / 2))`` bytes, even column low."""
    rows, cols = codes.shape
    if cols % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    c = codes.to(torch.uint8).reshape(rows, -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def _unpack(packed: Tensor, cols: int) -> Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], -1)[:, :cols]


def _block_scale(t: Tensor, block_size: int) -> Tensor:
    """Per-row-block max of ``|t|`` (fp32 ``(rows, nb)``)."""
    return _blocked(t.abs(), block_size).amax(dim=-1)


def _expand(scale: Tensor, cols: int, block_size: int) -> Tensor:
    return scale.repeat_interleave(block_size, dim=1)[:, :cols]


def encode_moment(x: Tensor, kind: int, block_size: int, noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """fp32 ``(rows, cols)`` moment -> ``(codes, scale)`` of ``kind``: nearest rounding, or stochastic
    with ``noise`` (U[0, 1) fp32, ``x``'s shape; :func:`moment_noise`).

    ``x`` must be finite, and >= 0 for the second-moment kinds."""
    moment_bits(kind)
    x = x.float()
    rows, cols = x.shape
    t = _transform(x, kind)
    scale = _block_scale(t, block_size) if cols else torch.zeros((rows, 0), dtype=torch.float32, device=x.device)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = t / _expand(safe, cols, block_size)
    L = _fp32(_levels(kind))
    signed = kind in (M8, M4)
    if noise is not None:
        q = _stochastic_codes(u, x, _expand(scale, cols, block_size), noise, kind, block_size, cols)
    elif signed:
        c = (u * 2.0) / (u.abs() + 1.0)
        q = torch.round(c * L).clamp_(-L, L)
    else:
        q = (torch.round(u * L) - 1.0).clamp_(0.0, L - 1.0)
    if signed:
        codes = q.to(torch.int8) if kind == M8 else _pack((q + 8.0).to(torch.uint8))
    else:
        codes = q.to(torch.uint8) if kind == V8 else _pack(q.to(torch.uint8))
    return codes, scale.contiguous()


def _decode_values(q: Tensor, sc: Tensor, kind: int) -> Tensor:
    """Code values ``q`` (float) with per-element scales ``sc`` -> the moment (:func:`decode_moment`'s maths)."""
    L = _fp32(_levels(kind))
    if kind in (M8, M4):
        c = q / L
        return (c / (2.0 - c.abs())) * sc
    s = ((q + 1.0) / L) * sc
    if kind == V8:
        return s * s
    s2 = s * s
    return s2 * s2


def _stochastic_codes(u: Tensor, x: Tensor, sc: Tensor, noise: Tensor, kind: int, block_size: int,
                      cols: int) -> Tensor:
    """Stochastic code values (module docstring): ``u = t / safe``, ``x`` the moment, ``sc`` its block's scale."""
    L = _fp32(_levels(kind))
    if kind in (M8, M4):
        y = ((u * 2.0) / (u.abs() + 1.0)) * L
        qmin, qmax = -L, L
    else:
        y = u * L - 1.0
        qmin, qmax = 0.0, L - 1.0
    lo = torch.floor(y).clamp_(qmin, qmax - 1.0)
    hi = lo + 1.0
    x_lo = _decode_values(lo, sc, kind)
    gap = _decode_values(hi, sc, kind) - x_lo
    p = torch.where(gap > 0, (x - x_lo) / torch.where(gap > 0, gap, torch.ones_like(gap)), torch.zeros_like(gap))
    return torch.where(noise < p, hi, lo)


def decode_moment(codes: Tensor, scale: Tensor, kind: int, block_size: int, cols: int) -> Tensor:
    """``(codes, scale)`` of ``kind`` -> the fp32 ``(rows, cols)`` moment."""
    moment_bits(kind)
    if kind in (M8, V8):
        q = codes.float()
    elif kind == M4:
        q = _unpack(codes, cols).float() - 8.0
    else:
        q = _unpack(codes, cols).float()
    return _decode_values(q, _expand(scale.float(), cols, block_size), kind)


def adamw_q_update_(
    grad: Tensor, m_codes: Tensor, m_scale: Tensor, v_codes: Tensor, v_scale: Tensor, update: Tensor,
    beta1: float, beta2: float, eps: float, neg_step_size: float, bias_correction2_sqrt: float,
    m_kind: int, v_kind: int, block_size: int, stream: int = -1, index0: int = 0,
) -> None:
    """One AdamW moment step of a ``rows x cols`` block of rows, in place, with the update emitted.

    With ``w = 1 - beta1`` (torch's ``exp_avg.lerp_(grad, 1 - beta1)``, each operation rounded)::

        m = lerp(m, g, 1 - beta1)
        v = v * beta2 + ((1 - beta2) * g) * g            (torch's mul_ then addcmul_)
        update = (neg_step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps)

    ``neg_step_size = -lr / (1 - beta1 ** step)``: the update is the whole step of
    ``torch.optim.AdamW`` (``param.addcdiv_(m, denom, value=-step_size)``), which the caller adds to
    the weights with ``alpha=1``. The update uses the new fp32 moments (before re-quantization),
    as bitsandbytes, torchao and FlashOptim do; then m and v are clamped to ``+-FLT_MAX`` and
    re-encoded: nearest (``stream < 0``), or stochastically with the noise of :func:`moment_noise`
    (``index0``: the global index of element ``(0, 0)``; row ``r`` starts at ``index0 + r * cols``)
    in the streams :func:`moment_stream` derives from ``stream``.
    """
    rows, cols = grad.shape
    g = grad.float()
    m = decode_moment(m_codes, m_scale, m_kind, block_size, cols)
    v = decode_moment(v_codes, v_scale, v_kind, block_size, cols)
    m = _lerp_fp32(m, g, 1.0 - beta1).clamp_(-FLT_MAX, FLT_MAX)
    v = (v * _fp32(beta2) + (g * _fp32(1.0 - beta2)) * g).clamp_(-FLT_MAX, FLT_MAX)
    denom = _sqrt(v) / _fp32(bias_correction2_sqrt) + _fp32(eps)
    update.copy_((m * _fp32(neg_step_size)) / denom)
    m_noise = v_noise = None
    if stream >= 0:
        m_noise = moment_noise(rows, cols, moment_stream(stream, m_kind), index0, g.device)
        v_noise = moment_noise(rows, cols, moment_stream(stream, v_kind), index0, g.device)
    mc, ms = encode_moment(m, m_kind, block_size, m_noise)
    vc, vs = encode_moment(v, v_kind, block_size, v_noise)
    m_codes.copy_(mc)
    m_scale.copy_(ms)
    v_codes.copy_(vc)
    v_scale.copy_(vs)
    assert ms.shape == (rows, num_blocks(cols, block_size)) or cols == 0
