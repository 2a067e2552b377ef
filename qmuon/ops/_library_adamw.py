"""The ``torch.ops.qmuon`` operator of the quantized AdamW moments: its typed prototype (schema and
reference), fake and compiled-kernel predicate. :mod:`._library` declares it with its ``_op`` (one
place declares every op; this module imports nothing of it, so there is no import cycle).

``adamw_q_update_``: one fused pass over a block of rows: decode the 8-bit / 4-bit first and second
moments, update them with the gradient, emit the fp32 AdamW update of those weights, re-encode
(nearest when ``stream`` < 0, else stochastic rounding keyed by each element's global index
``index0 + r * cols + c``). The
reference is :func:`.reference_adamw.adamw_q_update_`; the compiled twins are
``csrc/cpu/adamw_cpu.cpp`` and ``csrc/cuda/adamw_cuda.cu`` (maths: ``csrc/qmuon/adamw_math.h``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _kernels as K
from . import reference as ref
from . import reference_adamw as refa
__all__: list[str] = []

MUTATES = ("m_codes", "m_scale", "v_codes", "v_scale", "update")


def adamw_q_update_(
    grad: Tensor,
    m_codes: Tensor,
    m_scale: Tensor,
    v_codes: Tensor,
    v_scale: Tensor,
    update: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    neg_step_size: float,
    bias_correction2_sqrt: float,
    m_kind: int,
    v_kind: int,
    block_size: int,
    stream: int,
    index0: int,
    skip: Optional[Tensor] = None,
) -> None:
    """Quantized AdamW moment step of ``grad``'s rows; writes the fp32 update into ``update``
    (see :func:`qmuon.ops.reference_adamw.adamw_q_update_`). ``skip``: a one-element bool / uint8 tensor on
    ``grad``'s device; nonzero leaves the moments and ``update`` untouched (no host read)."""
    _check(grad, m_codes, m_scale, v_codes, v_scale, update, m_kind, v_kind, block_size)
    if stream >= 1 << 32 or index0 < 0:
        raise ValueError(f"adamw_q_update_: stream must be < 2**32 (or < 0: nearest) and index0 >= 0, got {stream}, "
                         f"{index0}")
    ref.check_skip(skip, None, grad.device, "adamw_q_update_")
    flag = ref.skip_flags(skip)
    written = (m_codes, m_scale, v_codes, v_scale, update)
    saved = ref.snapshot(None if flag is None else flag[0], written)
    refa.adamw_q_update_(grad, m_codes, m_scale, v_codes, v_scale, update, beta1, beta2, eps, neg_step_size,
                         bias_correction2_sqrt, m_kind, v_kind, block_size, stream, index0)
    ref.restore(None if flag is None else flag[0], written, saved)


def adamw_q_step_(
    grad: Tensor,
    m_codes: Tensor,
    m_scale: Tensor,
    v_codes: Tensor,
    v_scale: Tensor,
    update: Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    lr: float,
    step: int,
    m_kind: int,
    v_kind: int,
    block_size: int,
    stream: int,
    index0: int,
    skip: Optional[Tensor] = None,
) -> None:
    """:func:`adamw_q_update_` at AdamW step ``step`` with learning rate ``lr``: the bias terms
    (:func:`~qmuon.ops.reference_adamw.bias_terms`) are computed here, when the op runs. A compiled
    optimizer step passes ``step`` as a symbolic int read from the parameter's CPU step counter; a
    symbolic float could not reach the kernels' host-float arguments. No compiled twin of its own:
    it calls ``torch.ops.qmuon.adamw_q_update_`` (whose kernel is the compiled one)."""
    neg_step_size, bias_correction2_sqrt = refa.bias_terms(float(step), lr, beta1, beta2)
    torch.ops.qmuon.adamw_q_update_(grad, m_codes, m_scale, v_codes, v_scale, update, beta1, beta2, eps,
                                    neg_step_size, bias_correction2_sqrt, m_kind, v_kind, block_size, stream, index0,
                                    skip)


def fake_step(grad, m_codes, m_scale, v_codes, v_scale, update, beta1, beta2, eps, lr, step, m_kind, v_kind, block_size,
              stream, index0, skip=None):
    ref.check_skip(skip, None, grad.device, "adamw_q_step_")
    return None


def fake(grad, m_codes, m_scale, v_codes, v_scale, update, beta1, beta2, eps, neg_step_size, bias_correction2_sqrt,
      m_kind, v_kind, block_size, stream, index0, skip=None):
    ref.check_skip(skip, None, grad.device, "adamw_q_update_")
    return None


def _code_dtype(kind: int) -> torch.dtype:
    return torch.int8 if kind == refa.M8 else torch.uint8


def _check(grad: Tensor, m_codes: Tensor, m_scale: Tensor, v_codes: Tensor, v_scale: Tensor, update: Tensor,
           m_kind: int, v_kind: int, block_size: int) -> None:
    """Shapes and dtypes of a call (the same rules the compiled kernels' bindings enforce)."""
    if m_kind not in (refa.M8, refa.M4) or v_kind not in (refa.V8, refa.V4):
        raise ValueError(f"adamw_q_update_: m_kind must be {refa.M8} or {refa.M4} and v_kind {refa.V8} or {refa.V4}, "
                         f"got {m_kind}, {v_kind}")
    if grad.dim() != 2 or update.shape != grad.shape or update.dtype != torch.float32:
        raise ValueError(f"adamw_q_update_: grad must be 2-D and update fp32 of the same shape, got "
                         f"{tuple(grad.shape)} and {tuple(update.shape)} {update.dtype}")
    rows, cols = grad.shape
    nb = (cols + block_size - 1) // block_size
    for name, t, kind in (("m", m_codes, m_kind), ("v", v_codes, v_kind)):
        want = (rows, refa.moment_code_cols(kind, cols))
        if tuple(t.shape) != want or t.dtype != _code_dtype(kind):
            raise ValueError(f"adamw_q_update_: {name}_codes must be {_code_dtype(kind)} {want}, got "
                             f"{t.dtype} {tuple(t.shape)}")
    for name, t in (("m_scale", m_scale), ("v_scale", v_scale)):
        if tuple(t.shape) != (rows, nb) or t.dtype != torch.float32:
            raise ValueError(f"adamw_q_update_: {name} must be fp32 {(rows, nb)}, got {t.dtype} {tuple(t.shape)}")
    if block_size < 2 or block_size % 2:
        raise ValueError(f"adamw_q_update_: block_size must be even and >= 2, got {block_size}")


def _rows_ok(t: Tensor) -> bool:
    return t.dim() == 2 and (t.numel() == 0 or t.stride(1) == 1)


def supported(grad, m_codes, m_scale, v_codes, v_scale, update, beta1, beta2, eps, neg_step_size, bias_correction2_sqrt,
      m_kind, v_kind, block_size, stream, index0, skip=None):
    ts = (grad, m_codes, m_scale, v_codes, v_scale, update)
    return (K.skip_ok(skip, grad) and K.block_ok(block_size) and grad.dtype in K.GRAD_DTYPES and all(_rows_ok(t) for t in ts)
            and all(t.device == grad.device for t in ts))
