// The weight-write ops (bf16 and fp32 weights) of the qmuon_C library (schemas and CPU implementations); the CUDA ones
// are in binding_weight_cuda.cpp. A library fragment, so binding.cpp stays as it is.
#include <torch/library.h>

#include "binding_weight.h"

namespace qmuon {
namespace {

void run_cpu(const qmuon_weight_args& a, const char* op) {
  TORCH_CHECK(qmuon_cpu_bf16_weight_update(&a) == 0, "qmuon: CPU kernel ", op, " failed: unsupported dtype");
}

void bf16_weight_update_cpu(const at::Tensor& param, const at::Tensor& update, double alpha, double decay,
                            int64_t stream, int64_t index0, int64_t index_rs, const std::optional<at::Tensor>& skip) {
  const char* op = "bf16_weight_update_";
  const at::Tensor flags = skip_flags(skip, 1, param.device(), op);
  run_cpu(weight_args(param, nullptr, update, alpha, decay, stream, index0, index_rs, op, flags), op);
}

void bf16_ecc8_weight_update_cpu(const at::Tensor& param, const at::Tensor& ecc, const at::Tensor& update,
                                 double alpha, double decay, const std::optional<at::Tensor>& skip) {
  const char* op = "bf16_ecc8_weight_update_";
  const at::Tensor flags = skip_flags(skip, 1, param.device(), op);
  run_cpu(weight_args(param, &ecc, update, alpha, decay, -1, 0, 0, op, flags), op);
}

void fp32_weight_update_cpu(const at::Tensor& param, const at::Tensor& update, double alpha, double decay,
                            const std::optional<at::Tensor>& skip) {
  const at::Tensor flags = skip_flags(skip, 1, param.device(), "fp32_weight_update_");
  const qmuon_fp32_weight_args a = fp32_weight_args(param, update, alpha, decay, flags);
  TORCH_CHECK(qmuon_cpu_fp32_weight_update(&a) == 0, "qmuon: CPU kernel fp32_weight_update_ failed: unsupported dtype");
}

}  // namespace
}  // namespace qmuon

TORCH_LIBRARY_FRAGMENT(qmuon_C, m) { QMUON_WEIGHT_SCHEMAS(m); }

TORCH_LIBRARY_IMPL(qmuon_C, CPU, m) {
  m.impl("bf16_weight_update_", &qmuon::bf16_weight_update_cpu);
  m.impl("bf16_ecc8_weight_update_", &qmuon::bf16_ecc8_weight_update_cpu);
  m.impl("fp32_weight_update_", &qmuon::fp32_weight_update_cpu);
}
