// CUDA implementations of the qmuon_C ops (compiled only when torch has CUDA; see _extension.py):
// the device guard and current stream come from torch, the kernels (csrc/cuda/q8_cuda.cu) see only
// raw pointers and the cudaStream_t.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "binding_4bit.h"
#include "binding_common.h"

namespace qmuon {
namespace {

void check_cuda(int err, const char* what) {
  TORCH_CHECK(err == 0, "qmuon: CUDA kernel ", what, " failed: ", qmuon_cuda_error_string(err));
}

void* current_stream() { return static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()); }

void q8_momentum_update_multi_cuda(at::TensorList codes, at::TensorList absmax, at::TensorList grads,
                                   at::TensorList block_sumsq, double beta, bool nesterov, int64_t block_size,
                                   at::IntArrayRef streams, at::IntArrayRef row_offsets,
                                   const std::optional<at::Tensor>& skip, bool compute_sumsq) {
  std::optional<c10::cuda::CUDAGuard> guard;
  if (!codes.empty()) guard.emplace(codes[0].device());
  q8_momentum_update_multi_impl(
      codes, absmax, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets, skip, compute_sumsq,
      [](const std::vector<qmuon_q8_tensor>& ts, const qmuon_q8_params& p) {
        check_cuda(qmuon_cuda_q8_momentum_update(ts.data(), static_cast<int64_t>(ts.size()), p, current_stream()),
                   "q8_momentum_update_multi_");
      });
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_cuda(const at::Tensor& x, int64_t block_size, bool is_signed,
                                                      int64_t stream, int64_t row_offset) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t s = stream < 0 ? -1 : static_cast<int64_t>(static_cast<uint32_t>(stream));
  return quantize_rows_impl(x, block_size, is_signed,
                            [&](const float* xp, int64_t x_rs, void* cp, int32_t cd, float* ap, int64_t rows,
                                int64_t cols) {
                              check_cuda(qmuon_cuda_quantize_rows(xp, x_rs, cp, cd, ap, rows, cols, block_size, s,
                                                                  row_offset, current_stream()),
                                         "quantize_rows");
                            });
}

at::Tensor dequantize_rows_cuda(const at::Tensor& codes, const at::Tensor& absmax, int64_t block_size) {
  const c10::cuda::CUDAGuard guard(codes.device());
  return dequantize_rows_impl(codes, absmax, block_size,
                              [&](const void* cp, int64_t c_rs, int32_t cd, const float* ap, int64_t a_rs, float* op,
                                  int64_t rows, int64_t cols) {
                                check_cuda(qmuon_cuda_dequantize_rows(cp, c_rs, cd, ap, a_rs, op, rows, cols,
                                                                      block_size, current_stream()),
                                           "dequantize_rows");
                              });
}

// Launchers of the 4-bit / dense ops (binding_4bit.h) on the CUDA kernels (csrc/cuda/q4_cuda.cu).
struct CudaBackend {
  static constexpr bool kNeedsScratch = true;
  static void int4(const std::vector<qmuon_q4_tensor>& ts, const qmuon_q4_params& p) {
    check_cuda(qmuon_cuda_int4_momentum_update(ts.data(), static_cast<int64_t>(ts.size()), p, current_stream()),
               "int4_momentum_update_multi_");
  }
  static void e0m3(const std::vector<qmuon_q4_tensor>& ts, const qmuon_q4_params& p) {
    check_cuda(qmuon_cuda_e0m3_momentum_update(ts.data(), static_cast<int64_t>(ts.size()), p, current_stream()),
               "e0m3 momentum update");
  }
  static void e0m3_amax(const std::vector<qmuon_q4_tensor>& ts, const qmuon_q4_params& p) {
    check_cuda(qmuon_cuda_e0m3_momentum_amax(ts.data(), static_cast<int64_t>(ts.size()), p, current_stream()),
              "e0m3_momentum_amax_multi");
  }
  static void dense(const std::vector<qmuon_dense_tensor>& ts, const qmuon_dense_params& p) {
    check_cuda(qmuon_cuda_dense_momentum_update(ts.data(), static_cast<int64_t>(ts.size()), p, current_stream()),
               "dense_momentum_update_multi_");
  }
  static void codec(const qmuon_codec_args& a) { check_cuda(qmuon_cuda_codec(&a, current_stream()), "4-bit codec"); }
};

}  // namespace
}  // namespace qmuon

TORCH_LIBRARY_IMPL(qmuon_C, CUDA, m) {
  m.impl("q8_momentum_update_multi_", &qmuon::q8_momentum_update_multi_cuda);
  m.impl("quantize_rows", &qmuon::quantize_rows_cuda);
  m.impl("dequantize_rows", &qmuon::dequantize_rows_cuda);
  QMUON_4BIT_IMPLS(m, qmuon::CudaBackend, c10::cuda::CUDAGuard);
}
