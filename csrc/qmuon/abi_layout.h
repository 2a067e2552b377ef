// The layout of the C ABI's structs as this compiler lays them out: per struct (in the order of
// qmuon/ops/_cabi.py's STRUCTS) its size, then the offset of every field in declaration order. A
// library exports it (qmuon_cpu_abi_layout in csrc/cpu/q8_cpu.cpp, qmuon_cuda_abi_layout in
// csrc/cuda/lib_info.cu) and the Python caller, which fills the structs through ctypes, refuses a
// library whose list differs from its own (a header changed without the ctypes mirror, or the reverse).
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "qmuon/adamw_kernels.h"
#include "qmuon/kernels.h"
#include "qmuon/weight_kernels.h"

namespace qmuon {

#define QMUON_SIZE(s) static_cast<int64_t>(sizeof(s))
#define QMUON_OFF(s, f) static_cast<int64_t>(offsetof(s, f))

// Writes up to `capacity` entries to `out` (may be NULL) and returns how many there are.
inline int64_t abi_layout(int64_t* out, int64_t capacity) {
  static const int64_t kLayout[] = {
      QMUON_SIZE(qmuon_q8_tensor),
      QMUON_OFF(qmuon_q8_tensor, codes), QMUON_OFF(qmuon_q8_tensor, absmax), QMUON_OFF(qmuon_q8_tensor, grad),
      QMUON_OFF(qmuon_q8_tensor, sumsq), QMUON_OFF(qmuon_q8_tensor, rows), QMUON_OFF(qmuon_q8_tensor, cols),
      QMUON_OFF(qmuon_q8_tensor, codes_rs), QMUON_OFF(qmuon_q8_tensor, absmax_rs),
      QMUON_OFF(qmuon_q8_tensor, grad_rs), QMUON_OFF(qmuon_q8_tensor, row_offset),
      QMUON_OFF(qmuon_q8_tensor, stream), QMUON_OFF(qmuon_q8_tensor, skip),
      QMUON_SIZE(qmuon_q8_params),
      QMUON_OFF(qmuon_q8_params, beta), QMUON_OFF(qmuon_q8_params, nesterov),
      QMUON_OFF(qmuon_q8_params, code_dtype), QMUON_OFF(qmuon_q8_params, grad_dtype),
      QMUON_OFF(qmuon_q8_params, block_size),
      QMUON_SIZE(qmuon_q4_tensor),
      QMUON_OFF(qmuon_q4_tensor, packed), QMUON_OFF(qmuon_q4_tensor, scales),
      QMUON_OFF(qmuon_q4_tensor, tensor_scale), QMUON_OFF(qmuon_q4_tensor, grad), QMUON_OFF(qmuon_q4_tensor, sumsq),
      QMUON_OFF(qmuon_q4_tensor, scratch), QMUON_OFF(qmuon_q4_tensor, new_tensor_scale),
      QMUON_OFF(qmuon_q4_tensor, amax_out), QMUON_OFF(qmuon_q4_tensor, rows), QMUON_OFF(qmuon_q4_tensor, cols),
      QMUON_OFF(qmuon_q4_tensor, packed_rs), QMUON_OFF(qmuon_q4_tensor, scales_rs),
      QMUON_OFF(qmuon_q4_tensor, grad_rs), QMUON_OFF(qmuon_q4_tensor, row_offset),
      QMUON_OFF(qmuon_q4_tensor, stream), QMUON_OFF(qmuon_q4_tensor, skip),
      QMUON_SIZE(qmuon_q4_params),
      QMUON_OFF(qmuon_q4_params, beta), QMUON_OFF(qmuon_q4_params, nesterov),
      QMUON_OFF(qmuon_q4_params, grad_dtype), QMUON_OFF(qmuon_q4_params, block_size),
      QMUON_SIZE(qmuon_dense_tensor),
      QMUON_OFF(qmuon_dense_tensor, buf), QMUON_OFF(qmuon_dense_tensor, grad), QMUON_OFF(qmuon_dense_tensor, sumsq),
      QMUON_OFF(qmuon_dense_tensor, rows), QMUON_OFF(qmuon_dense_tensor, cols),
      QMUON_OFF(qmuon_dense_tensor, buf_rs), QMUON_OFF(qmuon_dense_tensor, grad_rs),
      QMUON_OFF(qmuon_dense_tensor, row_offset), QMUON_OFF(qmuon_dense_tensor, stream),
      QMUON_OFF(qmuon_dense_tensor, skip),
      QMUON_SIZE(qmuon_dense_params),
      QMUON_OFF(qmuon_dense_params, beta), QMUON_OFF(qmuon_dense_params, nesterov),
      QMUON_OFF(qmuon_dense_params, buf_dtype), QMUON_OFF(qmuon_dense_params, grad_dtype),
      QMUON_OFF(qmuon_dense_params, block_size),
      QMUON_SIZE(qmuon_codec_args),
      QMUON_OFF(qmuon_codec_args, op), QMUON_OFF(qmuon_codec_args, flag), QMUON_OFF(qmuon_codec_args, in0),
      QMUON_OFF(qmuon_codec_args, in1), QMUON_OFF(qmuon_codec_args, in2), QMUON_OFF(qmuon_codec_args, in3),
      QMUON_OFF(qmuon_codec_args, out0), QMUON_OFF(qmuon_codec_args, out1), QMUON_OFF(qmuon_codec_args, out2),
      QMUON_OFF(qmuon_codec_args, out3), QMUON_OFF(qmuon_codec_args, scratch), QMUON_OFF(qmuon_codec_args, rows),
      QMUON_OFF(qmuon_codec_args, cols), QMUON_OFF(qmuon_codec_args, block_size),
      QMUON_OFF(qmuon_codec_args, stream), QMUON_OFF(qmuon_codec_args, row_offset),
      QMUON_SIZE(qmuon_adamw_q_args),
      QMUON_OFF(qmuon_adamw_q_args, grad), QMUON_OFF(qmuon_adamw_q_args, grad_rs),
      QMUON_OFF(qmuon_adamw_q_args, grad_dtype), QMUON_OFF(qmuon_adamw_q_args, m_kind),
      QMUON_OFF(qmuon_adamw_q_args, v_kind), QMUON_OFF(qmuon_adamw_q_args, pad_),
      QMUON_OFF(qmuon_adamw_q_args, m_codes), QMUON_OFF(qmuon_adamw_q_args, m_rs),
      QMUON_OFF(qmuon_adamw_q_args, m_scale), QMUON_OFF(qmuon_adamw_q_args, m_scale_rs),
      QMUON_OFF(qmuon_adamw_q_args, v_codes), QMUON_OFF(qmuon_adamw_q_args, v_rs),
      QMUON_OFF(qmuon_adamw_q_args, v_scale), QMUON_OFF(qmuon_adamw_q_args, v_scale_rs),
      QMUON_OFF(qmuon_adamw_q_args, update), QMUON_OFF(qmuon_adamw_q_args, update_rs),
      QMUON_OFF(qmuon_adamw_q_args, rows), QMUON_OFF(qmuon_adamw_q_args, cols),
      QMUON_OFF(qmuon_adamw_q_args, block_size), QMUON_OFF(qmuon_adamw_q_args, beta1),
      QMUON_OFF(qmuon_adamw_q_args, beta2), QMUON_OFF(qmuon_adamw_q_args, eps),
      QMUON_OFF(qmuon_adamw_q_args, neg_step_size), QMUON_OFF(qmuon_adamw_q_args, bias_correction2_sqrt),
      QMUON_OFF(qmuon_adamw_q_args, stream), QMUON_OFF(qmuon_adamw_q_args, index0),
      QMUON_OFF(qmuon_adamw_q_args, skip),
      QMUON_SIZE(qmuon_weight_args),
      QMUON_OFF(qmuon_weight_args, param), QMUON_OFF(qmuon_weight_args, ecc), QMUON_OFF(qmuon_weight_args, update),
      QMUON_OFF(qmuon_weight_args, update_dtype), QMUON_OFF(qmuon_weight_args, rows),
      QMUON_OFF(qmuon_weight_args, cols), QMUON_OFF(qmuon_weight_args, param_rs),
      QMUON_OFF(qmuon_weight_args, ecc_rs), QMUON_OFF(qmuon_weight_args, update_rs),
      QMUON_OFF(qmuon_weight_args, alpha), QMUON_OFF(qmuon_weight_args, decay),
      QMUON_OFF(qmuon_weight_args, stream), QMUON_OFF(qmuon_weight_args, index0),
      QMUON_OFF(qmuon_weight_args, index_rs), QMUON_OFF(qmuon_weight_args, skip),
      QMUON_SIZE(qmuon_fp32_weight_args),
      QMUON_OFF(qmuon_fp32_weight_args, param), QMUON_OFF(qmuon_fp32_weight_args, update),
      QMUON_OFF(qmuon_fp32_weight_args, update_dtype), QMUON_OFF(qmuon_fp32_weight_args, rows),
      QMUON_OFF(qmuon_fp32_weight_args, cols), QMUON_OFF(qmuon_fp32_weight_args, param_rs),
      QMUON_OFF(qmuon_fp32_weight_args, update_rs), QMUON_OFF(qmuon_fp32_weight_args, update_cs),
      QMUON_OFF(qmuon_fp32_weight_args, alpha), QMUON_OFF(qmuon_fp32_weight_args, decay),
      QMUON_OFF(qmuon_fp32_weight_args, skip),
  };
  const int64_t n = static_cast<int64_t>(sizeof(kLayout) / sizeof(kLayout[0]));
  for (int64_t i = 0; out != nullptr && i < n && i < capacity; ++i) out[i] = kLayout[i];
  return n;
}

#undef QMUON_SIZE
#undef QMUON_OFF

}  // namespace qmuon
