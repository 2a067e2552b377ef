"""The standalone 4-bit codecs of the C-ABI twin (:mod:`._cabi`): pack / unpack, UE4M3, int4, E0M3 and the
GRASP grid, each one ``qmuon_<kind>_codec`` call on contiguous inputs into fresh outputs
(``csrc/binding_4bit.h``). :class:`CodecTwins` is a mixin of :class:`._cabi.CAbiOps`, which provides
``_codec`` (the bound entry point), ``_run`` and ``_scratch``."""

from __future__ import annotations

import ctypes as C
from typing import Any, Callable

import torch
from torch import Tensor

from ._cabi_checks import _check, _check_2d, _check_packed, _check_scalar, _f32c, _nb, _ptr, _s32, _same_device
from ._cabi_structs import (E0M3_BLOCK, E0M3_DEQUANTIZE, E0M3_QUANTIZE, GRID_DEQUANTIZE, GRID_QUANTIZE,
                            GRID_QUANTIZE_WITH_SCALE, INT4_DEQUANTIZE, INT4_QUANTIZE, MAX_BLOCK, PACK_INT4,
                            UE4M3_DECODE, UE4M3_ENCODE, UNPACK_INT4, CodecArgs)


class CodecTwins:
    """The codec methods of :class:`._cabi.CAbiOps` (same names and arguments as the ``torch.ops.qmuon`` ops)."""

    # provided by CAbiOps
    _codec: Any
    _run: Callable[..., None]
    _scratch: Callable[[int, Tensor], Tensor | None]

    def _codec_run(self, op: str, device: torch.device, code: int, rows: int, cols: int, **fields: Any) -> None:
        a = CodecArgs(op=code, rows=rows, cols=cols, stream=-1)
        for k, v in fields.items():
            setattr(a, k, v)
        self._run(self._codec, op, device, C.byref(a))

    def pack_int4(self, codes: Tensor) -> Tensor:
        op = "pack_int4"
        _check(codes.dim() == 2, op, lambda: f"codes must be 2-D, got {codes.dim()}-D")
        _check(codes.dtype == torch.int8, op, lambda: f"codes must be int8, got {codes.dtype}")
        codes = codes.contiguous()
        rows, cols = codes.shape
        out = torch.empty(rows, (cols + 1) // 2, dtype=torch.uint8, device=codes.device)
        if rows > 0 and cols > 0:
            self._codec_run(op, codes.device, PACK_INT4, rows, cols, in0=codes.data_ptr(), out0=out.data_ptr())
        return out

    def unpack_int4(self, packed: Tensor, cols: int) -> Tensor:
        op = "unpack_int4"
        _check(packed.dim() == 2, op, lambda: f"packed must be 2-D, got {packed.dim()}-D")
        _check(packed.dtype == torch.uint8, op, lambda: f"packed must be uint8, got {packed.dtype}")
        _check(cols >= 0 and (cols + 1) // 2 == packed.shape[1], op,
               lambda: f"{packed.shape[1]} packed columns cannot hold {cols} codes (needs ceil(cols / 2))")
        packed = packed.contiguous()
        rows = packed.shape[0]
        out = torch.empty(rows, cols, dtype=torch.int8, device=packed.device)
        if rows > 0 and cols > 0:
            self._codec_run(op, packed.device, UNPACK_INT4, rows, cols, in0=packed.data_ptr(), out0=out.data_ptr())
        return out

    def ue4m3_encode(self, x: Tensor, round_up: bool) -> Tensor:
        x = _f32c(x)
        out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        if x.numel() > 0:
            self._codec_run("ue4m3_encode", x.device, UE4M3_ENCODE, 1, x.numel(), flag=int(round_up),
                            in0=x.data_ptr(), out0=out.data_ptr())
        return out

    def ue4m3_decode(self, bits: Tensor) -> Tensor:
        _check(bits.dtype == torch.uint8, "ue4m3_decode", lambda: f"needs uint8 bit patterns, got {bits.dtype}")
        bits = bits.contiguous()
        out = torch.empty(bits.shape, dtype=torch.float32, device=bits.device)
        if bits.numel() > 0:
            self._codec_run("ue4m3_decode", bits.device, UE4M3_DECODE, 1, bits.numel(), in0=bits.data_ptr(),
                            out0=out.data_ptr())
        return out

    def int4_quantize(self, x: Tensor, block_size: int, stream: int, row_offset: int) -> tuple[Tensor, Tensor]:
        op = "int4_quantize"
        _check(x.dim() == 2, op, lambda: f"x must be 2-D, got {x.dim()}-D")
        _check(2 <= block_size <= MAX_BLOCK and block_size % 2 == 0, op,
               lambda: f"needs an even block_size in [2, {MAX_BLOCK}], got {block_size}")
        x = _f32c(x)
        rows, cols = x.shape
        packed = torch.empty(rows, (cols + 1) // 2, dtype=torch.uint8, device=x.device)
        absmax = torch.empty(rows, _nb(cols, block_size), dtype=torch.float32, device=x.device)
        if rows > 0 and cols > 0:
            self._codec_run(op, x.device, INT4_QUANTIZE, rows, cols, block_size=block_size, stream=_s32(stream),
                            row_offset=row_offset, in0=x.data_ptr(), out0=packed.data_ptr(), out1=absmax.data_ptr())
        return packed, absmax

    def int4_dequantize(self, packed: Tensor, absmax: Tensor, block_size: int, cols: int) -> Tensor:
        op = "int4_dequantize"
        rows = _check_packed(packed, cols, op)
        _check(block_size >= 1, op, lambda: f"needs block_size >= 1, got {block_size}")
        _check_2d(absmax, torch.float32, rows, _nb(cols, block_size), "absmax", 0, op, " (rows, ceil(cols / block_size))")
        _same_device(absmax, "absmax", packed, op)
        packed, absmax = packed.contiguous(), absmax.contiguous()
        out = torch.empty(rows, cols, dtype=torch.float32, device=packed.device)
        if rows > 0 and cols > 0:
            self._codec_run(op, packed.device, INT4_DEQUANTIZE, rows, cols, block_size=block_size,
                            in0=packed.data_ptr(), in1=absmax.data_ptr(), out0=out.data_ptr())
        return out

    def e0m3_quantize(self, x: Tensor, two_level: bool, stream: int, row_offset: int) -> tuple[Tensor, Tensor, Tensor]:
        op = "e0m3_quantize"
        _check(x.dim() == 2, op, lambda: f"x must be 2-D, got {x.dim()}-D")
        x = _f32c(x)
        rows, cols = x.shape
        packed = torch.empty(rows, (cols + 1) // 2, dtype=torch.uint8, device=x.device)
        scales = torch.empty(rows, _nb(cols, E0M3_BLOCK), dtype=torch.uint8, device=x.device)
        t = torch.empty((), dtype=torch.float32, device=x.device)
        scratch = self._scratch(1, x)
        if rows > 0 and cols > 0:
            self._codec_run(op, x.device, E0M3_QUANTIZE, rows, cols, flag=int(two_level), stream=_s32(stream),
                            row_offset=row_offset, in0=x.data_ptr(), out0=packed.data_ptr(), out1=scales.data_ptr(),
                            out2=t.data_ptr(), scratch=_ptr(scratch))
        else:
            t.fill_(1.0)
        return packed, scales, t

    def e0m3_dequantize(self, packed: Tensor, scales: Tensor, tensor_scale: Tensor, cols: int) -> Tensor:
        op = "e0m3_dequantize"
        rows = _check_packed(packed, cols, op)
        _check_2d(scales, torch.uint8, rows, _nb(cols, E0M3_BLOCK), "scales", 0, op, " (one UE4M3 scale per 16 elements)")
        _check(tensor_scale.numel() == 1, op, lambda: f"tensor_scale must have one element, got {tuple(tensor_scale.shape)}")
        _same_device(scales, "scales", packed, op)
        _same_device(tensor_scale, "tensor_scale", packed, op)
        packed, scales, t = packed.contiguous(), scales.contiguous(), _f32c(tensor_scale)
        out = torch.empty(rows, cols, dtype=torch.float32, device=packed.device)
        if rows > 0 and cols > 0:
            self._codec_run(op, packed.device, E0M3_DEQUANTIZE, rows, cols, in0=packed.data_ptr(),
                            in1=scales.data_ptr(), in2=t.data_ptr(), out0=out.data_ptr())
        return out

    def _grid_quantize(self, x: Tensor, grid_block: int, scale: Tensor | None, stream: int, row_offset: int
                       ) -> tuple[Tensor, ...]:
        op = "grid_quantize4" if scale is None else "grid_quantize4_with_scale"
        _check(x.dim() == 2, op, lambda: f"x must be 2-D, got {x.dim()}-D")
        _check(grid_block >= 1, op, lambda: f"needs grid_block >= 1, got {grid_block}")
        if scale is not None:
            _check_scalar(scale, "scale", 0, x.device, op)
        x = _f32c(x)
        rows, cols = x.shape
        packed = torch.empty(rows, (cols + 1) // 2, dtype=torch.uint8, device=x.device)
        row_max = torch.empty(rows, _nb(cols, grid_block), dtype=torch.uint8, device=x.device)
        col_max = torch.empty(_nb(rows, grid_block), cols, dtype=torch.uint8, device=x.device)
        fields: dict[str, Any] = dict(block_size=grid_block, stream=_s32(stream), row_offset=row_offset,
                                      in0=x.data_ptr(), out0=packed.data_ptr(), out1=row_max.data_ptr(),
                                      out2=col_max.data_ptr())
        t = None
        if scale is None:
            t = torch.empty((), dtype=torch.float32, device=x.device)
            scratch = self._scratch(1, x)  # the max |x| bits
            fields.update(out3=t.data_ptr(), scratch=_ptr(scratch))
        else:
            scale = scale.contiguous()
            fields.update(in1=scale.data_ptr())
        if rows > 0 and cols > 0:
            self._codec_run(op, x.device, GRID_QUANTIZE if scale is None else GRID_QUANTIZE_WITH_SCALE, rows, cols,
                            **fields)
        elif t is not None:
            t.fill_(1.0)
        return (packed, row_max, col_max) if t is None else (packed, row_max, col_max, t)

    def grid_quantize4(self, x: Tensor, grid_block: int, stream: int, row_offset: int
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return self._grid_quantize(x, grid_block, None, stream, row_offset)  # type: ignore[return-value]

    def grid_quantize4_with_scale(self, x: Tensor, grid_block: int, scale: Tensor, stream: int, row_offset: int
                                  ) -> tuple[Tensor, Tensor, Tensor]:
        return self._grid_quantize(x, grid_block, scale, stream, row_offset)  # type: ignore[return-value]

    def grid_dequantize4(self, packed: Tensor, row_max: Tensor, col_max: Tensor, scale: Tensor, grid_block: int,
                         cols: int) -> Tensor:
        op = "grid_dequantize4"
        rows = _check_packed(packed, cols, op)
        _check(grid_block >= 1, op, lambda: f"needs grid_block >= 1, got {grid_block}")
        _check_2d(row_max, torch.uint8, rows, _nb(cols, grid_block), "row maxima", 0, op, " (rows, ceil(cols / s))")
        _check_2d(col_max, torch.uint8, _nb(rows, grid_block), cols, "column maxima", 0, op, " (ceil(rows / s), cols)")
        _check(scale.numel() == 1, op, lambda: f"scale must have one element, got {tuple(scale.shape)}")
        for what, t in (("row maxima", row_max), ("column maxima", col_max), ("scale", scale)):
            _same_device(t, what, packed, op)
        packed, rb, cb, t = packed.contiguous(), row_max.contiguous(), col_max.contiguous(), _f32c(scale)
        out = torch.empty(rows, cols, dtype=torch.float32, device=packed.device)
        if rows > 0 and cols > 0:
            self._codec_run(op, packed.device, GRID_DEQUANTIZE, rows, cols, block_size=grid_block,
                            in0=packed.data_ptr(), in1=rb.data_ptr(), in2=cb.data_ptr(), in3=t.data_ptr(),
                            out0=out.data_ptr())
        return out
