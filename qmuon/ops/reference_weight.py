"""Pure-PyTorch reference of the bf16 weight writes: the readable specification of
``torch.ops.qmuon.bf16_weight_update_`` and ``torch.ops.qmuon.bf16_ecc8_weight_update_``, which the
compiled kernels (``csrc/qmuon/weight_math.h``, ``csrc/cpu/weight_cpu.cpp``,
``csrc/cuda/weight_cuda.cu``) reproduce bit for bit.

The new weight, in fp32
-----------------------
Both ops first form, from the stored weight ``w`` (widened exactly to fp32), the fp32 update ``u``
(any float dtype, widened exactly) and the Python floats ``alpha`` (``-lr``, or ``-lr * lr_scale``)
and ``decay`` (``1 - lr * weight_decay``, decoupled weight decay)::

    x = fp32(fp32(w * decay) + fp32(u * alpha))     (three separately rounded fp32 operations)

``alpha`` and ``decay`` are rounded to fp32 first (as torch does with a Python scalar), and no
operation is fused (no FMA), so every device gives the same ``x``. Weight decay is part of ``x``:
the weight is rounded once per step, not once for the decay and once for the update.

Writing ``x`` to bf16
---------------------
* ``"nearest"``: round to nearest even (``x.to(torch.bfloat16)``; a NaN is written as the one NaN
  ``0x7FC0``, :func:`nearest_bf16`). An update smaller than half the
  gap between ``w`` and its neighbours (``ulp(w) / 2``, ``|w| * 2**-9`` for bf16) is lost entirely.
* ``"stochastic"``: ``bits(x) + r`` truncated to its high 16 bits, with ``r`` 16 uniform random bits:
  rounds away from zero with probability (discarded fraction) / 2**16, so the stored weight equals
  ``x`` in expectation and small updates survive on average. ``r`` is the top 16 bits of the
  counter-based hash of :mod:`.reference` (``fmix32(lo32(i) ^ hi32(i) * 0x27D4EB2F ^ stream)``) at
  the element's global index ``i`` (see below) and a stream of ``(seed, parameter key, step)``
  (:func:`weight_noise_stream`, distinct from the momentum's stream), so a resumed run, a shard and
  the CUDA kernel draw the same bits. Non-finite ``x`` rounds to nearest (a NaN stays NaN).
* ``"ecc8"`` (FlashOptim's error correction, arXiv 2602.23349, databricks/flashoptim
  ``_compute_ecc_bits`` / ``_apply_error_correction``): an int8 code per weight stores the rounding
  error of the last write as a fraction of half the bf16 gap at the stored value::

      h      = 2**(e(w) - 8)        e(w): unbiased exponent of bf16 w (at least -126: zero and
                                    subnormals share the smallest normal's gap); h = ulp(w) / 2
      master = fp32(w) + fp32(fp32(code / 127) * h)                            (decode)
      w'     = bf16_nearest(x)
      code'  = round_half_even(clamp(fp32(fp32(x - w') / h(w')) * 127, -127, 127))    (encode)

  ``x`` is computed from ``master`` instead of ``w``, so the weight behaves like one with
  8 + ~8 significant bits: the stored error is within ``h / 254`` of the true one, where nearest
  rounding alone keeps none of it. ``x - w'`` and the division by the power of two ``h`` are exact;
  non-finite ``x`` (or ``w'``) stores code 0. FlashOptim rounds the code half away from zero; we
  round half to even like every other code in this package (no measurable difference: ties are
  rare and off by one code).

Global element index
--------------------
Element ``(r, c)`` of a 2-D view has index ``index0 + r * index_row_stride + c``. Callers pass the
index of the view's first element in the *unsharded, contiguous* parameter and its row stride in
elements, so a ``Shard(0)`` shard, a row chunk or a column block of a fused parameter draws the
bits the whole parameter would.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .reference import _MASK32, fmix32, noise_stream

__all__ = [
    "weight_noise_stream",
    "nearest_bf16",
    "ecc8_decode",
    "ecc8_encode",
    "bf16_weight_update_",
    "bf16_ecc8_weight_update_",
    "fp32_weight_update_",
]

ECC_QMAX = 127.0
#: Mixed into the weight-rounding stream so that it differs from the momentum's stream of the same
#: (seed, step, key) (the two roundings must not draw correlated bits).
WEIGHT_STREAM_SALT = 0x2545F491


def weight_noise_stream(seed: int, key: int, step: int | Tensor) -> int | Tensor:
    """32-bit stream of the weight rounding of parameter ``key`` at optimizer ``step`` (a 0-d int64
    tensor step gives a tensor stream: :func:`~qmuon.ops.reference.noise_stream`)."""
    out = fmix32((noise_stream(seed, step, key) ^ WEIGHT_STREAM_SALT) & _MASK32)
    return out if isinstance(out, Tensor) else int(out)


def noise_index(rows: int, cols: int, index0: int, index_row_stride: int, device: torch.device) -> Tensor:
    """int64 ``(rows, cols)``: the global element index of each element (module docstring)."""
    r = torch.arange(rows, device=device, dtype=torch.int64) * int(index_row_stride) + int(index0)
    return r[:, None] + torch.arange(cols, device=device, dtype=torch.int64)[None, :]


def _noise_bits16(idx: Tensor, stream: int | Tensor) -> Tensor:
    """The top 16 bits of the counter hash at ``idx`` (int64, values in [0, 2**16))."""
    h = fmix32(((idx & _MASK32) ^ (idx >> 32) * 0x27D4EB2F ^ stream) & _MASK32)
    return h >> 16


def new_weight_fp32(w: Tensor, update: Tensor, alpha: float, decay: float) -> Tensor:
    """``fp32(fp32(w * decay) + fp32(u * alpha))``, each operation rounded separately."""
    return w.float() * decay + update.float() * alpha


#: bf16 bits of the one NaN the kernels write (c10::BFloat16's scalar conversion writes it too; torch's
#: vectorized CPU conversion writes 0xFFFF for some NaNs, so NaNs are canonicalized here explicitly).
BF16_NAN_BITS = 0x7FC0


def nearest_bf16(x: Tensor) -> Tensor:
    """fp32 -> bf16, round to nearest even; every NaN becomes :data:`BF16_NAN_BITS`."""
    out = x.to(torch.bfloat16)
    # a fill, not torch.tensor: no host-to-device copy (a CUDA graph capture refuses one)
    nan = torch.full((), BF16_NAN_BITS, dtype=torch.int16, device=x.device).view(torch.bfloat16)
    return torch.where(x.isnan(), nan, out)


def stochastic_round_bf16(x: Tensor, bits16: Tensor) -> Tensor:
    """fp32 -> bf16 rounding away from zero with probability (discarded bits) / 2**16."""
    b = x.view(torch.int32).to(torch.int64) & _MASK32
    up = ((b + bits16) >> 16) & 0xFFFF
    out = torch.where(up >= 0x8000, up - 0x10000, up).to(torch.int16).view(torch.bfloat16)
    return torch.where(x.isfinite(), out, nearest_bf16(x))


def ecc8_half_ulp(wb: Tensor) -> Tensor:
    """fp32 ``h = 2**(e(w) - 8)``: half the gap between bf16 ``w`` and its neighbours (exact, built
    from bits: ``2**-134`` is an fp32 subnormal)."""
    e = (wb.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    k = torch.clamp(e, min=1) - 127 - 8  # in [-134, 120]
    one = torch.ones_like(k)
    bits = torch.where(k >= -126, (k + 127) << 23, one << (k + 149).clamp(0, 30))
    return bits.view(torch.float32)


def ecc8_decode(wb: Tensor, ecc: Tensor) -> Tensor:
    """The fp32 weight that bf16 ``wb`` plus its int8 correction ``ecc`` stand for."""
    frac = ecc.float() / torch.full_like(wb, ECC_QMAX, dtype=torch.float32)  # a true division on every device
    return wb.float() + frac * ecc8_half_ulp(wb)


def ecc8_encode(x: Tensor, wb: Tensor) -> Tensor:
    """int8 code of the rounding error ``x - wb`` (``wb = bf16_nearest(x)``) in units of ``h(wb) / 127``."""
    e = (x - wb.float()) / ecc8_half_ulp(wb)
    q = torch.round((e * ECC_QMAX).clamp_(-ECC_QMAX, ECC_QMAX))
    ok = x.isfinite() & wb.isfinite()
    return torch.where(ok, q, torch.zeros_like(q)).nan_to_num_(0.0).to(torch.int8)


def bf16_weight_update_(param: Tensor, update: Tensor, alpha: float, decay: float, stream: int, index0: int,
                        index_row_stride: int) -> None:
    """``param <- bf16(decay * param + alpha * update)`` in place: nearest (``stream < 0``) or
    stochastic rounding with ``stream`` (2-D ``param`` bf16, ``update`` of the same shape)."""
    x = new_weight_fp32(param, update, alpha, decay)
    if stream < 0:
        param.copy_(nearest_bf16(x))
        return
    rows, cols = param.shape
    idx = noise_index(rows, cols, index0, index_row_stride, param.device)
    param.copy_(stochastic_round_bf16(x, _noise_bits16(idx, stream)))


def bf16_ecc8_weight_update_(param: Tensor, ecc: Tensor, update: Tensor, alpha: float, decay: float) -> None:
    """``param, ecc <- bf16 + int8 code of (decay * master + alpha * update)`` in place, where
    ``master = ecc8_decode(param, ecc)``."""
    x = new_weight_fp32(ecc8_decode(param, ecc), update, alpha, decay)
    wb = nearest_bf16(x)
    ecc.copy_(ecc8_encode(x, wb))
    param.copy_(wb)


def fp32_weight_update_(param: Tensor, update: Tensor, alpha: float, decay: float) -> None:
    """``param <- decay * param + alpha * update`` for fp32 weights, as ``torch.optim.Muon`` /
    ``AdamW`` write it: ``param.mul_(decay); param.add_(update, alpha=alpha)``.

    Per element that is ``fp32(w * decay)``, then torch's add with ``alpha``, which on CPU builds with
    FMA (AVX2, AVX-512) and on CUDA is one fused multiply-add ``fma(u, alpha, w')``, rounded once (the
    update, any float dtype, widened exactly to fp32; ``alpha`` and ``decay`` rounded to fp32). The
    compiled kernel (``csrc/qmuon/weight_math.h``, ``fp32_weight_element``) does the same in one pass
    over the weights and reads the update with any strides; where torch's add rounds twice
    (``ATEN_CPU_CAPABILITY=default`` on x86) the op keeps this reference
    (``qmuon.ops._kernels.fp32_write_matches_torch``)."""
    param.mul_(decay)
    param.add_(update, alpha=alpha)
