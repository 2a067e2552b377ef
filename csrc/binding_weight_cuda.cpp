// CUDA implementations of the weight-write ops (bf16 and fp32 weights) (compiled only when torch has CUDA): the device
// guard and current stream come from torch, the kernel (csrc/cuda/weight_cuda.cu) sees raw pointers.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "binding_weight.h"

namespace qmuon {
namespace {

void run_cuda(const qmuon_weight_args& a, const char* op) {
  const int err = qmuon_cuda_bf16_weight_update(&a, static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()));
  TORCH_CHECK(err == 0, "qmuon: CUDA kernel ", op, " failed: ", qmuon_cuda_error_string(err));
}

void bf16_weight_update_cuda(const at::Tensor& param, const at::Tensor& update, double alpha, double decay,
                             int64_t stream, int64_t index0, int64_t index_rs, const std::optional<at::Tensor>& skip) {
  const c10::cuda::CUDAGuard guard(param.device());
  const char* op = "bf16_weight_update_";
  const at::Tensor flags = skip_flags(skip, 1, param.device(), op);
  run_cuda(weight_args(param, nullptr, update, alpha, decay, stream, index0, index_rs, op, flags), op);
}

void bf16_ecc8_weight_update_cuda(const at::Tensor& param, const at::Tensor& ecc, const at::Tensor& update,
                                  double alpha, double decay, const std::optional<at::Tensor>& skip) {
  const c10::cuda::CUDAGuard guard(param.device());
  const char* op = "bf16_ecc8_weight_update_";
  const at::Tensor flags = skip_flags(skip, 1, param.device(), op);
  run_cuda(weight_args(param, &ecc, update, alpha, decay, -1, 0, 0, op, flags), op);
}

void fp32_weight_update_cuda(const at::Tensor& param, const at::Tensor& update, double alpha, double decay,
                             const std::optional<at::Tensor>& skip) {
  const c10::cuda::CUDAGuard guard(param.device());
  const at::Tensor flags = skip_flags(skip, 1, param.device(), "fp32_weight_update_");
  const qmuon_fp32_weight_args a = fp32_weight_args(param, update, alpha, decay, flags);
  const int err = qmuon_cuda_fp32_weight_update(&a, static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()));
  TORCH_CHECK(err == 0, "qmuon: CUDA kernel fp32_weight_update_ failed: ", qmuon_cuda_error_string(err));
}

}  // namespace
}  // namespace qmuon

TORCH_LIBRARY_IMPL(qmuon_C, CUDA, m) {
  m.impl("bf16_weight_update_", &qmuon::bf16_weight_update_cuda);
  m.impl("bf16_ecc8_weight_update_", &qmuon::bf16_ecc8_weight_update_cuda);
  m.impl("fp32_weight_update_", &qmuon::fp32_weight_update_cuda);
}
