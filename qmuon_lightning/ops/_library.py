"""Schemas of the ``torch.ops.qmuon`` operators, in one place.

Each op is declared on one ``torch.library.Library("qmuon", "DEF")`` from a typed Python prototype
(the schema, with its mutation annotations, comes from ``torch.library.infer_schema``). Its default
implementation (dispatch key ``CompositeExplicitAutograd``) is the pure-PyTorch reference in
:mod:`.reference` / :mod:`.reference_4bit`; a fake implementation describes output shapes for
``torch.compile`` / meta tensors; compiled CPU and CUDA kernels register for the ``CPU`` / ``CUDA``
keys on top of these defaults (:mod:`._extension`).

Why not ``torch.library.custom_op``: it wraps every call in Python layers (argument defaults filled
from the schema, version bumps, an autograd shim, a dynamo guard) that cost 55-65 us per call on an
idle machine and 0.3-1 ms right after a 16M-element kernel has evicted the caches, more than the
fused sums of squares cost (measured in benchmarks/bench_update.py). Here a call is the C++
dispatcher, one Python kernel and the compiled op. What custom_op did that still matters is done by
:class:`QmuonOp`: the version counters of the mutated tensors are bumped after every call (so
autograd notices in-place writes), whichever kernel ran.

Multi-tensor ops take lists; ``block_sumsq`` (outputs), ``streams`` and ``row_offsets`` are per
tensor. A stream of -1 means nearest rounding, anything else is the 32-bit stochastic-rounding
stream of that tensor. The multi-tensor updates return None and write their per-row-block sums of
squares into the caller-allocated ``block_sumsq`` list (see :func:`empty_block_sumsq`), so torch can
auto-functionalize them (``torch.compile``, AOTAutograd).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import Tensor

from . import reference as ref

_NS = "qmuon"
_lib = torch.library.Library(_NS, "DEF")  # kept alive for the life of the process: it owns the ops


class QmuonOp:
    """One ``torch.ops.qmuon`` operator: its schema, reference default, fake, and the kernels
    registered per dispatch key. Calling it calls ``torch.ops.qmuon.<name>``."""

    def __init__(self, fn: Callable[..., Any], mutates_args: tuple[str, ...]) -> None:
        self.name = fn.__name__
        self.reference = fn
        params = list(inspect.signature(fn).parameters)
        unknown = set(mutates_args) - set(params)
        if unknown:
            raise ValueError(f"qmuon::{self.name}: mutates_args names no parameter: {sorted(unknown)}")
        self.mutated = tuple(params.index(a) for a in mutates_args)
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)
        _lib.define(self.name + schema)
        self.register_kernel("CompositeExplicitAutograd", fn)

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

    def register_kernel(self, dispatch_key: str, fn: Callable[..., Any]) -> None:
        """Implementation for ``dispatch_key`` (``"CPU"``, ``"CUDA"``, ``"CompositeExplicitAutograd"``)."""
        _lib.impl(self.name, self._bumping(fn), dispatch_key)

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        torch.library.register_fake(f"{_NS}::{self.name}", fn, lib=_lib)
        return fn

    def __call__(self, *args: Any) -> Any:
        return getattr(torch.ops.qmuon, self.name)(*args)


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


# The multi-tensor updates write their per-row-block sums of squares into caller-allocated
# ``block_sumsq`` tensors and return None: a mutating op that returns a Tensor[] cannot be
# auto-functionalized, so it would break torch.compile / AOTAutograd.
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
) -> None:
    """8-bit (int8 or uint8 codes) momentum update over many matrices.

    Overwrites every grad with its Newton-Schulz input and writes, per tensor, the fp32 sum of
    squares of that input for each row block into ``block_sumsq[i]`` (caller-allocated, fp32,
    shaped like the tensor's absmax).
    """
    _check_block_sumsq(block_sumsq, codes, block_size, "q8_momentum_update_multi_")
    for c, a, g, out, s, o in zip(codes, absmax, grads, block_sumsq, streams, row_offsets, strict=True):
        out.copy_(ref.q8_momentum_update_(
            c, a, g, beta=beta, nesterov=nesterov, block_size=block_size, stream=_stream(s), row_offset=o))


@q8_momentum_update_multi_.register_fake
def _(codes, absmax, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets):
    _check_block_sumsq(block_sumsq, codes, block_size, "q8_momentum_update_multi_")
    return None


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
) -> None:
    """fp32 / bf16 momentum update with the same contract as ``q8_momentum_update_multi_``."""
    _check_block_sumsq(block_sumsq, bufs, block_size, "dense_momentum_update_multi_")
    for b, g, out, s, o in zip(bufs, grads, block_sumsq, streams, row_offsets, strict=True):
        out.copy_(ref.dense_momentum_update_(
            b, g, beta=beta, nesterov=nesterov, block_size=block_size, stream=_stream(s), row_offset=o))


@dense_momentum_update_multi_.register_fake
def _(bufs, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets):
    _check_block_sumsq(block_sumsq, bufs, block_size, "dense_momentum_update_multi_")
    return None


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


@_op(mutates_args=())
def dequantize_rows(codes: Tensor, absmax: Tensor, block_size: int) -> Tensor:
    """(codes, absmax) -> fp32 matrix."""
    return ref.dequantize_rows(codes, absmax, block_size)


@dequantize_rows.register_fake
def _(codes, absmax, block_size):
    return torch.empty(codes.shape, dtype=torch.float32, device=codes.device)


# ----------------------------------------------------------------------------- 4-bit formats
# Pure-PyTorch references (ops/reference_4bit.py); compiled CPU / CUDA kernels (csrc/) register on top.
from . import reference_4bit as ref4  # noqa: E402


@_op(mutates_args=())
def pack_int4(codes: Tensor) -> Tensor:
    """int8 sign-magnitude codes in -7..7 ``(rows, cols)`` -> uint8 ``(rows, ceil(cols / 2))``."""
    return ref4.pack_int4(codes)


@pack_int4.register_fake
def _(codes):
    return torch.empty((codes.shape[0], ref4.packed_cols(codes.shape[1])), dtype=torch.uint8, device=codes.device)


@_op(mutates_args=())
def unpack_int4(packed: Tensor, cols: int) -> Tensor:
    """Inverse of ``pack_int4``: int8 codes ``(rows, cols)``."""
    return ref4.unpack_int4(packed, cols)


@unpack_int4.register_fake
def _(packed, cols):
    return torch.empty((packed.shape[0], cols), dtype=torch.int8, device=packed.device)


@_op(mutates_args=())
def ue4m3_encode(x: Tensor, round_up: bool) -> Tensor:
    """Non-negative fp32 -> UE4M3 bit patterns (uint8), nearest-even or rounded up."""
    return ref4.ue4m3_encode(x, round_up=round_up)


@ue4m3_encode.register_fake
def _(x, round_up):
    return torch.empty(x.shape, dtype=torch.uint8, device=x.device)


@_op(mutates_args=())
def ue4m3_decode(bits: Tensor) -> Tensor:
    """UE4M3 bit patterns -> fp32."""
    return ref4.ue4m3_decode(bits)


@ue4m3_decode.register_fake
def _(bits):
    return torch.empty(bits.shape, dtype=torch.float32, device=bits.device)


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


@_op(mutates_args=())
def int4_dequantize(packed: Tensor, absmax: Tensor, block_size: int, cols: int) -> Tensor:
    return ref4.int4_dequantize(packed, absmax, block_size, cols)


@int4_dequantize.register_fake
def _(packed, absmax, block_size, cols):
    return torch.empty((packed.shape[0], cols), dtype=torch.float32, device=packed.device)


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


@_op(mutates_args=())
def e0m3_dequantize(packed: Tensor, scales: Tensor, tensor_scale: Tensor, cols: int) -> Tensor:
    return ref4.e0m3_dequantize(packed, scales, tensor_scale, cols)


@e0m3_dequantize.register_fake
def _(packed, scales, tensor_scale, cols):
    return torch.empty((packed.shape[0], cols), dtype=torch.float32, device=packed.device)


@_op(mutates_args=())
def grid_quantize4(x: Tensor, grid_block: int, stream: int, row_offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """fp32 matrix -> (packed codes, UE4M3 tile-row maxima, UE4M3 tile-column maxima, fp32 scale)."""
    return ref4.grid_quantize4(x, grid_block, noise=_noise(x, stream, row_offset))


@grid_quantize4.register_fake
def _(x, grid_block, stream, row_offset):
    rows, cols = x.shape
    return (torch.empty((rows, ref4.packed_cols(cols)), dtype=torch.uint8, device=x.device),
            torch.empty((rows, ref.num_blocks(cols, grid_block)), dtype=torch.uint8, device=x.device),
            torch.empty((ref.num_blocks(rows, grid_block), cols), dtype=torch.uint8, device=x.device),
            torch.empty((), dtype=torch.float32, device=x.device))


@_op(mutates_args=())
def grid_dequantize4(packed: Tensor, row_max: Tensor, col_max: Tensor, scale: Tensor, grid_block: int,
                     cols: int) -> Tensor:
    return ref4.grid_dequantize4(packed, row_max, col_max, scale, grid_block, cols)


@grid_dequantize4.register_fake
def _(packed, row_max, col_max, scale, grid_block, cols):
    return torch.empty((packed.shape[0], cols), dtype=torch.float32, device=packed.device)


def _check_grads_2d(grads: list[Tensor], n: int, op: str) -> None:
    if len(grads) != n:
        raise ValueError(f"qmuon::{op}: got {len(grads)} grads for {n} states")


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
) -> None:
    """int4 momentum update (same contract as ``q8_momentum_update_multi_``; ``block_sumsq`` is
    shaped ``(rows, ceil(cols / block_size))`` of each grad)."""
    _check_grads_2d(grads, len(packed), "int4_momentum_update_multi_")
    _check_block_sumsq(block_sumsq, grads, block_size, "int4_momentum_update_multi_")
    for c, a, g, out, s, o in zip(packed, absmax, grads, block_sumsq, streams, row_offsets, strict=True):
        out.copy_(ref4.int4_momentum_update_(
            c, a, g, beta=beta, nesterov=nesterov, block_size=block_size, stream=_stream(s), row_offset=o))


@int4_momentum_update_multi_.register_fake
def _(packed, absmax, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets):
    _check_block_sumsq(block_sumsq, grads, block_size, "int4_momentum_update_multi_")
    return None


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
) -> None:
    """e0m3 momentum update; ``block_size`` only sets the granularity of ``block_sumsq``."""
    _check_grads_2d(grads, len(packed), "e0m3_momentum_update_multi_")
    _check_block_sumsq(block_sumsq, grads, block_size, "e0m3_momentum_update_multi_")
    for c, sc, t, g, out, s, o in zip(packed, scales, tensor_scales, grads, block_sumsq, streams, row_offsets,
                                      strict=True):
        out.copy_(ref4.e0m3_momentum_update_(
            c, sc, t, g, beta=beta, nesterov=nesterov, block_size=block_size, stream=_stream(s), row_offset=o))


@e0m3_momentum_update_multi_.register_fake
def _(packed, scales, tensor_scales, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets):
    _check_block_sumsq(block_sumsq, grads, block_size, "e0m3_momentum_update_multi_")
    return None


# Compiled CPU / CUDA kernels (csrc/, built on first use) take over on the devices they support and
# fall back to the reference above when they are unavailable; see _extension.py.
from . import _extension  # noqa: E402

_extension.register_compiled_kernels({
    "q8_momentum_update_multi_": q8_momentum_update_multi_,
    "quantize_rows": quantize_rows,
    "dequantize_rows": dequantize_rows,
    "dense_momentum_update_multi_": dense_momentum_update_multi_,
    "int4_momentum_update_multi_": int4_momentum_update_multi_,
    "e0m3_momentum_update_multi_": e0m3_momentum_update_multi_,
    "pack_int4": pack_int4,
    "unpack_int4": unpack_int4,
    "ue4m3_encode": ue4m3_encode,
    "ue4m3_decode": ue4m3_decode,
    "int4_quantize": int4_quantize,
    "int4_dequantize": int4_dequantize,
    "e0m3_quantize": e0m3_quantize,
    "e0m3_dequantize": e0m3_dequantize,
    "grid_quantize4": grid_quantize4,
    "grid_dequantize4": grid_dequantize4,
})
