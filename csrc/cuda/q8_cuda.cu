// CUDA kernels of the 8-bit quantized-momentum ops. No torch headers: raw pointers and a
// cudaStream_t, launched through the C ABI in qmuon/kernels.h (called by csrc/binding_cuda.cpp).
//
// One warp owns one row block: it dequantizes, updates and writes the Newton-Schulz input, keeps
// the new momentum in shared memory (each lane re-reads only what it wrote, so no barrier), reduces
// absmax and sum of squares with warp shuffles, then requantizes. Lanes move 4 consecutive
// elements at a time when the matrix's alignment allows it (vec path), else one.
// All fp32 maths comes from qmuon/block_math.h (__fmul_rn & co.; built with --fmad=false too).
// A matrix whose `skip` flag (device memory) is set is not touched: each warp reads its matrix's flag
// before anything else and the whole warp leaves (no barrier in this kernel; the warp is its matrix's).
#include <cuda_runtime.h>

#include <stdint.h>

#include "qmuon/block_math.h"
#include "qmuon/kernels.h"
#include "qmuon/validate.h"

namespace qmuon {
namespace cuda_kernels {

constexpr int kWarp = 32;
constexpr int kMaxWarpsPerCta = 8;
constexpr int kSmemBudgetFloats = 8192;  // 32 KiB of staged momentum per CTA
constexpr int kMaxTensorsPerLaunch = 24;

// Kernel-parameter batch of matrices (kept well under the 4 KiB kernel-parameter limit).
struct Q8Batch {
  qmuon_q8_tensor t[kMaxTensorsPerLaunch];
  int64_t block_begin[kMaxTensorsPerLaunch + 1];  // prefix sums of rows * nb
  int64_t nb[kMaxTensorsPerLaunch];
  int32_t vec[kMaxTensorsPerLaunch];
  int32_t num_tensors;
};
static_assert(sizeof(Q8Batch) + 64 <= 4096, "kernel parameters must stay under 4 KiB");

__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xFFFFFFFFu, v);
#else
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const uint32_t w = __shfl_xor_sync(0xFFFFFFFFu, v, o);
    v = w > v ? w : v;
  }
  return v;
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fadd(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}

// 4 consecutive values of a grad dtype (vec path).
template <typename G>
struct Vec4;

template <>
struct Vec4<F32> {
  __device__ __forceinline__ static void load(const float* p, float v[4]) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x; v[1] = x.y; v[2] = x.z; v[3] = x.w;
  }
  __device__ __forceinline__ static void store(float* p, const float v[4]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  }
};

template <typename G16>
struct Vec4Half {
  __device__ __forceinline__ static void load(const uint16_t* p, float v[4]) {
    const uint2 x = *reinterpret_cast<const uint2*>(p);
    v[0] = G16::load(static_cast<uint16_t>(x.x & 0xFFFFu));
    v[1] = G16::load(static_cast<uint16_t>(x.x >> 16));
    v[2] = G16::load(static_cast<uint16_t>(x.y & 0xFFFFu));
    v[3] = G16::load(static_cast<uint16_t>(x.y >> 16));
  }
  __device__ __forceinline__ static void store(uint16_t* p, const float v[4]) {
    uint2 x;
    x.x = static_cast<uint32_t>(G16::store(v[0])) | (static_cast<uint32_t>(G16::store(v[1])) << 16);
    x.y = static_cast<uint32_t>(G16::store(v[2])) | (static_cast<uint32_t>(G16::store(v[3])) << 16);
    *reinterpret_cast<uint2*>(p) = x;
  }
};
template <>
struct Vec4<BF16> : Vec4Half<BF16> {};
template <>
struct Vec4<F16> : Vec4Half<F16> {};

template <typename CodeT>
__device__ __forceinline__ void load_codes4(const CodeT* p, float v[4]) {
  const uint32_t x = *reinterpret_cast<const uint32_t*>(p);
#pragma unroll
  for (int k = 0; k < 4; ++k) v[k] = CodeIO<CodeT>::load(static_cast<CodeT>((x >> (8 * k)) & 0xFFu));
}

template <typename CodeT>
__device__ __forceinline__ void store_codes4(CodeT* p, const float q[4]) {
  uint32_t x = 0;
#pragma unroll
  for (int k = 0; k < 4; ++k) x |= static_cast<uint32_t>(static_cast<uint8_t>(CodeIO<CodeT>::store(q[k]))) << (8 * k);
  *reinterpret_cast<uint32_t*>(p) = x;
}

__device__ __forceinline__ int find_tensor(const Q8Batch& batch, int64_t g) {
  int lo = 0, hi = batch.num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.block_begin[mid] <= g) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ float quantize_one(float m, float inv, bool stochastic, uint64_t index, uint32_t stream) {
  return stochastic ? quantize_stochastic(m, inv, uniform_noise(index, stream)) : quantize_nearest(m, inv);
}

template <typename CodeT, typename G>
__global__ void q8_momentum_update_kernel(const __grid_constant__ Q8Batch batch, const MomentumWeights mw,
                                          const int nesterov, const int64_t bs, const int warps_per_cta) {
  using GS = typename G::storage;
  extern __shared__ float4 smem4[];  // float4: 16-byte aligned for the vec path
  float* smem = reinterpret_cast<float*>(smem4);
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * warps_per_cta + warp;
  if (g >= batch.block_begin[batch.num_tensors]) return;  // whole warp leaves together
  const int ti = find_tensor(batch, g);
  const qmuon_q8_tensor& t = batch.t[ti];
  if (skipped(t.skip)) return;  // flagged matrix: the whole warp leaves before any load, store or shuffle
  const int64_t nb = batch.nb[ti];
  const int64_t local = g - batch.block_begin[ti];
  const int64_t r = local / nb;
  const int64_t b = local - r * nb;
  const int64_t c0 = b * bs;
  const int n = static_cast<int>(min(bs, t.cols - c0));
  CodeT* __restrict__ codes = static_cast<CodeT*>(t.codes) + r * t.codes_rs + c0;
  GS* __restrict__ grad = static_cast<GS*>(t.grad) + r * t.grad_rs + c0;
  float* absmax = t.absmax + r * t.absmax_rs + b;
  float* __restrict__ m_new = smem + static_cast<int64_t>(warp) * bs;
  const bool stochastic = t.stream >= 0;
  const uint32_t stream = static_cast<uint32_t>(t.stream);
  const uint64_t first_index =
      static_cast<uint64_t>(t.row_offset + r) * static_cast<uint64_t>(t.cols) + static_cast<uint64_t>(c0);

  // The first data loads are issued before the absmax load and the division (two dependent DRAM round
  // trips otherwise come first); each iteration then prefetches the next one's codes and grads.
  uint32_t amax_bits = 0;
  float ss = 0.0f;
  if (batch.vec[ti]) {
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f}, gv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (lane * 4 < n) {
      load_codes4(codes + lane * 4, c);
      Vec4<G>::load(grad + lane * 4, gv);
    }
    const float scale = dequant_scale(*absmax);
    for (int i = lane * 4; i < n; i += kWarp * 4) {
      float v[4], m[4], c_next[4], g_next[4];
      const bool more = i + kWarp * 4 < n;
      if (more) {
        load_codes4(codes + i + kWarp * 4, c_next);
        Vec4<G>::load(grad + i + kWarp * 4, g_next);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        m[k] = lerp(fmul(c[k], scale), gv[k], mw.to_grad);
        v[k] = nesterov ? lerp(gv[k], m[k], mw.to_mom) : m[k];
        const uint32_t ab = abs_bits(m[k]);
        amax_bits = ab > amax_bits ? ab : amax_bits;
        ss = fadd(ss, fmul(v[k], v[k]));
      }
      Vec4<G>::store(grad + i, v);
      *reinterpret_cast<float4*>(m_new + i) = make_float4(m[0], m[1], m[2], m[3]);
      if (more) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          c[k] = c_next[k];
          gv[k] = g_next[k];
        }
      }
    }
  } else {
    float c_first = 0.0f, g_first = 0.0f;
    if (lane < n) {
      c_first = CodeIO<CodeT>::load(codes[lane]);
      g_first = G::load(grad[lane]);
    }
    const float scale = dequant_scale(*absmax);
    for (int i = lane; i < n; i += kWarp) {
      const float gv = i == lane ? g_first : G::load(grad[i]);
      const float code = i == lane ? c_first : CodeIO<CodeT>::load(codes[i]);
      const float m = lerp(fmul(code, scale), gv, mw.to_grad);
      const float v = nesterov ? lerp(gv, m, mw.to_mom) : m;
      grad[i] = G::store(v);
      m_new[i] = m;
      const uint32_t ab = abs_bits(m);
      amax_bits = ab > amax_bits ? ab : amax_bits;
      ss = fadd(ss, fmul(v, v));
    }
  }
  const float amax = bits_f32(warp_max_u32(amax_bits));
  ss = warp_sum(ss);
  const float inv = quant_inv(amax);
  if (batch.vec[ti]) {
    for (int i = lane * 4; i < n; i += kWarp * 4) {
      const float4 m4 = *reinterpret_cast<const float4*>(m_new + i);
      const float m[4] = {m4.x, m4.y, m4.z, m4.w};
      float q[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) q[k] = quantize_one(m[k], inv, stochastic, first_index + i + k, stream);
      store_codes4(codes + i, q);
    }
  } else {
    for (int i = lane; i < n; i += kWarp) {
      codes[i] = CodeIO<CodeT>::store(quantize_one(m_new[i], inv, stochastic, first_index + i, stream));
    }
  }
  if (lane == 0) {
    *absmax = amax;
    if (t.sumsq != nullptr) t.sumsq[r * nb + b] = ss;
  }
}

template <typename CodeT>
__global__ void quantize_rows_kernel(const float* __restrict__ x, int64_t x_rs, CodeT* __restrict__ codes,
                                     float* __restrict__ absmax, int64_t rows, int64_t cols, int64_t bs,
                                     int64_t stream, int64_t row_offset) {
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t nb = (cols + bs - 1) / bs;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (g >= rows * nb) return;
  const int64_t r = g / nb;
  const int64_t b = g - r * nb;
  const int64_t c0 = b * bs;
  const int n = static_cast<int>(min(bs, cols - c0));
  const float* xb = x + r * x_rs + c0;
  CodeT* cb = codes + r * cols + c0;
  uint32_t amax_bits = 0;
  for (int i = lane; i < n; i += kWarp) {
    const uint32_t ab = abs_bits(xb[i]);
    amax_bits = ab > amax_bits ? ab : amax_bits;
  }
  const float amax = bits_f32(warp_max_u32(amax_bits));
  const float inv = quant_inv(amax);
  const uint64_t first_index =
      static_cast<uint64_t>(row_offset + r) * static_cast<uint64_t>(cols) + static_cast<uint64_t>(c0);
  for (int i = lane; i < n; i += kWarp) {
    cb[i] = CodeIO<CodeT>::store(
        quantize_one(xb[i], inv, stream >= 0, first_index + i, static_cast<uint32_t>(stream)));
  }
  if (lane == 0) absmax[r * nb + b] = amax;
}

template <typename CodeT>
__global__ void dequantize_rows_kernel(const CodeT* __restrict__ codes, int64_t codes_rs,
                                       const float* __restrict__ absmax, int64_t absmax_rs, float* __restrict__ out,
                                       int64_t rows, int64_t cols, int64_t bs) {
  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int64_t nb = (cols + bs - 1) / bs;
  const int64_t g = static_cast<int64_t>(blockIdx.x) * (blockDim.x / kWarp) + warp;
  if (g >= rows * nb) return;
  const int64_t r = g / nb;
  const int64_t b = g - r * nb;
  const int64_t c0 = b * bs;
  const int n = static_cast<int>(min(bs, cols - c0));
  const float scale = dequant_scale(absmax[r * absmax_rs + b]);
  const CodeT* cb = codes + r * codes_rs + c0;
  float* ob = out + r * cols + c0;
  for (int i = lane; i < n; i += kWarp) ob[i] = fmul(CodeIO<CodeT>::load(cb[i]), scale);
}

inline bool aligned(const void* p, uintptr_t a) { return (reinterpret_cast<uintptr_t>(p) % a) == 0; }

inline int update_warps_per_cta(int64_t bs) {
  int64_t w = kSmemBudgetFloats / bs;
  return static_cast<int>(w < 1 ? 1 : (w > kMaxWarpsPerCta ? kMaxWarpsPerCta : w));
}

template <typename CodeT, typename G>
int launch_q8_update(const qmuon_q8_tensor* tensors, int64_t num_tensors, const qmuon_q8_params& p,
                     cudaStream_t stream) {
  const MomentumWeights mw = make_momentum_weights(p.beta);
  const int64_t bs = p.block_size;
  const int warps = update_warps_per_cta(bs);
  const size_t smem = static_cast<size_t>(warps) * static_cast<size_t>(bs) * sizeof(float);
  const uintptr_t grad_vec_bytes = 4 * sizeof(typename G::storage);
  int64_t i = 0;
  while (i < num_tensors) {
    Q8Batch batch{};
    int count = 0;
    batch.block_begin[0] = 0;
    for (; i < num_tensors && count < kMaxTensorsPerLaunch; ++i) {
      const qmuon_q8_tensor& t = tensors[i];
      if (t.rows <= 0 || t.cols <= 0) continue;
      const int64_t nb = (t.cols + bs - 1) / bs;
      batch.t[count] = t;
      batch.nb[count] = nb;
      batch.vec[count] = bs % 4 == 0 && t.cols % 4 == 0 &&
                         (t.rows == 1 || (t.codes_rs % 4 == 0 && t.grad_rs % 4 == 0)) && aligned(t.codes, 4) &&
                         aligned(t.grad, grad_vec_bytes);
      batch.block_begin[count + 1] = batch.block_begin[count] + t.rows * nb;
      ++count;
    }
    batch.num_tensors = count;
    if (count == 0) continue;
    const int64_t total = batch.block_begin[count];
    const int64_t grid = (total + warps - 1) / warps;
    if (grid > 0x7FFFFFFFLL) return cudaErrorInvalidConfiguration;
    q8_momentum_update_kernel<CodeT, G><<<static_cast<unsigned>(grid), warps * kWarp, smem, stream>>>(
        batch, mw, p.nesterov, bs, warps);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename CodeT>
int dispatch_grad(const qmuon_q8_tensor* tensors, int64_t num_tensors, const qmuon_q8_params& p, cudaStream_t s) {
  switch (p.grad_dtype) {
    case QMUON_FLOAT32: return launch_q8_update<CodeT, F32>(tensors, num_tensors, p, s);
    case QMUON_BFLOAT16: return launch_q8_update<CodeT, BF16>(tensors, num_tensors, p, s);
    case QMUON_FLOAT16: return launch_q8_update<CodeT, F16>(tensors, num_tensors, p, s);
    default: return QMUON_ERR_BAD_DTYPE;
  }
}

constexpr int kRowKernelWarps = 8;

inline int64_t row_kernel_grid(int64_t rows, int64_t cols, int64_t bs) {
  return (rows * ((cols + bs - 1) / bs) + kRowKernelWarps - 1) / kRowKernelWarps;
}

}  // namespace cuda_kernels
}  // namespace qmuon

using namespace qmuon::cuda_kernels;

extern "C" int qmuon_cuda_q8_momentum_update(const qmuon_q8_tensor* tensors, int64_t num_tensors,
                                             qmuon_q8_params params, void* cuda_stream) {
  if (const int err = qmuon::check_q8_update(params)) return err;
  const cudaStream_t s = static_cast<cudaStream_t>(cuda_stream);
  switch (params.code_dtype) {
    case QMUON_INT8: return dispatch_grad<int8_t>(tensors, num_tensors, params, s);
    case QMUON_UINT8: return dispatch_grad<uint8_t>(tensors, num_tensors, params, s);
    default: return QMUON_ERR_BAD_DTYPE;
  }
}

extern "C" int qmuon_cuda_quantize_rows(const float* x, int64_t x_rs, void* codes, int32_t code_dtype, float* absmax,
                                        int64_t rows, int64_t cols, int64_t block_size, int64_t stream,
                                        int64_t row_offset, void* cuda_stream) {
  if (const int err = qmuon::check_rows_op(code_dtype, block_size)) return err;
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t grid = row_kernel_grid(rows, cols, block_size);
  if (grid > 0x7FFFFFFFLL) return cudaErrorInvalidConfiguration;
  const cudaStream_t s = static_cast<cudaStream_t>(cuda_stream);
  switch (code_dtype) {
    case QMUON_INT8:
      quantize_rows_kernel<int8_t><<<static_cast<unsigned>(grid), kRowKernelWarps * kWarp, 0, s>>>(
          x, x_rs, static_cast<int8_t*>(codes), absmax, rows, cols, block_size, stream, row_offset);
      break;
    case QMUON_UINT8:
      quantize_rows_kernel<uint8_t><<<static_cast<unsigned>(grid), kRowKernelWarps * kWarp, 0, s>>>(
          x, x_rs, static_cast<uint8_t*>(codes), absmax, rows, cols, block_size, stream, row_offset);
      break;
    default: return QMUON_ERR_BAD_DTYPE;
  }
  return cudaGetLastError();
}

extern "C" int qmuon_cuda_dequantize_rows(const void* codes, int64_t codes_rs, int32_t code_dtype,
                                          const float* absmax, int64_t absmax_rs, float* out, int64_t rows,
                                          int64_t cols, int64_t block_size, void* cuda_stream) {
  if (const int err = qmuon::check_rows_op(code_dtype, block_size)) return err;
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  const int64_t grid = row_kernel_grid(rows, cols, block_size);
  if (grid > 0x7FFFFFFFLL) return cudaErrorInvalidConfiguration;
  const cudaStream_t s = static_cast<cudaStream_t>(cuda_stream);
  switch (code_dtype) {
    case QMUON_INT8:
      dequantize_rows_kernel<int8_t><<<static_cast<unsigned>(grid), kRowKernelWarps * kWarp, 0, s>>>(
          static_cast<const int8_t*>(codes), codes_rs, absmax, absmax_rs, out, rows, cols, block_size);
      break;
    case QMUON_UINT8:
      dequantize_rows_kernel<uint8_t><<<static_cast<unsigned>(grid), kRowKernelWarps * kWarp, 0, s>>>(
          static_cast<const uint8_t*>(codes), codes_rs, absmax, absmax_rs, out, rows, cols, block_size);
      break;
    default: return QMUON_ERR_BAD_DTYPE;
  }
  return cudaGetLastError();
}

extern "C" const char* qmuon_cuda_error_string(int code) {
  const char* text = qmuon::qmuon_error_text(code);  // QMUON_ERR_* (qmuon/validate.h), else a CUDA error
  return text != nullptr ? text : cudaGetErrorString(static_cast<cudaError_t>(code));
}
