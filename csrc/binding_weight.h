// Device-independent half of the weight-write binding (bf16 and fp32 weights): argument checks and the kernel arguments
// (binding_weight.cpp instantiates it with the CPU kernel, binding_weight_cuda.cpp with the CUDA one).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "binding_common.h"
#include "qmuon/weight_kernels.h"

namespace qmuon {

inline void check_weight_matrix(const at::Tensor& t, const at::Tensor& param, const char* name, const char* op) {
  TORCH_CHECK(t.dim() == 2 && t.sizes() == param.sizes(), "qmuon: ", op, " ", name, " must have the param's shape ",
              param.sizes(), ", got ", t.sizes());
  TORCH_CHECK(t.device() == param.device(), "qmuon: ", op, " ", name, " is on ", t.device(), ", param on ",
              param.device());
  TORCH_CHECK(kernel_layout_ok(t), "qmuon: ", op, " ", name, " must have unit column stride");
}

inline int64_t row_stride_of(const at::Tensor& t) { return t.size(0) <= 1 ? t.size(1) : t.stride(0); }

// `ecc`: undefined for the nearest / stochastic op. `flags`: skip_flags() of the call (undefined: none), kept
// alive by the caller until the kernel has run.
inline qmuon_weight_args weight_args(const at::Tensor& param, const at::Tensor* ecc, const at::Tensor& update,
                                     double alpha, double decay, int64_t stream, int64_t index0, int64_t index_rs,
                                     const char* op, const at::Tensor& flags) {
  TORCH_CHECK(param.scalar_type() == c10::kBFloat16, "qmuon: ", op, " param must be bf16, got ", param.scalar_type());
  check_weight_matrix(param, param, "param", op);
  check_weight_matrix(update, param, "update", op);
  const int32_t ud = to_qmuon_dtype(update.scalar_type());
  TORCH_CHECK(ud == QMUON_FLOAT32 || ud == QMUON_BFLOAT16 || ud == QMUON_FLOAT16, "qmuon: ", op,
              " update must be fp32, bf16 or fp16, got ", update.scalar_type());
  qmuon_weight_args a{};
  a.param = static_cast<uint16_t*>(param.data_ptr());
  a.update = update.data_ptr();
  a.update_dtype = ud;
  a.rows = param.size(0);
  a.cols = param.size(1);
  a.param_rs = row_stride_of(param);
  a.update_rs = row_stride_of(update);
  if (ecc != nullptr) {
    TORCH_CHECK(ecc->scalar_type() == c10::kChar, "qmuon: ", op, " ecc must be int8, got ", ecc->scalar_type());
    check_weight_matrix(*ecc, param, "ecc", op);
    a.ecc = static_cast<int8_t*>(ecc->data_ptr());
    a.ecc_rs = row_stride_of(*ecc);
  }
  a.alpha = static_cast<float>(alpha);
  a.decay = static_cast<float>(decay);
  a.stream = stream < 0 ? -1 : static_cast<int64_t>(static_cast<uint32_t>(stream));
  a.index0 = index0;
  a.index_rs = index_rs;
  a.skip = skip_ptr(flags, 0);
  return a;
}

// The fp32 write: param fp32 with unit column stride; update fp32 / bf16 / fp16 with any strides.
inline qmuon_fp32_weight_args fp32_weight_args(const at::Tensor& param, const at::Tensor& update, double alpha,
                                               double decay, const at::Tensor& flags) {
  const char* op = "fp32_weight_update_";
  TORCH_CHECK(param.scalar_type() == c10::kFloat, "qmuon: ", op, " param must be fp32, got ", param.scalar_type());
  check_weight_matrix(param, param, "param", op);
  TORCH_CHECK(update.dim() == 2 && update.sizes() == param.sizes(), "qmuon: ", op,
              " update must have the param's shape ", param.sizes(), ", got ", update.sizes());
  TORCH_CHECK(update.device() == param.device(), "qmuon: ", op, " update is on ", update.device(), ", param on ",
              param.device());
  TORCH_CHECK(update.stride(0) >= 0 && update.stride(1) >= 0, "qmuon: ", op, " update has a negative stride");
  const int32_t ud = to_qmuon_dtype(update.scalar_type());
  TORCH_CHECK(ud == QMUON_FLOAT32 || ud == QMUON_BFLOAT16 || ud == QMUON_FLOAT16, "qmuon: ", op,
              " update must be fp32, bf16 or fp16, got ", update.scalar_type());
  qmuon_fp32_weight_args a{};
  a.param = param.data_ptr<float>();
  a.update = update.data_ptr();
  a.update_dtype = ud;
  a.rows = param.size(0);
  a.cols = param.size(1);
  a.param_rs = row_stride_of(param);
  a.update_rs = update.stride(0);
  a.update_cs = update.stride(1);
  a.alpha = static_cast<float>(alpha);
  a.decay = static_cast<float>(decay);
  a.skip = skip_ptr(flags, 0);
  return a;
}

}  // namespace qmuon

#define QMUON_WEIGHT_SCHEMAS(m)                                                                                  \
  m.def("bf16_weight_update_(Tensor(a!) param, Tensor update, float alpha, float decay, int stream, int index0, " \
        "int index_row_stride, Tensor? skip=None) -> ()");                                                       \
  m.def("bf16_ecc8_weight_update_(Tensor(a!) param, Tensor(b!) ecc, Tensor update, float alpha, float decay, "   \
        "Tensor? skip=None) -> ()");                                                                             \
  m.def("fp32_weight_update_(Tensor(a!) param, Tensor update, float alpha, float decay, Tensor? skip=None) -> ()")
