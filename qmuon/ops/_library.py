"""The ``torch.ops.qmuon`` operators, each declared once.

An op is a typed Python prototype decorated with :func:`_op`: the schema (with its mutation
annotations) comes from ``torch.library.infer_schema``, the prototype's body is the pure-PyTorch
reference (:mod:`.reference` / :mod:`.reference_4bit`) and the default implementation (dispatch key
``CompositeExplicitAutograd``), ``@op.register_fake`` describes output shapes for ``torch.compile`` /
meta tensors, and ``@op.compiled_when`` says which arguments the compiled twin
``torch.ops.qmuon_C.<name>`` supports. Every op lands in :data:`OPS`, from which :mod:`._kernels`
registers the compiled kernels (``CPU`` / ``CUDA`` keys) at the end of this module.

Why a ``Library`` and not ``torch.library.custom_op``: custom_op runs several Python layers per call
(defaults, version bumps, an autograd shim, a dynamo guard) that cost more than the fused sums of
squares (docs/kernels.md has the measurements). What of it still matters is done by
:class:`QmuonOp`: the version counters of the mutated tensors are bumped after every call (so
autograd notices in-place writes), whichever kernel ran.

Multi-tensor ops take lists; ``block_sumsq`` (outputs), ``streams`` and ``row_offsets`` are per
tensor. A stream of -1 means nearest rounding, anything else is the 32-bit stochastic-rounding
stream of that tensor. The multi-tensor updates return None and write their per-row-block sums of
squares into the caller-allocated ``block_sumsq`` list (see :func:`empty_block_sumsq`): a mutating op
that returned a Tensor[] could not be auto-functionalized (``torch.compile``, AOTAutograd).

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
from . import _library_weight
from . import reference as ref
from . import reference_4bit as ref4

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


def _stream(s: int) -> int | None:
    return None if s < 0 else s


def empty_block_sumsq(mats: list[Tensor], block_size: int) -> list[Tensor]:
    """Uninitialized ``block_sumsq`` outputs for a multi-tensor update of the 2-D ``mats`` (codes,
    bufs or grads): fp32 ``(rows, ceil(cols / block_size))`` per matrix, on its device."""
    return [
        torch.empty((m.shape[0], ref.num_blocks(m.shape[1], block_size)), dtype=torch.float32, device=m.device)
        for m in mats
    ]


def _check_block_sumsq(block_sumsq: list[Tensor], mats: list[Tensor], block_size: int, op: str) -> None:
    """The caller-allocated outputs: one fp32 ``(rows, ceil(cols / block_size))`` tensor per matrix,
    on that matrix's device."""
    if len(block_sumsq) != len(mats):
        raise ValueError(f"qmuon::{op}: got {len(block_sumsq)} block_sumsq outputs for {len(mats)} tensors")
    for i, (out, m) in enumerate(zip(block_sumsq, mats)):
        shape = (m.shape[0], ref.num_blocks(m.shape[1], block_size)) if m.dim() == 2 else None
        if out.dtype != torch.float32 or tuple(out.shape) != shape or out.device != m.device:
            raise ValueError(
                f"qmuon::{op}: block_sumsq {i} must be float32 of shape {shape} on {m.device}, got "
                f"{out.dtype} {tuple(out.shape)} on {out.device}")


def _check_grads_2d(grads: list[Tensor], n: int, op: str) -> None:
    if len(grads) != n:
        raise ValueError(f"qmuon::{op}: got {len(grads)} grads for {n} states")


def _grads_device(grads: list[Tensor]) -> torch.device | None:
    return grads[0].device if grads else None


def _each_matrix(update_one: Callable[..., Tensor], op: str, states: tuple[list[Tensor], ...], grads: list[Tensor],
                 block_sumsq: list[Tensor], beta: float, nesterov: bool, block_size: int, streams: list[int],
                 row_offsets: list[int], skip: Optional[Tensor] = None, **per_matrix: list[Any]) -> None:
    """The reference of a multi-tensor update: ``update_one`` (the :mod:`.reference` /
    :mod:`.reference_4bit` update of one matrix) on every matrix, its block sums copied into the
    caller's ``block_sumsq``. ``per_matrix`` lists become keyword arguments of ``update_one``.
    ``skip`` (one flag per matrix): a flagged matrix is updated as the others, then every tensor of it
    (state, grad, block sums) gets its old bits back, selected on the device (no host read)."""
    for lst in (*states, streams, row_offsets, *per_matrix.values()):
        _check_grads_2d(grads, len(lst), op)
    _check_block_sumsq(block_sumsq, grads, block_size, op)
    ref.check_skip(skip, len(grads), _grads_device(grads), op)
    flags = ref.skip_flags(skip)
    for i, (g, out) in enumerate(zip(grads, block_sumsq)):
        flag = None if flags is None else flags[i]
        written = (*(st[i] for st in states), g, out)
        saved = ref.snapshot(flag, written)
        out.copy_(update_one(*(st[i] for st in states), g, beta=beta, nesterov=nesterov, block_size=block_size,
                             stream=_stream(streams[i]), row_offset=row_offsets[i],
                             **{k: v[i] for k, v in per_matrix.items()}))
        ref.restore(flag, written, saved)


def _update_fake(op: QmuonOp) -> None:
    """The fake of a multi-tensor update: it returns None, after the reference's check of the
    ``block_sumsq`` outputs against the grads."""
    params = list(inspect.signature(op.reference).parameters)
    i_grads, i_sums, i_bs, i_skip = (params.index(p) for p in ("grads", "block_sumsq", "block_size", "skip"))

    def fake(*args: Any) -> None:
        _check_block_sumsq(args[i_sums], args[i_grads], args[i_bs], op.name)
        ref.check_skip(args[i_skip] if len(args) > i_skip else None, len(args[i_grads]),
                       _grads_device(args[i_grads]), op.name)

    op.register_fake(fake)


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
    _each_matrix(ref.q8_momentum_update_, "q8_momentum_update_multi_", (codes, absmax), grads, block_sumsq, beta,
                 nesterov, block_size, streams, row_offsets, skip)


_update_fake(q8_momentum_update_multi_)


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
    _each_matrix(ref.dense_momentum_update_, "dense_momentum_update_multi_", (bufs,), grads, block_sumsq, beta,
                 nesterov, block_size, streams, row_offsets, skip)


_update_fake(dense_momentum_update_multi_)


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


# ----------------------------------------------------------------------------- 4-bit formats

@_op(mutates_args=())
def pack_int4(codes: Tensor) -> Tensor:
    """int8 sign-magnitude codes in -7..7 ``(rows, cols)`` -> uint8 ``(rows, ceil(cols / 2))``."""
    return ref4.pack_int4(codes)


@pack_int4.register_fake
def _(codes):
    return torch.empty((codes.shape[0], ref4.packed_cols(codes.shape[1])), dtype=torch.uint8, device=codes.device)


@pack_int4.compiled_when
def _(codes):
    return codes.dim() == 2 and codes.dtype == torch.int8


@_op(mutates_args=())
def unpack_int4(packed: Tensor, cols: int) -> Tensor:
    """Inverse of ``pack_int4``: int8 codes ``(rows, cols)``."""
    return ref4.unpack_int4(packed, cols)


@unpack_int4.register_fake
def _(packed, cols):
    return torch.empty((packed.shape[0], cols), dtype=torch.int8, device=packed.device)


@unpack_int4.compiled_when
def _(packed, cols):
    return K.packed_ok(packed, cols)


@_op(mutates_args=())
def ue4m3_encode(x: Tensor, round_up: bool) -> Tensor:
    """Non-negative fp32 -> UE4M3 bit patterns (uint8), nearest-even or rounded up."""
    return ref4.ue4m3_encode(x, round_up=round_up)


@ue4m3_encode.register_fake
def _(x, round_up):
    return torch.empty(x.shape, dtype=torch.uint8, device=x.device)


@ue4m3_encode.compiled_when
def _(x, round_up):
    return x.dtype in K.FLOAT_DTYPES


@_op(mutates_args=())
def ue4m3_decode(bits: Tensor) -> Tensor:
    """UE4M3 bit patterns -> fp32."""
    return ref4.ue4m3_decode(bits)


@ue4m3_decode.register_fake
def _(bits):
    return torch.empty(bits.shape, dtype=torch.float32, device=bits.device)


@ue4m3_decode.compiled_when
def _(bits):
    return bits.dtype == torch.uint8


def _dequantize_fake(packed: Tensor, *args: Any) -> Tensor:
    """The fake of every 4-bit dequantize op, ``(packed, ..., cols) -> fp32 (rows, cols)``."""
    return torch.empty((packed.shape[0], args[-1]), dtype=torch.float32, device=packed.device)


def _noise(x: Tensor, stream: int, row_offset: int) -> Tensor | None:
    return None if stream < 0 else ref.uniform_noise(*x.shape, stream, row_offset, x.device)


@_op(mutates_args=())
def int4_quantize(x: Tensor, block_size: int, stream: int, row_offset: int) -> tuple[Tensor, Tensor]:
    """fp32 matrix -> (packed int4 codes, fp32 absmax per row block)."""
    return ref4.int4_quantize(x, block_size, noise=_noise(x, stream, row_offset))


@int4_quantize.register_fake
def _(x, block_size, stream, row_offset):
    rows, cols = x.shape
    return (torch.empty((rows, ref4.packed_cols(cols)), dtype=torch.uint8, device=x.device),
            torch.empty((rows, ref.num_blocks(cols, block_size)), dtype=torch.float32, device=x.device))


@int4_quantize.compiled_when
def _(x, block_size, stream, row_offset):
    return x.dim() == 2 and x.dtype in K.FLOAT_DTYPES and K.int4_block_ok(block_size)


@_op(mutates_args=())
def int4_dequantize(packed: Tensor, absmax: Tensor, block_size: int, cols: int) -> Tensor:
    return ref4.int4_dequantize(packed, absmax, block_size, cols)


int4_dequantize.register_fake(_dequantize_fake)


@int4_dequantize.compiled_when
def _(packed, absmax, block_size, cols):
    return K.packed_ok(packed, cols) and K.mats_ok([absmax], (torch.float32,)) and block_size >= 1


@_op(mutates_args=())
def e0m3_quantize(x: Tensor, two_level: bool, stream: int, row_offset: int) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 matrix -> (packed E0M3 codes, UE4M3 per-16 scales, fp32 0-d tensor scale)."""
    return ref4.e0m3_quantize(x, two_level=two_level, noise=_noise(x, stream, row_offset))


@e0m3_quantize.register_fake
def _(x, two_level, stream, row_offset):
    rows, cols = x.shape
    return (torch.empty((rows, ref4.packed_cols(cols)), dtype=torch.uint8, device=x.device),
            torch.empty((rows, ref4.e0m3_num_blocks(cols)), dtype=torch.uint8, device=x.device),
            torch.empty((), dtype=torch.float32, device=x.device))


@e0m3_quantize.compiled_when
def _(x, two_level, stream, row_offset):
    return x.dim() == 2 and x.dtype in K.FLOAT_DTYPES


@_op(mutates_args=())
def e0m3_dequantize(packed: Tensor, scales: Tensor, tensor_scale: Tensor, cols: int) -> Tensor:
    return ref4.e0m3_dequantize(packed, scales, tensor_scale, cols)


e0m3_dequantize.register_fake(_dequantize_fake)


@e0m3_dequantize.compiled_when
def _(packed, scales, tensor_scale, cols):
    return (K.packed_ok(packed, cols) and K.mats_ok([scales], (torch.uint8,)) and tensor_scale.numel() == 1
            and tensor_scale.dtype in K.FLOAT_DTYPES and tensor_scale.device == packed.device)


@_op(mutates_args=())
def grid_quantize4(x: Tensor, grid_block: int, stream: int, row_offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp32 matrix -> (packed codes, UE4M3 tile-row maxima, UE4M3 tile-column maxima, fp32 scale)."""
    return ref4.grid_quantize4(x, grid_block, noise=_noise(x, stream, row_offset))


@grid_quantize4.register_fake
def _grid_quantize4_fake(x, grid_block, stream, row_offset):
    rows, cols = x.shape
    return (torch.empty((rows, ref4.packed_cols(cols)), dtype=torch.uint8, device=x.device),
            torch.empty((rows, ref.num_blocks(cols, grid_block)), dtype=torch.uint8, device=x.device),
            torch.empty((ref.num_blocks(rows, grid_block), cols), dtype=torch.uint8, device=x.device),
            torch.empty((), dtype=torch.float32, device=x.device))


@grid_quantize4.compiled_when
def _(x, grid_block, stream, row_offset):
    return x.dim() == 2 and x.dtype in K.FLOAT_DTYPES and grid_block >= 1


@_op(mutates_args=())
def grid_quantize4_with_scale(x: Tensor, grid_block: int, scale: Tensor, stream: int,
                              row_offset: int) -> tuple[Tensor, Tensor, Tensor]:
    """``grid_quantize4`` with the maxima scale given (a one-element fp32 tensor): (packed codes, UE4M3
    tile-row maxima, UE4M3 tile-column maxima). A row shard passes its matrix's scale (``amax / 448``
    of the MAX all-reduced amax) and gets the matrix's bytes for its rows; ``x``'s first row must be a
    tile boundary (the column maxima cover ``grid_block``-row tiles from there)."""
    return ref4.grid_quantize4_with_scale(x, grid_block, scale.reshape(()), noise=_noise(x, stream, row_offset))


@grid_quantize4_with_scale.register_fake
def _(x, grid_block, scale, stream, row_offset):
    return _grid_quantize4_fake(x, grid_block, stream, row_offset)[:3]


@grid_quantize4_with_scale.compiled_when
def _(x, grid_block, scale, stream, row_offset):
    return x.dim() == 2 and x.dtype in K.FLOAT_DTYPES and grid_block >= 1 and K.scalar_ok(scale, x.device)


@_op(mutates_args=())
def grid_dequantize4(packed: Tensor, row_max: Tensor, col_max: Tensor, scale: Tensor, grid_block: int,
                     cols: int) -> Tensor:
    return ref4.grid_dequantize4(packed, row_max, col_max, scale, grid_block, cols)


grid_dequantize4.register_fake(_dequantize_fake)


@grid_dequantize4.compiled_when
def _(packed, row_max, col_max, scale, grid_block, cols):
    return (K.packed_ok(packed, cols) and row_max.dtype == torch.uint8 and col_max.dtype == torch.uint8
            and scale.numel() == 1 and scale.dtype in K.FLOAT_DTYPES and scale.device == packed.device
            and grid_block >= 1)


@_op(mutates_args=("packed", "absmax", "grads", "block_sumsq"))
def int4_momentum_update_multi_(
    packed: list[Tensor],
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
    """int4 momentum update (same contract as ``q8_momentum_update_multi_``; ``block_sumsq`` is
    shaped ``(rows, ceil(cols / block_size))`` of each grad)."""
    _each_matrix(ref4.int4_momentum_update_, "int4_momentum_update_multi_", (packed, absmax), grads, block_sumsq,
                 beta, nesterov, block_size, streams, row_offsets, skip)


_update_fake(int4_momentum_update_multi_)


@int4_momentum_update_multi_.compiled_when
def _(packed, absmax, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets, skip=None):
    return (K.skip_ok(skip, grads) and K.int4_block_ok(block_size) and K.lists_ok(len(grads), packed, absmax)
            and K.mats_ok(packed, (torch.uint8,)) and K.mats_ok(absmax, (torch.float32,))
            and K.grads_and_sums_ok(grads, block_sumsq))


@_op(mutates_args=("packed", "scales", "tensor_scales", "grads", "block_sumsq"))
def e0m3_momentum_update_multi_(
    packed: list[Tensor],
    scales: list[Tensor],
    tensor_scales: list[Tensor],
    grads: list[Tensor],
    block_sumsq: list[Tensor],
    beta: float,
    nesterov: bool,
    block_size: int,
    streams: list[int],
    row_offsets: list[int],
    skip: Optional[Tensor] = None,
) -> None:
    """e0m3 momentum update; ``block_size`` only sets the granularity of ``block_sumsq``."""
    _each_matrix(ref4.e0m3_momentum_update_, "e0m3_momentum_update_multi_", (packed, scales, tensor_scales), grads,
                 block_sumsq, beta, nesterov, block_size, streams, row_offsets, skip)


_update_fake(e0m3_momentum_update_multi_)


def _e0m3_state_ok(packed, scales, tensor_scales, grads) -> bool:
    return (K.lists_ok(len(grads), packed, scales, tensor_scales) and K.mats_ok(packed, (torch.uint8,))
            and K.mats_ok(scales, (torch.uint8,)) and K.scalars_ok(tensor_scales, grads)
            and K.mats_ok(grads, K.GRAD_DTYPES))


@e0m3_momentum_update_multi_.compiled_when
def _e0m3_update_ok(packed, scales, tensor_scales, grads, block_sumsq, beta, nesterov, block_size, streams,
                    row_offsets, skip=None):
    return (K.skip_ok(skip, grads) and K.e0m3_block_ok(block_size) and _e0m3_state_ok(packed, scales, tensor_scales, grads)
            and K.grads_and_sums_ok(grads, block_sumsq))


# Row-sharded e0m3 (FSDP2 Shard(0)): the tensor scale is the whole matrix's, max |m_new| / (7 * 448), so a
# shard runs the update's two passes as two ops with a MAX all-reduce between them:
#   amax = e0m3_momentum_amax_multi(...); all_reduce(amax, MAX); t = e0m3_tensor_scale_from_amax(amax[i])
#   e0m3_momentum_update_with_scale_multi_(..., new_tensor_scales=[t, ...], ...)
# which gives each shard the bytes the unsharded update writes for its rows.
@_op(mutates_args=())
def e0m3_momentum_amax_multi(
    packed: list[Tensor],
    scales: list[Tensor],
    tensor_scales: list[Tensor],
    grads: list[Tensor],
    beta: float,
) -> Tensor:
    """fp32 ``(n,)``: per matrix, max |m_new| of the new momentum ``m_new = beta * m_old + (1 - beta) * g``
    (``m_old`` decoded with the stored tensor scale); 0 for an empty matrix, NaN (0x7FC00000) if
    ``m_new`` holds a NaN. Writes nothing."""
    _check_grads_2d(grads, len(packed), "e0m3_momentum_amax_multi")
    if not packed:
        return torch.zeros(0)
    return torch.stack([ref4.e0m3_momentum_amax(c, sc, t, g, beta=beta)
                        for c, sc, t, g in zip(packed, scales, tensor_scales, grads, strict=True)])


@e0m3_momentum_amax_multi.register_fake
def _(packed, scales, tensor_scales, grads, beta):
    _check_grads_2d(grads, len(packed), "e0m3_momentum_amax_multi")
    return torch.empty((len(packed),), dtype=torch.float32, device=grads[0].device if grads else "cpu")


@e0m3_momentum_amax_multi.compiled_when
def _(packed, scales, tensor_scales, grads, beta):
    return _e0m3_state_ok(packed, scales, tensor_scales, grads)


@_op(mutates_args=("packed", "scales", "tensor_scales", "grads", "block_sumsq"))
def e0m3_momentum_update_with_scale_multi_(
    packed: list[Tensor],
    scales: list[Tensor],
    tensor_scales: list[Tensor],
    new_tensor_scales: list[Tensor],
    grads: list[Tensor],
    block_sumsq: list[Tensor],
    beta: float,
    nesterov: bool,
    block_size: int,
    streams: list[int],
    row_offsets: list[int],
    skip: Optional[Tensor] = None,
) -> None:
    """``e0m3_momentum_update_multi_`` encoding with the given tensor scales (one-element fp32 tensors)
    instead of the ones computed from the matrices; the old state is decoded with ``tensor_scales[i]``
    as it is at the call, which afterwards holds ``new_tensor_scales[i]``."""
    _each_matrix(ref4.e0m3_momentum_update_, "e0m3_momentum_update_with_scale_multi_",
                 (packed, scales, tensor_scales), grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets,
                 skip, new_tensor_scale=new_tensor_scales)


_update_fake(e0m3_momentum_update_with_scale_multi_)


@e0m3_momentum_update_with_scale_multi_.compiled_when
def _(packed, scales, tensor_scales, new_tensor_scales, grads, block_sumsq, beta, nesterov, block_size, streams,
      row_offsets, skip=None):
    return (_e0m3_update_ok(packed, scales, tensor_scales, grads, block_sumsq, beta, nesterov, block_size, streams,
                            row_offsets, skip)
            and K.lists_ok(len(grads), new_tensor_scales) and K.scalars_ok(new_tensor_scales, grads))


_library_weight.declare(_op)  # the bf16 weight-write ops

from . import _library_adamw as _adamw  # noqa: E402  (the quantized AdamW op: prototype, fake, predicate)

adamw_q_update_ = _op(mutates_args=_adamw.MUTATES)(_adamw.adamw_q_update_)
adamw_q_update_.register_fake(_adamw.fake)
adamw_q_update_.compiled_when(_adamw.supported)
adamw_q_step_ = _op(mutates_args=_adamw.MUTATES)(_adamw.adamw_q_step_)
adamw_q_step_.register_fake(_adamw.fake_step)

# Compiled CPU / CUDA kernels (csrc/, built on first use) take over where their predicates hold.
K.register_compiled_kernels(OPS.values())
