"""The auxiliary AdamW's stored moments: every format decision of the AdamW groups.

An AdamW group's ``state_format`` (QMuon's ``adamw_state_format``) names a *family*: ``"fp32"``,
``"bf16"``, ``"int8"`` or ``"int4"``. A family is a pair of registered formats (one registry,
:mod:`.registry`): the first moment's (role ``"adamw_m"``) and the second's (role ``"adamw_v"``), e.g.
``adamw_m_int8`` / ``adamw_v_int8`` (:mod:`.formats.adamw_q8`). A parameter's state is a plain
``dict[str, Tensor]``: ``step`` (0-d fp32, as ``torch.optim.AdamW``) plus both formats' tensors.

Which format a tensor gets (:func:`moment_formats`): the family's, except 1-D tensors and tensors
with fewer than :data:`SMALL_TENSOR_ELEMENTS` elements, which keep fp32 moments (biases, norm gains:
few bytes, and the most sensitive to quantization). Quantized moments are stored in row blocks of
the parameter's ``(rows, cols)`` view (``cols`` = product of the trailing dims), so the state of a
``Shard(0)`` row shard is the row slice of the whole state and reshards without requantizing.

The update of a block of rows (:func:`update_rows`) runs the fused kernel of the quantized formats
(``torch.ops.qmuon.adamw_q_update_``) or, for dense moments, torch's own in-place ops in
``torch.optim.AdamW``'s order (bit-exact with it for fp32).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .. import ops  # noqa: F401  (registers torch.ops.qmuon)
from ..ops import _library_adamw
from ..ops import reference_adamw as _refa
from .formats.base import STEP, FormatOptions, StateFormat, StateFormatError
from .registry import FORMATS, family_format

__all__ = [
    "DEFAULT_ADAMW_STATE_FORMAT",
    "FULL_PRECISION",
    "check_adamw_state_format",
    "matrix_shape",
    "moment_formats",
    "init_adamw_state",
    "convert_adamw_state",
    "to_torch_adamw_state",
    "update_rows",
    "moment_noise_stream",
    "flat_slice_pieces",
]

log = logging.getLogger(__name__)

ADAMW_ROLES = ("adamw_m", "adamw_v")
#: QMuon's ``adamw_state_format`` default (chosen from the fidelity benchmark: docs/formats.md).
DEFAULT_ADAMW_STATE_FORMAT = "int8"
#: Tensors with fewer elements (and every 1-D tensor) keep fp32 moments whatever the family.
SMALL_TENSOR_ELEMENTS = 4096
#: The family of small tensors and of ``torch.optim.AdamW``'s own state.
FULL_PRECISION = "fp32"
_FULL = FULL_PRECISION


def adamw_state_families() -> tuple[str, ...]:
    """Every registered ``adamw_state_format`` (families with both moment formats), registry order."""
    fams: list[str] = []
    for f in FORMATS.values():
        fam = getattr(f, "family", None)
        if f.role == "adamw_m" and fam not in fams and _pair(fam) is not None:
            fams.append(fam)
    return tuple(fams)


def _pair(family: Any) -> tuple[StateFormat, StateFormat] | None:
    m, v = family_format(family, "adamw_m"), family_format(family, "adamw_v")
    return (m, v) if m is not None and v is not None else None


def check_adamw_state_format(name: Any, where: str) -> str:
    """``name`` if it is a registered AdamW state family, else ``ValueError`` naming the choices."""
    if not isinstance(name, str) or _pair(name) is None:
        raise ValueError(f"{where}: adamw state_format must be one of {adamw_state_families()} (how the AdamW "
                         f"moments exp_avg / exp_avg_sq are stored), got {name!r}")
    return name


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The ``(rows, cols)`` view of a parameter (1-D: ``(n, 1)``; 0-d: ``(1, 1)``)."""
    if len(shape) == 0:
        return 1, 1
    return int(shape[0]), math.prod([int(s) for s in shape[1:]])


def moment_formats(family: str, shape: Sequence[int]) -> tuple[StateFormat, StateFormat]:
    """The (first, second) moment formats of a parameter of ``shape`` (its local rows when sharded:
    pass the global shape to decide, so every rank agrees) in ``family``."""
    check_adamw_state_format(family, "QMuon")
    if len(shape) < 2 or math.prod([int(s) for s in shape]) < SMALL_TENSOR_ELEMENTS:
        family = _FULL
    pair = _pair(family)
    assert pair is not None
    return pair


def moment_options(fmt: StateFormat) -> FormatOptions:
    return FormatOptions(block_size=fmt.default_block_size)


def _dense(fmt: StateFormat) -> bool:
    return fmt.spec.kind.startswith("adamw_dense")


def init_adamw_state(family: str, global_shape: Sequence[int], local_shape: Sequence[int],
                     device: torch.device) -> dict[str, Tensor]:
    """Zero moments (and ``step``) for a parameter whose (local) rows are ``local_shape``."""
    st: dict[str, Tensor] = {STEP: torch.zeros((), dtype=torch.float32)}
    rows, cols = matrix_shape(local_shape)
    for fmt in moment_formats(family, global_shape):
        kw = {"shape": tuple(local_shape)} if _dense(fmt) else {}
        st.update(fmt.init(rows, cols, moment_options(fmt), device, **kw))
    return st


def _detect(state: Mapping[str, Any], role: str) -> StateFormat:
    for f in FORMATS.values():
        if f.role == role and f.owns(state):
            return f
    for f in FORMATS.values():
        msg = f.explain_unowned(state) if f.role == role else None
        if msg:
            raise StateFormatError(msg)
    what = "first moment (exp_avg)" if role == "adamw_m" else "second moment (exp_avg_sq)"
    raise StateFormatError(f"no AdamW {what} in state (keys: {sorted(state)})")


def detect_moment_formats(state: Mapping[str, Any]) -> tuple[StateFormat, StateFormat]:
    """The formats a loaded AdamW state entry is in (from its keys and dtypes)."""
    return _detect(state, "adamw_m"), _detect(state, "adamw_v")


def convert_adamw_state(state: Mapping[str, Any], family: str, global_shape: Sequence[int],
                        local_shape: Sequence[int], where: str) -> dict[str, Any]:
    """A loaded AdamW state entry (QMuon's in any family, or ``torch.optim.AdamW``'s) validated
    against the parameter's (local) shape and converted to the formats ``family`` gives it.

    Same formats: the tensors are kept (no requantization). Another format: dequantized and
    re-encoded (nearest). Row blocks are per row, so a sharded rank converts its own rows.
    ``step`` is kept (added as 0 when missing); other non-moment entries are kept."""
    rows, cols = matrix_shape(local_shape)
    targets = moment_formats(family, global_shape)
    found = detect_moment_formats(state)
    keys = set().union(*(f.spec.keys for f in FORMATS.values() if f.role in ADAMW_ROLES))
    out: dict[str, Any] = {k: v for k, v in state.items() if k not in keys}
    step = out.get(STEP)
    if step is None:
        out[STEP] = torch.zeros((), dtype=torch.float32)
    elif not isinstance(step, Tensor) or step.numel() != 1:
        raise StateFormatError(f"{where}: AdamW step must be a one-element tensor, got {step!r}")
    else:
        out[STEP] = step.detach().reshape(()).to(torch.float32)
    for src, dst in zip(found, targets):
        src.validate(dict(state), rows, cols, moment_options(src), where)
        if src is dst:
            out.update({k: state[k] for k in src.spec.keys})
            continue
        x = src.dequantize(dict(state), moment_options(src), cols)
        if not torch.isfinite(x).all():
            raise StateFormatError(f"{where}: the saved {src.name} moment holds NaN/Inf; the checkpoint is corrupt")
        enc = dst.encode(x.reshape(tuple(local_shape)) if _dense(dst) else x, moment_options(dst))
        out.update(enc)
        log.info("%s: converted AdamW moment %s to %s", where, src.name, dst.name)
    return out


def to_torch_adamw_state(state: Mapping[str, Any], shape: Sequence[int]) -> dict[str, Tensor]:
    """``{"step", "exp_avg", "exp_avg_sq"}`` in fp32 with the parameter's ``shape``: what
    ``torch.optim.AdamW.load_state_dict`` takes (dequantized when the moments are quantized)."""
    rows, cols = matrix_shape(shape)
    out: dict[str, Tensor] = {STEP: state[STEP].detach().clone() if STEP in state else torch.zeros(())}
    for fmt, key in zip(detect_moment_formats(state), ("exp_avg", "exp_avg_sq")):
        # a copy: a dense moment's dequantize is a view of the live state
        out[key] = fmt.dequantize(dict(state), moment_options(fmt), cols).reshape(tuple(shape)).float().clone()
    return out


def describe_adamw_state(state: Mapping[str, Any]) -> str:
    """``"adamw_m_int8 (block 256) + adamw_v_int8 (block 256)"`` (logs, summaries)."""
    return " + ".join(f.describe(moment_options(f)) for f in detect_moment_formats(state))


def moment_noise_stream(seed: int, key: int, step: int) -> int:
    """The stochastic-rounding stream of parameter ``key``'s quantized moments at optimizer ``step``
    (:func:`qmuon.ops.reference_adamw.adamw_noise_stream`: distinct from the Muon momentum's
    and the bf16 weights' streams; m and v then draw two streams derived from it)."""
    return _refa.adamw_noise_stream(seed, key, step)


def _rows(t: Tensor, r0: int, r1: int) -> Tensor:
    """Rows ``[r0, r1)`` of a state tensor's ``(rows, cols)`` view (a view: writes reach the state)."""
    return t.view(t.shape[0] if t.ndim else 1, -1)[r0:r1]


def update_rows(m_fmt: StateFormat, v_fmt: StateFormat, state: Mapping[str, Tensor], r0: int, r1: int,
                grad: Tensor, update: Tensor, *, beta1: float, beta2: float, eps: float, lr: float | Tensor,
                step: int | Tensor,
                stream: int = -1, index0: int = 0, skip: Tensor | None = None) -> None:
    """Update the moments of rows ``[r0, r1)`` (``grad``: those rows' ``(r1 - r0, cols)`` gradient)
    and write ``update`` (fp32, same shape): the whole AdamW step of those weights without weight
    decay, ``(neg_step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps)`` with the bias terms of
    optimizer step ``step`` (:func:`~qmuon.ops.reference_adamw.bias_terms`), to be added with
    ``alpha=1``. ``state``: the parameter's (local) state tensors. Quantized moments take ``step`` into
    their op, which computes the bias terms when it runs (a compiled step passes ``step`` as a symbolic
    int; the kernels take the terms as host floats).

    ``stream`` >= 0 rounds quantized moments stochastically (``ops.reference_adamw.adamw_noise_stream``),
    their noise keyed by global element index ``index0 + r * cols + c`` (``index0``: the index of
    row ``r0``'s first element in the whole parameter); dense moments ignore both. ``skip``: None or a
    one-element device flag: when True the moments and ``update`` are left as they are (no host read).
    ``lr`` / ``step`` as 0-d device tensors (a capturable step): the bias terms are computed on the device
    (:func:`~qmuon.ops.reference_adamw.bias_terms_on_device`) and quantized moments step through the op's
    reference (the kernel's twin), so nothing is read on the host."""
    on_device = isinstance(lr, Tensor) or isinstance(step, Tensor)  # a capturable step's device scalars
    if on_device:
        neg_step_size, bias_correction2_sqrt = _refa.bias_terms_on_device(
            torch.as_tensor(step), torch.as_tensor(lr, dtype=torch.float64), beta1, beta2)
    if _dense(m_fmt) and _dense(v_fmt):
        if not on_device:
            neg_step_size, bias_correction2_sqrt = _refa.bias_terms(step, lr, beta1, beta2)
        m = _rows(state[m_fmt.spec.keys[0]], r0, r1)
        v = _rows(state[v_fmt.spec.keys[0]], r0, r1)
        g = grad if grad.dtype == torch.float32 else grad.float()
        if skip is not None:
            _dense_rows_skipping(m, v, g, update, skip.reshape(()), beta1=beta1, beta2=beta2, eps=eps,
                                 neg_step_size=neg_step_size, bias_correction2_sqrt=bias_correction2_sqrt)
            return
        m32 = m if m.dtype == torch.float32 else m.float()
        v32 = v if v.dtype == torch.float32 else v.float()
        # torch.optim.AdamW's single-tensor step, op for op (bit-exact for fp32 moments)
        m32.lerp_(g, 1 - beta1)
        v32.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = torch.sqrt(v32)
        denom.div_(bias_correction2_sqrt).add_(eps)
        torch.mul(m32, neg_step_size, out=update)
        update.div_(denom)
        if m32 is not m:
            m.copy_(m32)
        if v32 is not v:
            v.copy_(v32)
        return
    if _dense(m_fmt) or _dense(v_fmt) or m_fmt.default_block_size != v_fmt.default_block_size:
        raise StateFormatError(f"AdamW moments {m_fmt.name} + {v_fmt.name}: no fused update for this pair")
    mk, ms = m_fmt.spec.keys
    vk, vs = v_fmt.spec.keys
    if on_device:  # the op's reference (the kernel's twin, bit for bit) reads the terms as tensors
        _library_adamw.adamw_q_update_(
            grad, _rows(state[mk], r0, r1), _rows(state[ms], r0, r1), _rows(state[vk], r0, r1),
            _rows(state[vs], r0, r1), update, float(beta1), float(beta2), float(eps), neg_step_size,
            bias_correction2_sqrt, m_fmt.kind, v_fmt.kind, m_fmt.default_block_size, stream, index0, skip)
        return
    torch.ops.qmuon.adamw_q_step_(
        grad, _rows(state[mk], r0, r1), _rows(state[ms], r0, r1), _rows(state[vk], r0, r1), _rows(state[vs], r0, r1),
        update, float(beta1), float(beta2), float(eps), float(lr), step,
        m_fmt.kind, v_fmt.kind, m_fmt.default_block_size, stream, index0, skip)  # type: ignore[attr-defined]


def _dense_rows_skipping(m: Tensor, v: Tensor, g: Tensor, update: Tensor, keep: Tensor, *, beta1: float, beta2: float,
                         eps: float, neg_step_size: float, bias_correction2_sqrt: float) -> None:
    """:func:`update_rows`' dense step with a skip flag ``keep`` (0-d bool on the device; True: the
    moments stay bit-identical): the same ops into the ``update`` buffer (fp32 moments) or the fp32
    copy a bf16 moment needs anyway, then ``torch.where`` back in place, so a skippable step holds no
    more temporaries than a plain one."""
    if m.dtype == torch.float32:
        torch.lerp(m, g, 1 - beta1, out=update)
        torch.where(keep, m, update, out=m)
        m_new = m  # the new m where it is used (not skipped)
    else:
        m_new = m.float()
        m_new.lerp_(g, 1 - beta1)
        torch.where(keep, m, m_new.to(m.dtype), out=m)  # rounded as m.copy_(m_new) rounds
    if v.dtype == torch.float32:
        torch.mul(v, beta2, out=update).addcmul_(g, g, value=1 - beta2)
        torch.where(keep, v, update, out=v)
        v_new = v
    else:
        v_new = v.float()
        v_new.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        torch.where(keep, v, v_new.to(v.dtype), out=v)
    denom = torch.sqrt(v_new)
    denom.div_(bias_correction2_sqrt).add_(eps)
    torch.mul(m_new, neg_step_size, out=update)
    update.div_(denom)


def flat_slice_pieces(family: str, shape: Sequence[int], start: int, length: int) -> list[tuple[int, int, int]] | None:
    """How a flat slice ``[start, start + length)`` of a parameter of ``shape`` (flattened row-major,
    as DeepSpeed ZeRO partitions it) is stepped with the moments ``family`` gives the whole parameter:
    a list of ``(offset in the slice, rows, width)`` pieces, each a contiguous ``(rows, width)``
    matrix of the slice, or ``None`` when the parameter keeps fp32 moments (elementwise: the 1-D slice
    steps as it is).

    The pieces are cut on the whole parameter's block grid (blocks of ``block_size`` columns from
    column 0 of each row): whole rows stay one ``(k, cols)`` piece; a partial row is cut at its first
    block boundary. Every block that lies wholly inside the slice is then a block of some piece, with
    the same elements as in the whole parameter, so its quantized moments equal single-process
    QMuon's bit for bit. Only a block cut by the slice's ends (at most one at each end) is quantized
    as two smaller blocks, one per rank holding a part of it."""
    m_fmt, _ = moment_formats(family, shape)
    if m_fmt.family == _FULL:
        return None
    rows, cols = matrix_shape(shape)
    bs = int(getattr(m_fmt, "default_block_size", 0) or 1)  # dense bf16: elementwise, any cut is exact
    if start < 0 or length < 0 or start + length > rows * cols:
        raise ValueError(f"slice [{start}, {start + length}) is outside a parameter of {rows * cols} elements")
    pieces: list[tuple[int, int, int]] = []
    pos, end = start, start + length
    while pos < end:
        r, c = divmod(pos, cols)
        if c == 0 and end - pos >= cols:
            k = (end - pos) // cols
            pieces.append((pos - start, k, cols))
            pos += k * cols
            continue
        stop = r * cols + (min(cols, (c // bs + 1) * bs) if c % bs else cols)
        stop = min(end, stop)
        pieces.append((pos - start, 1, stop - pos))
        pos = stop
    return pieces
