// Argument checks of the C entry points (qmuon/kernels.h), shared by the CPU (csrc/cpu/*.cpp) and CUDA
// (csrc/cuda/*.cu) launchers so that both accept and reject exactly the same calls with the same code.
// Each returns 0 or a QMUON_ERR_* code. Order: op, then block size, then dtypes, all before the
// empty-tensor shortcut (an empty call with a bad dtype is an error on both); pointers are checked
// only where there is data to point at.
#pragma once

#include <stdint.h>

#include "qmuon/block_math_4bit.h"
#include "qmuon/kernels.h"

namespace qmuon {

inline bool grad_dtype_ok(int32_t d) { return d == QMUON_FLOAT32 || d == QMUON_BFLOAT16 || d == QMUON_FLOAT16; }
inline bool code_dtype_ok(int32_t d) { return d == QMUON_INT8 || d == QMUON_UINT8; }
inline bool block_size_ok(int64_t bs) { return bs >= 1 && bs <= kMaxBlockSize; }
inline bool int4_block_size_ok(int64_t bs) { return bs >= 2 && bs <= kMaxBlockSize && bs % 2 == 0; }
inline bool e0m3_block_size_ok(int64_t bs) {
  return block_size_ok(bs) && (bs % kE0M3Block == 0 || kE0M3Block % bs == 0);
}

inline int check_q8_update(const qmuon_q8_params& p) {
  if (!block_size_ok(p.block_size)) return QMUON_ERR_BAD_BLOCK_SIZE;
  if (!code_dtype_ok(p.code_dtype) || !grad_dtype_ok(p.grad_dtype)) return QMUON_ERR_BAD_DTYPE;
  return 0;
}

inline int check_rows_op(int32_t code_dtype, int64_t block_size) {
  if (!block_size_ok(block_size)) return QMUON_ERR_BAD_BLOCK_SIZE;
  if (!code_dtype_ok(code_dtype)) return QMUON_ERR_BAD_DTYPE;
  return 0;
}

inline int check_int4_update(const qmuon_q4_params& p) {
  if (!int4_block_size_ok(p.block_size)) return QMUON_ERR_BAD_BLOCK_SIZE;
  return grad_dtype_ok(p.grad_dtype) ? 0 : QMUON_ERR_BAD_DTYPE;
}

inline int check_e0m3_update(const qmuon_q4_params& p) {
  if (!e0m3_block_size_ok(p.block_size)) return QMUON_ERR_BAD_BLOCK_SIZE;
  return grad_dtype_ok(p.grad_dtype) ? 0 : QMUON_ERR_BAD_DTYPE;
}

// The amax pass does not use block_size.
inline int check_e0m3_amax(const qmuon_q4_params& p) { return grad_dtype_ok(p.grad_dtype) ? 0 : QMUON_ERR_BAD_DTYPE; }

inline int check_dense_update(const qmuon_dense_params& p) {
  if (!block_size_ok(p.block_size)) return QMUON_ERR_BAD_BLOCK_SIZE;
  if ((p.buf_dtype != QMUON_FLOAT32 && p.buf_dtype != QMUON_BFLOAT16) || !grad_dtype_ok(p.grad_dtype)) {
    return QMUON_ERR_BAD_DTYPE;
  }
  return 0;
}

// The standalone codecs: the op, its block size, then (non-empty calls) the pointers it reads and writes
// (see qmuon_codec_op). CUDA additionally needs `scratch` for E0M3_QUANTIZE / GRID_QUANTIZE.
inline int check_codec(const qmuon_codec_args& a) {
  if (a.op < QMUON_CODEC_PACK_INT4 || a.op > QMUON_CODEC_GRID_QUANTIZE_WITH_SCALE) return QMUON_ERR_BAD_OP;
  switch (a.op) {
    case QMUON_CODEC_INT4_QUANTIZE:  // a block's codes fill whole bytes: even
      if (!int4_block_size_ok(a.block_size)) return QMUON_ERR_BAD_BLOCK_SIZE;
      break;
    case QMUON_CODEC_INT4_DEQUANTIZE:
    case QMUON_CODEC_GRID_QUANTIZE:
    case QMUON_CODEC_GRID_DEQUANTIZE:
    case QMUON_CODEC_GRID_QUANTIZE_WITH_SCALE:
      if (a.block_size < 1) return QMUON_ERR_BAD_BLOCK_SIZE;
      break;
    default: break;
  }
  // The given scale is part of the op's contract, empty matrix or not.
  if (a.op == QMUON_CODEC_GRID_QUANTIZE_WITH_SCALE && a.in1 == nullptr) return QMUON_ERR_BAD_OP;
  // The tensor scale is written even for an empty matrix (1, the reference's scale of nothing).
  if (a.op == QMUON_CODEC_E0M3_QUANTIZE && a.out2 == nullptr) return QMUON_ERR_BAD_OP;
  if (a.op == QMUON_CODEC_GRID_QUANTIZE && a.out3 == nullptr) return QMUON_ERR_BAD_OP;
  if (a.rows <= 0 || a.cols <= 0) return 0;
  const bool ins_ok = a.in0 != nullptr && a.out0 != nullptr;
  switch (a.op) {
    case QMUON_CODEC_INT4_QUANTIZE: return ins_ok && a.out1 != nullptr ? 0 : QMUON_ERR_BAD_OP;
    case QMUON_CODEC_INT4_DEQUANTIZE: return ins_ok && a.in1 != nullptr ? 0 : QMUON_ERR_BAD_OP;
    case QMUON_CODEC_E0M3_QUANTIZE: return ins_ok && a.out1 != nullptr && a.out2 != nullptr ? 0 : QMUON_ERR_BAD_OP;
    case QMUON_CODEC_E0M3_DEQUANTIZE: return ins_ok && a.in1 != nullptr && a.in2 != nullptr ? 0 : QMUON_ERR_BAD_OP;
    case QMUON_CODEC_GRID_QUANTIZE:
      return ins_ok && a.out1 != nullptr && a.out2 != nullptr && a.out3 != nullptr ? 0 : QMUON_ERR_BAD_OP;
    case QMUON_CODEC_GRID_QUANTIZE_WITH_SCALE:
      return ins_ok && a.out1 != nullptr && a.out2 != nullptr ? 0 : QMUON_ERR_BAD_OP;
    case QMUON_CODEC_GRID_DEQUANTIZE:
      return ins_ok && a.in1 != nullptr && a.in2 != nullptr && a.in3 != nullptr ? 0 : QMUON_ERR_BAD_OP;
    default: return ins_ok ? 0 : QMUON_ERR_BAD_OP;
  }
}

// The text of a QMUON_ERR_* code (NULL for any other code: a CUDA error, which the CUDA table names).
inline const char* qmuon_error_text(int code) {
  switch (code) {
    case QMUON_ERR_BAD_DTYPE: return "unsupported dtype";
    case QMUON_ERR_BAD_BLOCK_SIZE: return "unsupported block_size";
    case QMUON_ERR_BAD_OP: return "malformed call (unknown op, or a required pointer is NULL)";
    default: return nullptr;
  }
}

}  // namespace qmuon
