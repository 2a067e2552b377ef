// Per-block reductions shared by the CPU kernels (q8_cpu.cpp, q4_cpu.cpp): written so that
// g++ -O3 vectorizes them while keeping a fixed, documented summation order.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "qmuon/block_math.h"

namespace qmuon {
namespace cpu {

constexpr int kLanes = 16;  // independent fp32 accumulators of a block's sum of squares

// Sum of squares of x[0:n]: element i goes to partial sum i % 32 (two 16-lane vector accumulators,
// so consecutive adds do not wait on each other), lane j + 16 is added to lane j, then the 16 lanes
// are combined pairwise (j + 8 into j, then j + 4, j + 2, j + 1). The order is fixed for every build;
// it differs from the reference's, which the tests allow for (see tests/_helpers.sumsq_rtol). AVX-512
// builds add each square with a fused multiply-add (one rounding instead of two: a smaller error,
// and 1-2% off the update's time in paired runs); other builds multiply, then add.
//
// Written with GCC / Clang vector types: with plain float arrays g++ vectorized the loop but then
// combined the lanes one scalar at a time through the stack, and that cost more than the loop for a
// 256-element block (the whole sum went from +8-12% of the update's time to +3-4%).
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
static_assert(kLanes == 16, "sum_squares is written for 16 lanes");

// acc + v * v, the square not rounded on its own where the CPU has a fused multiply-add (one vector
// operation instead of two; the kernels are built with -ffp-contract=off, so this is explicit).
// (By reference: a 64-byte vector passed or returned by value draws g++'s -Wpsabi note in builds
// without AVX-512.)
inline void add_square(f32x16& acc, const f32x16& v) {
#if defined(__AVX512F__)
  acc = reinterpret_cast<f32x16>(_mm512_fmadd_ps(reinterpret_cast<__m512>(v), reinterpret_cast<__m512>(v),
                                                 reinterpret_cast<__m512>(acc)));
#else
  acc = acc + v * v;
#endif
}

template <typename Half, typename Full>
inline Half add_halves(const Full& v) {
  Half lo, hi;
  std::memcpy(&lo, &v, sizeof(Half));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(Half), sizeof(Half));
  return lo + hi;
}

inline float sum_squares(const float* __restrict x, int64_t n) {
  f32x16 acc = {}, acc_odd = {};
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    f32x16 v, w;
    std::memcpy(&v, x + i, sizeof(v));
    std::memcpy(&w, x + i + kLanes, sizeof(w));
    add_square(acc, v);
    add_square(acc_odd, w);
  }
  acc = acc + acc_odd;
  for (; i + kLanes <= n; i += kLanes) {
    f32x16 v;
    std::memcpy(&v, x + i, sizeof(v));
    add_square(acc, v);
  }
  for (int j = 0; i + j < n; ++j) acc[j] = fadd(acc[j], fmul(x[i + j], x[i + j]));
  const f32x4 h4 = add_halves<f32x4>(add_halves<f32x8>(acc));
  return fadd(fadd(h4[0], h4[2]), fadd(h4[1], h4[3]));
}

// Bits of max |x[0:n]|: an integer max over the sign-cleared bit patterns (exact for finite
// values, and it vectorizes).
inline uint32_t absmax_bits(const float* __restrict x, int64_t n) {
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = abs_bits(x[i]);
    m = b > m ? b : m;
  }
  return m;
}

}  // namespace cpu
}  // namespace qmuon
