"""The ``torch.ops.qmuon`` ops of the 4-bit momentum formats: the codecs (int4 sign-magnitude packing,
UE4M3 scales, int4 / e0m3 / grid quantize and dequantize) and the int4 / e0m3 multi-tensor momentum
updates, with the two passes of a row-sharded e0m3 update. Their reference is :mod:`.reference_4bit`,
their compiled twins ``csrc/cpu/q4_cpu.cpp`` and ``csrc/cuda/q4_cuda.cu``.

:mod:`._library` calls :func:`declare` with its op decorator before it registers the compiled kernels, so
these ops are declared (and get their kernels) like every other op, and this module imports nothing from
:mod:`._library` (no import cycle)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor

from . import _kernels as K
from . import reference as ref
from . import reference_4bit as ref4
from ._library_multi import check_grads_2d, each_matrix, update_fake

__all__: list[str] = []


def _dequantize_fake(packed: Tensor, *args: Any) -> Tensor:
    """The fake of every 4-bit dequantize op, ``(packed, ..., cols) -> fp32 (rows, cols)``."""
    return torch.empty((packed.shape[0], args[-1]), dtype=torch.float32, device=packed.device)


def _noise(x: Tensor, stream: int, row_offset: int) -> Tensor | None:
    return None if stream < 0 else ref.uniform_noise(*x.shape, stream, row_offset, x.device)


def _e0m3_state_ok(packed, scales, tensor_scales, grads) -> bool:
    return (K.lists_ok(len(grads), packed, scales, tensor_scales) and K.mats_ok(packed, (torch.uint8,))
            and K.mats_ok(scales, (torch.uint8,)) and K.scalars_ok(tensor_scales, grads)
            and K.mats_ok(grads, K.GRAD_DTYPES))


def declare(_op: Callable[..., Any]) -> dict[str, Any]:
    """Declare the 4-bit formats' ops with the op decorator ``_op`` of :mod:`._library`; returns the ops by
    name."""

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
    def grid_quantize4(x: Tensor, grid_block: int, stream: int,
                       row_offset: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
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
        each_matrix(ref4.int4_momentum_update_, "int4_momentum_update_multi_", (packed, absmax), grads, block_sumsq,
                    beta, nesterov, block_size, streams, row_offsets, skip)

    update_fake(int4_momentum_update_multi_)

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
        each_matrix(ref4.e0m3_momentum_update_, "e0m3_momentum_update_multi_", (packed, scales, tensor_scales), grads,
                    block_sumsq, beta, nesterov, block_size, streams, row_offsets, skip)

    update_fake(e0m3_momentum_update_multi_)

    @e0m3_momentum_update_multi_.compiled_when
    def _e0m3_update_ok(packed, scales, tensor_scales, grads, block_sumsq, beta, nesterov, block_size, streams,
                        row_offsets, skip=None):
        return (K.skip_ok(skip, grads) and K.e0m3_block_ok(block_size)
                and _e0m3_state_ok(packed, scales, tensor_scales, grads) and K.grads_and_sums_ok(grads, block_sumsq))

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
        check_grads_2d(grads, len(packed), "e0m3_momentum_amax_multi")
        if not packed:
            return torch.zeros(0)
        return torch.stack([ref4.e0m3_momentum_amax(c, sc, t, g, beta=beta)
                            for c, sc, t, g in zip(packed, scales, tensor_scales, grads, strict=True)])

    @e0m3_momentum_amax_multi.register_fake
    def _(packed, scales, tensor_scales, grads, beta):
        check_grads_2d(grads, len(packed), "e0m3_momentum_amax_multi")
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
        each_matrix(ref4.e0m3_momentum_update_, "e0m3_momentum_update_with_scale_multi_",
                    (packed, scales, tensor_scales), grads, block_sumsq, beta, nesterov, block_size, streams,
                    row_offsets, skip, new_tensor_scale=new_tensor_scales)

    update_fake(e0m3_momentum_update_with_scale_multi_)

    @e0m3_momentum_update_with_scale_multi_.compiled_when
    def _(packed, scales, tensor_scales, new_tensor_scales, grads, block_sumsq, beta, nesterov, block_size, streams,
          row_offsets, skip=None):
        return (_e0m3_update_ok(packed, scales, tensor_scales, grads, block_sumsq, beta, nesterov, block_size, streams,
                                row_offsets, skip)
                and K.lists_ok(len(grads), new_tensor_scales) and K.scalars_ok(new_tensor_scales, grads))

    return {op.name: op for op in (
        pack_int4, unpack_int4, ue4m3_encode, ue4m3_decode, int4_quantize, int4_dequantize, e0m3_quantize,
        e0m3_dequantize, grid_quantize4, grid_quantize4_with_scale, grid_dequantize4, int4_momentum_update_multi_,
        e0m3_momentum_update_multi_, e0m3_momentum_amax_multi, e0m3_momentum_update_with_scale_multi_)}
