"""The ``torch.ops.qmuon`` operators, each declared once.

An op is a typed Python prototype decorated with :func:`_op`: the schema (with its mutation
annotations) comes from ``torch.library.infer_schema``, the prototype's body is the pure-PyTorch
reference (:mod:`.reference` / :mod:`.reference_4bit`) and the default implementation (dispatch key
``CompositeExplicitAutograd``), ``@op.register_fake`` describes output shapes for ``torch.compile`` /
meta tensors, and ``@op.compiled_when`` says which arguments the compiled twin
``torch.ops.qmuon_C.<name>`` supports. Every op lands in :data:`OPS`, from which :mod:`._kernels`
registers the compiled kernels (``CPU`` / ``CUDA`` keys) at the end of this module.

This module declares the 8-bit and dense momentum ops and hands :func:`_op` to the modules that declare
the others before it registers the kernels: the 4-bit formats (:mod:`._library_4bit`), the weight writes
(:mod:`._library_weight`) and the quantized AdamW (:mod:`._library_adamw`). What the multi-tensor updates
share (reference loop, fake, ``block_sumsq`` checks) is :mod:`._library_multi`.

Why a ``Library`` and not ``torch.library.custom_op``: custom_op runs several Python layers per call
(defaults, version bumps, an autograd shim, a dynamo guard) that cost more than the fused sums of
squares (docs/kernels.md has the measurements). What of it still matters is done by
:class:`QmuonOp`: the version counters of the mutated tensors are bumped after every call (so
autograd notices in-place writes), whichever kernel ran.

Multi-tensor ops take lists; ``block_sumsq`` (outputs), ``streams`` and ``row_offsets`` are per
tensor. A stream of -1 means nearest rounding, anything else is the 32-bit stochastic-rounding
stream of that tensor. The multi-tensor updates return None and write their per-row-block sums of
squares into the caller-allocated ``block_sumsq`` list (see :func:`._library_multi.empty_block_sumsq`): a
mutating op that returned a Tensor[] could not be auto-functionalized (``torch.compile``, AOTAutograd).

Every op that mutates optimizer state or weights takes a trailing ``skip`` (``Tensor? skip=None``): device-side
flags, one per matrix of a multi-tensor update (a 1-D bool / uint8 tensor of ``len(grads)`` elements) or one
for the single-matrix ops, that leave a flagged matrix entirely untouched (state, grad, ``block_sumsq``,
weights) without any host read; the other matrices get exactly what a call without ``skip`` writes.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from . import _kernels as K
from . import _library_4bit
from . import _library_weight
from . import reference as ref
from ._library_multi import each_matrix, update_fake

_NS = "qmuon"
_lib = torch.library.Library(_NS, "DEF")  # kept alive for the life of the process: it owns the ops


class QmuonOp:
    """One ``torch.ops.qmuon`` operator: its schema, reference default, fake, the predicate of its
    compiled kernel, and the kernels registered per dispatch key. Calling it calls
    ``torch.ops.qmuon.<name>``."""

    def __init__(self, fn: Callable[..., Any], mutates_args: tuple[str, ...]) -> None:
        self.name = fn.__name__
        self.reference = fn
        #: ``supported(*args) -> bool`` of the compiled twin ``torch.ops.qmuon_C.<name>``; None: no twin.
        self.supported: Callable[..., bool] | None = None
        params = list(inspect.signature(fn).parameters)
        unknown = set(mutates_args) - set(params)
        if unknown:
            raise ValueError(f"qmuon::{self.name}: mutates_args names no parameter: {sorted(unknown)}")
        if self.name in OPS:
            raise ValueError(f"qmuon::{self.name} is declared twice")
        self.mutated = tuple(params.index(a) for a in mutates_args)
        #: Index of the stochastic-rounding ``streams`` (list) / ``stream`` (int) argument, if any.
        self.stream_arg = next((params.index(a) for a in ("streams", "stream") if a in params), None)
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        _lib.define(self.name + schema)
        self.register_kernel("CompositeExplicitAutograd", fn)
        OPS[self.name] = self

    def _bumping(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, then a version-counter bump of every tensor it mutated (what the dispatcher's
        ADInplaceOrView kernels do for torch's own in-place ops)."""
        if not self.mutated:
            return fn
        mutated = self.mutated

        def kernel(*args: Any) -> Any:
            out = fn(*args)
            for i in mutated:
                a = args[i]
                torch._C._increment_version((a,) if isinstance(a, Tensor) else tuple(a))
            return out

        kernel.__name__ = getattr(fn, "__name__", self.name)
        return kernel

    def _refusing_capture(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, refused inside a CUDA graph capture when it rounds stochastically: the noise streams are
        host integers, which a captured graph would freeze, so every replay would repeat one step's noise
        (docs/kernels.md, "CUDA graphs"). Nearest rounding (every stream -1) captures and replays."""
        i = self.stream_arg
        if i is None or torch.version.cuda is None:  # no CUDA build: nothing can be captured
            return fn
        name = self.name

        def kernel(*args: Any) -> Any:
            s = args[i]
            # CUDA not initialized: nothing is being captured (and nothing is initialized here).
            if (any(x >= 0 for x in s) if isinstance(s, (list, tuple)) else s >= 0) and \
                    torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"qmuon::{name}: stochastic rounding cannot be captured in a CUDA graph: its noise stream "
                    "is a host integer that a replay would repeat. Capture with rounding='nearest' (streams of "
                    "-1), or run the optimizer step outside the graph.")
            return fn(*args)

        kernel.__name__ = getattr(fn, "__name__", self.name)
        return kernel

    def register_kernel(self, dispatch_key: str, fn: Callable[..., Any]) -> None:
        """Implementation for ``dispatch_key`` (``"CPU"``, ``"CUDA"``, ``"CompositeExplicitAutograd"``)."""
        _lib.impl(self.name, self._bumping(self._refusing_capture(fn)), dispatch_key)

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.register_fake(f"{_NS}::{self.name}", fn, lib=_lib)
        return fn

    def compiled_when(self, fn: Callable[..., bool]) -> Callable[..., bool]:
        """Declare that ``torch.ops.qmuon_C.<name>`` implements this op for the arguments on which
        ``fn`` (same parameters as the op) is true; other calls run the reference."""
        self.supported = fn
        return fn

    def __call__(self, *args: Any) -> Any:
        return getattr(torch.ops.qmuon, self.name)(*args)


#: Every declared op, by name (the one list :mod:`._kernels` registers compiled kernels from).
OPS: dict[str, QmuonOp] = {}


def _op(mutates_args: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], QmuonOp]:
    """Declare ``torch.ops.qmuon.<fn name>`` with ``fn`` (typed) as its schema and reference."""
    return lambda fn: QmuonOp(fn, tuple(mutates_args))


@_op(mutates_args=("codes", "absmax", "grads", "block_sumsq"))
def q8_momentum_update_multi_(
    codes: list[Tensor],
    absmax: list[Tensor],
    grads: list[Tensor],
    block_sumsq: list[Tensor],
    beta: float,
    nesterov: bool,
    block_size: int,
    streams: list[int],
    row_offsets: list[int],
    skip: Optional[Tensor] = None,
) -> None:
    """8-bit (int8 or uint8 codes) momentum update over many matrices.

    Overwrites every grad with its Newton-Schulz input and writes, per tensor, the fp32 sum of
    squares of that input for each row block into ``block_sumsq[i]`` (caller-allocated, fp32,
    shaped like the tensor's absmax). ``skip`` (bool / uint8, ``len(grads)`` elements on the grads'
    device): matrix ``i`` is not written at all (state, grad, ``block_sumsq[i]``) where ``skip[i]`` is
    nonzero; the same for every multi-tensor update.
    """
    each_matrix(ref.q8_momentum_update_, "q8_momentum_update_multi_", (codes, absmax), grads, block_sumsq, beta,
                nesterov, block_size, streams, row_offsets, skip)


update_fake(q8_momentum_update_multi_)


@q8_momentum_update_multi_.compiled_when
def _(codes, absmax, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets, skip=None):
    return (K.skip_ok(skip, grads) and K.block_ok(block_size) and K.mats_ok(codes, K.CODE_DTYPES) and K.mats_ok(absmax, (torch.float32,))
            and K.grads_and_sums_ok(grads, block_sumsq))


@_op(mutates_args=("bufs", "grads", "block_sumsq"))
def dense_momentum_update_multi_(
    bufs: list[Tensor],
    grads: list[Tensor],
    block_sumsq: list[Tensor],
    beta: float,
    nesterov: bool,
    block_size: int,
    streams: list[int],
    row_offsets: list[int],
    skip: Optional[Tensor] = None,
) -> None:
    """fp32 / bf16 momentum update with the same contract as ``q8_momentum_update_multi_``."""
    each_matrix(ref.dense_momentum_update_, "dense_momentum_update_multi_", (bufs,), grads, block_sumsq, beta,
                nesterov, block_size, streams, row_offsets, skip)


update_fake(dense_momentum_update_multi_)


@dense_momentum_update_multi_.compiled_when
def _(bufs, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets, skip=None):
    return (K.skip_ok(skip, grads) and K.block_ok(block_size) and K.lists_ok(len(grads), bufs) and K.mats_ok(bufs, K.DENSE_BUF_DTYPES)
            and K.grads_and_sums_ok(grads, block_sumsq)
            and (not bufs or K.dense_matches_torch(bufs[0].device)))  # fp32 must stay torch.optim.Muon's lerp


@_op(mutates_args=())
def quantize_rows(x: Tensor, block_size: int, signed: bool, stream: int, row_offset: int) -> tuple[Tensor, Tensor]:
    """fp32 matrix -> (codes, absmax) in the row-block layout."""
    noise = None if stream < 0 else ref.uniform_noise(*x.shape, stream, row_offset, x.device)
    return ref.quantize_rows(x, block_size, signed=signed, noise=noise)


@quantize_rows.register_fake
def _(x, block_size, signed, stream, row_offset):
    rows, cols = x.shape
    codes = torch.empty((rows, cols), dtype=torch.int8 if signed else torch.uint8, device=x.device)
    absmax = torch.empty((rows, ref.num_blocks(cols, block_size)), dtype=torch.float32, device=x.device)
    return codes, absmax


@quantize_rows.compiled_when
def _(x, block_size, signed, stream, row_offset):
    return K.block_ok(block_size) and x.dim() == 2 and x.dtype in K.GRAD_DTYPES


@_op(mutates_args=())
def dequantize_rows(codes: Tensor, absmax: Tensor, block_size: int) -> Tensor:
    """(codes, absmax) -> fp32 matrix."""
    return ref.dequantize_rows(codes, absmax, block_size)


@dequantize_rows.register_fake
def _(codes, absmax, block_size):
    return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)


@dequantize_rows.compiled_when
def _(codes, absmax, block_size):
    return (K.block_ok(block_size) and codes.dim() == 2 and codes.dtype in K.CODE_DTYPES
            and absmax.dtype == torch.float32)


_library_4bit.declare(_op)  # the 4-bit formats' ops
_library_weight.declare(_op)  # the bf16 weight-write ops

from . import _library_adamw as _adamw  # noqa: E402  (the quantized AdamW op: prototype, fake, predicate)

adamw_q_update_ = _op(mutates_args=_adamw.MUTATES)(_adamw.adamw_q_update_)
adamw_q_update_.register_fake(_adamw.fake)
adamw_q_update_.compiled_when(_adamw.supported)
adamw_q_step_ = _op(mutates_args=_adamw.MUTATES)(_adamw.adamw_q_step_)
adamw_q_step_.register_fake(_adamw.fake_step)

# Compiled CPU / CUDA kernels (csrc/, built on first use) take over where their predicates hold.
K.register_compiled_kernels(OPS.values())
