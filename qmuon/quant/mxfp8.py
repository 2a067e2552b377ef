"""MXFP8 (OCP Microscaling, E4M3 elements) codec and the Newton-Schulz input carrier.

**Format** (OCP Microscaling Formats (MX) v1.0, "MXFP8 E4M3"). A row of ``cols`` values is cut
into blocks of ``k = 32`` consecutive elements (the last block of a row may be shorter: it is
zero-padded for the scale computation and nothing of the padding is stored). Each block ``B``
stores one shared scale ``X = 2^e`` in E8M0 (an 8-bit biased exponent: code ``e + 127`` in
``0..254``, code ``255`` = NaN) and ``k`` FP8 E4M3 elements ``P_i`` (1 sign, 4 exponent bits with
bias 7, 3 mantissa bits, no infinities; largest normal ``448 = 1.75 * 2^8``, smallest normal
``2^-6``, subnormal step ``2^-9``). A value decodes as ``v_i = X * P_i``.

The shared exponent is the OCP rule::

    e = floor(log2(amax(|B|))) - emax_elem,      emax_elem = 8  (the exponent of E4M3's largest normal)

clamped to E8M0's range ``[-127, 127]``. Then ``amax / X`` lies in ``[256, 512)``; E4M3 reaches
448, so element quotients above 448 are **saturated** to +-448 (the OCP conversion is saturating;
E4M3 has no infinity to overflow to). ``floor(log2(amax))`` is read exactly from the fp32
exponent (``torch.frexp``), not from a rounded ``log2``.

**Error bound** (derived; the tests check it against a float64 reference). Let ``q = x / X``.
Division by a power of two is exact in fp32, and the E4M3 cast rounds to nearest-even:

* normal range ``2^-6 <= |q| <= 448``: the spacing in binade ``[2^j, 2^(j+1))`` is ``2^(j-3)``, so
  ``|P - q| <= 2^(j-4) <= 2^-4 |q|``: relative error at most ``2^-4``, in ``x`` units
  ``|x_hat - x| <= 2^-4 |x|``;
* subnormal range ``|q| < 2^-6``: spacing ``2^-9``, so ``|x_hat - x| <= 2^-10 X``;
* saturated elements ``448 < |q| < 512`` (only in the binade of the block maximum):
  ``|x_hat - x| = |x| - 448 X < (1 - 448/512) |x| = 2^-3 |x|``.

Hence for every finite element ``|x_hat - x| <= max(2^-4 |x| + 2^-10 X, |x| - 448 X)`` and always
``< 2^-3 |x| + 2^-10 X``. Decoding ``X * P`` is exact in fp32 and in bf16 (3 mantissa bits fit in
bf16's 7, and the exponent range of bf16 is fp32's), so a receiver decoding into a bf16
Newton-Schulz batch sees exactly the carrier's values.

**Non-finite values.** A block holding NaN or +-Inf gets the NaN scale (code 255) and decodes to
NaN in every element (the OCP rule: a NaN shared scale makes the whole block NaN); the element
payload keeps NaN for NaN and saturates +-Inf to +-448. :class:`~qmuon.QMuon` never feeds
non-finite inputs to the carrier (it skips or rejects such gradients first).

**The Newton-Schulz carrier** (:func:`mxfp8_encode_normalized`, :func:`mxfp8_roundtrip_normalized`).
Muon orthogonalizes ``G / ||G||_F``. The carrier stores the *normalized* input ``Y = G * inv_norm``
as MXFP8 plus the fp32 scalar ``inv_norm`` (the carried inverse norm, so a receiver can recover
``G``'s scale if it needs it). For Newton-Schulz the decoded ``Y`` is already normalized, so the NS
iteration is run with an inverse norm of 1. Per element the carrier moves ``1 + 1/32`` bytes instead
of bf16's 2 (0.516x), which is what it saves in a gather / all-to-all of NS inputs; its cost is the
rounding error above: about ``2^-4`` relative per element worst case, ``~2^-4/sqrt(3)`` RMS for
values spread over a binade.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "MX_BLOCK",
    "MXFP8Carrier",
    "mxfp8_encode",
    "mxfp8_decode",
    "mxfp8_roundtrip_normalized",
]

#: Largest finite E4M3 (fn) value, ``1.75 * 2^8``.
E4M3_MAX = 448.0
#: Exponent of E4M3's largest normal power of two (``emax_elem`` in the OCP MX specification).
E4M3_EMAX = 8
#: E8M0 stores the exponent ``e`` as ``e + 127``; 255 is NaN.
E8M0_BIAS = 127
E8M0_NAN = 255
#: OCP MX block size.
MX_BLOCK = 32

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_input(x: Tensor, block: int, name: str = "x") -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"mxfp8: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(
            f"mxfp8: {name} must be 2-D (rows, cols) with blocks along each row, got shape {tuple(x.shape)}; "
            "reshape it to (shape[0], -1) first"
        )
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"mxfp8: {name} must be a floating-point tensor (fp32/bf16/fp16/fp64), got {x.dtype}")
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ValueError(f"mxfp8: block must be a positive int (OCP MX uses 32), got {block!r}")


def _e8m0_to_float(codes: Tensor) -> Tensor:
    """E8M0 codes (uint8) -> fp32 ``2^(code - 127)`` exactly (2^-127 is an fp32 subnormal); 255 -> NaN."""
    return codes.contiguous().view(torch.float8_e8m0fnu).to(torch.float32)


def _num_blocks(cols: int, block: int) -> int:
    return -(-cols // block)


def mxfp8_encode(x: Tensor, block: int = MX_BLOCK) -> tuple[Tensor, Tensor]:
    """Encode a 2-D tensor row-blockwise as MXFP8 (E4M3 elements, E8M0 shared scales).

    Args:
        x: ``(rows, cols)`` floating-point tensor (values are read in fp32; fp64 input is first
            rounded to fp32).
        block: elements per shared scale along a row (OCP: 32). A ragged last block is zero-padded
            for its maximum only.

    Returns:
        ``(payload, scales)``: ``payload`` is ``torch.float8_e4m3fn`` of shape ``(rows, cols)``;
        ``scales`` is ``torch.uint8`` of shape ``(rows, ceil(cols / block))`` holding E8M0 codes
        (``2^(code - 127)``, 255 = NaN). See the module docstring for the rule and error bound.
    """
    _check_input(x, block)
    rows, cols = x.shape
    nb = _num_blocks(cols, block)
    xf = x.to(torch.float32)
    pad = nb * block - cols
    xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    xb = xp.reshape(rows, nb, block)
    absb = xb.abs()
    # NaN propagates through amax; +-Inf gives amax = Inf. Both make the block's scale NaN.
    amax = absb.amax(dim=-1)
    nonfinite = ~torch.isfinite(amax)
    # floor(log2(amax)) exactly: amax = m * 2^E with m in [0.5, 1)  ->  floor(log2 amax) = E - 1.
    _, exp = torch.frexp(torch.where(nonfinite | (amax == 0), torch.ones_like(amax), amax))
    e = (exp.to(torch.int32) - 1) - E4M3_EMAX
    e = torch.where(amax == 0, torch.full_like(e, -E8M0_BIAS), e)  # all-zero block: any scale; use the smallest
    e = e.clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = (e + E8M0_BIAS).to(torch.int32)
    codes = torch.where(nonfinite, torch.full_like(codes, E8M0_NAN), codes)
    scales = codes.to(torch.uint8)
    # q = x / 2^e exactly (1 / 2^e = 2^-e is E8M0 code 254 - code), saturate, round to nearest-even E4M3.
    inv_scale = _e8m0_to_float((2 * E8M0_BIAS - (e + E8M0_BIAS)).to(torch.uint8)).unsqueeze(-1)
    q = (xb * inv_scale).clamp(-E4M3_MAX, E4M3_MAX)  # clamp keeps NaN and maps +-Inf to +-448
    payload = q.to(torch.float8_e4m3fn).reshape(rows, nb * block)
    if pad:
        payload = payload[:, :cols].contiguous()
    return payload, scales


def mxfp8_decode(
    payload: Tensor, scales: Tensor, block: int = MX_BLOCK, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Decode :func:`mxfp8_encode`'s output to ``dtype`` (``X * P`` per element; exact in fp32 and
    bf16). A block whose scale code is 255 decodes to NaN."""
    if not isinstance(payload, Tensor) or payload.dtype != torch.float8_e4m3fn or payload.ndim != 2:
        raise ValueError(
            "mxfp8_decode: payload must be a 2-D torch.float8_e4m3fn tensor (from mxfp8_encode), got "
            f"{getattr(payload, 'dtype', type(payload).__name__)} of shape {tuple(getattr(payload, 'shape', ()))}"
        )
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ValueError(f"mxfp8_decode: block must be a positive int (OCP MX uses 32), got {block!r}")
    rows, cols = payload.shape
    nb = _num_blocks(cols, block)
    if not isinstance(scales, Tensor) or scales.dtype != torch.uint8 or tuple(scales.shape) != (rows, nb):
        raise ValueError(
            f"mxfp8_decode: scales must be uint8 E8M0 codes of shape ({rows}, {nb}) = (rows, ceil(cols / {block})), got "
            f"{getattr(scales, 'dtype', type(scales).__name__)} of shape {tuple(getattr(scales, 'shape', ()))}; "
            "pass the block size used to encode"
        )
    if scales.device != payload.device:
        raise ValueError(f"mxfp8_decode: payload is on {payload.device} but scales are on {scales.device}")
    scale = _e8m0_to_float(scales).repeat_interleave(block, dim=1)[:, :cols]  # code 255 -> NaN
    out = payload.to(torch.float32) * scale
    return out if dtype == torch.float32 else out.to(dtype)


def mxfp8_nbytes(rows: int, cols: int, block: int = MX_BLOCK) -> int:
    """Bytes of an MXFP8 carrier of a ``rows x cols`` matrix: payload + scales + the fp32 inverse norm."""
    return rows * cols + rows * _num_blocks(cols, block) + 4


@dataclass
class MXFP8Carrier:
    """A normalized Newton-Schulz input in MXFP8: ``payload * 2^(scales - 127) ~= x * inv_norm``.

    ``inv_norm`` is the fp32 inverse Frobenius norm that was folded into the payload (carried so a
    receiver can undo the normalization: ``decode() / inv_norm ~= x``).
    """

    payload: Tensor  # float8_e4m3fn (rows, cols)
    scales: Tensor  # uint8 E8M0 (rows, ceil(cols / block))
    inv_norm: Tensor  # fp32 0-d
    block: int = MX_BLOCK

    def decode(self, dtype: torch.dtype = torch.bfloat16) -> Tensor:
        """The normalized input as a receiver sees it (bf16 by default: exact, see the module doc)."""
        return mxfp8_decode(self.payload, self.scales, self.block, dtype)

    def nbytes(self) -> int:
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() + 4


def mxfp8_encode_normalized(x: Tensor, inv_norm: Tensor | float, block: int = MX_BLOCK) -> MXFP8Carrier:
    """Fold ``inv_norm`` into ``x`` (in fp32) and encode the product as an :class:`MXFP8Carrier`.

    ``x`` is the raw NS input ``(rows, cols)`` (e.g. the Nesterov blend in the gradient buffer);
    ``inv_norm`` is ``1 / max(||x||_F, eps)`` (a 0-d tensor or a float).
    """
    _check_input(x, block)
    inv = torch.as_tensor(inv_norm, dtype=torch.float32, device=x.device)
    if inv.numel() != 1:
        raise ValueError(f"mxfp8_encode_normalized: inv_norm must be a scalar, got shape {tuple(inv.shape)}")
    inv = inv.reshape(())
    payload, scales = mxfp8_encode(x.to(torch.float32) * inv, block)
    return MXFP8Carrier(payload, scales, inv.clone(), block)


def mxfp8_roundtrip_normalized(
    x: Tensor, inv_norm: Tensor | float, block: int = MX_BLOCK, dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """``decode(encode(x * inv_norm))``: the normalized NS input exactly as a carrier's receiver
    decodes it (bf16 by default). Newton-Schulz on it must use an inverse norm of 1."""
    return mxfp8_encode_normalized(x, inv_norm, block).decode(dtype)
