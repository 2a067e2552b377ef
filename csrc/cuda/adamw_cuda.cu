// CUDA kernel of the quantized AdamW moment step (torch.ops.qmuon.adamw_q_update_). No torch headers.
// One thread block per row block of `block_size` elements: the threads decode m and v, update them
// and write the fp32 update, reduce the new block scales in shared memory, then re-encode.
// Maths: csrc/qmuon/adamw_math.h, the same per-element functions as the CPU kernel (bit-exact with
// ops/reference_adamw.py: __f*_rn arithmetic, no contraction; built with --fmad=false).
#include <cuda_runtime.h>

#include "qmuon/adamw_kernels.h"
#include "qmuon/adamw_math.h"
#include "qmuon/kernels.h"

namespace qmuon {
namespace {

constexpr int kThreads = 256;

template <typename G>
__global__ void adamw_q_kernel(qmuon_adamw_q_args a, AdamWConsts c, int64_t nb) {
  __shared__ float mb[kMaxBlockSize];
  __shared__ float vb[kMaxBlockSize];
  __shared__ uint32_t red_m[kThreads];
  __shared__ uint32_t red_v[kThreads];
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
    v = adamw_stored(v, a.v_kind);
    mb[j] = m;
    vb[j] = v;
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
  const float new_ms = bits_f32(red_m[0]), new_vs = bits_f32(red_v[0]);
  const float m_safe = new_ms > 0.0f ? new_ms : 1.0f, v_safe = new_vs > 0.0f ? new_vs : 1.0f;
  if (threadIdx.x == 0) {
    *ms = new_ms;
    *vs = new_vs;
  }
  uint8_t* mw = a.m_codes + row * a.m_rs;
  uint8_t* vw = a.v_codes + row * a.v_rs;
  if (!adamw_kind_4bit(a.m_kind)) {
    for (int64_t j = threadIdx.x; j < n; j += kThreads)
      mw[c0 + j] = static_cast<uint8_t>(adamw_code_bits(adamw_encode(mb[j], m_safe, a.m_kind), a.m_kind));
  } else {
    for (int64_t j = 2 * threadIdx.x; j < n; j += 2 * kThreads) {
      const uint32_t lo = adamw_code_bits(adamw_encode(mb[j], m_safe, a.m_kind), a.m_kind);
      const uint32_t hi = j + 1 < n ? adamw_code_bits(adamw_encode(mb[j + 1], m_safe, a.m_kind), a.m_kind) : 0u;
      mw[(c0 + j) >> 1] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
  if (!adamw_kind_4bit(a.v_kind)) {
    for (int64_t j = threadIdx.x; j < n; j += kThreads)
      vw[c0 + j] = static_cast<uint8_t>(adamw_code_bits(adamw_encode(vb[j], v_safe, a.v_kind), a.v_kind));
  } else {
    for (int64_t j = 2 * threadIdx.x; j < n; j += 2 * kThreads) {
      const uint32_t lo = adamw_code_bits(adamw_encode(vb[j], v_safe, a.v_kind), a.v_kind);
      const uint32_t hi = j + 1 < n ? adamw_code_bits(adamw_encode(vb[j + 1], v_safe, a.v_kind), a.v_kind) : 0u;
      vw[(c0 + j) >> 1] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
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
