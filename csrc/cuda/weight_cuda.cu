// CUDA kernel of the bf16 weight writes (nearest, stochastic, 8-bit error-corrected): one thread per
// element, the per-element maths of qmuon/weight_math.h (shared with the CPU kernel and equal to
// ops/reference_weight.py bit for bit). No torch headers: raw pointers and a cudaStream_t.
#include <cuda_runtime.h>

#include <stdint.h>

#include "qmuon/block_math.h"
#include "qmuon/kernels.h"
#include "qmuon/weight_kernels.h"
#include "qmuon/weight_math.h"

namespace qmuon {
namespace {

constexpr int kThreads = 256;

template <typename U>
__global__ void weight_update_kernel(qmuon_weight_args a) {
  using S = typename U::storage;
  const int64_t n = a.rows * a.cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.cols, c = i - r * a.cols;
    uint16_t* w = a.param + r * a.param_rs + c;
    const float u = U::load(static_cast<const S*>(a.update)[r * a.update_rs + c]);
    if (a.ecc != nullptr) {
      bf16_ecc8_element(w, a.ecc + r * a.ecc_rs + c, u, a.alpha, a.decay);
    } else {
      const uint64_t index = static_cast<uint64_t>(a.index0 + r * a.index_rs + c);
      *w = bf16_weight_element(*w, u, a.alpha, a.decay, a.stream, index);
    }
  }
}

template <typename U>
int launch(const qmuon_weight_args& a, cudaStream_t stream) {
  const int64_t n = a.rows * a.cols;
  if (n == 0) return 0;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const unsigned grid = static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
  weight_update_kernel<U><<<grid, kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace
}  // namespace qmuon

extern "C" int qmuon_cuda_bf16_weight_update(const qmuon_weight_args* args, void* cuda_stream) {
  using namespace qmuon;
  cudaStream_t s = static_cast<cudaStream_t>(cuda_stream);
  switch (args->update_dtype) {
    case QMUON_FLOAT32: return launch<F32>(*args, s);
    case QMUON_BFLOAT16: return launch<BF16>(*args, s);
    case QMUON_FLOAT16: return launch<F16>(*args, s);
    default: return QMUON_ERR_BAD_DTYPE;
  }
}
