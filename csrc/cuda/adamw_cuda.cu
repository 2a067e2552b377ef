// CUDA kernel of the quantized AdamW moment step (torch.ops.qmuon.adamw_q_update_). No torch headers.
// One thread block per row block of `block_size` elements: the threads decode m and v, update them
// and write the fp32 update, reduce the new block scales in shared memory, then re-encode.
// Maths: csrc/qmuon/adamw_math.h, the same per-element functions as the CPU kernel (bit-exact with
// ops/reference_adamw.py: __f*_rn arithmetic, no contraction; built with --fmad=false).
// A set `skip` flag (device memory, one per call) makes every thread leave first thing, before the shared
// memory and the barriers: nothing is written (moments, scales, update).
#include <cuda_runtime.h>

#include "qmuon/adamw_kernels.h"
#include "qmuon/adamw_math.h"
#include "qmuon/kernels.h"

namespace qmuon {
namespace {

constexpr int kThreads = 256;

// Code of element j of a block (moment x[j], block scale `scale`): nearest (stream < 0) or stochastic.
__device__ __forceinline__ uint32_t code_of(const float* x, int64_t j, float scale, float safe, int32_t kind,
                                            int64_t stream, uint32_t s, int64_t index0) {
  const float t = adamw_stored(x[j], kind);
  const float q = stream < 0 ? adamw_encode(t, safe, kind)
                             : adamw_encode_stochastic(t, x[j], scale, safe, kind,
                                                       uniform_noise(static_cast<uint64_t>(index0 + j), s));
  return adamw_code_bits(q, kind);
}

// Encode the block's n moments into the row of codes at column c0 (4-bit: a thread packs two).
__device__ __forceinline__ void encode_block(uint8_t* row, int64_t c0, int64_t n, const float* x, float scale,
                                             int32_t kind, int64_t stream, int64_t index0) {
  const float safe = scale > 0.0f ? scale : 1.0f;
  const uint32_t s = stream < 0 ? 0u : adamw_moment_stream(static_cast<uint32_t>(stream), kind);
  if (!adamw_kind_4bit(kind)) {
    for (int64_t j = threadIdx.x; j < n; j += kThreads)
      row[c0 + j] = static_cast<uint8_t>(code_of(x, j, scale, safe, kind, stream, s, index0));
  } else {
    for (int64_t j = 2 * threadIdx.x; j < n; j += 2 * kThreads) {
      const uint32_t lo = code_of(x, j, scale, safe, kind, stream, s, index0);
      const uint32_t hi = j + 1 < n ? code_of(x, j + 1, scale, safe, kind, stream, s, index0) : 0u;
      row[(c0 + j) >> 1] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

template <typename G>
__global__ void adamw_q_kernel(qmuon_adamw_q_args a, AdamWConsts c, int64_t nb) {
  __shared__ float mb[kMaxBlockSize];
  __shared__ float vb[kMaxBlockSize];
  __shared__ uint32_t red_m[kThreads];
  __shared__ uint32_t red_v[kThreads];
  if (skipped(a.skip)) return;  // the same flag for every thread of the grid: none waits at a barrier below
  const int64_t row = static_cast<int64_t>(blockIdx.x) / nb;
  const int64_t blk = static_cast<int64_t>(blockIdx.x) % nb;
  const int64_t c0 = blk * a.block_size;
  const int64_t n = (a.cols - c0) < a.block_size ? (a.cols - c0) : a.block_size;
  const auto* g = static_cast<const typename G::storage*>(a.grad) + row * a.grad_rs + c0;
  const uint8_t* mrow = a.m_codes + row * a.m_rs;
  const uint8_t* vrow = a.v_codes + row * a.v_rs;
  float* ms = a.m_scale + row * a.m_scale_rs + blk;
  float* vs = a.v_scale + row * a.v_scale_rs + blk;
  float* up = a.update + row * a.update_rs + c0;
  const float m_scale = *ms, v_scale = *vs;
  uint32_t m_max = 0, v_max = 0;
  for (int64_t j = threadIdx.x; j < n; j += kThreads) {
    float m = adamw_decode(adamw_load_code(mrow, c0 + j, a.m_kind), m_scale, a.m_kind);
    float v = adamw_decode(adamw_load_code(vrow, c0 + j, a.v_kind), v_scale, a.v_kind);
    up[j] = adamw_element(m, v, G::load(g[j]), c);
    mb[j] = m;
    vb[j] = v;  // the moment itself: the stochastic rounding weighs decoded moments
    m_max = max(m_max, abs_bits(m));
    v_max = max(v_max, abs_bits(v));
  }
  red_m[threadIdx.x] = m_max;
  red_v[threadIdx.x] = v_max;
  __syncthreads();  // every thread has read its codes (and the old scales) before anything is written
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      red_m[threadIdx.x] = max(red_m[threadIdx.x], red_m[threadIdx.x + s]);
      red_v[threadIdx.x] = max(red_v[threadIdx.x], red_v[threadIdx.x + s]);
    }
    __syncthreads();
  }
  // adamw_stored is monotone, so the stored quantity of the largest v is the block scale
  const float new_ms = bits_f32(red_m[0]), new_vs = adamw_stored(bits_f32(red_v[0]), a.v_kind);
  if (threadIdx.x == 0) {
    *ms = new_ms;
    *vs = new_vs;
  }
  const int64_t index0 = a.index0 + row * a.cols + c0;  // global index of the block's first element
  encode_block(a.m_codes + row * a.m_rs, c0, n, mb, new_ms, a.m_kind, a.stream, index0);
  encode_block(a.v_codes + row * a.v_rs, c0, n, vb, new_vs, a.v_kind, a.stream, index0);
}

template <typename G>
int launch(const qmuon_adamw_q_args& a, cudaStream_t stream) {
  const AdamWConsts c = make_adamw_consts(a.beta1, a.beta2, a.eps, a.neg_step_size, a.bias_correction2_sqrt);
  const int64_t nb = (a.cols + a.block_size - 1) / a.block_size;
  const int64_t blocks = a.rows * nb;
  if (blocks > 0x7FFFFFFFLL) return QMUON_ERR_BAD_OP;
  adamw_q_kernel<G><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a, c, nb);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace
}  // namespace qmuon

extern "C" int qmuon_cuda_adamw_q_update(const qmuon_adamw_q_args* args, void* cuda_stream) {
  using namespace qmuon;
  const qmuon_adamw_q_args& a = *args;
  if (a.block_size < 2 || a.block_size > kMaxBlockSize || (a.block_size & 1)) return QMUON_ERR_BAD_BLOCK_SIZE;
  if ((a.m_kind != kAdamM8 && a.m_kind != kAdamM4) || (a.v_kind != kAdamV8 && a.v_kind != kAdamV4))
    return QMUON_ERR_BAD_OP;
  if (a.rows <= 0 || a.cols <= 0) return 0;
  cudaStream_t s = static_cast<cudaStream_t>(cuda_stream);
  switch (a.grad_dtype) {
    case QMUON_FLOAT32: return launch<F32>(a, s);
    case QMUON_BFLOAT16: return launch<BF16>(a, s);
    case QMUON_FLOAT16: return launch<F16>(a, s);
    default: return QMUON_ERR_BAD_DTYPE;
  }
}
