// CUDA implementation of the quantized AdamW op (kernel: csrc/cuda/adamw_cuda.cu; compiled only when
// torch has CUDA). Device guard and current stream from torch; the kernel sees raw pointers.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "binding_adamw.h"

namespace qmuon {
namespace {

void adamw_q_update_cuda(const at::Tensor& grad, const at::Tensor& m_codes, const at::Tensor& m_scale,
                         const at::Tensor& v_codes, const at::Tensor& v_scale, const at::Tensor& update, double beta1,
                         double beta2, double eps, double neg_step_size, double bias_correction2_sqrt, int64_t m_kind,
                         int64_t v_kind, int64_t block_size, int64_t stream, int64_t index0,
                         const std::optional<at::Tensor>& skip) {
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor flags = skip_flags(skip, 1, grad.device(), "adamw_q_update_");
  const qmuon_adamw_q_args a = adamw_q_args(grad, m_codes, m_scale, v_codes, v_scale, update, beta1, beta2, eps,
                                            neg_step_size, bias_correction2_sqrt, m_kind, v_kind, block_size, stream,
                                            index0, flags);
  const int err = qmuon_cuda_adamw_q_update(&a, static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()));
  TORCH_CHECK(err == 0, "qmuon: CUDA kernel adamw_q_update_ failed: ", qmuon_cuda_error_string(err));
}

}  // namespace
}  // namespace qmuon

TORCH_LIBRARY_IMPL(qmuon_C, CUDA, m) { m.impl("adamw_q_update_", &qmuon::adamw_q_update_cuda); }
