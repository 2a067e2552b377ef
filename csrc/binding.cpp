// Registers the compiled kernels as the `qmuon_C` operator library (schemas below) with CPU
// implementations. qmuon_lightning/ops/_extension.py routes torch.ops.qmuon.* (declared in Python
// with torch.library.custom_op) to these ops with `register_kernel`. CUDA implementations are
// registered by binding_cuda.cpp, which is only compiled when torch has CUDA.
#include <torch/library.h>

#include <optional>
#include <string>

#include "binding_4bit.h"
#include "binding_common.h"

namespace qmuon {
namespace {

void check_cpu(int err, const char* what) {
  TORCH_CHECK(err == 0, "qmuon: CPU kernel ", what, " failed: ", cpu_error_string(err));
}

void q8_momentum_update_multi_cpu(at::TensorList codes, at::TensorList absmax, at::TensorList grads,
                                  at::TensorList block_sumsq, double beta, bool nesterov, int64_t block_size,
                                  at::IntArrayRef streams, at::IntArrayRef row_offsets,
                                  const std::optional<at::Tensor>& skip, bool compute_sumsq) {
  q8_momentum_update_multi_impl(
      codes, absmax, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets, skip, compute_sumsq,
      [](const std::vector<qmuon_q8_tensor>& ts, const qmuon_q8_params& p) {
        check_cpu(qmuon_cpu_q8_momentum_update(ts.data(), static_cast<int64_t>(ts.size()), p),
                  "q8_momentum_update_multi_");
      });
}

std::tuple<at::Tensor, at::Tensor> quantize_rows_cpu(const at::Tensor& x, int64_t block_size, bool is_signed,
                                                     int64_t stream, int64_t row_offset) {
  const int64_t s = stream < 0 ? -1 : static_cast<int64_t>(static_cast<uint32_t>(stream));
  return quantize_rows_impl(x, block_size, is_signed,
                            [&](const float* xp, int64_t x_rs, void* cp, int32_t cd, float* ap, int64_t rows,
                                int64_t cols) {
                              check_cpu(qmuon_cpu_quantize_rows(xp, x_rs, cp, cd, ap, rows, cols, block_size, s,
                                                                row_offset),
                                        "quantize_rows");
                            });
}

at::Tensor dequantize_rows_cpu(const at::Tensor& codes, const at::Tensor& absmax, int64_t block_size) {
  return dequantize_rows_impl(codes, absmax, block_size,
                              [&](const void* cp, int64_t c_rs, int32_t cd, const float* ap, int64_t a_rs, float* op,
                                  int64_t rows, int64_t cols) {
                                check_cpu(qmuon_cpu_dequantize_rows(cp, c_rs, cd, ap, a_rs, op, rows, cols,
                                                                    block_size),
                                          "dequantize_rows");
                              });
}

// Launchers of the 4-bit / dense ops (binding_4bit.h) on the CPU kernels (csrc/cpu/q4_cpu.cpp).
struct CpuBackend {
  static constexpr bool kNeedsScratch = false;
  static void int4(const std::vector<qmuon_q4_tensor>& ts, const qmuon_q4_params& p) {
    check_cpu(qmuon_cpu_int4_momentum_update(ts.data(), static_cast<int64_t>(ts.size()), p),
              "int4_momentum_update_multi_");
  }
  static void e0m3(const std::vector<qmuon_q4_tensor>& ts, const qmuon_q4_params& p) {
    check_cpu(qmuon_cpu_e0m3_momentum_update(ts.data(), static_cast<int64_t>(ts.size()), p),
              "e0m3 momentum update");
  }
  static void e0m3_amax(const std::vector<qmuon_q4_tensor>& ts, const qmuon_q4_params& p) {
    check_cpu(qmuon_cpu_e0m3_momentum_amax(ts.data(), static_cast<int64_t>(ts.size()), p),
              "e0m3_momentum_amax_multi");
  }
  static void dense(const std::vector<qmuon_dense_tensor>& ts, const qmuon_dense_params& p) {
    check_cpu(qmuon_cpu_dense_momentum_update(ts.data(), static_cast<int64_t>(ts.size()), p),
              "dense_momentum_update_multi_");
  }
  static void codec(const qmuon_codec_args& a) { check_cpu(qmuon_cpu_codec(&a), "4-bit codec"); }
};

std::string cpu_vector_isa() { return qmuon_cpu_vector_isa(); }

struct NoGuard {
  explicit NoGuard(c10::Device) {}
};

}  // namespace
}  // namespace qmuon

TORCH_LIBRARY(qmuon_C, m) {
  m.def(
      "q8_momentum_update_multi_(Tensor(a!)[] codes, Tensor(b!)[] absmax, Tensor(c!)[] grads, "
      "Tensor(d!)[] block_sumsq, float beta, bool nesterov, int block_size, int[] streams, int[] row_offsets, "
      "Tensor? skip=None, bool compute_sumsq=True) -> ()");
  m.def("quantize_rows(Tensor x, int block_size, bool signed, int stream, int row_offset) -> (Tensor, Tensor)");
  m.def("dequantize_rows(Tensor codes, Tensor absmax, int block_size) -> Tensor");
  // No tensor arguments, so one catch-all kernel: "avx512" or "portable" (see kernels.h).
  m.def("cpu_vector_isa() -> str", &qmuon::cpu_vector_isa);
  QMUON_4BIT_SCHEMAS(m);
}

TORCH_LIBRARY_IMPL(qmuon_C, CPU, m) {
  m.impl("q8_momentum_update_multi_", &qmuon::q8_momentum_update_multi_cpu);
  m.impl("quantize_rows", &qmuon::quantize_rows_cpu);
  m.impl("dequantize_rows", &qmuon::dequantize_rows_cpu);
  QMUON_4BIT_IMPLS(m, qmuon::CpuBackend, qmuon::NoGuard);
}
