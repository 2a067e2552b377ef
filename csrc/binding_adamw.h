// Device-independent half of the quantized AdamW op's binding: argument checks and the call of the C
// ABI (qmuon/adamw_kernels.h). binding_adamw.cpp instantiates it for CPU, binding_adamw_cuda.cpp for CUDA.
#pragma once

#include "binding_common.h"
#include "qmuon/adamw_kernels.h"
#include "qmuon/adamw_math.h"

#define QMUON_ADAMW_SCHEMAS(m)                                                                                  \
  m.def(                                                                                                      \
      "adamw_q_update_(Tensor grad, Tensor(a!) m_codes, Tensor(b!) m_scale, Tensor(c!) v_codes, "              \
      "Tensor(d!) v_scale, Tensor(e!) update, float beta1, float beta2, float eps, float neg_step_size, "      \
      "float bias_correction2_sqrt, int m_kind, int v_kind, int block_size, int stream, int index0, "          \
      "Tensor? skip=None) -> ()")

namespace qmuon {

inline int64_t adamw_code_cols(int64_t kind, int64_t cols) { return adamw_kind_4bit(static_cast<int32_t>(kind)) ? (cols + 1) / 2 : cols; }

inline int64_t row_stride_of(const at::Tensor& t) { return t.size(0) <= 1 ? t.size(1) : t.stride(0); }

// Checks the arguments and fills the C ABI struct; every tensor must already be in the kernel layout.
// `flags`: skip_flags() of the call (undefined: none), kept alive by the caller until the kernel has run.
inline qmuon_adamw_q_args adamw_q_args(const at::Tensor& grad, const at::Tensor& m_codes, const at::Tensor& m_scale,
                                       const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& update,
                                       double beta1, double beta2, double eps, double neg_step_size,
                                       double bias_correction2_sqrt, int64_t m_kind, int64_t v_kind,
                                       int64_t block_size, int64_t stream, int64_t index0, const at::Tensor& flags) {
  TORCH_CHECK(block_size >= 2 && block_size <= kMaxBlockSize && block_size % 2 == 0,
              "qmuon: adamw_q_update_: block_size must be even in [2, ", kMaxBlockSize, "], got ", block_size);
  TORCH_CHECK((m_kind == kAdamM8 || m_kind == kAdamM4) && (v_kind == kAdamV8 || v_kind == kAdamV4),
              "qmuon: adamw_q_update_: bad moment kinds ", m_kind, ", ", v_kind);
  TORCH_CHECK(grad.dim() == 2, "qmuon: adamw_q_update_: grad must be 2-D");
  TORCH_CHECK(stream < (int64_t{1} << 32), "qmuon: adamw_q_update_: stream must be < 2^32 (or < 0: nearest), got ", stream);
  TORCH_CHECK(index0 >= 0, "qmuon: adamw_q_update_: index0 must be >= 0, got ", index0);
  const int64_t rows = grad.size(0), cols = grad.size(1), nb = num_blocks(cols, block_size);
  const int32_t gd = to_qmuon_dtype(grad.scalar_type());
  TORCH_CHECK(gd == QMUON_FLOAT32 || gd == QMUON_BFLOAT16 || gd == QMUON_FLOAT16,
              "qmuon: adamw_q_update_: grad must be fp32 / bf16 / fp16, got ", grad.scalar_type());
  TORCH_CHECK(m_codes.scalar_type() == (m_kind == kAdamM8 ? c10::kChar : c10::kByte) &&
                  v_codes.scalar_type() == c10::kByte,
              "qmuon: adamw_q_update_: code dtypes do not match the kinds");
  TORCH_CHECK(m_codes.dim() == 2 && m_codes.size(0) == rows && m_codes.size(1) == adamw_code_cols(m_kind, cols),
              "qmuon: adamw_q_update_: m_codes has the wrong shape");
  TORCH_CHECK(v_codes.dim() == 2 && v_codes.size(0) == rows && v_codes.size(1) == adamw_code_cols(v_kind, cols),
              "qmuon: adamw_q_update_: v_codes has the wrong shape");
  for (const at::Tensor* s : {&m_scale, &v_scale})
    TORCH_CHECK(s->scalar_type() == c10::kFloat && s->dim() == 2 && s->size(0) == rows && s->size(1) == nb,
                "qmuon: adamw_q_update_: scales must be fp32 (rows, ceil(cols / block_size))");
  TORCH_CHECK(update.scalar_type() == c10::kFloat && update.dim() == 2 && update.size(0) == rows &&
                  update.size(1) == cols,
              "qmuon: adamw_q_update_: update must be fp32 (rows, cols)");
  for (const at::Tensor* t : {&grad, &m_codes, &m_scale, &v_codes, &v_scale, &update})
    TORCH_CHECK(kernel_layout_ok(*t) && t->device() == grad.device(),
                "qmuon: adamw_q_update_: every tensor must be row-major with unit column stride, on one device");
  qmuon_adamw_q_args a{};
  a.grad = grad.data_ptr();
  a.grad_rs = row_stride_of(grad);
  a.grad_dtype = gd;
  a.m_kind = static_cast<int32_t>(m_kind);
  a.v_kind = static_cast<int32_t>(v_kind);
  a.m_codes = static_cast<uint8_t*>(m_codes.data_ptr());
  a.m_rs = row_stride_of(m_codes);
  a.m_scale = m_scale.data_ptr<float>();
  a.m_scale_rs = row_stride_of(m_scale);
  a.v_codes = static_cast<uint8_t*>(v_codes.data_ptr());
  a.v_rs = row_stride_of(v_codes);
  a.v_scale = v_scale.data_ptr<float>();
  a.v_scale_rs = row_stride_of(v_scale);
  a.update = update.data_ptr<float>();
  a.update_rs = row_stride_of(update);
  a.rows = rows;
  a.cols = cols;
  a.block_size = block_size;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.neg_step_size = neg_step_size;
  a.bias_correction2_sqrt = bias_correction2_sqrt;
  a.stream = stream;
  a.index0 = index0;
  a.skip = skip_ptr(flags, 0);
  return a;
}

}  // namespace qmuon
