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
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import _blocked, _fp32, _lerp_fp32, num_blocks

__all__ = [
    "MOMENT_KINDS",
    "M8",
    "V8",
    "M4",
    "V4",
    "moment_bits",
    "moment_code_cols",
    "encode_moment",
    "decode_moment",
    "adamw_q_update_",
]

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


def encode_moment(x: Tensor, kind: int, block_size: int) -> tuple[Tensor, Tensor]:
    """fp32 ``(rows, cols)`` moment -> ``(codes, scale)`` of ``kind`` (nearest rounding).

    ``x`` must be finite, and >= 0 for the second-moment kinds."""
    moment_bits(kind)
    x = x.float()
    rows, cols = x.shape
    t = _transform(x, kind)
    scale = _block_scale(t, block_size) if cols else torch.zeros((rows, 0), dtype=torch.float32, device=x.device)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = t / _expand(safe, cols, block_size)
    L = _fp32(_levels(kind))
    if kind in (M8, M4):
        c = (u * 2.0) / (u.abs() + 1.0)
        q = torch.round(c * L).clamp_(-L, L)
        codes = q.to(torch.int8) if kind == M8 else _pack((q + 8.0).to(torch.uint8))
    else:
        q = (torch.round(u * L) - 1.0).clamp_(0.0, L - 1.0)
        codes = q.to(torch.uint8) if kind == V8 else _pack(q.to(torch.uint8))
    return codes, scale.contiguous()


def decode_moment(codes: Tensor, scale: Tensor, kind: int, block_size: int, cols: int) -> Tensor:
    """``(codes, scale)`` of ``kind`` -> the fp32 ``(rows, cols)`` moment."""
    moment_bits(kind)
    L = _fp32(_levels(kind))
    if kind == M8:
        q = codes.float()
    elif kind == M4:
        q = _unpack(codes, cols).float() - 8.0
    elif kind == V8:
        q = codes.float()
    else:
        q = _unpack(codes, cols).float()
    sc = _expand(scale.float(), cols, block_size)
    if kind in (M8, M4):
        c = q / L
        u = c / (2.0 - c.abs())
        return u * sc
    s = ((q + 1.0) / L) * sc
    if kind == V8:
        return s * s
    s2 = s * s
    return s2 * s2


def adamw_q_update_(
    grad: Tensor, m_codes: Tensor, m_scale: Tensor, v_codes: Tensor, v_scale: Tensor, update: Tensor,
    beta1: float, beta2: float, eps: float, neg_step_size: float, bias_correction2_sqrt: float,
    m_kind: int, v_kind: int, block_size: int,
) -> None:
    """One AdamW moment step of a ``rows x cols`` block of rows, in place, with the update emitted.

    With ``w = 1 - beta1`` (torch's ``exp_avg.lerp_(grad, 1 - beta1)``, each operation rounded)::

        m = lerp(m, g, 1 - beta1)
        v = v * beta2 + ((1 - beta2) * g) * g            (torch's mul_ then addcmul_)
        update = (neg_step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps)

    ``neg_step_size = -lr / (1 - beta1 ** step)``: the update is the whole step of
    ``torch.optim.AdamW`` (``param.addcdiv_(m, denom, value=-step_size)``), which the caller adds to
    the weights with ``alpha=1``. The update uses the new fp32 moments (before re-quantization),
    as bitsandbytes, torchao and FlashOptim do; then m and v are re-encoded (nearest).
    """
    rows, cols = grad.shape
    g = grad.float()
    m = decode_moment(m_codes, m_scale, m_kind, block_size, cols)
    v = decode_moment(v_codes, v_scale, v_kind, block_size, cols)
    m = _lerp_fp32(m, g, 1.0 - beta1)
    v = v * _fp32(beta2) + (g * _fp32(1.0 - beta2)) * g
    denom = _sqrt(v) / _fp32(bias_correction2_sqrt) + _fp32(eps)
    update.copy_((m * _fp32(neg_step_size)) / denom)
    mc, ms = encode_moment(m, m_kind, block_size)
    vc, vs = encode_moment(v, v_kind, block_size)
    m_codes.copy_(mc)
    m_scale.copy_(ms)
    v_codes.copy_(vc)
    v_scale.copy_(vs)
    assert ms.shape == (rows, num_blocks(cols, block_size)) or cols == 0
