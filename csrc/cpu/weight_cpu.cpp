// CPU kernels of the weight writes: bf16 (nearest, stochastic, 8-bit error-corrected) one row at a
// time, threads over rows with at::parallel_for; the per-element maths is qmuon/weight_math.h, shared
// with the CUDA kernel, so results equal the reference (ops/reference_weight.py) bit for bit. The fp32
// write (decay and update in one pass, any update strides) is at the end.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu/vector_width.h"
#include "qmuon/block_math.h"
#include "qmuon/kernels.h"
#include "qmuon/weight_kernels.h"
#include "qmuon/weight_math.h"

namespace qmuon {
namespace {

template <typename U>
QMUON_WIDE_VECTORS void weight_rows(const qmuon_weight_args& a, int64_t r0, int64_t r1) {
  using S = typename U::storage;
  // Locals: the int8 codes may alias anything (char type), so fields read through `a` inside the
  // loops would have to be reloaded and the loops would not vectorize.
  const int64_t cols = a.cols;
  const float alpha = a.alpha, decay = a.decay;
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* __restrict w = a.param + r * a.param_rs;
    const S* __restrict u = static_cast<const S*>(a.update) + r * a.update_rs;
    if (a.ecc != nullptr) {
      int8_t* __restrict code = a.ecc + r * a.ecc_rs;
      for (int64_t c = 0; c < cols; ++c) {
        const Ecc8Bits b = bf16_ecc8_bits(w[c], code[c], U::load(u[c]), alpha, decay);
        code[c] = static_cast<int8_t>(b.code);
        w[c] = static_cast<uint16_t>(b.w);
      }
    } else if (a.stream < 0) {
      for (int64_t c = 0; c < cols; ++c) w[c] = BF16::store(new_weight(BF16::load(w[c]), U::load(u[c]), alpha, decay));
    } else {
      // Runs of indices with one high word share the hash key, so the loop keeps a 32-bit counter
      // (and vectorizes); a row crossing a multiple of 2^32 is split there.
      const uint64_t base = static_cast<uint64_t>(a.index0 + r * a.index_rs);
      const uint32_t stream = static_cast<uint32_t>(a.stream);
      for (int64_t c0 = 0; c0 < cols;) {
        const uint64_t i0 = base + static_cast<uint64_t>(c0);
        const uint32_t lo = static_cast<uint32_t>(i0);
        const int64_t n = std::min<int64_t>(cols - c0, static_cast<int64_t>((uint64_t{1} << 32) - lo));
        const uint32_t key = uniform_noise_key(i0, stream);
        uint16_t* __restrict wr = w + c0;
        const S* __restrict ur = u + c0;
        for (int64_t j = 0; j < n; ++j) {
          const float x = new_weight(BF16::load(wr[j]), U::load(ur[j]), alpha, decay);
          wr[j] = stochastic_bf16(x, fmix32((lo + static_cast<uint32_t>(j)) ^ key) >> 16);
        }
        c0 += n;
      }
    }
  }
}

template <typename U>
void weight_update(const qmuon_weight_args& a) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(a.cols, 1));
  at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) { weight_rows<U>(a, r0, r1); });
}

}  // namespace
}  // namespace qmuon

namespace qmuon {
namespace {
bool update_dtype_ok(int32_t d) { return d == QMUON_FLOAT32 || d == QMUON_BFLOAT16 || d == QMUON_FLOAT16; }
}  // namespace
}  // namespace qmuon

extern "C" int qmuon_cpu_bf16_weight_update(const qmuon_weight_args* args) {
  using namespace qmuon;
  if (!update_dtype_ok(args->update_dtype)) return QMUON_ERR_BAD_DTYPE;
  if (skipped(args->skip)) return 0;  // flagged: neither the weights nor their error codes are written
  switch (args->update_dtype) {
    case QMUON_FLOAT32: weight_update<F32>(*args); return 0;
    case QMUON_BFLOAT16: weight_update<BF16>(*args); return 0;
    case QMUON_FLOAT16: weight_update<F16>(*args); return 0;
    default: return QMUON_ERR_BAD_DTYPE;
  }
}

// ---------------------------------------------------------------------------------------------
// fp32 weights: param <- fma(update, alpha, fp32(param * decay)), one pass over the weights
// ---------------------------------------------------------------------------------------------
namespace qmuon {
namespace {

// Tile of the transposed read: kTile x kTile update elements widened into an fp32 buffer (16 KiB for
// 64 x 64: stays in L1 with the weight rows it updates).
constexpr int64_t kTile = 64;

// Row-major update (unit column stride): one vectorized loop per row.
template <typename U>
QMUON_WIDE_VECTORS void fp32_rows(const qmuon_fp32_weight_args& a, int64_t r0, int64_t r1) {
  using S = typename U::storage;
  const int64_t cols = a.cols;
  const float alpha = a.alpha, decay = a.decay;
  for (int64_t r = r0; r < r1; ++r) {
    float* __restrict w = a.param + r * a.param_rs;
    const S* __restrict u = static_cast<const S*>(a.update) + r * a.update_rs;
    for (int64_t c = 0; c < cols; ++c) w[c] = fp32_weight_element(w[c], U::load(u[c]), alpha, decay);
  }
}

#if defined(__AVX2__)
// 8 consecutive update elements widened to fp32 (exact, as U::load).
template <typename U>
inline __m256 load8(const typename U::storage* p) {
  if constexpr (std::is_same_v<U, F32>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if constexpr (std::is_same_v<U, BF16>) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    } else {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
  }
}

// In-register transpose of the 8 x 8 block r[0..7] (the classic unpack / shuffle / permute network).
inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
  const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

// buf[i * kTile + j] = fp32(update[rt + i, ct + j]) for a column-major update: data movement only
// (the widening is exact), 8 x 8 blocks transposed in registers where AVX2 is available (g++ leaves
// the element-wise transpose scalar: 4x slower than the row-major write, measured).
template <typename U>
inline void load_tile_transposed(const typename U::storage* __restrict ubase, int64_t update_cs, int64_t rt,
                                 int64_t ct, int64_t nr, int64_t nc, float* __restrict buf) {
  int64_t j0 = 0;
#if defined(__AVX2__)
#if defined(__F16C__)
  constexpr bool kVec = true;
#else
  constexpr bool kVec = !std::is_same_v<U, F16>;  // fp16 widening needs F16C
#endif
  if constexpr (kVec) {
    for (; j0 + 8 <= nc; j0 += 8) {
      int64_t i0 = 0;
      for (; i0 + 8 <= nr; i0 += 8) {
        __m256 r[8];
        for (int k = 0; k < 8; ++k) r[k] = load8<U>(ubase + (ct + j0 + k) * update_cs + rt + i0);
        transpose8(r);
        for (int k = 0; k < 8; ++k) _mm256_storeu_ps(buf + (i0 + k) * kTile + j0, r[k]);
      }
      for (int64_t j = j0; j < j0 + 8; ++j)
        for (int64_t i = i0; i < nr; ++i) buf[i * kTile + j] = U::load(ubase[(ct + j) * update_cs + rt + i]);
    }
  }
#endif
  for (int64_t j = j0; j < nc; ++j) {
    const typename U::storage* __restrict ucol = ubase + (ct + j) * update_cs + rt;  // contiguous along rows
    for (int64_t i = 0; i < nr; ++i) buf[i * kTile + j] = U::load(ucol[i]);
  }
}

// Column-major update (unit row stride: a transposed Newton-Schulz output): each kTile x kTile tile is
// read along its contiguous columns into an fp32 buffer, then applied row by row (vectorized), so
// neither the update nor the weights are walked with a large stride element by element.
template <typename U>
QMUON_WIDE_VECTORS void fp32_rows_transposed(const qmuon_fp32_weight_args& a, int64_t r0, int64_t r1) {
  using S = typename U::storage;
  alignas(64) float buf[kTile * kTile];
  const float alpha = a.alpha, decay = a.decay;
  const S* __restrict ubase = static_cast<const S*>(a.update);
  for (int64_t rt = r0; rt < r1; rt += kTile) {
    const int64_t nr = std::min<int64_t>(kTile, r1 - rt);
    for (int64_t ct = 0; ct < a.cols; ct += kTile) {
      const int64_t nc = std::min<int64_t>(kTile, a.cols - ct);
      load_tile_transposed<U>(ubase, a.update_cs, rt, ct, nr, nc, buf);
      for (int64_t i = 0; i < nr; ++i) {
        float* __restrict w = a.param + (rt + i) * a.param_rs + ct;
        const float* __restrict b = buf + i * kTile;
        for (int64_t j = 0; j < nc; ++j) w[j] = fp32_weight_element(w[j], b[j], alpha, decay);
      }
    }
  }
}

// Any other strides: element by element.
template <typename U>
void fp32_rows_strided(const qmuon_fp32_weight_args& a, int64_t r0, int64_t r1) {
  using S = typename U::storage;
  const S* ubase = static_cast<const S*>(a.update);
  for (int64_t r = r0; r < r1; ++r) {
    float* w = a.param + r * a.param_rs;
    for (int64_t c = 0; c < a.cols; ++c)
      w[c] = fp32_weight_element(w[c], U::load(ubase[r * a.update_rs + c * a.update_cs]), a.alpha, a.decay);
  }
}

template <typename U>
void fp32_weight_update(const qmuon_fp32_weight_args& a) {
  if (a.rows <= 0 || a.cols <= 0) return;
  const bool row_major = a.cols <= 1 || a.update_cs == 1;
  const bool col_major = !row_major && (a.rows <= 1 || a.update_rs == 1);
  // Whole tiles per thread for the transposed read; ~32K elements per task otherwise.
  int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(a.cols, 1));
  if (col_major) grain = ((grain + kTile - 1) / kTile) * kTile;
  at::parallel_for(0, a.rows, grain, [&](int64_t r0, int64_t r1) {
    if (row_major) {
      fp32_rows<U>(a, r0, r1);
    } else if (col_major) {
      fp32_rows_transposed<U>(a, r0, r1);
    } else {
      fp32_rows_strided<U>(a, r0, r1);
    }
  });
}

}  // namespace
}  // namespace qmuon

extern "C" int qmuon_cpu_fp32_weight_update(const qmuon_fp32_weight_args* args) {
  using namespace qmuon;
  if (!update_dtype_ok(args->update_dtype)) return QMUON_ERR_BAD_DTYPE;
  if (skipped(args->skip)) return 0;  // flagged: the weights are not written
  switch (args->update_dtype) {
    case QMUON_FLOAT32: fp32_weight_update<F32>(*args); return 0;
    case QMUON_BFLOAT16: fp32_weight_update<BF16>(*args); return 0;
    case QMUON_FLOAT16: fp32_weight_update<F16>(*args); return 0;
    default: return QMUON_ERR_BAD_DTYPE;
  }
}
