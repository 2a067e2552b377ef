"""ctypes mirrors of the kernels' C-ABI structs (``csrc/qmuon/kernels.h``, ``adamw_kernels.h``,
``weight_kernels.h``), their enum values, and the layout check against a library's own
(``csrc/qmuon/abi_layout.h``). :mod:`._cabi` fills them and calls the entry points. Every struct of a
matrix a kernel writes ends with ``skip``, the device address of that matrix's flag byte (or NULL)."""

from __future__ import annotations

import ctypes as C

import torch

# csrc/qmuon/kernels.h (enum qmuon_dtype, QMUON_CODEC_*), block_math.h, block_math_4bit.h, adamw_math.h
F32, BF16, F16, I8, U8 = 0, 1, 2, 3, 4
_DTYPE = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16, torch.int8: I8, torch.uint8: U8}
MAX_BLOCK = 4096
_CODE_DTYPES = (torch.int8, torch.uint8)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
E0M3_BLOCK = 16
(PACK_INT4, UNPACK_INT4, UE4M3_ENCODE, UE4M3_DECODE, INT4_QUANTIZE, INT4_DEQUANTIZE, E0M3_QUANTIZE, E0M3_DEQUANTIZE,
 GRID_QUANTIZE, GRID_DEQUANTIZE, GRID_QUANTIZE_WITH_SCALE) = range(1, 12)
ADAM_M8, ADAM_V8, ADAM_M4, ADAM_V4 = 0, 1, 2, 3

_p, _i32, _i64, _f32, _f64 = C.c_void_p, C.c_int32, C.c_int64, C.c_float, C.c_double


class Q8Tensor(C.Structure):
    _fields_ = [("codes", _p), ("absmax", _p), ("grad", _p), ("sumsq", _p), ("rows", _i64), ("cols", _i64),
                ("codes_rs", _i64), ("absmax_rs", _i64), ("grad_rs", _i64), ("row_offset", _i64), ("stream", _i64),
                ("skip", _p)]


class Q8Params(C.Structure):
    _fields_ = [("beta", _f64), ("nesterov", _i32), ("code_dtype", _i32), ("grad_dtype", _i32),
                ("block_size", _i64)]


class Q4Tensor(C.Structure):
    _fields_ = [("packed", _p), ("scales", _p), ("tensor_scale", _p), ("grad", _p), ("sumsq", _p), ("scratch", _p),
                ("new_tensor_scale", _p), ("amax_out", _p), ("rows", _i64), ("cols", _i64), ("packed_rs", _i64),
                ("scales_rs", _i64), ("grad_rs", _i64), ("row_offset", _i64), ("stream", _i64), ("skip", _p)]


class Q4Params(C.Structure):
    _fields_ = [("beta", _f64), ("nesterov", _i32), ("grad_dtype", _i32), ("block_size", _i64)]


class DenseTensor(C.Structure):
    _fields_ = [("buf", _p), ("grad", _p), ("sumsq", _p), ("rows", _i64), ("cols", _i64), ("buf_rs", _i64),
                ("grad_rs", _i64), ("row_offset", _i64), ("stream", _i64), ("skip", _p)]


class DenseParams(C.Structure):
    _fields_ = [("beta", _f64), ("nesterov", _i32), ("buf_dtype", _i32), ("grad_dtype", _i32), ("block_size", _i64)]


class CodecArgs(C.Structure):
    _fields_ = [("op", _i32), ("flag", _i32), ("in0", _p), ("in1", _p), ("in2", _p), ("in3", _p), ("out0", _p),
                ("out1", _p), ("out2", _p), ("out3", _p), ("scratch", _p), ("rows", _i64), ("cols", _i64),
                ("block_size", _i64), ("stream", _i64), ("row_offset", _i64)]


class AdamwQArgs(C.Structure):
    _fields_ = [("grad", _p), ("grad_rs", _i64), ("grad_dtype", _i32), ("m_kind", _i32), ("v_kind", _i32),
                ("pad_", _i32), ("m_codes", _p), ("m_rs", _i64), ("m_scale", _p), ("m_scale_rs", _i64),
                ("v_codes", _p), ("v_rs", _i64), ("v_scale", _p), ("v_scale_rs", _i64), ("update", _p),
                ("update_rs", _i64), ("rows", _i64), ("cols", _i64), ("block_size", _i64), ("beta1", _f64),
                ("beta2", _f64), ("eps", _f64), ("neg_step_size", _f64), ("bias_correction2_sqrt", _f64),
                ("stream", _i64), ("index0", _i64), ("skip", _p)]


class WeightArgs(C.Structure):
    _fields_ = [("param", _p), ("ecc", _p), ("update", _p), ("update_dtype", _i32), ("rows", _i64), ("cols", _i64),
                ("param_rs", _i64), ("ecc_rs", _i64), ("update_rs", _i64), ("alpha", _f32), ("decay", _f32),
                ("stream", _i64), ("index0", _i64), ("index_rs", _i64), ("skip", _p)]


class Fp32WeightArgs(C.Structure):
    _fields_ = [("param", _p), ("update", _p), ("update_dtype", _i32), ("rows", _i64), ("cols", _i64),
                ("param_rs", _i64), ("update_rs", _i64), ("update_cs", _i64), ("alpha", _f32), ("decay", _f32),
                ("skip", _p)]


#: In the order of csrc/qmuon/abi_layout.h.
STRUCTS = (Q8Tensor, Q8Params, Q4Tensor, Q4Params, DenseTensor, DenseParams, CodecArgs, AdamwQArgs, WeightArgs,
           Fp32WeightArgs)


def layout() -> list[int]:
    """Per struct of :data:`STRUCTS`: its size, then the offset of every field, in declaration order
    (what ``qmuon_*_abi_layout`` of a library returns for the C compiler's structs)."""
    out: list[int] = []
    for s in STRUCTS:
        out.append(C.sizeof(s))
        out.extend(getattr(s, name).offset for name, _ in s._fields_)
    return out


def library_layout(lib: C.CDLL, kind: str) -> list[int]:
    """The C compiler's :func:`layout` of ``lib`` (``qmuon_<kind>_abi_layout``)."""
    fn = getattr(lib, f"qmuon_{kind}_abi_layout")
    fn.restype, fn.argtypes = C.c_int64, [C.POINTER(C.c_int64), C.c_int64]
    n = int(fn(None, 0))
    buf = (C.c_int64 * n)()
    fn(buf, n)
    return list(buf)
