// CUDA kernels of the weight writes: bf16 (nearest, stochastic, 8-bit error-corrected), one thread per
// element, and fp32 (below); the per-element maths of qmuon/weight_math.h (shared with the CPU kernel
// and equal to ops/reference_weight.py bit for bit). No torch headers: raw pointers and a cudaStream_t.
// A set `skip` flag (device memory, one per call) makes every thread leave first thing, before any other
// load, store or barrier: the weights (and error codes) are not written.
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
  if (skipped(a.skip)) return;
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

// fp32 weights: param <- fma(update, alpha, fp32(param * decay)) (weight_math.h, fp32_weight_element).
// Row-major update: one thread per element. Column-major update (unit row stride, a transposed
// Newton-Schulz output): 32 x 32 tiles staged through shared memory, so both the update's reads
// (along its columns) and the weights' reads and writes (along rows) are coalesced.
template <typename U>
__global__ void fp32_weight_kernel(qmuon_fp32_weight_args a) {
  using S = typename U::storage;
  if (skipped(a.skip)) return;
  const int64_t n = a.rows * a.cols;
  const S* u = static_cast<const S*>(a.update);
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / a.cols, c = i - r * a.cols;
    float* w = a.param + r * a.param_rs + c;
    *w = fp32_weight_element(*w, U::load(u[r * a.update_rs + c * a.update_cs]), a.alpha, a.decay);
  }
}

constexpr int kTile = 32;
constexpr int kTileRows = 8;  // threads per block: kTile x kTileRows

template <typename U>
__global__ void fp32_weight_transposed_kernel(qmuon_fp32_weight_args a) {
  using S = typename U::storage;
  __shared__ float tile[kTile][kTile + 1];  // +1: no bank conflicts on the transposed read
  if (skipped(a.skip)) return;  // the same flag for every thread of the grid: none waits at the barrier below
  const S* u = static_cast<const S*>(a.update);
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTile, c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  // load: threadIdx.x walks rows (the update's unit stride)
  for (int j = threadIdx.y; j < kTile; j += kTileRows) {
    const int64_t r = r0 + threadIdx.x, c = c0 + j;
    if (r < a.rows && c < a.cols) tile[j][threadIdx.x] = U::load(u[r + c * a.update_cs]);
  }
  __syncthreads();
  // write: threadIdx.x walks columns (the weights' unit stride)
  for (int i = threadIdx.y; i < kTile; i += kTileRows) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < a.rows && c < a.cols) {
      float* w = a.param + r * a.param_rs + c;
      *w = fp32_weight_element(*w, tile[threadIdx.x][i], a.alpha, a.decay);
    }
  }
}

template <typename U>
int launch_fp32(const qmuon_fp32_weight_args& a, cudaStream_t stream) {
  const int64_t n = a.rows * a.cols;
  if (n == 0) return 0;
  const bool col_major = a.cols > 1 && a.update_cs != 1 && (a.rows <= 1 || a.update_rs == 1);
  const int64_t tiles_r = (a.rows + kTile - 1) / kTile, tiles_c = (a.cols + kTile - 1) / kTile;
  if (col_major && tiles_r <= 65535) {
    const dim3 grid(static_cast<unsigned>(tiles_c), static_cast<unsigned>(tiles_r));
    fp32_weight_transposed_kernel<U><<<grid, dim3(kTile, kTileRows), 0, stream>>>(a);
  } else {
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    const unsigned grid = static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
    fp32_weight_kernel<U><<<grid, kThreads, 0, stream>>>(a);
  }
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

extern "C" int qmuon_cuda_fp32_weight_update(const qmuon_fp32_weight_args* args, void* cuda_stream) {
  using namespace qmuon;
  cudaStream_t s = static_cast<cudaStream_t>(cuda_stream);
  switch (args->update_dtype) {
    case QMUON_FLOAT32: return launch_fp32<F32>(*args, s);
    case QMUON_BFLOAT16: return launch_fp32<BF16>(*args, s);
    case QMUON_FLOAT16: return launch_fp32<F16>(*args, s);
    default: return QMUON_ERR_BAD_DTYPE;
  }
}
