"""The Muon step, once, as free functions every driver calls.

One Muon step is::

    momentum  (through the group's state format: dequantize, m = beta m + (1 - beta) g, requantize;
               the Nesterov blend, the Newton-Schulz (NS) input, is written into the gradient buffer
               together with its per-row-block sums of squares)
    -> items  (one per matrix or fused part: its NS input, sum of squares, lr factor)
    -> orthogonalize (same-shape items batched within a memory budget, 1/norm folded into NS)
    -> variant (NorMuon: per-row second moment rescales O, :mod:`.variants`)
    -> apply  (p = decay * p - lr * lr_scale * O; decay 1 - lr wd, or only where p and O agree in
               sign with cautious weight decay)

:class:`~qmuon.QMuon` (one process), the sharded step
(:mod:`qmuon.distributed.orthogonalize`: the owner rank of a matrix runs
:func:`orthogonalize` on matrices assembled from every rank's rows), the DeepSpeed driver and the
fidelity monitor all go through these functions; they differ only in where an item's NS input
comes from (:attr:`NSItem.source` / :attr:`NSItem.load`) and where its output goes
(:attr:`NSItem.apply`).

Memory: the NS working set of a batch of ``B`` matrices is about ``(2 B + 1)`` times the batch in
the NS dtype (input, the running iterate, the next one) plus small Gram matrices. Batching same-shape
matrices only pays while the matrices are small (fewer, larger GEMMs); stacking every same-shape
matrix of a model (as one unbounded batch would) costs more peak memory than the quantized state
saves. A batch therefore holds at most ``cap`` elements: the larger of ``batch_budget`` times the
largest matrix and :data:`BATCH_STEP_SHARE` of all the optimizer's Muon elements, and on CPU at most
:data:`CPU_BATCH_MAX_ELEMENTS`. A large model's step keeps the transient memory of its largest
matrix's own NS (as ``torch.optim.Muon``, which orthogonalizes one matrix at a time), while a small
model's same-shape matrices batch. The share bounds the extra transient: a batch's NS working set is
about 3 x its elements in the NS dtype (6 bytes per element in bf16), i.e. at most
``6 * BATCH_STEP_SHARE`` = 3 bytes per Muon parameter, against the step's ~9 (fp32 weight and
gradient, int8 momentum): a third at most, and on CPU never more than 6 MiB in bf16 (12 MiB in
fp32; the :data:`CPU_BATCH_MAX_ELEMENTS` ceiling).

Bit-exact batching (:class:`BatchSizes`): a batched matmul's result for one matrix can depend on the
batch *size* (measured on CPU: ``baddbmm`` of a batch of one 16 x 16 matrix and of a batch of two
take different oneDNN / BLAS paths and differ in the last bit for some inputs; with two threads an
fp32 batch of one is split across threads, a larger one is not). A sharded owner or an expert-bank
shard holds only some of a shape's matrices, so batching "what this call holds" made sharded and
single-process steps differ. Instead every call that orthogonalizes matrices of one shape runs
batches of exactly ``P(shape)`` matrices, a pure function of the optimizer's Muon matrices (global
shapes, the same on every rank and in every call of a step), and pads a short batch with zero
matrices (NS of zero is zero and costs only the padded GEMMs). ``P`` is balanced so the
single-process step pads at most one slot per batch: ``n`` same-shape matrices under a limit of
``L = min(cap // (rows cols), MAX_BATCH_MATRICES)`` per batch run as ``ceil(n / L)`` batches of
``ceil(n / ceil(n / L))``; the cap of 4 matrices bounds a sharded owner's padded work to 4x the NS of
the shape's matrices it holds. A call that steps some parameters on purpose (gradient release: one
parameter per call) does not pad (``BatchSizes.pad=False``): padding would multiply its NS work.
"""

from __future__ import annotations

import math

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from ..ops import reference as ref
from ..quant import state as qstate
from ..quant.mxfp8 import mxfp8_roundtrip_normalized
from .apply import Rng, apply_update_, block_rng
from .gram_newton_schulz import newton_schulz_gram, pick_ns_method
from .newton_schulz import NSSchedule, newton_schulz_folded, resolve_ns_dtype, resolve_schedule
from .plan import MatrixPart, ParamPlan
from .variants import RowMoment, normuon_scale

__all__ = [
    "BatchSizes",
    "NSSettings",
    "NSItem",
    "ns_settings",
    "orthogonalize",
    "finite_flags",
    "finite_mask",
    "call_closure",
    "momentum_inputs",
    "update_momentum",
    "local_items",
    "part_item",
    "row_sumsq",
    "is_dtensor",
    "local",
    "apply_to",
]

#: Default cap of a batch, in multiples of the largest matrix of the step (see the module docstring).
DEFAULT_BATCH_BUDGET = 1.0
#: On CPU a batch never holds more elements than this: stacking pays for small matrices (fewer,
#: larger GEMM calls) but not for large ones, where one ``bmm`` over the stack ran slower than one
#: ``mm`` per matrix (GPT d_model 512: 842 ms batched vs 802 ms one by one; torch.optim.Muon 835 ms).
CPU_BATCH_MAX_ELEMENTS = 2**20
#: A batch may also hold up to this share of the optimizer's Muon elements (see the module
#: docstring). Batches are sized by :class:`BatchSizes` from every Muon matrix of the optimizer, so a
#: sharded rank batches (and pads) exactly as the single-process step does.
BATCH_STEP_SHARE = 0.5
#: At most this many matrices per batch: a call holding fewer matrices of a shape than the step
#: (a sharded owner) pads its last batch to the step's size, so this bounds that padded work to
#: at most 4x the NS work of the shape's matrices it holds (the gain of larger batches is in
#: dispatch overhead only: small matrices).
MAX_BATCH_MATRICES = 4


def _device_type(device: Any) -> str:
    return torch.device(device).type if not isinstance(device, str) else device.split(":")[0]


@dataclass(frozen=True)
class BatchSizes:
    """How many matrices of each Newton-Schulz shape one batch holds: a pure function of a set of
    matrices (an optimizer's Muon matrices, global shapes), the budget and the device type.

    ``counts``: NS shape ``(rows, cols)`` (after the orientation transpose) -> how many matrices of
    the set have it. Every call of :func:`orthogonalize` given the same :class:`BatchSizes` runs
    batches of exactly :meth:`per_batch` matrices of a shape (padding with zero matrices), whichever
    subset of them it holds, so the bits of each result do not depend on the subset.
    """

    counts: tuple[tuple[tuple[int, int], int], ...]
    batch_budget: float = DEFAULT_BATCH_BUDGET
    share: float = 0.0
    #: Pad a short batch to :meth:`per_batch` (False: a call that steps a subset on purpose, e.g.
    #: one parameter under gradient release, where padding would multiply its NS work).
    pad: bool = True

    @classmethod
    def of(cls, ns_shapes: Iterable[tuple[int, int]], batch_budget: float = DEFAULT_BATCH_BUDGET,
           share: float | None = None) -> "BatchSizes":
        """The sizes for the matrices ``ns_shapes`` (one entry per matrix); ``share`` defaults to
        :data:`BATCH_STEP_SHARE` (read when called, so tests and benchmarks can change it)."""
        counts: dict[tuple[int, int], int] = defaultdict(int)
        for r, c in ns_shapes:
            counts[(int(r), int(c))] += 1
        return cls(tuple(sorted(counts.items())), float(batch_budget),
                   float(BATCH_STEP_SHARE if share is None else share))

    def cap(self, device_type: str) -> int:
        """The most elements one batch holds on ``device_type`` ("cpu", "cuda", ...)."""
        if not self.counts:
            return 1
        largest = max(r * c for (r, c), _ in self.counts)
        total = sum(r * c * n for (r, c), n in self.counts)
        cap = max(1, int(self.batch_budget * largest), int(self.share * total))
        return min(cap, CPU_BATCH_MAX_ELEMENTS) if device_type == "cpu" else cap

    def per_batch(self, rows: int, cols: int, device_type: str) -> int:
        """Matrices per batch for the NS shape ``rows x cols`` (balanced: ``n`` matrices under a
        limit ``L`` run as ``ceil(n / L)`` batches of ``ceil(n / ceil(n / L))``; a shape outside the
        set gets ``L``)."""
        limit = max(1, min(MAX_BATCH_MATRICES, self.cap(device_type) // (rows * cols)))
        n = dict(self.counts).get((rows, cols))
        if n is None:
            return limit
        batches = -(-n // limit)
        return -(-n // batches)


_DTENSOR_TYPE: list[type] = []  # (DTensor,) once looked up; stays empty without torch.distributed


def _dtensor_types() -> tuple[type, ...]:
    if not _DTENSOR_TYPE and torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        _DTENSOR_TYPE.append(DTensor)
    return tuple(_DTENSOR_TYPE)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (FSDP2 parameter or gradient), without importing
    torch.distributed on builds that lack it. Called several times per matrix and step, so the
    class is looked up once (the import statement alone cost ~16 us a call on a loaded CPU), and
    plain tensors and parameters (the common case) answer from their exact type."""
    tp = type(t)
    if tp is Tensor or tp is torch.nn.Parameter:
        return False
    return isinstance(t, Tensor) and isinstance(t, _dtensor_types())


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view of its storage), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


@dataclass(frozen=True)
class NSSettings:
    """How a matrix is orthogonalized; items with equal settings and shape share a batch."""

    schedule: NSSchedule
    steps: int
    dtype: torch.dtype
    carrier: str  # "bf16": the NS input as it is; "mxfp8": its decoded MXFP8 carrier (quant.mxfp8)
    method: str = "auto"  # core.gram_newton_schulz.NS_METHODS
    #: The device type whose rules the automatic choices follow (``method="auto"``, the batch cap):
    #: the one the run started on (the group's ``auto_device``), so a resume elsewhere keeps them.
    auto_device: str = "cpu"


#: Group key of the device type the group's automatic choices were made for (set on its first step).
AUTO_DEVICE = "auto_device"


def record_auto_choices(group: dict[str, Any], device: torch.device) -> None:
    """Fix what ``"auto"`` chose for a Muon group on ``device`` (its first step), in the group, so it
    is saved with the state and a resume on another machine keeps the arithmetic: the NS dtype
    (``ns_dtype`` becomes ``"bf16"`` / ``"fp32"``) and the device type whose rules pick the NS
    method and the batch size (:data:`AUTO_DEVICE`)."""
    if group.get("ns_dtype", "auto") == "auto":
        group["ns_dtype"] = "bf16" if resolve_ns_dtype("auto", device) == torch.bfloat16 else "fp32"
    group.setdefault(AUTO_DEVICE, _device_type(device))


def ns_settings(group: dict[str, Any], device: torch.device) -> NSSettings:
    """The NS settings of a Muon ``group`` on ``device`` (``ns_dtype="auto"`` is resolved there)."""
    steps = int(group["ns_steps"])
    return NSSettings(
        schedule=resolve_schedule(group["ns_coefficients"], steps),
        steps=steps,
        dtype=resolve_ns_dtype(group.get("ns_dtype", "auto"), device),
        carrier=group.get("ns_input", "bf16"),
        method=group.get("ns_method", "auto"),
        auto_device=group.get(AUTO_DEVICE) or _device_type(device),
    )


@dataclass(eq=False)
class NSItem:
    """One matrix waiting for Newton-Schulz.

    ``rows x cols`` is the *stored* block (see :mod:`.plan`); with ``transpose`` Newton-Schulz
    runs on its transpose (the layer's ``(out, in)`` matrix of an ``(in, out)`` weight), and
    sources, loads and outputs stay in the stored orientation (views of the transposed batch slot).
    The NS input comes from ``source`` (a 2-D ``rows x cols`` tensor, any float dtype, any strides)
    or, when ``source`` is None, from ``load(dest)``, which writes it into a ``rows x cols`` view of
    a batch slot (a sharded owner decodes the rows received from every rank straight into the
    batch). ``apply(out)`` receives the ``rows x cols`` NS output (in the NS dtype; possibly a
    strided view) and must not keep it: the batch is freed after the call.
    ``moment``: NorMuon's second moment of the layer's rows (:mod:`.variants`); when set, the NS
    output is rescaled by :func:`~.variants.normuon_scale` (and ``moment.v`` updated) before
    ``apply`` sees it.
    """

    rows: int
    cols: int
    sumsq: Tensor  # 0-d fp32: squared Frobenius norm of the NS input
    eps: float
    settings: NSSettings
    apply: Callable[[Tensor], None]
    source: Tensor | None = None
    load: Callable[[Tensor], None] | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    transpose: bool = False
    moment: RowMoment | None = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def _stored(slot: Tensor, transpose: bool) -> Tensor:
    """The stored-orientation view of a batch slot (or of an NS output)."""
    return slot.mT if transpose else slot


def _fill(batch: Tensor, chunk: Sequence[NSItem]) -> None:
    for i, it in enumerate(chunk):
        dest = _stored(batch[i], it.transpose)
        if it.source is not None:
            dest.copy_(it.source)
        else:
            assert it.load is not None
            it.load(dest)


def orthogonalize(items: Iterable[NSItem], batching: float | BatchSizes = DEFAULT_BATCH_BUDGET) -> None:
    """Orthogonalize every item and hand each output to its ``apply``.

    Items of one NS shape and :class:`NSSettings` are stacked, in the order given, into batches of
    exactly :meth:`BatchSizes.per_batch` matrices (the last one padded with zero matrices);
    ``batching`` is a :class:`BatchSizes` (an optimizer's, so every call of a step and every rank
    batch alike) or a ``batch_budget`` float (sizes from this call's items:
    :meth:`BatchSizes.of`). ``1 / max(||G||, eps)`` is folded into the first NS iteration. A lone
    item (a batch of one) whose source already has the NS dtype is orthogonalized in place of a copy.
    """
    items = list(items)
    if not items:
        return
    if not isinstance(batching, BatchSizes):
        batching = BatchSizes.of([_ns_shape(it) for it in items], batching)
    queues: dict[tuple, list[NSItem]] = defaultdict(list)
    for it in items:
        # Keyed by the shape NS sees: an (in, out) layer batches with (out, in) layers of its shape.
        queues[(*_ns_shape(it), it.settings, str(it.device))].append(it)
    for (rows, cols, settings, device), queue in queues.items():
        per_batch = batching.per_batch(rows, cols, settings.auto_device)
        for start in range(0, len(queue), per_batch):
            chunk = queue[start: start + per_batch]
            _orthogonalize_chunk(chunk, rows, cols, settings, per_batch if batching.pad else len(chunk))


def _ns_shape(it: NSItem) -> tuple[int, int]:
    return (it.cols, it.rows) if it.transpose else (it.rows, it.cols)


def _orthogonalize_chunk(chunk: list[NSItem], ns_rows: int, ns_cols: int, s: NSSettings, size: int = 0) -> None:
    """NS of one batch of ``ns_rows x ns_cols`` matrices (each item's stored block, or its
    transpose), padded with zero matrices to ``size`` (default: the chunk's length)."""
    first = chunk[0]
    size = max(size, len(chunk))
    pad = size - len(chunk)
    sumsq = torch.stack([it.sumsq.reshape(()) for it in chunk])
    if all(it.eps == first.eps for it in chunk):
        inv_norm = sumsq.sqrt_().clamp_min_(first.eps).reciprocal_()  # 1 / max(||G||, eps), in place
    else:
        eps = torch.stack([sumsq.new_full((), it.eps) for it in chunk])  # fills: no host-to-device copy
        inv_norm = torch.maximum(sumsq.sqrt(), eps).reciprocal()
    if pad:
        # zero matrices: NS maps them to zero whatever the scale (1 keeps every product finite)
        inv_norm = torch.cat([inv_norm, inv_norm.new_ones(pad)])
    if s.carrier == "mxfp8":
        # NS sees exactly what a receiver of the MXFP8 carrier of G / ||G|| decodes (encoded from
        # the full-precision NS input); that input is normalized already, so its inverse norm
        # becomes 1. The gradient buffer is never written.
        # The carrier's blocks run along stored rows (what a sharded rank can encode on its own).
        batch = torch.empty((size, ns_rows, ns_cols), dtype=s.dtype, device=first.device)
        batch[len(chunk):].zero_()
        for i, it in enumerate(chunk):
            if it.source is not None:
                x = it.source.contiguous()
            else:
                assert it.load is not None
                x = torch.empty((it.rows, it.cols), dtype=torch.float32, device=first.device)
                it.load(x)
            _stored(batch[i], it.transpose).copy_(mxfp8_roundtrip_normalized(x, inv_norm[i]))
        inv_norm = torch.ones_like(inv_norm)
    elif size == 1 and not first.transpose and first.source is not None and first.source.dtype == s.dtype:
        batch = first.source.unsqueeze(0)  # no copy; NS does not write its input
    else:
        batch = torch.empty((size, ns_rows, ns_cols), dtype=s.dtype, device=first.device)
        if pad:
            batch[len(chunk):].zero_()
        _fill(batch, chunk)
    if pick_ns_method(s.method, ns_rows, ns_cols, s.auto_device, s.dtype, s.schedule) == "gram":
        out = newton_schulz_gram(batch, inv_norm, s.schedule, s.steps, dtype=s.dtype)
    else:
        out = newton_schulz_folded(batch, inv_norm, s.schedule, s.steps, dtype=s.dtype)
    del batch
    for i, it in enumerate(chunk):
        o = out[i]  # the layer's (out, in) matrix
        if it.moment is not None:
            o = normuon_scale(o, it.moment)
        it.apply(_stored(o, it.transpose))


def call_closure(closure: Callable[[], Any] | None) -> Any:
    """``torch.optim``'s closure protocol: re-evaluate the loss with autograd on (steps run
    under ``no_grad``)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# ------------------------------------------------------------------------------------ momentum
def finite_mask(grads: Sequence[Tensor]) -> Tensor:
    """Per gradient, whether it is usable, as a bool tensor on the gradients' device: no host read.

    One fused L2 norm per gradient (NaN and Inf propagate into it; the fast reduction: the max-abs
    norm was ~18x slower on CPU). A finite gradient whose sum of squares overflows fp32 (elements of
    about 1.8e19 / sqrt(numel) and more) also reads as not finite and is skipped: its Newton-Schulz
    input norm, and AdamW's second moment, would overflow in the step's own fp32 arithmetic anyway
    (torch's ``clip_grad_norm_`` calls such a norm non-finite too). :func:`finite_flags` keeps the exact
    test for the callers that read the flags on the host anyway.
    """
    l2 = torch._foreach_norm(list(grads), 2.0)
    return torch.stack([n.float() for n in l2]).isfinite()


def finite_flags(grads: Sequence[Tensor]) -> list[bool]:
    """Per gradient, whether every element is finite, with one host sync.

    The fused L2 norm propagates NaN/Inf and is the fast reduction (the inf-norm is several times
    slower on CPU); it can overflow for huge finite gradients, so only tensors whose L2 norm is
    not finite are re-checked with the exact max-abs.
    """
    if not grads:
        return []
    l2 = torch._foreach_norm(list(grads), 2.0)
    finite = torch.stack([n.float() for n in l2]).isfinite().tolist()
    suspects = [j for j, ok in enumerate(finite) if not ok]
    if suspects:
        amax = torch._foreach_norm([grads[j] for j in suspects], float("inf"))
        for j, a in zip(suspects, amax):
            finite[j] = bool(a.float().isfinite())
    return finite


@dataclass
class MomentumInputs:
    """What the format update of one group needs, per parameter (local rows for DTensors)."""

    grads2d: list[Tensor] = field(default_factory=list)
    states: list[dict[str, Tensor]] = field(default_factory=list)
    streams: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    #: Per parameter, its 0-d bool skip flag on the device (True: non-finite gradient, the update
    #: leaves the parameter and its state untouched), or None (every parameter is updated).
    skips: list[Tensor] | None = None

    def subset(self, idx: Sequence[int]) -> "MomentumInputs":
        out = MomentumInputs(*([getattr(self, f)[j] for j in idx]
                               for f in ("grads2d", "states", "streams", "offsets", "keys")))
        out.skips = None if self.skips is None else [self.skips[j] for j in idx]
        return out

    def skip_vector(self) -> Tensor | None:
        """The ops' ``skip`` argument: one flag per matrix (a device tensor; nothing is read)."""
        return None if self.skips is None or not self.skips else torch.stack(self.skips)


def momentum_inputs(group: dict[str, Any], grads: Sequence[Tensor], states: Sequence[dict[str, Tensor]],
                    plans: Sequence[ParamPlan], row_offsets: Sequence[int]) -> MomentumInputs:
    """Advance each state's ``step`` and collect the format update's inputs.

    ``grads``: local gradients; ``states``: local state tensors (already initialized);
    ``row_offsets``: global index of each gradient's first row (stochastic-rounding noise is keyed
    by the global element, so a shard draws the noise of the unsharded matrix).
    """
    stochastic = group["rounding"] == "stochastic"
    out = MomentumInputs()
    for grad, st, plan, row0 in zip(grads, states, plans, row_offsets, strict=True):
        rows = grad.shape[0]
        cols = math.prod(grad.shape[1:])  # plan.cols, or a rowwise tensor-parallel shard's own columns
        st["step"] += 1
        # A 2-D view when the layout allows; otherwise a copy the caller writes back.
        out.grads2d.append(grad.view(rows, cols) if grad.is_contiguous() else grad.reshape(rows, cols))
        out.states.append(st)
        out.streams.append(ref.noise_stream(group["seed"], int(st["step"].item()), plan.key) if stochastic else -1)
        out.offsets.append(int(row0))
        out.keys.append(plan.key)
    return out


def update_momentum(group: dict[str, Any], inputs: MomentumInputs, *, sharded_params: Sequence[Any] | None = None,
                    process_group: Any = None) -> list[Tensor]:
    """The group's format update over ``inputs``; returns the per-row-block sums of squares of
    each NS input (fp32 ``(rows, ceil(cols / block_size))``).

    With ``sharded_params`` (the DTensor parameters behind ``inputs``, in order) the format's
    sharded update runs instead, collectively over ``process_group``.
    """
    fmt = qstate.get_format(group["state_format"])
    opts = qstate.format_options(group)
    block_sums = [
        torch.empty((g.shape[0], ref.num_blocks(g.shape[1], opts.block_size)), dtype=torch.float32, device=g.device)
        for g in inputs.grads2d
    ]
    if not inputs.grads2d:
        return block_sums
    kw = dict(beta=float(group["momentum"]), nesterov=bool(group["nesterov"]), opts=opts, streams=inputs.streams,
              offsets=inputs.offsets, keys=inputs.keys, seed=int(group["seed"]))
    if sharded_params is not None:
        fmt.update_sharded(list(sharded_params), inputs.states, inputs.grads2d, block_sums, **kw,
                           process_group=process_group)
    else:
        skip = inputs.skip_vector()
        if skip is None or _takes_skip(fmt):
            fmt.update(inputs.states, inputs.grads2d, block_sums, **kw, skip=skip)
        else:
            _update_then_restore(fmt, inputs.states, inputs.grads2d, block_sums, kw, skip)
    return block_sums


_TAKES_SKIP: dict[type, bool] = {}


def _takes_skip(fmt: Any) -> bool:
    """Whether a format's ``update`` takes the ``skip`` flags (every built-in one does; a format
    registered before the argument existed may not)."""
    tp = type(fmt)
    if tp not in _TAKES_SKIP:
        import inspect

        _TAKES_SKIP[tp] = "skip" in inspect.signature(fmt.update).parameters
    return _TAKES_SKIP[tp]


def _update_then_restore(fmt: Any, states: list[dict[str, Tensor]], grads2d: list[Tensor], block_sums: list[Tensor],
                         kw: dict[str, Any], skip: Tensor) -> None:
    """A format without ``skip``: its update runs on every matrix, then each flagged matrix's state
    tensors get their old bits back, selected on the device (no host read; a copy of the call's
    state lives during the update)."""
    saved = [{k: v.clone() for k, v in st.items() if k != qstate.STEP and isinstance(v, Tensor)} for st in states]
    fmt.update(states, grads2d, block_sums, **kw)
    for j, (st, old) in enumerate(zip(states, saved)):
        for k, v in old.items():
            st[k].copy_(torch.where(skip[j], v, st[k]))


def local_items(plan: ParamPlan, ns_input: Tensor, block_sums: Tensor, group: dict[str, Any],
                settings: NSSettings, apply: Callable[[MatrixPart, Tensor], None],
                moments: Sequence[RowMoment | None] | None = None) -> list[NSItem]:
    """The NS items of a parameter held whole by this process (one per matrix / fused part / bank
    member part).

    ``ns_input``: the 2-D stored NS input; ``apply(part, out)`` receives each part's NS output in
    the stored orientation (``part.rows x part.cols``); ``moments``: NorMuon's second moment of
    each part (aligned with ``plan.parts``; None: plain Muon).
    """
    moments = moments if moments is not None else [None] * len(plan.parts)
    return [part_item(part, ns_input, block_sums, group, settings, apply, moment=moment)
            for part, moment in zip(plan.parts, moments, strict=True)]


def part_item(part: MatrixPart, ns_input: Tensor, block_sums: Tensor, group: dict[str, Any], settings: NSSettings,
              apply: Callable[[MatrixPart, Tensor], None], first_row: int = 0,
              moment: RowMoment | None = None) -> NSItem:
    """The NS item of one part whose stored rows this process holds (``ns_input`` / ``block_sums``:
    the rows from global row ``first_row`` on; a sharded rank's whole bank members use it too);
    ``moment``: the part's NorMuon second moment (None: plain Muon)."""
    source = part.block(ns_input, first_row)
    if part.whole_rows:
        sumsq = block_sums[part.r0 - first_row: part.r1 - first_row].sum()
    elif part.bank is not None and part.bank.whole and part.bank.per_row == 1:
        sumsq = block_sums[part.r0 - first_row].sum()  # the member is the whole stored row
    else:
        sumsq = row_sumsq(source).sum()
    return NSItem(rows=part.rows, cols=part.cols, sumsq=sumsq, eps=float(group["eps"]), settings=settings,
                  apply=_bind(apply, part), source=source, device=ns_input.device, transpose=part.transposed,
                  moment=moment)


def row_sumsq(block: Tensor) -> Tensor:
    """Per-row sums of squares ``(rows, 1)`` fp32 of a block of columns (a part that splits the
    columns, or a part of a bank member, cannot use the momentum kernel's per-row-block sums). A sharded rank computes the same
    rows bit for bit, and the owner sums them in the same order, so ``1 / ||G||`` matches."""
    return block.float().square().sum(dim=1, keepdim=True)


def _bind(apply: Callable[[MatrixPart, Tensor], None], part: MatrixPart) -> Callable[[Tensor], None]:
    return lambda out: apply(part, out)


def apply_to(param_rows: Tensor, lr: float, first_row: int = 0, *, decay: float = 1.0, cautious: bool = False,
             bf16_update: str = "nearest", state: dict[str, Tensor] | None = None,
             rng: Rng | None = None, skip: Tensor | None = None) -> Callable[[MatrixPart, Tensor], None]:
    """The default ``apply`` of :func:`local_items`: ``p[block] = decay * p[block] - lr * lr_scale * O``
    on the parameter ``param_rows`` (any ndim; 2-D when parts split the columns; its stored rows start
    at global row ``first_row``), written through :func:`~qmuon.core.apply.apply_update_`
    (one rounding for bf16 weights, decoupled weight decay included; ``cautious``: the decay only
    where ``p`` and ``O`` agree in sign). ``state``: the parameter's weight-correction tensors (its
    shape); ``rng``: the rounding counter of ``param_rows``' first element; ``skip``: the parameter's
    0-d device flag (True: leave it untouched; its NS output may be NaN then)."""

    def apply(part: MatrixPart, out: Tensor) -> None:
        rows = part.block(param_rows, first_row)
        if rows.dtype != torch.float32 and not out.is_contiguous():
            # NS returns a transposed view for tall matrices (and for (in, out) weights); the bf16 /
            # fp16 writes take it contiguous (fp32 weights read it in place: core.apply).
            out = out.contiguous()
        apply_update_(rows, out if out.shape == rows.shape else out.reshape(rows.shape), alpha=-lr * part.lr_scale,
                      decay=decay, bf16_update=bf16_update,
                      state={k: part.block(v, first_row) for k, v in state.items()} if state else None,
                      rng=block_rng(rng, param_rows, rows), cautious=cautious, skip=skip)

    return apply

