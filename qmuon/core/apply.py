"""How an fp32 update reaches a parameter: the one place where both groups (Muon and AdamW) write weights.

``param <- decay * param + alpha * update``, computed in fp32 and written once in the parameter's
own dtype. For fp32 parameters this is exact (``param.mul_(decay); param.add_(update, alpha=alpha)``,
the arithmetic of ``torch.optim.Muon`` / ``AdamW``), done in one pass by
``torch.ops.qmuon.fp32_weight_update_``, which reads the update in any layout and dtype (a
transposed bf16 Newton-Schulz output needs neither a contiguous nor an fp32 copy). For bf16
parameters stored without an fp32 master copy (``model.to(torch.bfloat16)``, Lightning
``precision="bf16-true"``) the rounding of that one write decides whether small updates survive;
``bf16_update`` names the rule:

``"nearest"``
    round to nearest even. 0 extra bytes. An update smaller than half the bf16 gap at the weight
    (``|update| < ulp(w) / 2``, about ``|w| / 512``) is lost every step: with lr 3e-4 an AdamW
    update (~lr) cannot move any weight above ~0.15 in magnitude. Fine for short fine-tunes with
    large steps; :func:`qmuon.optim.stalled_updates` reports the share of elements it
    would freeze.
``"stochastic"`` (default)
    counter-based stochastic rounding: unbiased in expectation, 0 extra bytes, and reproducible:
    the random bits are a hash of ``(seed, parameter key, step, global element index)``, the scheme
    of the momentum's stochastic rounding, so a resumed run and a sharded run write the same bits.
``"ecc8"``
    an int8 error-correction code per weight kept as optimizer state (``weight_ecc``, +1 byte per
    parameter; FlashOptim's ECC, arXiv 2602.23349): the weight behaves like an fp32 master of ~16
    significant bits, deterministic.

Decoupled weight decay is part of the same single rounding: ``x = decay * w + alpha * u`` in fp32,
then one write (a separate bf16 ``mul_`` would round twice and, for nearest rounding, lose the decay
entirely: ``1 - lr * wd`` rounds to 1 in bf16 for ``lr * wd < 2**-9``).

The arithmetic and the bit-level rules: :mod:`qmuon.ops.reference_weight`; the fused
kernels: ``torch.ops.qmuon.bf16_weight_update_`` / ``bf16_ecc8_weight_update_``. Parameters of
other dtypes (fp16) support ``"nearest"`` only.

Callers pass views: a block of a parameter's (local) rows and the update for exactly that block,
so a step's transient memory is one block's fp32 update, never a copy of the whole model.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import Tensor

from .. import ops  # noqa: F401  (registers torch.ops.qmuon)
from ..ops import reference_weight as refw
from ..quant import state as qstate

__all__ = ["WeightWrite", "StallCounts", "record_stalls", "BF16_UPDATES", "apply_update_", "weight_state_init",
           "weight_state_keys", "writes_rounded", "block_rng", "check_weight_state", "sync_weight_state"]

log = logging.getLogger(__name__)

#: How an fp32 update reaches a low-precision weight.
BF16_UPDATES = ("nearest", "stochastic", "ecc8")
DEFAULT_BF16_UPDATE = "stochastic"

#: ``(seed, parameter key, optimizer step, global index of the view's first element)``
Rng = tuple[int, int, int, int]


@dataclass(frozen=True)
class WeightWrite:
    """How one parameter's update is written this step (the keyword arguments of :func:`apply_update_`
    besides the update itself): the rule, the parameter's correction state (local views), the
    rounding counter of its first element."""

    bf16_update: str = "nearest"
    state: dict[str, Tensor] | None = None
    rng: "Rng | None" = None

    @property
    def rounding(self) -> dict[str, Any]:
        return {"bf16_update": self.bf16_update, "state": self.state, "rng": self.rng}


@dataclass
class StallCounts:
    """Per parameter storage (``untyped_storage().data_ptr()`` of the local tensor): how many of its
    elements received an update this step, and how many of those nearest rounding would have left
    unchanged (``bf16(x) == w`` although ``x != w``: the update is below half a bf16 gap)."""

    moved: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    stalled: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    numel: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, param: Tensor, x: Tensor) -> None:
        w = param.float().reshape(x.shape)
        wanted = x != w
        stall = wanted & (x.to(param.dtype).float() == w)
        ptr = param.untyped_storage().data_ptr()
        self.moved[ptr] += int(wanted.sum())
        self.stalled[ptr] += int(stall.sum())
        self.numel[ptr] += x.numel()


_recorder: StallCounts | None = None


@contextmanager
def record_stalls() -> Iterator[StallCounts]:
    """Within the block, every write to a low-precision (bf16 / fp16) weight also counts the elements
    whose update nearest rounding would lose (:class:`StallCounts`), whatever the rule in use. Costs
    one fp32 copy of each written block; meant for a periodic numerics check
    (:func:`qmuon.optim.bf16_stall_report`), not every step."""
    global _recorder
    prev, _recorder = _recorder, StallCounts()
    try:
        yield _recorder
    finally:
        _recorder = prev


def _check_rule(bf16_update: str) -> None:
    if bf16_update not in BF16_UPDATES:
        raise ValueError(f"bf16_update must be one of {BF16_UPDATES}, got {bf16_update!r}")


def writes_rounded(param: Tensor) -> bool:
    """Whether ``param``'s writes go through a ``bf16_update`` rule (bf16 storage)."""
    return param.dtype == torch.bfloat16


def weight_state_keys(param: Tensor, bf16_update: str) -> tuple[str, ...]:
    """Keys of the state tensors ``param`` needs under ``bf16_update`` (``()`` unless bf16 + ecc8)."""
    _check_rule(bf16_update)
    fmt = qstate.weight_format(bf16_update)
    return fmt.spec.keys if fmt is not None and writes_rounded(param) else ()


def weight_state_init(param: Tensor, bf16_update: str) -> dict[str, Tensor]:
    """Optimizer-state tensors a parameter needs for writing its updates: none for fp32 parameters
    and for ``"nearest"`` / ``"stochastic"``; zero ``weight_ecc`` codes (the parameter's local shape)
    for a bf16 parameter under ``"ecc8"``. ``param``: the local tensor (a DTensor's shard)."""
    _check_rule(bf16_update)
    fmt = qstate.weight_format(bf16_update)
    if fmt is None or not writes_rounded(param):
        return {}
    return fmt.init_like(param)


def check_weight_state(param: Tensor, state: dict[str, Any], bf16_update: str, where: str) -> None:
    """Raise :class:`~qmuon.quant.StateFormatError` when a loaded state lacks the
    correction tensors ``bf16_update`` needs, or holds them with the wrong dtype or shape
    (``param``: the local tensor the state belongs to)."""
    fmt = qstate.weight_format(bf16_update)
    if fmt is None or not writes_rounded(param):
        return
    fmt.validate_like(state, tuple(param.shape), where)


def check_loaded_weight_state(param: Tensor, state: dict[str, Any], bf16_update: str, saved_rule: str | None,
                              where: str) -> None:
    """Validate the weight-correction tensors of a loaded state (``param``: the local tensor). Saved and
    resumed with the same ``bf16_update``: what the rule needs must be there, int8 and shaped like the
    parameter (a missing ``weight_ecc`` is an incomplete checkpoint). A changed rule is allowed: codes it
    does not use are dropped at the next step, codes it needs start at zero."""
    wkeys = qstate.weight_state_keys()
    if saved_rule == bf16_update or (any(k in state for k in wkeys) and weight_state_keys(param, bf16_update)):
        check_weight_state(param, {k: v for k, v in state.items() if k in wkeys}, bf16_update, where)


def sync_weight_state(param: Tensor, state: dict[str, Any], bf16_update: str) -> dict[str, Tensor]:
    """Make ``state`` hold exactly the correction tensors ``param`` needs under ``bf16_update``:
    missing ones are created (zero codes: the stored weight is taken as exact, e.g. after switching
    from ``"stochastic"`` to ``"ecc8"``), stale ones dropped (switching away from ``"ecc8"``: the bf16
    weight is already the nearest rounding of the master). Returns the new tensors (for sharding)."""
    want = set(weight_state_keys(param, bf16_update))
    for k in qstate.weight_state_keys() - want:
        if state.pop(k, None) is not None:
            log.info("bf16_update=%r: dropped the %s state of a parameter", bf16_update, k)
    if all(k in state for k in want):  # not set(state): a set of every state key, per parameter and step
        return {}
    new = {k: v for k, v in weight_state_init(param, bf16_update).items() if k not in state}
    state.update(new)
    return new


def block_rng(rng: Rng | None, whole: Tensor, block: Tensor) -> Rng | None:
    """The ``rng`` of a view ``block`` of ``whole`` (whose first element has ``rng[3]``): same
    stream, first index shifted by the block's offset in ``whole``'s storage."""
    if rng is None:
        return None
    seed, key, step, first = rng
    return (seed, key, step, first + _offset_in(block, whole))


@torch.compiler.assume_constant_result
def _offset_in(block: Tensor, whole: Tensor) -> int:
    """Elements from ``whole``'s first to ``block``'s first element in their storage: a constant of the
    parameter's layout (so a compiled step takes it as one instead of breaking its graph on it)."""
    return block.storage_offset() - whole.storage_offset()


def _view_2d(t: Tensor) -> Tensor | None:
    """A 2-D view of ``t`` (rows, trailing elements; 1 x n for 0-d / 1-D) with unit column stride,
    or ``None`` when its layout has none."""
    shape = (1, t.numel()) if t.dim() < 2 else (t.shape[0], math.prod(t.shape[1:]))
    try:
        v = t.view(shape)
    except RuntimeError:
        return None
    return v if v.shape[1] <= 1 or v.stride(1) == 1 else None


def apply_update_(param: Tensor, update: Tensor, *, alpha: float | Tensor, decay: float | Tensor = 1.0,
                  bf16_update: str = "nearest", state: dict[str, Any] | None = None,
                  rng: Rng | None = None, cautious: bool = False, skip: Tensor | None = None) -> None:
    """``param <- decay * param + alpha * update`` in place.

    Args:
        param: the weights to change (a view of the parameter's local storage, any shape).
        update: the update for exactly those weights (same number of elements; fp32, or any float dtype;
            for fp32 weights with a 2-D view, any strides).
        alpha: scale of the update (``-lr * lr_scale`` for Muon, ``-lr`` for AdamW).
        decay: decoupled weight decay factor ``1 - lr * weight_decay`` (1.0: none).
            Either may be a 0-d tensor on ``param``'s device (a capturable step: its lr lives on the
            device): the write then runs as torch ops, the kernels' references, reading nothing.
        bf16_update: the rounding rule when ``param`` is bf16 (see :data:`BF16_UPDATES`).
        state: views of the parameter's weight-correction state matching ``param``
            (from :func:`weight_state_init`), when the rule keeps any.
        cautious: cautious weight decay: ``decay`` applies only where the weight and the step
            ``alpha * update`` have opposite signs (:mod:`qmuon.core.variants`).
        rng: ``(seed, key, step, first_element_index)`` (``step`` a 0-d int tensor under device
            scalars): the counter of rounding noise, when the
            rule draws any. Element ``(r, c)`` of ``param``'s 2-D view (rows, trailing elements)
            draws the bits of global index ``first + r * stride(0) + c``: its flat position in
            the (unsharded, contiguous) parameter when ``first`` is the position of ``param[0]``
            (:func:`block_rng` shifts it for a sub-block).
        skip: None, or a one-element bool tensor on ``param``'s device: when True nothing is written
            (``param`` and ``state`` stay bit-identical; ``update`` may hold NaN). Decided on the
            device, never read on the host.
    """
    _check_rule(bf16_update)
    if isinstance(alpha, Tensor) or isinstance(decay, Tensor):
        _apply_device_scalars_(param, update, alpha=alpha, decay=decay, bf16_update=bf16_update, state=state,
                               rng=rng, cautious=cautious, skip=skip)
        return
    if cautious and decay != 1.0:
        # Cautious weight decay (modded-nanogpt, dion): decay only where the step moves the weight
        # toward zero (weight and ``alpha * update`` of opposite sign). Applied as its own in-place
        # multiply, so a bf16 weight takes one extra rounding for it.
        u = update.reshape(param.shape).to(param.dtype)
        agree = (param * u) >= 0 if alpha < 0 else (param * u) <= 0
        if skip is not None:
            agree = agree & ~skip.reshape(())
        param.mul_(torch.where(agree, decay, 1.0).to(param.dtype))  # x * 1.0 == x: a skip stays exact
        decay = 1.0
    if param.dtype == torch.float32:
        p2 = _view_2d(param)
        if p2 is not None:
            # One pass over the weights, the update read as it is (a transposed NS output, bf16):
            # torch's mul_ + add_ arithmetic bit for bit (ops.reference_weight.fp32_weight_update_).
            u2 = update if update.shape == p2.shape else update.reshape(p2.shape)
            torch.ops.qmuon.fp32_weight_update_(p2, u2, alpha, decay, skip)
            return
    if param.dtype == torch.float32 or param.dtype == torch.float64:
        if skip is None:
            if decay != 1.0:
                param.mul_(decay)
            param.add_(update.reshape(param.shape), alpha=alpha)
            return
        new = param.mul(decay) if decay != 1.0 else param.clone()
        new.add_(update.reshape(param.shape), alpha=alpha)
        param.copy_(torch.where(skip.reshape(()), param, new))
        return
    if _recorder is not None:
        master = param.float()
        if state:
            fmt = qstate.weight_format(bf16_update)
            if fmt is not None:
                master = fmt.master_weight(param, state)
        new_master = master * decay + update.reshape(param.shape).float() * alpha
        _recorder.add(param, new_master if skip is None else torch.where(skip.reshape(()), master, new_master))
    if not writes_rounded(param):
        if bf16_update != "nearest":
            raise ValueError(f"bf16_update={bf16_update!r} applies to bf16 parameters; a {param.dtype} parameter "
                             "supports 'nearest' only (keep fp16 weights with an fp32 master, e.g. mixed precision)")
        new = (param.float() * decay + update.reshape(param.shape).float() * alpha).to(param.dtype)
        param.copy_(new if skip is None else torch.where(skip.reshape(()), param, new))
        return
    p2 = _view_2d(param)
    work = p2 if p2 is not None else param.contiguous().view(param.shape[0] if param.dim() else 1, -1)
    u2 = update.reshape(work.shape)
    fmt = qstate.weight_format(bf16_update)
    if fmt is not None:
        if state is None or any(k not in state for k in fmt.spec.keys):
            raise ValueError(f"apply_update_: bf16_update={bf16_update!r} needs the parameter's "
                             f"{'/'.join(fmt.spec.keys)} state (create it with weight_state_init)")
        views = {}
        for k in fmt.spec.keys:
            s2 = _view_2d(state[k])
            if s2 is None or s2.shape != work.shape:
                raise ValueError(f"apply_update_: {k} of shape {tuple(state[k].shape)} does not match the "
                                 f"parameter block {tuple(param.shape)}")
            views[k] = s2
        fmt.apply_(work, u2, views, alpha=alpha, decay=decay, skip=skip)
    elif bf16_update == "stochastic":
        if rng is None:
            raise ValueError("apply_update_: bf16_update='stochastic' needs rng=(seed, key, step, first_index)")
        seed, key, step, first = (int(x) for x in rng)
        stream = refw.weight_noise_stream(seed, key, step)
        row_stride = work.stride(0) if work.shape[0] > 1 else work.shape[1]
        torch.ops.qmuon.bf16_weight_update_(work, u2, alpha, decay, stream, first, row_stride, skip)
    else:
        torch.ops.qmuon.bf16_weight_update_(work, u2, alpha, decay, -1, 0, 0, skip)
    if p2 is None:
        param.copy_(work.view(param.shape))


def _apply_device_scalars_(param: Tensor, update: Tensor, *, alpha: float | Tensor, decay: float | Tensor,
                           bf16_update: str, state: dict[str, Any] | None, rng: Rng | None, cautious: bool,
                           skip: Tensor | None) -> None:
    """:func:`apply_update_` with ``alpha`` / ``decay`` as 0-d device tensors (a capturable step): the
    same arithmetic as the kernels, written with their pure-torch references (``ops.reference_weight``),
    so nothing is read on the host and a CUDA graph or a compiled step takes the scalars as inputs.

    Each scalar is rounded to fp32 once, as the kernels' arguments are. bf16 / fp16 weights and the
    ecc8 rule get the kernels' result bit for bit; fp32 weights get ``fp32(w * decay) + fp32(u * alpha)``
    where the kernel fuses the add into one FMA (torch has no fused multiply-add with a tensor
    scalar): within one rounding of the weight per step."""
    a32 = alpha.to(torch.float32) if isinstance(alpha, Tensor) else alpha
    d32 = decay.to(torch.float32) if isinstance(decay, Tensor) else decay
    keep = None if skip is None else skip.reshape(())
    u = update.reshape(param.shape)
    if cautious:
        prod = param * u.to(param.dtype)
        agree = torch.where(a32 < 0, prod >= 0, prod <= 0) if isinstance(a32, Tensor) else \
            (prod >= 0 if a32 < 0 else prod <= 0)
        if keep is not None:
            agree = agree & ~keep
        one = torch.ones((), dtype=torch.float32, device=param.device)
        param.mul_(torch.where(agree, d32, one).to(param.dtype))  # x * 1.0 == x: a skip stays exact
        d32 = 1.0
    if _recorder is not None and writes_rounded(param):
        master = param.float()
        fmt = qstate.weight_format(bf16_update) if state else None
        if fmt is not None:
            master = fmt.master_weight(param, state)
        new_master = master * d32 + u.float() * a32
        _recorder.add(param, new_master if keep is None else torch.where(keep, master, new_master))
    fmt = qstate.weight_format(bf16_update) if writes_rounded(param) else None
    if fmt is not None:
        if state is None or any(k not in state for k in fmt.spec.keys):
            raise ValueError(f"apply_update_: bf16_update={bf16_update!r} needs the parameter's "
                             f"{'/'.join(fmt.spec.keys)} state (create it with weight_state_init)")
        work = param.reshape(param.shape[0] if param.dim() else 1, -1)
        views = {k: state[k].reshape(work.shape) for k in fmt.spec.keys}
        fmt.apply_(work, u.reshape(work.shape), views, alpha=a32, decay=d32, skip=skip)
        if work.data_ptr() != param.data_ptr() or not param.is_contiguous():
            param.copy_(work.view(param.shape))
        for k in fmt.spec.keys:
            if views[k].data_ptr() != state[k].data_ptr() or not state[k].is_contiguous():
                state[k].copy_(views[k].view(state[k].shape))
        return
    x = refw.new_weight_fp32(param, u, a32, d32)  # fp32(fp32(w * decay) + fp32(u * alpha))
    if param.dtype == torch.float64:
        x = param * d32 + u.to(param.dtype) * a32
    if not writes_rounded(param) or bf16_update == "nearest":
        if writes_rounded(param):
            x = refw.nearest_bf16(x)
        elif bf16_update != "nearest" and param.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"bf16_update={bf16_update!r} applies to bf16 parameters; a {param.dtype} parameter "
                             "supports 'nearest' only (keep fp16 weights with an fp32 master, e.g. mixed precision)")
        new = x.to(param.dtype)
    elif bf16_update == "stochastic":
        if rng is None:
            raise ValueError("apply_update_: bf16_update='stochastic' needs rng=(seed, key, step, first_index)")
        seed, key, step, first = rng
        step_t = step.to(torch.int64) if isinstance(step, Tensor) else int(step)
        stream = refw.weight_noise_stream(int(seed), int(key), step_t)
        p2 = _view_2d(param)
        rows, cols = (p2.shape if p2 is not None else (param.shape[0] if param.dim() else 1, -1))
        cols = param.numel() // max(rows, 1) if cols == -1 else cols
        row_stride = (p2.stride(0) if p2 is not None and rows > 1 else cols)
        idx = refw.noise_index(rows, cols, int(first), row_stride, param.device)
        new = refw.stochastic_round_bf16(x.reshape(rows, cols), refw._noise_bits16(idx, stream)).view(param.shape)
    else:
        raise ValueError(f"apply_update_: bf16_update={bf16_update!r} has no weight format registered")
    param.copy_(new if keep is None else torch.where(keep, param, new))
