// CPU kernels of the 8-bit quantized-momentum ops: one row block at a time, threads over row
// blocks with at::parallel_for, inner loops written so that g++ -O3 vectorizes them (fixed-order
// fp32 maths from block_math.h, integer max for the absmax, 16-lane sums of squares). One loop has
// an AVX-512 form beside its portable one (store_codes: clamp, round and narrow to bytes), because
// g++ compiles the portable clamp into compare-and-blend sequences there; both give the same codes.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/block_reduce_cpu.h"
#include "qmuon/abi_layout.h"
#include "qmuon/block_math.h"
#include "qmuon/kernels.h"
#include "qmuon/validate.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace qmuon {
namespace {

using cpu::kLanes;
using cpu::sum_squares;
constexpr int64_t kPrefetchBlocks = 4;  // software prefetch distance of the update, in row blocks

// Work per parallel_for chunk: ~32K elements.
int64_t grain_blocks(int64_t block_size) { return std::max<int64_t>(1, 32768 / block_size); }

inline float absmax_of(const float* __restrict x, int64_t n) { return bits_f32(cpu::absmax_bits(x, n)); }

// Codes from fp32 values: code = clamp(round(x * inv), -127, 127), NaN -> 0, stored as CodeT; the
// portable loop is block_math.h's quantize_nearest / quantize_stochastic. ROUND is nearest (ties to
// even) or floor (stochastic rounding: x then already holds x * inv + u, and inv is 1, an exact
// multiply). The AVX-512 loop clamps before it rounds, which gives the same code as rounding first
// (the bounds are integers and rounding is monotone), and masks NaN to 0 in the conversion: 13-19%
// faster update than the portable int32 staging buffer plus narrowing loop (kernel_ab).
#if defined(__AVX512F__)
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
constexpr int kFloor = _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC;
#else
constexpr int kNearest = 0;
constexpr int kFloor = 1;
#endif

template <int ROUND>
inline int32_t code_of(float x, float inv) {
  const float q = fmul(x, inv);
  return static_cast<int32_t>(clamp_code(ROUND == kNearest ? round_half_even(q) : round_down(q)));
}

template <typename CodeT, int ROUND>
inline void store_codes(const float* __restrict x, float inv, CodeT* __restrict codes, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // g++ turns the portable loop below into three compares and two blends per vector for the clamp
  // and a separate round; here: max, min, one conversion with the rounding mode and NaN mask built
  // in, and a narrowing store.
  const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-kQMax), hi = _mm512_set1_ps(kQMax);
  for (; i + 16 <= n; i += 16) {
    const __m512 q = _mm512_mul_ps(_mm512_loadu_ps(x + i), vinv);
    const __mmask16 is_num = _mm512_cmp_ps_mask(q, q, _CMP_ORD_Q);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
    __m512i qi = _mm512_maskz_cvt_roundps_epi32(is_num, c, ROUND);
    if constexpr (std::is_same_v<CodeT, uint8_t>) qi = _mm512_add_epi32(qi, _mm512_set1_epi32(128));
    _mm512_mask_cvtepi32_storeu_epi8(codes + i, 0xFFFF, qi);
  }
  for (; i < n; ++i) codes[i] = CodeIO<CodeT>::store_int(code_of<ROUND>(x[i], inv));
#else
  // Portable: codes into an int32 staging buffer, then narrowed to bytes in a second loop. One loop
  // from floats straight to bytes makes g++ vectorize 64 codes per iteration through mask and byte-
  // permute sequences; split, each loop runs 16 lanes wide and the narrowing is a plain pack.
  alignas(64) int32_t qi[kMaxBlockSize];
  for (; i < n; ++i) qi[i] = code_of<ROUND>(x[i], inv);
  for (i = 0; i < n; ++i) codes[i] = CodeIO<CodeT>::store_int(qi[i]);
#endif
}

template <typename CodeT, bool STOCHASTIC>
inline void quantize_block(const float* __restrict x, CodeT* __restrict codes, int64_t n, float inv,
                           uint64_t first_index, uint32_t stream) {
  if (!STOCHASTIC) {
    store_codes<CodeT, kNearest>(x, inv, codes, n);
    return;
  }
  alignas(64) float t[kMaxBlockSize];  // x * inv + u, then floored
  const uint32_t lo0 = static_cast<uint32_t>(first_index);
  if (static_cast<uint64_t>(lo0) + static_cast<uint64_t>(n) <= (uint64_t{1} << 32)) {
    // The high word of the index is the same for the whole block: 32-bit counter, vectorizes.
    const uint32_t key = uniform_noise_key(first_index, stream);
    const int32_t n32 = static_cast<int32_t>(n);
    for (int32_t i = 0; i < n32; ++i) {
      t[i] = fadd(fmul(x[i], inv), uniform_noise_lo(lo0 + static_cast<uint32_t>(i), key));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      t[i] = fadd(fmul(x[i], inv), uniform_noise(first_index + static_cast<uint64_t>(i), stream));
    }
  }
  store_codes<CodeT, kFloor>(t, 1.0f, codes, n);
}

// One matrix of the fused update: for each row block, dequantize, update, write the NS input,
// requantize, write absmax and the block's sum of squares.
template <typename CodeT, typename G, bool NESTEROV, bool STOCHASTIC>
void q8_update_matrix(const qmuon_q8_tensor& t, const MomentumWeights& mw, int64_t bs) {
  using GS = typename G::storage;
  const int64_t nb = (t.cols + bs - 1) / bs;
  const uint32_t stream = static_cast<uint32_t>(t.stream);
  at::parallel_for(0, t.rows * nb, grain_blocks(bs), [&](int64_t begin, int64_t end) {
    alignas(64) float m_new[kMaxBlockSize];
    alignas(64) float ns[kMaxBlockSize];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r = blk / nb;
      const int64_t b = blk - r * nb;
      const int64_t c0 = b * bs;
      const int64_t n = std::min(bs, t.cols - c0);
      CodeT* __restrict codes = static_cast<CodeT*>(t.codes) + r * t.codes_rs + c0;
      GS* __restrict grad = static_cast<GS*>(t.grad) + r * t.grad_rs + c0;
      float* absmax = t.absmax + r * t.absmax_rs + b;

      if (sizeof(GS) == 4) {
        // Software prefetch kPrefetchBlocks ahead (same row layout assumed; prefetches never fault):
        // the requantize phase below touches no memory, so keep DRAM busy meanwhile. fp32 grads only:
        // with 16-bit grads the loop is compute-bound and the prefetches cost 3-5% (measured).
        const uintptr_t pg = reinterpret_cast<uintptr_t>(grad) + kPrefetchBlocks * bs * sizeof(GS);
        const uintptr_t pc = reinterpret_cast<uintptr_t>(codes) + kPrefetchBlocks * bs * sizeof(CodeT);
        for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(GS)); off += 64) {
          __builtin_prefetch(reinterpret_cast<const void*>(pg + off), 1);
        }
        for (int64_t off = 0; off < n; off += 64) __builtin_prefetch(reinterpret_cast<const void*>(pc + off), 1);
      }
      const float scale = dequant_scale(*absmax);
      const MomentumWeights w = mw;  // local copy: the stores below cannot alias it
      // The new absmax is an integer max over |m| bits, taken in this loop (an exact, order-free
      // reduction that keeps it vectorized) rather than in a second pass over m_new: ~3% faster.
      uint32_t amax_bits = 0;
      // beta in [0.5, 1) (every practical momentum) makes the weight 1 - beta small and beta large:
      // that case runs with both lerp branches fixed at compile time (two fewer vector ops per lerp).
      auto update_loop = [&](auto typical) {
        for (int64_t i = 0; i < n; ++i) {
          const float m_old = fmul(CodeIO<CodeT>::load(codes[i]), scale);
          const float g = G::load(grad[i]);
          const float m = typical ? lerp_fixed<true>(m_old, g, w.to_grad) : lerp(m_old, g, w.to_grad);
          const float v = NESTEROV ? (typical ? lerp_fixed<false>(g, m, w.to_mom) : lerp(g, m, w.to_mom)) : m;
          grad[i] = G::store(v);
          m_new[i] = m;
          ns[i] = v;
          const uint32_t ab = abs_bits(m);
          amax_bits = ab > amax_bits ? ab : amax_bits;
        }
      };
      if (w.to_grad.small && !w.to_mom.small) {
        update_loop(std::true_type{});
      } else {
        update_loop(std::false_type{});
      }
      const float amax = bits_f32(amax_bits);
      if (t.sumsq != nullptr) t.sumsq[r * nb + b] = sum_squares(ns, n);
      *absmax = amax;
      const uint64_t first_index = static_cast<uint64_t>(t.row_offset + r) * static_cast<uint64_t>(t.cols) +
                                   static_cast<uint64_t>(c0);
      quantize_block<CodeT, STOCHASTIC>(m_new, codes, n, quant_inv(amax), first_index, stream);
    }
  });
}

template <typename CodeT, typename G>
void q8_update_dispatch_flags(const qmuon_q8_tensor& t, const MomentumWeights& mw, int64_t bs, bool nesterov) {
  const bool stochastic = t.stream >= 0;
  if (nesterov && stochastic) {
    q8_update_matrix<CodeT, G, true, true>(t, mw, bs);
  } else if (nesterov) {
    q8_update_matrix<CodeT, G, true, false>(t, mw, bs);
  } else if (stochastic) {
    q8_update_matrix<CodeT, G, false, true>(t, mw, bs);
  } else {
    q8_update_matrix<CodeT, G, false, false>(t, mw, bs);
  }
}

template <typename CodeT>
int q8_update_dispatch_grad(const qmuon_q8_tensor& t, const MomentumWeights& mw, const qmuon_q8_params& p) {
  switch (p.grad_dtype) {
    case QMUON_FLOAT32: q8_update_dispatch_flags<CodeT, F32>(t, mw, p.block_size, p.nesterov != 0); return 0;
    case QMUON_BFLOAT16: q8_update_dispatch_flags<CodeT, BF16>(t, mw, p.block_size, p.nesterov != 0); return 0;
    case QMUON_FLOAT16: q8_update_dispatch_flags<CodeT, F16>(t, mw, p.block_size, p.nesterov != 0); return 0;
    default: return QMUON_ERR_BAD_DTYPE;
  }
}

template <typename CodeT>
void quantize_matrix(const float* x, int64_t x_rs, CodeT* codes, float* absmax, int64_t rows, int64_t cols,
                     int64_t bs, int64_t stream, int64_t row_offset) {
  const int64_t nb = (cols + bs - 1) / bs;
  at::parallel_for(0, rows * nb, grain_blocks(bs), [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r = blk / nb;
      const int64_t b = blk - r * nb;
      const int64_t c0 = b * bs;
      const int64_t n = std::min(bs, cols - c0);
      const float* xb = x + r * x_rs + c0;
      const float amax = absmax_of(xb, n);
      absmax[r * nb + b] = amax;
      const uint64_t first_index =
          static_cast<uint64_t>(row_offset + r) * static_cast<uint64_t>(cols) + static_cast<uint64_t>(c0);
      if (stream >= 0) {
        quantize_block<CodeT, true>(xb, codes + r * cols + c0, n, quant_inv(amax), first_index,
                                    static_cast<uint32_t>(stream));
      } else {
        quantize_block<CodeT, false>(xb, codes + r * cols + c0, n, quant_inv(amax), first_index, 0u);
      }
    }
  });
}

template <typename CodeT>
void dequantize_matrix(const CodeT* codes, int64_t codes_rs, const float* absmax, int64_t absmax_rs, float* out,
                       int64_t rows, int64_t cols, int64_t bs) {
  const int64_t nb = (cols + bs - 1) / bs;
  at::parallel_for(0, rows * nb, grain_blocks(bs), [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r = blk / nb;
      const int64_t b = blk - r * nb;
      const int64_t c0 = b * bs;
      const int64_t n = std::min(bs, cols - c0);
      const CodeT* __restrict c = codes + r * codes_rs + c0;
      float* __restrict o = out + r * cols + c0;
      const float scale = dequant_scale(absmax[r * absmax_rs + b]);
      for (int64_t i = 0; i < n; ++i) o[i] = fmul(CodeIO<CodeT>::load(c[i]), scale);
    }
  });
}

}  // namespace
}  // namespace qmuon

// The struct layout of the C ABI as this compiler lays it out (qmuon/abi_layout.h): qmuon/ops/_cabi.py
// compares it with its ctypes mirror before calling the qmuon_cpu_* functions through it.
extern "C" int64_t qmuon_cpu_abi_layout(int64_t* out, int64_t capacity) { return qmuon::abi_layout(out, capacity); }

extern "C" const char* qmuon_cpu_vector_isa(void) {
#if defined(__AVX512F__)
  return "avx512";
#else
  return "portable";
#endif
}

extern "C" int qmuon_cpu_q8_momentum_update(const qmuon_q8_tensor* tensors, int64_t num_tensors,
                                            qmuon_q8_params params) {
  using namespace qmuon;
  if (const int err = check_q8_update(params)) return err;
  const MomentumWeights mw = make_momentum_weights(params.beta);
  for (int64_t i = 0; i < num_tensors; ++i) {
    const qmuon_q8_tensor& t = tensors[i];
    if (t.rows <= 0 || t.cols <= 0 || skipped(t.skip)) continue;  // a flagged matrix: nothing is written
    int err = 0;
    switch (params.code_dtype) {
      case QMUON_INT8: err = q8_update_dispatch_grad<int8_t>(t, mw, params); break;
      case QMUON_UINT8: err = q8_update_dispatch_grad<uint8_t>(t, mw, params); break;
      default: err = QMUON_ERR_BAD_DTYPE;
    }
    if (err) return err;
  }
  return 0;
}

extern "C" int qmuon_cpu_quantize_rows(const float* x, int64_t x_rs, void* codes, int32_t code_dtype, float* absmax,
                                       int64_t rows, int64_t cols, int64_t block_size, int64_t stream,
                                       int64_t row_offset) {
  using namespace qmuon;
  if (const int err = check_rows_op(code_dtype, block_size)) return err;
  if (rows <= 0 || cols <= 0) return 0;
  switch (code_dtype) {
    case QMUON_INT8:
      quantize_matrix(x, x_rs, static_cast<int8_t*>(codes), absmax, rows, cols, block_size, stream, row_offset);
      return 0;
    case QMUON_UINT8:
      quantize_matrix(x, x_rs, static_cast<uint8_t*>(codes), absmax, rows, cols, block_size, stream, row_offset);
      return 0;
    default: return QMUON_ERR_BAD_DTYPE;
  }
}

extern "C" int qmuon_cpu_dequantize_rows(const void* codes, int64_t codes_rs, int32_t code_dtype, const float* absmax,
                                         int64_t absmax_rs, float* out, int64_t rows, int64_t cols,
                                         int64_t block_size) {
  using namespace qmuon;
  if (const int err = check_rows_op(code_dtype, block_size)) return err;
  if (rows <= 0 || cols <= 0) return 0;
  switch (code_dtype) {
    case QMUON_INT8:
      dequantize_matrix(static_cast<const int8_t*>(codes), codes_rs, absmax, absmax_rs, out, rows, cols, block_size);
      return 0;
    case QMUON_UINT8:
      dequantize_matrix(static_cast<const uint8_t*>(codes), codes_rs, absmax, absmax_rs, out, rows, cols, block_size);
      return 0;
    default: return QMUON_ERR_BAD_DTYPE;
  }
}
