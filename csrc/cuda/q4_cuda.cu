// CUDA kernels of the 4-bit (int4, e0m3, grid) and dense-format (fp32 / bf16) momentum ops. No torch
// headers: raw pointers and a cudaStream_t through the C ABI in qmuon/kernels.h (called by
// csrc/binding_cuda.cpp via binding_4bit.h). All fp32 maths comes from qmuon/block_math_4bit.h
// (__fmul_rn & co., __fmaf_rn for the dense lerp; built with --fmad=false), so results equal the
// reference bit for bit; sums of squares are reduced in a fixed order (warp shuffles).
//
// Every update launches up to 24 matrices per kernel (a `Batch` in the kernel parameters, as the 8-bit
// kernel), so a step over hundreds of matrices costs a handful of launches.
// int4 update: one warp per row block, as the 8-bit kernel; each lane owns whole bytes (two
//   consecutive elements), keeps the new momentum in shared memory, warp-reduces absmax and the sum
//   of squares, then requantizes the bytes it read.
// e0m3 update: the per-tensor scale depends on the new momentum of the whole tensor, so two passes:
//   pass 1 (read-only) recomputes the new momentum and maxes |m| per CTA, one atomicMax per CTA into
//   the matrix's device scratch; pass 2 recomputes it, writes the NS input, codes and block scales at
//   the new tensor scale and the tensor scale itself. One element per lane, a warp per chunk of
//   max(block_size, 32) elements of a row, the per-16 block maxima by width-16 shuffles. A row shard
//   runs pass 1 alone (the amax op) and, once the amax is all-reduced, pass 2 with its matrix's scale
//   given (new_tensor_scale).
// dense update: one warp per row block (sum of squares by warp shuffles).
// codecs: simple grid-stride kernels (conversion / checkpoint paths, not the step).
// skip: a matrix whose flag (device memory) is set is not touched. Work items never span two matrices, so
// every warp (int4, dense) or CTA (both e0m3 passes) reads its matrix's flag first and all of its threads
// leave together, before any memory access, shuffle or barrier; the e0m3 scale copy skips it too.
#include <cuda_runtime.h>

#include <stdint.h>

#include "qmuon/block_math_4bit.h"
#include "qmuon/kernels.h"
#include "qmuon/validate.h"

namespace qmuon {
namespace cuda4 {

constexpr int kWarp = 32;
constexpr int kWarpsPerCta = 8;
constexpr int kSmemBudgetFloats = 8192;
constexpr int kThreadsPerCta = 256;  // the codec kernels' CTA size (kThreads below)

__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const uint32_t w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fadd(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

__device__ __forceinline__ uint64_t elem_index(int64_t row_offset, int64_t r, int64_t cols, int64_t c) {
  return static_cast<uint64_t>(row_offset + r) * static_cast<uint64_t>(cols) + static_cast<uint64_t>(c);
}

__device__ __forceinline__ float unpacked_code(const uint8_t* p, int64_t i) {
  const uint32_t byte = p[i >> 1];
  return nibble_to_code((i & 1) ? (byte >> 4) : (byte & 15u));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int launch_error() { return static_cast<int>(cudaGetLastError()); }

// ---------------------------------------------------------------------------------------------
// Multi-matrix batches: up to kMaxTensorsPerLaunch matrices per launch, as the 8-bit kernel. `begin`
// holds the prefix sums of each matrix's work items (warps for int4 / dense, CTAs for e0m3), and a
// warp or CTA finds its matrix by binary search.
// ---------------------------------------------------------------------------------------------
constexpr int kMaxTensorsPerLaunch = 24;

template <typename T>
struct Batch {
  T t[kMaxTensorsPerLaunch];
  int64_t begin[kMaxTensorsPerLaunch + 1];
  int32_t num;
};
static_assert(sizeof(Batch<qmuon_q4_tensor>) + 128 <= 4096, "kernel parameters must stay under 4 KiB");
static_assert(sizeof(Batch<qmuon_dense_tensor>) + 128 <= 4096, "kernel parameters must stay under 4 KiB");

__device__ __forceinline__ int find_tensor(const int64_t* begin, int num, int64_t g) {
  int lo = 0, hi = num - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (begin[mid] <= g) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Calls launch(batch) for consecutive groups of up to kMaxTensorsPerLaunch non-empty matrices of `ts`
// that satisfy keep(t); items(t) is the number of work items of one matrix. Returns the first error.
template <typename T, typename Keep, typename Items, typename Launch>
int for_each_batch(const T* ts, int64_t num, Keep&& keep, Items&& items, Launch&& launch) {
  int64_t i = 0;
  while (i < num) {
    Batch<T> batch{};
    int count = 0;
    for (; i < num && count < kMaxTensorsPerLaunch; ++i) {
      const T& t = ts[i];
      if (t.rows <= 0 || t.cols <= 0 || !keep(t)) continue;
      batch.t[count] = t;
      batch.begin[count + 1] = batch.begin[count] + items(t);
      ++count;
    }
    batch.num = count;
    if (count == 0) continue;
    const int err = launch(batch);
    if (err) return err;
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// int4 update
// ---------------------------------------------------------------------------------------------
template <typename G>
__global__ void int4_update_kernel(const __grid_constant__ Batch<qmuon_q4_tensor> batch, const MomentumWeights mw,
                                   const int nesterov, const int64_t bs, const int warps_per_cta) {
  using GS = typename G::storage;
  extern __shared__ float smem[];
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * warps_per_cta + warp;
  if (g >= batch.begin[batch.num]) return;  // the whole warp leaves together
  const int ti = find_tensor(batch.begin, batch.num, g);
  const qmuon_q4_tensor& t = batch.t[ti];
  if (skipped(t.skip)) return;  // flagged matrix: the whole warp leaves
  const int64_t nb = (t.cols + bs - 1) / bs;
  const int64_t local = g - batch.begin[ti];
  const int64_t r = local / nb;
  const int64_t b = local - r * nb;
  const int64_t c0 = b * bs;  // even
  const int n = static_cast<int>(min(bs, t.cols - c0));
  uint8_t* pk = t.packed + r * t.packed_rs + c0 / 2;
  GS* grad = static_cast<GS*>(t.grad) + r * t.grad_rs + c0;
  float* absmax = static_cast<float*>(t.scales) + r * t.scales_rs + b;
  float* m_new = smem + static_cast<int64_t>(warp) * bs;
  const bool stochastic = t.stream >= 0;
  const uint32_t stream = static_cast<uint32_t>(t.stream);
  const float scale = int4_dequant_scale(*absmax);
  uint32_t amax_bits = 0;
  float ss = 0.0f;
  for (int j = lane; 2 * j < n; j += kWarp) {
    const uint32_t byte = pk[j];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int i = 2 * j + k;
      if (i < n) {
        const float m_old = fmul(nibble_to_code(k ? (byte >> 4) : (byte & 15u)), scale);
        const float gv = G::load(grad[i]);
        const float m = lerp(m_old, gv, mw.to_grad);
        const float v = nesterov ? lerp(gv, m, mw.to_mom) : m;
        grad[i] = G::store(v);
        m_new[i] = m;
        const uint32_t ab = abs_bits(m);
        amax_bits = ab > amax_bits ? ab : amax_bits;
        ss = fadd(ss, fmul(v, v));
      }
    }
  }
  const float amax = bits_f32(warp_max_u32(amax_bits));
  ss = warp_sum(ss);
  const float inv = int4_quant_inv(amax);
  const uint64_t first = elem_index(t.row_offset, r, t.cols, c0);
  for (int j = lane; 2 * j < n; j += kWarp) {
    const int i = 2 * j;
    const float u0 = stochastic ? uniform_noise(first + i, stream) : 0.0f;
    const uint32_t lo = code_to_nibble(round_code4(fmul(m_new[i], inv), stochastic, u0));
    uint32_t hi = 0;
    if (i + 1 < n) {
      const float u1 = stochastic ? uniform_noise(first + i + 1, stream) : 0.0f;
      hi = code_to_nibble(round_code4(fmul(m_new[i + 1], inv), stochastic, u1));
    }
    pk[j] = pack_nibbles(lo, hi);
  }
  if (lane == 0) {
    *absmax = amax;
    if (t.sumsq != nullptr) t.sumsq[r * nb + b] = ss;
  }
}

// ---------------------------------------------------------------------------------------------
// e0m3 update
// ---------------------------------------------------------------------------------------------
// One element per lane. A warp walks a chunk of max(block_size, 32) consecutive elements of one row,
// 32 at a time; chunks start at multiples of 16, so each half-warp holds one 16-element scale block and
// its maximum is 4 xor shuffles of width 16. Pass 1 (read-only): max |m_new| per warp, then per CTA
// (shared memory), then one atomicMax per CTA into the matrix's scratch. CTAs never span two matrices.
// Every warp runs the same number of iterations (lanes past the row end hold 0), so the shuffles and
// the barrier are reached by all threads.
constexpr int kE0M3Pass1ChunksPerWarp = 4;  // pass 1: fewer CTAs, so fewer atomics (one per CTA)
// Pass 1 only needs the maximum, so its chunks need not follow block_size: 256 elements whatever the
// block (8 warps x 4 chunks x 256 = 8192 elements, one atomic, per CTA).
constexpr int64_t kE0M3Pass1Chunk = 256;

inline int64_t e0m3_chunk(int64_t bs) { return bs > kWarp ? bs : kWarp; }

// CTAs of one matrix: its chunks, kWarpsPerCta * chunks_per_warp per CTA.
inline int64_t e0m3_ctas(const qmuon_q4_tensor& t, int64_t chunk, int chunks_per_warp) {
  return ceil_div(t.rows * ceil_div(t.cols, chunk), static_cast<int64_t>(kWarpsPerCta) * chunks_per_warp);
}

// The old momentum of element (r, c): code * decode(scale byte) * t_old.
__device__ __forceinline__ float e0m3_old_momentum(const qmuon_q4_tensor& t, float t_old, int64_t r, int64_t c) {
  const float step = e0m3_step(static_cast<const uint8_t*>(t.scales)[r * t.scales_rs + c / kE0M3Block], t_old);
  return fmul(unpacked_code(t.packed + r * t.packed_rs, c), step);
}

// Where a warp's k-th chunk is: row r, columns [c0, end) (end = 0 when the CTA's last warps have none).
struct ChunkPos {
  int64_t r, c0, end;
};

__device__ __forceinline__ ChunkPos chunk_pos(const qmuon_q4_tensor& t, int64_t local_cta, int k, int chunks_per_warp,
                                              int warp, int64_t chunk) {
  const int64_t nch = (t.cols + chunk - 1) / chunk;
  const int64_t q = (local_cta * chunks_per_warp + k) * kWarpsPerCta + warp;
  ChunkPos p{0, 0, 0};
  if (q < t.rows * nch) {
    p.r = q / nch;
    p.c0 = (q - p.r * nch) * chunk;
    p.end = min(p.c0 + chunk, t.cols);
  }
  return p;
}

// use_skip: the update's pass 1 (a flagged matrix's CTAs leave at once: the whole CTA, before the barrier);
// the amax op (0) writes nothing of the state and ignores the flags.
template <typename G>
__global__ void e0m3_pass1_kernel(const __grid_constant__ Batch<qmuon_q4_tensor> batch, const MomentumWeights mw,
                                  const int64_t chunk, const int chunks_per_warp, const int use_skip) {
  using GS = typename G::storage;
  __shared__ uint32_t warp_max[kWarpsPerCta];
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int ti = find_tensor(batch.begin, batch.num, blockIdx.x);  // grid == batch.begin[num]
  const qmuon_q4_tensor& t = batch.t[ti];
  if (use_skip && skipped(t.skip)) return;  // uniform over the CTA (one matrix per CTA): no thread waits below
  const int64_t local_cta = static_cast<int64_t>(blockIdx.x) - batch.begin[ti];
  if (local_cta == 0 && threadIdx.x == 0) t.scratch[1] = *t.tensor_scale;  // pass 2 reads the old scale here
  const float t_old = *t.tensor_scale;
  uint32_t amax_bits = 0;
  for (int k = 0; k < chunks_per_warp; ++k) {
    const ChunkPos p = chunk_pos(t, local_cta, k, chunks_per_warp, warp, chunk);
    const GS* grad = static_cast<const GS*>(t.grad) + p.r * t.grad_rs;
    for (int64_t c = p.c0 + lane; c < p.end; c += kWarp) {
      const float m = lerp(e0m3_old_momentum(t, t_old, p.r, c), G::load(grad[c]), mw.to_grad);
      const uint32_t ab = abs_bits(m);
      amax_bits = ab > amax_bits ? ab : amax_bits;
    }
  }
  amax_bits = warp_max_u32(amax_bits);
  if (lane == 0) warp_max[warp] = amax_bits;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = 0;
    for (int w = 0; w < kWarpsPerCta; ++w) m = warp_max[w] > m ? warp_max[w] : m;
    atomicMax(reinterpret_cast<unsigned int*>(t.scratch), m);  // one atomic per CTA
  }
}

// max |m| of pass 1 (scratch[0], bits) as amax_out, NaN made the one quiet NaN (amax_from_bits); one
// thread per matrix of the batch.
__global__ void e0m3_amax_out_kernel(const __grid_constant__ Batch<qmuon_q4_tensor> batch) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < batch.num) *batch.t[i].amax_out = amax_from_bits(f32_bits(batch.t[i].scratch[0]));
}

// The given new scales become the tensor scales, after pass 2 has decoded with the old ones.
__global__ void e0m3_copy_scales_kernel(const __grid_constant__ Batch<qmuon_q4_tensor> batch) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < batch.num && !skipped(batch.t[i].skip) && batch.t[i].new_tensor_scale != batch.t[i].tensor_scale) {
    *batch.t[i].tensor_scale = *batch.t[i].new_tensor_scale;
  }
}

// from_amax: the new scale is computed from pass 1's max |m| (scratch[0], bits read as a float) and
// written to *t.tensor_scale by the matrix's first CTA; the old one comes from scratch[1] (pass 1 copied
// it there, as the tensor scale is overwritten while other CTAs run). Otherwise t_old = *t.tensor_scale
// and t_new = *t.new_tensor_scale (copied over afterwards by e0m3_copy_scales_kernel).
template <typename G>
__global__ void e0m3_pass2_kernel(const __grid_constant__ Batch<qmuon_q4_tensor> batch, const MomentumWeights mw,
                                  const int nesterov, const int64_t chunk, const int64_t bs, const int from_amax) {
  using GS = typename G::storage;
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int ti = find_tensor(batch.begin, batch.num, blockIdx.x);  // grid == batch.begin[num]
  const qmuon_q4_tensor& t = batch.t[ti];
  if (skipped(t.skip)) return;  // flagged matrix: the whole CTA leaves (its tensor scale is not written either)
  const int64_t local_cta = static_cast<int64_t>(blockIdx.x) - batch.begin[ti];
  const float t_old = from_amax ? t.scratch[1] : *t.tensor_scale;
  const float t_new = from_amax ? e0m3_tensor_scale_from_amax(t.scratch[0]) : *t.new_tensor_scale;
  if (from_amax && local_cta == 0 && threadIdx.x == 0) *t.tensor_scale = t_new;
  const ChunkPos p = chunk_pos(t, local_cta, 0, 1, warp, chunk);
  const bool stochastic = t.stream >= 0;
  const uint32_t stream = static_cast<uint32_t>(t.stream);
  const int64_t nb = (t.cols + bs - 1) / bs;
  GS* grad = static_cast<GS*>(t.grad) + p.r * t.grad_rs;
  uint8_t* pk = t.packed + p.r * t.packed_rs;
  uint8_t* sc = static_cast<uint8_t*>(t.scales) + p.r * t.scales_rs;
  const uint64_t row_first = elem_index(t.row_offset, p.r, t.cols, 0);
  float ss = 0.0f;  // bs >= 32: the chunk is one sum block
  for (int64_t base = p.c0; base < p.c0 + chunk; base += kWarp) {  // the same count in every warp
    const int64_t c = base + lane;
    const bool valid = c < p.end;
    float m = 0.0f, v = 0.0f;
    if (valid) {
      const float gv = G::load(grad[c]);
      m = lerp(e0m3_old_momentum(t, t_old, p.r, c), gv, mw.to_grad);
      v = nesterov ? lerp(gv, m, mw.to_mom) : m;
      grad[c] = G::store(v);
    }
    // Every lane of a half-warp has read its old scale byte and packed byte before these shuffles, and
    // the writes below come after them.
    uint32_t block_max = abs_bits(m);
#pragma unroll
    for (int o = kE0M3Block / 2; o > 0; o /= 2) {
      const uint32_t w = __shfl_xor_sync(0xFFFFFFFFu, block_max, o);
      block_max = w > block_max ? w : block_max;
    }
    const uint32_t s_bits = e0m3_scale_bits(bits_f32(block_max), t_new);
    uint32_t nib = 0;
    if (valid) {
      const float u = stochastic ? uniform_noise(row_first + static_cast<uint64_t>(c), stream) : 0.0f;
      nib = code_to_nibble(e0m3_code(m, e0m3_step(s_bits, t_new), stochastic, u));
    }
    const uint32_t hi = __shfl_xor_sync(0xFFFFFFFFu, nib, 1);  // the odd neighbour's nibble (0 past the end)
    if (valid && (lane & 1) == 0) pk[c / 2] = pack_nibbles(nib, hi);
    if (valid && (lane & (kE0M3Block - 1)) == 0) sc[c / kE0M3Block] = static_cast<uint8_t>(s_bits);
    const float sq = fmul(v, v);
    if (bs >= kWarp) {
      ss = fadd(ss, sq);
    } else {  // sum blocks of bs in {1, 2, 4, 8, 16} lanes
      float s = sq;
      for (int o = static_cast<int>(bs) / 2; o > 0; o /= 2) s = fadd(s, __shfl_xor_sync(0xFFFFFFFFu, s, o));
      if (valid && lane % bs == 0 && t.sumsq != nullptr) t.sumsq[p.r * nb + c / bs] = s;
    }
  }
  if (bs >= kWarp) {
    ss = warp_sum(ss);
    if (lane == 0 && p.end > p.c0 && t.sumsq != nullptr) t.sumsq[p.r * nb + p.c0 / bs] = ss;
  }
}

// ---------------------------------------------------------------------------------------------
// dense update
// ---------------------------------------------------------------------------------------------
template <typename B, typename G>
__global__ void dense_update_kernel(const __grid_constant__ Batch<qmuon_dense_tensor> batch, const MomentumWeights mw,
                                    const int nesterov, const int64_t bs) {
  using BS = typename B::storage;
  using GS = typename G::storage;
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp;
  if (g >= batch.begin[batch.num]) return;
  const int ti = find_tensor(batch.begin, batch.num, g);
  const qmuon_dense_tensor& t = batch.t[ti];
  if (skipped(t.skip)) return;  // flagged matrix: the whole warp leaves
  const int64_t nb = (t.cols + bs - 1) / bs;
  const int64_t local = g - batch.begin[ti];
  const int64_t r = local / nb;
  const int64_t b = local - r * nb;
  const int64_t c0 = b * bs;
  const int n = static_cast<int>(min(bs, t.cols - c0));
  BS* buf = static_cast<BS*>(t.buf) + r * t.buf_rs + c0;
  GS* grad = static_cast<GS*>(t.grad) + r * t.grad_rs + c0;
  const bool stochastic = sizeof(BS) == 2 && t.stream >= 0;
  const uint32_t stream = static_cast<uint32_t>(t.stream);
  const uint64_t first = elem_index(t.row_offset, r, t.cols, c0);
  float ss = 0.0f;
  for (int i = lane; i < n; i += kWarp) {
    const float gv = G::load(grad[i]);
    const float m = fused_lerp(B::load(buf[i]), gv, mw.to_grad);
    const float v = nesterov ? fused_lerp(gv, m, mw.to_mom) : m;
    if (stochastic) {
      buf[i] = static_cast<BS>(bf16_stochastic(m, noise_bits16(first + i, stream)));
    } else {
      buf[i] = B::store(m);
    }
    grad[i] = G::store(v);
    ss = fadd(ss, fmul(v, v));
  }
  ss = warp_sum(ss);
  if (lane == 0 && t.sumsq != nullptr) t.sumsq[r * nb + b] = ss;
}

// ---------------------------------------------------------------------------------------------
// codecs
// ---------------------------------------------------------------------------------------------
#define QMUON_GRID_STRIDE(i, n) \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)

__global__ void pack_int4_kernel(const int8_t* in, uint8_t* out, int64_t rows, int64_t cols) {
  const int64_t pc = (cols + 1) / 2;
  QMUON_GRID_STRIDE(idx, rows * pc) {
    const int64_t r = idx / pc, j = idx - r * pc;
    const int32_t lo = in[r * cols + 2 * j];
    const int32_t hi = 2 * j + 1 < cols ? in[r * cols + 2 * j + 1] : 0;
    const uint32_t nl = static_cast<uint32_t>(lo < 0 ? 8 - lo : lo);
    const uint32_t nh = static_cast<uint32_t>(hi < 0 ? 8 - hi : hi);
    out[idx] = static_cast<uint8_t>((nl | (nh << 4)) & 0xFFu);
  }
}

__global__ void unpack_int4_kernel(const uint8_t* in, int8_t* out, int64_t rows, int64_t cols) {
  const int64_t pc = (cols + 1) / 2;
  QMUON_GRID_STRIDE(idx, rows * cols) {
    const int64_t r = idx / cols, c = idx - r * cols;
    out[idx] = static_cast<int8_t>(unpacked_code(in + r * pc, c));
  }
}

__global__ void ue4m3_encode_kernel(const float* in, uint8_t* out, int64_t n, int round_up) {
  QMUON_GRID_STRIDE(i, n) { out[i] = static_cast<uint8_t>(ue4m3_encode(in[i], round_up != 0)); }
}

__global__ void ue4m3_decode_kernel(const uint8_t* in, float* out, int64_t n) {
  QMUON_GRID_STRIDE(i, n) { out[i] = ue4m3_decode(in[i]); }
}

// Max |x| over the whole matrix into scratch (as bits): warp shuffles, then the CTA's warps through
// shared memory, then one atomicMax per CTA (kThreads threads per CTA, no early exit before the barrier).
__global__ void amax_kernel(const float* x, int64_t n, float* scratch) {
  __shared__ uint32_t warp_max[kThreadsPerCta / kWarp];
  uint32_t m = 0;
  QMUON_GRID_STRIDE(i, n) {
    const uint32_t b = abs_bits(x[i]);
    m = b > m ? b : m;
  }
  m = warp_max_u32(m);
  if (threadIdx.x % kWarp == 0) warp_max[threadIdx.x / kWarp] = m;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreadsPerCta / kWarp; ++w) m = warp_max[w] > m ? warp_max[w] : m;
    atomicMax(reinterpret_cast<unsigned int*>(scratch), m);
  }
}

__global__ void fill_one_kernel(float* out) { *out = 1.0f; }

// int4_quantize: one thread per (row, block) — codes of a block are whole bytes (even block size).
__global__ void int4_quantize_kernel(const float* x, uint8_t* pk, float* absmax, int64_t rows, int64_t cols,
                                     int64_t bs, int64_t stream, int64_t row_offset) {
  const int64_t nb = (cols + bs - 1) / bs, pc = (cols + 1) / 2;
  QMUON_GRID_STRIDE(blk, rows * nb) {
    const int64_t r = blk / nb, c0 = (blk - r * nb) * bs, n = min(bs, cols - c0);
    const float* xb = x + r * cols + c0;
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t b = abs_bits(xb[i]);
      m = b > m ? b : m;
    }
    const float amax = bits_f32(m);
    absmax[blk] = amax;
    const float inv = int4_quant_inv(amax);
    const bool st = stream >= 0;
    const uint64_t first = elem_index(row_offset, r, cols, c0);
    for (int64_t i = 0; i < n; i += 2) {
      const uint32_t lo = code_to_nibble(
          round_code4(fmul(xb[i], inv), st, st ? uniform_noise(first + i, static_cast<uint32_t>(stream)) : 0.0f));
      uint32_t hi = 0;
      if (i + 1 < n) {
        hi = code_to_nibble(round_code4(fmul(xb[i + 1], inv), st,
                                        st ? uniform_noise(first + i + 1, static_cast<uint32_t>(stream)) : 0.0f));
      }
      pk[r * pc + (c0 + i) / 2] = pack_nibbles(lo, hi);
    }
  }
}

__global__ void int4_dequantize_kernel(const uint8_t* pk, const float* absmax, float* out, int64_t rows, int64_t cols,
                                       int64_t bs) {
  const int64_t nb = (cols + bs - 1) / bs, pc = (cols + 1) / 2;
  QMUON_GRID_STRIDE(idx, rows * cols) {
    const int64_t r = idx / cols, c = idx - r * cols;
    out[idx] = fmul(unpacked_code(pk + r * pc, c), int4_dequant_scale(absmax[r * nb + c / bs]));
  }
}

// e0m3_quantize: one thread per 16-element block; the tensor scale comes from scratch (two-level).
__global__ void e0m3_quantize_kernel(const float* x, uint8_t* pk, uint8_t* sc, float* t_out, const float* scratch,
                                     int64_t rows, int64_t cols, int two_level, int64_t stream, int64_t row_offset) {
  const int64_t nb = (cols + kE0M3Block - 1) / kE0M3Block, pc = (cols + 1) / 2;
  const float t = two_level ? e0m3_tensor_scale_from_amax(scratch[0]) : 1.0f;
  if (blockIdx.x == 0 && threadIdx.x == 0) *t_out = t;
  const bool st = stream >= 0;
  QMUON_GRID_STRIDE(blk, rows * nb) {
    const int64_t r = blk / nb, c0 = (blk - r * nb) * kE0M3Block, n = min(static_cast<int64_t>(kE0M3Block), cols - c0);
    const float* xb = x + r * cols + c0;
    uint32_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t b = abs_bits(xb[i]);
      m = b > m ? b : m;
    }
    const uint32_t s_bits = e0m3_scale_bits(bits_f32(m), t);
    sc[blk] = static_cast<uint8_t>(s_bits);
    const float step = e0m3_step(s_bits, t);
    const uint64_t first = elem_index(row_offset, r, cols, c0);
    for (int64_t i = 0; i < n; i += 2) {
      const uint32_t lo = code_to_nibble(
          e0m3_code(xb[i], step, st, st ? uniform_noise(first + i, static_cast<uint32_t>(stream)) : 0.0f));
      uint32_t hi = 0;
      if (i + 1 < n) {
        hi = code_to_nibble(
            e0m3_code(xb[i + 1], step, st, st ? uniform_noise(first + i + 1, static_cast<uint32_t>(stream)) : 0.0f));
      }
      pk[r * pc + (c0 + i) / 2] = pack_nibbles(lo, hi);
    }
  }
}

__global__ void e0m3_dequantize_kernel(const uint8_t* pk, const uint8_t* sc, const float* t, float* out, int64_t rows,
                                       int64_t cols) {
  const int64_t nb = (cols + kE0M3Block - 1) / kE0M3Block, pc = (cols + 1) / 2;
  const float ts = *t;
  QMUON_GRID_STRIDE(idx, rows * cols) {
    const int64_t r = idx / cols, c = idx - r * cols;
    out[idx] = fmul(unpacked_code(pk + r * pc, c), e0m3_step(sc[r * nb + c / kE0M3Block], ts));
  }
}

// Grid maxima: thread per (row, column tile) and per (row tile, column). The scale is *t_src, or
// (t_from_amax) computed from the max |x| bits there and written to *t_out.
__global__ void grid_maxima_kernel(const float* x, uint8_t* row_bits, uint8_t* col_bits, float* t_out,
                                   const float* t_src, int t_from_amax, int64_t rows, int64_t cols, int64_t s) {
  const int64_t nbc = (cols + s - 1) / s, nbr = (rows + s - 1) / s;
  const float t = t_from_amax ? grid_scale_from_amax(*t_src) : *t_src;
  if (t_from_amax && blockIdx.x == 0 && threadIdx.x == 0) *t_out = t;
  QMUON_GRID_STRIDE(idx, rows * nbc + nbr * cols) {
    uint32_t m = 0;
    if (idx < rows * nbc) {
      const int64_t r = idx / nbc, c0 = (idx - r * nbc) * s, c1 = min(cols, c0 + s);
      for (int64_t c = c0; c < c1; ++c) {
        const uint32_t b = abs_bits(x[r * cols + c]);
        m = b > m ? b : m;
      }
      row_bits[idx] = static_cast<uint8_t>(ue4m3_encode(fdiv(bits_f32(m), t), true));
    } else {
      const int64_t j = idx - rows * nbc, gr = j / cols, c = j - gr * cols, r0 = gr * s, r1 = min(rows, r0 + s);
      for (int64_t r = r0; r < r1; ++r) {
        const uint32_t b = abs_bits(x[r * cols + c]);
        m = b > m ? b : m;
      }
      col_bits[j] = static_cast<uint8_t>(ue4m3_encode(fdiv(bits_f32(m), t), true));
    }
  }
}

__global__ void grid_codes_kernel(const float* x, const uint8_t* row_bits, const uint8_t* col_bits, const float* t_in,
                                  uint8_t* pk, int64_t rows, int64_t cols, int64_t s, int64_t stream,
                                  int64_t row_offset) {
  const int64_t nbc = (cols + s - 1) / s, pc = (cols + 1) / 2;
  const float t = *t_in;
  const bool st = stream >= 0;
  QMUON_GRID_STRIDE(idx, rows * pc) {
    const int64_t r = idx / pc, c = 2 * (idx - r * pc);
    const uint64_t first = elem_index(row_offset, r, cols, c);
    const float d0 = grid_den(row_bits[r * nbc + c / s], col_bits[(r / s) * cols + c], t);
    const uint32_t lo = code_to_nibble(
        grid_code(x[r * cols + c], d0, st, st ? uniform_noise(first, static_cast<uint32_t>(stream)) : 0.0f));
    uint32_t hi = 0;
    if (c + 1 < cols) {
      const float d1 = grid_den(row_bits[r * nbc + (c + 1) / s], col_bits[(r / s) * cols + c + 1], t);
      hi = code_to_nibble(grid_code(x[r * cols + c + 1], d1, st,
                                    st ? uniform_noise(first + 1, static_cast<uint32_t>(stream)) : 0.0f));
    }
    pk[idx] = pack_nibbles(lo, hi);
  }
}

__global__ void grid_dequantize_kernel(const uint8_t* pk, const uint8_t* row_bits, const uint8_t* col_bits,
                                       const float* t_in, float* out, int64_t rows, int64_t cols, int64_t s) {
  const int64_t nbc = (cols + s - 1) / s, pc = (cols + 1) / 2;
  const float t = *t_in;
  QMUON_GRID_STRIDE(idx, rows * cols) {
    const int64_t r = idx / cols, c = idx - r * cols;
    out[idx] = grid_dequant(unpacked_code(pk + r * pc, c),
                            grid_den(row_bits[r * nbc + c / s], col_bits[(r / s) * cols + c], t));
  }
}

constexpr int kThreads = kThreadsPerCta;

inline unsigned grid_for(int64_t n) {
  const int64_t g = ceil_div(n < 1 ? 1 : n, kThreads);
  return static_cast<unsigned>(g > 65535 * 16 ? 65535 * 16 : g);
}

// ---------------------------------------------------------------------------------------------
// launchers
// ---------------------------------------------------------------------------------------------
template <template <typename> class Launch, typename... Args>
int dispatch_grad(int32_t grad_dtype, Args&&... args) {
  switch (grad_dtype) {
    case QMUON_FLOAT32: return Launch<F32>::run(args...);
    case QMUON_BFLOAT16: return Launch<BF16>::run(args...);
    case QMUON_FLOAT16: return Launch<F16>::run(args...);
    default: return QMUON_ERR_BAD_DTYPE;
  }
}

inline unsigned grid_dim(int64_t g) { return static_cast<unsigned>(g); }  // callers check g <= INT32_MAX

template <typename G>
struct Int4Launch {
  static int run(const qmuon_q4_tensor* ts, int64_t num, const qmuon_q4_params& p, cudaStream_t s) {
    const MomentumWeights mw = make_momentum_weights(p.beta);
    const int64_t bs = p.block_size;
    int64_t w = kSmemBudgetFloats / bs;
    const int warps = static_cast<int>(w < 1 ? 1 : (w > kWarpsPerCta ? kWarpsPerCta : w));
    const size_t smem = static_cast<size_t>(warps) * static_cast<size_t>(bs) * sizeof(float);
    return for_each_batch(
        ts, num, [](const qmuon_q4_tensor&) { return true; },
        [bs](const qmuon_q4_tensor& t) { return t.rows * ceil_div(t.cols, bs); },
        [&](const Batch<qmuon_q4_tensor>& batch) {
          const int64_t grid = ceil_div(batch.begin[batch.num], warps);
          if (grid > 0x7FFFFFFFLL) return static_cast<int>(cudaErrorInvalidConfiguration);
          int4_update_kernel<G><<<grid_dim(grid), warps * kWarp, smem, s>>>(batch, mw, p.nesterov, bs, warps);
          return launch_error();
        });
  }
};

// Pass 1 over a batch of matrices: max |m_new| into each one's scratch[0], old scale into scratch[1].
// amax_out: the amax op (writes each matrix's max |m_new| to amax_out, ignores the skip flags); else the
// update's pass 1.
template <typename G>
int e0m3_pass1(const qmuon_q4_tensor* ts, int64_t num, bool given, const MomentumWeights& mw, int64_t chunk,
               cudaStream_t s, bool amax_out) {
  constexpr int k = kE0M3Pass1ChunksPerWarp;
  return for_each_batch(
      ts, num, [given](const qmuon_q4_tensor& t) { return (t.new_tensor_scale != nullptr) == given; },
      [chunk](const qmuon_q4_tensor& t) { return e0m3_ctas(t, chunk, k); },
      [&](const Batch<qmuon_q4_tensor>& batch) {
        const int64_t grid = batch.begin[batch.num];
        if (grid > 0x7FFFFFFFLL) return static_cast<int>(cudaErrorInvalidConfiguration);
        e0m3_pass1_kernel<G><<<grid_dim(grid), kWarpsPerCta * kWarp, 0, s>>>(batch, mw, chunk, k, amax_out ? 0 : 1);
        int err = launch_error();
        if (err || !amax_out) return err;
        e0m3_amax_out_kernel<<<1, kMaxTensorsPerLaunch, 0, s>>>(batch);
        return launch_error();
      });
}

template <typename G>
struct E0M3Launch {
  static int run(const qmuon_q4_tensor* ts, int64_t num, const qmuon_q4_params& p, cudaStream_t s) {
    const MomentumWeights mw = make_momentum_weights(p.beta);
    const int64_t bs = p.block_size;
    const int64_t chunk = e0m3_chunk(bs);
    for (int64_t i = 0; i < num; ++i) {
      if (ts[i].rows > 0 && ts[i].cols > 0 && ts[i].new_tensor_scale == nullptr && ts[i].scratch == nullptr) {
        return QMUON_ERR_BAD_OP;
      }
    }
    // Matrices whose new scale is computed: pass 1, then pass 2 reading it from scratch.
    int err = e0m3_pass1<G>(ts, num, false, mw, kE0M3Pass1Chunk, s, false);
    if (err) return err;
    for (const bool given : {false, true}) {
      err = for_each_batch(
          ts, num, [given](const qmuon_q4_tensor& t) { return (t.new_tensor_scale != nullptr) == given; },
          [chunk](const qmuon_q4_tensor& t) { return e0m3_ctas(t, chunk, 1); },
          [&](const Batch<qmuon_q4_tensor>& batch) {
            const int64_t grid = batch.begin[batch.num];
            if (grid > 0x7FFFFFFFLL) return static_cast<int>(cudaErrorInvalidConfiguration);
            e0m3_pass2_kernel<G><<<grid_dim(grid), kWarpsPerCta * kWarp, 0, s>>>(batch, mw, p.nesterov, chunk, bs,
                                                                                 given ? 0 : 1);
            int e = launch_error();
            if (e || !given) return e;
            // Stream order keeps every CTA's read of the old scale before this copy.
            e0m3_copy_scales_kernel<<<1, kMaxTensorsPerLaunch, 0, s>>>(batch);
            return launch_error();
          });
      if (err) return err;
    }
    return 0;
  }
};

template <typename G>
struct E0M3AmaxLaunch {
  static int run(const qmuon_q4_tensor* ts, int64_t num, const qmuon_q4_params& p, cudaStream_t s) {
    const MomentumWeights mw = make_momentum_weights(p.beta);
    for (int64_t i = 0; i < num; ++i) {
      if (ts[i].scratch == nullptr || ts[i].amax_out == nullptr) return QMUON_ERR_BAD_OP;
    }
    // amax_out of an empty matrix stays as the caller zeroed it; the max does not depend on the chunk.
    return e0m3_pass1<G>(ts, num, false, mw, kE0M3Pass1Chunk, s, true);
  }
};

template <typename B>
struct DenseLaunchB {
  template <typename G>
  struct For {
    static int run(const qmuon_dense_tensor* ts, int64_t num, const qmuon_dense_params& p, cudaStream_t s) {
      const MomentumWeights mw = make_momentum_weights(p.beta);
      const int64_t bs = p.block_size;
      return for_each_batch(
          ts, num, [](const qmuon_dense_tensor&) { return true; },
          [bs](const qmuon_dense_tensor& t) { return t.rows * ceil_div(t.cols, bs); },
          [&](const Batch<qmuon_dense_tensor>& batch) {
            const int64_t grid = ceil_div(batch.begin[batch.num], kWarpsPerCta);
            if (grid > 0x7FFFFFFFLL) return static_cast<int>(cudaErrorInvalidConfiguration);
            dense_update_kernel<B, G><<<grid_dim(grid), kWarpsPerCta * kWarp, 0, s>>>(batch, mw, p.nesterov, bs);
            return launch_error();
          });
    }
  };
};

template <typename G>
using DenseF32Launch = DenseLaunchB<F32>::For<G>;
template <typename G>
using DenseBF16Launch = DenseLaunchB<BF16>::For<G>;

// Maxima, then codes, with the scale *t_src (t_from_amax: computed from the max |x| bits there and
// written to out3, which the codes kernel then reads).
int grid_quantize(const qmuon_codec_args& a, const float* t_src, int t_from_amax, cudaStream_t s) {
  const int64_t rows = a.rows, cols = a.cols, sb = a.block_size;
  const float* x = static_cast<const float*>(a.in0);
  grid_maxima_kernel<<<grid_for(rows * ceil_div(cols, sb) + ceil_div(rows, sb) * cols), kThreads, 0, s>>>(
      x, static_cast<uint8_t*>(a.out1), static_cast<uint8_t*>(a.out2), static_cast<float*>(a.out3), t_src,
      t_from_amax, rows, cols, sb);
  const int err = launch_error();
  if (err) return err;
  grid_codes_kernel<<<grid_for(rows * ceil_div(cols, 2)), kThreads, 0, s>>>(
      x, static_cast<const uint8_t*>(a.out1), static_cast<const uint8_t*>(a.out2),
      t_from_amax ? static_cast<const float*>(a.out3) : t_src, static_cast<uint8_t*>(a.out0), rows, cols, sb,
      a.stream, a.row_offset);
  return launch_error();
}

int codec(const qmuon_codec_args& a, cudaStream_t s) {
  if (const int err = check_codec(a)) return err;  // the same checks as qmuon_cpu_codec
  if ((a.op == QMUON_CODEC_E0M3_QUANTIZE || a.op == QMUON_CODEC_GRID_QUANTIZE) && a.scratch == nullptr) {
    return QMUON_ERR_BAD_OP;  // CUDA keeps the max |x| in device scratch
  }
  const int64_t rows = a.rows, cols = a.cols;
  if (rows <= 0 || cols <= 0) {
    if (a.op == QMUON_CODEC_E0M3_QUANTIZE || a.op == QMUON_CODEC_GRID_QUANTIZE) {  // as the CPU: scale 1
      fill_one_kernel<<<1, 1, 0, s>>>(static_cast<float*>(a.op == QMUON_CODEC_E0M3_QUANTIZE ? a.out2 : a.out3));
      return launch_error();
    }
    return 0;
  }
  switch (a.op) {
    case QMUON_CODEC_PACK_INT4:
      pack_int4_kernel<<<grid_for(rows * ceil_div(cols, 2)), kThreads, 0, s>>>(
          static_cast<const int8_t*>(a.in0), static_cast<uint8_t*>(a.out0), rows, cols);
      return launch_error();
    case QMUON_CODEC_UNPACK_INT4:
      unpack_int4_kernel<<<grid_for(rows * cols), kThreads, 0, s>>>(static_cast<const uint8_t*>(a.in0),
                                                                    static_cast<int8_t*>(a.out0), rows, cols);
      return launch_error();
    case QMUON_CODEC_UE4M3_ENCODE:
      ue4m3_encode_kernel<<<grid_for(cols), kThreads, 0, s>>>(static_cast<const float*>(a.in0),
                                                              static_cast<uint8_t*>(a.out0), cols, a.flag);
      return launch_error();
    case QMUON_CODEC_UE4M3_DECODE:
      ue4m3_decode_kernel<<<grid_for(cols), kThreads, 0, s>>>(static_cast<const uint8_t*>(a.in0),
                                                              static_cast<float*>(a.out0), cols);
      return launch_error();
    case QMUON_CODEC_INT4_QUANTIZE:
      int4_quantize_kernel<<<grid_for(rows * ceil_div(cols, a.block_size)), kThreads, 0, s>>>(
          static_cast<const float*>(a.in0), static_cast<uint8_t*>(a.out0), static_cast<float*>(a.out1), rows, cols,
          a.block_size, a.stream, a.row_offset);
      return launch_error();
    case QMUON_CODEC_INT4_DEQUANTIZE:
      int4_dequantize_kernel<<<grid_for(rows * cols), kThreads, 0, s>>>(
          static_cast<const uint8_t*>(a.in0), static_cast<const float*>(a.in1), static_cast<float*>(a.out0), rows,
          cols, a.block_size);
      return launch_error();
    case QMUON_CODEC_E0M3_QUANTIZE: {
      if (a.flag) {
        amax_kernel<<<grid_for(rows * cols), kThreads, 0, s>>>(static_cast<const float*>(a.in0), rows * cols,
                                                               a.scratch);
        const int err = launch_error();
        if (err) return err;
      }
      e0m3_quantize_kernel<<<grid_for(rows * ceil_div(cols, kE0M3Block)), kThreads, 0, s>>>(
          static_cast<const float*>(a.in0), static_cast<uint8_t*>(a.out0), static_cast<uint8_t*>(a.out1),
          static_cast<float*>(a.out2), a.scratch, rows, cols, a.flag, a.stream, a.row_offset);
      return launch_error();
    }
    case QMUON_CODEC_E0M3_DEQUANTIZE:
      e0m3_dequantize_kernel<<<grid_for(rows * cols), kThreads, 0, s>>>(
          static_cast<const uint8_t*>(a.in0), static_cast<const uint8_t*>(a.in1), static_cast<const float*>(a.in2),
          static_cast<float*>(a.out0), rows, cols);
      return launch_error();
    case QMUON_CODEC_GRID_QUANTIZE: {
      amax_kernel<<<grid_for(rows * cols), kThreads, 0, s>>>(static_cast<const float*>(a.in0), rows * cols,
                                                             a.scratch);
      const int err = launch_error();
      if (err) return err;
      return grid_quantize(a, a.scratch, 1, s);
    }
    case QMUON_CODEC_GRID_QUANTIZE_WITH_SCALE:
      return grid_quantize(a, static_cast<const float*>(a.in1), 0, s);
    case QMUON_CODEC_GRID_DEQUANTIZE:
      grid_dequantize_kernel<<<grid_for(rows * cols), kThreads, 0, s>>>(
          static_cast<const uint8_t*>(a.in0), static_cast<const uint8_t*>(a.in1), static_cast<const uint8_t*>(a.in2),
          static_cast<const float*>(a.in3), static_cast<float*>(a.out0), rows, cols, a.block_size);
      return launch_error();
    default: return QMUON_ERR_BAD_OP;
  }
}

}  // namespace cuda4
}  // namespace qmuon

using namespace qmuon::cuda4;

extern "C" int qmuon_cuda_int4_momentum_update(const qmuon_q4_tensor* tensors, int64_t num_tensors,
                                               qmuon_q4_params params, void* cuda_stream) {
  if (const int err = qmuon::check_int4_update(params)) return err;
  return dispatch_grad<Int4Launch>(params.grad_dtype, tensors, num_tensors, params,
                                   static_cast<cudaStream_t>(cuda_stream));
}

extern "C" int qmuon_cuda_e0m3_momentum_update(const qmuon_q4_tensor* tensors, int64_t num_tensors,
                                               qmuon_q4_params params, void* cuda_stream) {
  if (const int err = qmuon::check_e0m3_update(params)) return err;
  return dispatch_grad<E0M3Launch>(params.grad_dtype, tensors, num_tensors, params,
                                   static_cast<cudaStream_t>(cuda_stream));
}

extern "C" int qmuon_cuda_e0m3_momentum_amax(const qmuon_q4_tensor* tensors, int64_t num_tensors,
                                             qmuon_q4_params params, void* cuda_stream) {
  if (const int err = qmuon::check_e0m3_amax(params)) return err;
  return dispatch_grad<E0M3AmaxLaunch>(params.grad_dtype, tensors, num_tensors, params,
                                       static_cast<cudaStream_t>(cuda_stream));
}

extern "C" int qmuon_cuda_dense_momentum_update(const qmuon_dense_tensor* tensors, int64_t num_tensors,
                                                qmuon_dense_params params, void* cuda_stream) {
  if (const int err = qmuon::check_dense_update(params)) return err;
  const cudaStream_t s = static_cast<cudaStream_t>(cuda_stream);
  switch (params.buf_dtype) {
    case QMUON_FLOAT32: return dispatch_grad<DenseF32Launch>(params.grad_dtype, tensors, num_tensors, params, s);
    case QMUON_BFLOAT16: return dispatch_grad<DenseBF16Launch>(params.grad_dtype, tensors, num_tensors, params, s);
    default: return QMUON_ERR_BAD_DTYPE;
  }
}

extern "C" int qmuon_cuda_codec(const qmuon_codec_args* args, void* cuda_stream) {
  if (args == nullptr) return QMUON_ERR_BAD_OP;
  return qmuon::cuda4::codec(*args, static_cast<cudaStream_t>(cuda_stream));
}
