"""The ``torch.ops.qmuon`` ops that write weights (bf16 with a rounding rule; fp32 with decay and update
in one pass): their reference is :mod:`.reference_weight`, their compiled twins
``csrc/cpu/weight_cpu.cpp`` and ``csrc/cuda/weight_cuda.cu``.

:mod:`._library` calls :func:`declare` with its op decorator before it registers the compiled
kernels, so these ops are declared (and get their kernels) like every other op, and this module
imports nothing from :mod:`._library` (no import cycle)."""

from __future__ import annotations

import torch
from torch import Tensor

from typing import Any, Callable, Optional

from . import _kernels as K
from . import reference as ref
from . import reference_weight as refw

__all__: list[str] = []

_UPDATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows_ok(t: Tensor) -> bool:
    """2-D with unit column stride (rows may be padded): what the kernels index."""
    return t.dim() == 2 and (t.shape[1] <= 1 or t.stride(1) == 1) and (t.shape[0] <= 1 or t.stride(0) >= t.shape[1])


def _check(param: Tensor, update: Tensor, op: str) -> None:
    if param.dim() != 2 or param.dtype != torch.bfloat16:
        raise ValueError(f"qmuon::{op}: param must be a 2-D bf16 tensor, got {param.dim()}-D {param.dtype}")
    if update.shape != param.shape:
        raise ValueError(f"qmuon::{op}: update has shape {tuple(update.shape)}, param {tuple(param.shape)}")


def _skipping(skip: Optional[Tensor], param: Tensor, op: str, written: tuple[Tensor, ...],
              write: Callable[[], None]) -> None:
    """``write()``, undone bit for bit (on the device, no host read) when the one-element ``skip`` is nonzero."""
    ref.check_skip(skip, None, param.device, op)
    flag = None if skip is None else ref.skip_flags(skip)[0]
    saved = ref.snapshot(flag, written)
    write()
    ref.restore(flag, written, saved)


def _fake_skip(skip: Optional[Tensor], param: Tensor, op: str) -> None:
    ref.check_skip(skip, None, param.device, op)


def declare(_op: Callable[..., Any]) -> dict[str, Any]:
    """Declare ``qmuon::bf16_weight_update_``, ``qmuon::bf16_ecc8_weight_update_`` and
    ``qmuon::fp32_weight_update_`` with the op
    decorator ``_op`` of :mod:`._library`; returns the ops by name."""

    @_op(mutates_args=("param",))
    def bf16_weight_update_(param: Tensor, update: Tensor, alpha: float, decay: float, stream: int, index0: int,
                            index_row_stride: int, skip: Optional[Tensor] = None) -> None:
        """``param <- bf16(decay * param + alpha * update)``: nearest (``stream < 0``) or stochastic
        rounding with the 32-bit ``stream``; element ``(r, c)`` draws the noise of global index
        ``index0 + r * index_row_stride + c`` (see :mod:`.reference_weight`). ``skip``: a one-element
        bool / uint8 tensor on the param's device; nonzero leaves ``param`` untouched (no host read)."""
        _check(param, update, "bf16_weight_update_")
        _skipping(skip, param, "bf16_weight_update_", (param,),
                  lambda: refw.bf16_weight_update_(param, update, alpha, decay, stream, index0, index_row_stride))

    @bf16_weight_update_.register_fake
    def _(param, update, alpha, decay, stream, index0, index_row_stride, skip=None):
        _fake_skip(skip, param, "bf16_weight_update_")
        return None

    @bf16_weight_update_.compiled_when
    def _(param, update, alpha, decay, stream, index0, index_row_stride, skip=None):
        return (K.skip_ok(skip, param) and param.dtype == torch.bfloat16 and update.dtype in _UPDATE_DTYPES and _rows_ok(param) and _rows_ok(update)
                and update.shape == param.shape and update.device == param.device and index0 >= 0
                and index_row_stride >= 0)

    @_op(mutates_args=("param", "ecc"))
    def bf16_ecc8_weight_update_(param: Tensor, ecc: Tensor, update: Tensor, alpha: float, decay: float,
                                 skip: Optional[Tensor] = None) -> None:
        """``param, ecc <- bf16 + int8 error code of (decay * master + alpha * update)`` where
        ``master`` is ``param`` corrected by ``ecc`` (FlashOptim's ECC; see :mod:`.reference_weight`).
        ``skip``: as for ``bf16_weight_update_`` (a flagged call writes neither ``param`` nor ``ecc``)."""
        _check(param, update, "bf16_ecc8_weight_update_")
        if ecc.shape != param.shape or ecc.dtype != torch.int8:
            raise ValueError(f"qmuon::bf16_ecc8_weight_update_: ecc must be int8 shaped like param {tuple(param.shape)}, "
                             f"got {ecc.dtype} {tuple(ecc.shape)}")
        _skipping(skip, param, "bf16_ecc8_weight_update_", (param, ecc),
                  lambda: refw.bf16_ecc8_weight_update_(param, ecc, update, alpha, decay))

    @bf16_ecc8_weight_update_.register_fake
    def _(param, ecc, update, alpha, decay, skip=None):
        _fake_skip(skip, param, "bf16_ecc8_weight_update_")
        return None

    @bf16_ecc8_weight_update_.compiled_when
    def _(param, ecc, update, alpha, decay, skip=None):
        return (K.skip_ok(skip, param) and param.dtype == torch.bfloat16 and ecc.dtype == torch.int8 and update.dtype in _UPDATE_DTYPES
                and _rows_ok(param) and _rows_ok(ecc) and _rows_ok(update) and update.shape == param.shape
                and ecc.shape == param.shape and update.device == param.device and ecc.device == param.device)

    @_op(mutates_args=("param",))
    def fp32_weight_update_(param: Tensor, update: Tensor, alpha: float, decay: float,
                            skip: Optional[Tensor] = None) -> None:
        """``param <- fma(update, alpha, fp32(decay * param))``: torch's ``param.mul_(decay);
        param.add_(update, alpha=alpha)`` (see :func:`.reference_weight.fp32_weight_update_`) for a 2-D
        fp32 ``param``; ``update`` of its shape, fp32 / bf16 / fp16, any strides (the compiled kernel
        reads a transposed update in place, no contiguous or fp32 copy). ``skip``: as for
        ``bf16_weight_update_``."""
        if param.dim() != 2 or param.dtype != torch.float32:
            raise ValueError(f"qmuon::fp32_weight_update_: param must be a 2-D fp32 tensor, got {param.dim()}-D "
                             f"{param.dtype}")
        if update.shape != param.shape:
            raise ValueError(f"qmuon::fp32_weight_update_: update has shape {tuple(update.shape)}, param "
                             f"{tuple(param.shape)}")
        _skipping(skip, param, "fp32_weight_update_", (param,),
                  lambda: refw.fp32_weight_update_(param, update, alpha, decay))

    @fp32_weight_update_.register_fake
    def _(param, update, alpha, decay, skip=None):
        _fake_skip(skip, param, "fp32_weight_update_")
        return None

    @fp32_weight_update_.compiled_when
    def _(param, update, alpha, decay, skip=None):
        return (K.skip_ok(skip, param) and param.dtype == torch.float32 and update.dtype in _UPDATE_DTYPES and _rows_ok(param)
                and update.dim() == 2 and update.shape == param.shape and update.device == param.device
                and K.fp32_write_matches_torch(param.device))

    return {"bf16_weight_update_": bf16_weight_update_, "bf16_ecc8_weight_update_": bf16_ecc8_weight_update_,
            "fp32_weight_update_": fp32_weight_update_}
