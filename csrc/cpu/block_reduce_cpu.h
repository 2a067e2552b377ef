// Per-block reductions shared by the CPU kernels (q8_cpu.cpp, q4_cpu.cpp): written so that
// g++ -O3 vectorizes them while keeping a fixed, documented summation order.
#pragma once

#include <cstdint>

#include "qmuon/block_math.h"

namespace qmuon {
namespace cpu {

constexpr int kLanes = 16;  // independent fp32 accumulators of a block's sum of squares

// Sum of squares of x[0:n] with kLanes interleaved partial sums (element i -> lane i % kLanes)
// combined pairwise.
inline float sum_squares(const float* __restrict x, int64_t n) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) acc[j] = fadd(acc[j], fmul(x[i + j], x[i + j]));
  }
  for (int j = 0; i + j < n; ++j) acc[j] = fadd(acc[j], fmul(x[i + j], x[i + j]));
  for (int w = kLanes / 2; w > 0; w /= 2) {
    for (int j = 0; j < w; ++j) acc[j] = fadd(acc[j], acc[j + w]);
  }
  return acc[0];
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
