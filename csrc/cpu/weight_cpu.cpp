// CPU kernels of the bf16 weight writes (nearest, stochastic, 8-bit error-corrected): one row at a
// time, threads over rows with at::parallel_for; the per-element maths is qmuon/weight_math.h, shared
// with the CUDA kernel, so results equal the reference (ops/reference_weight.py) bit for bit.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

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

extern "C" int qmuon_cpu_bf16_weight_update(const qmuon_weight_args* args) {
  using namespace qmuon;
  switch (args->update_dtype) {
    case QMUON_FLOAT32: weight_update<F32>(*args); return 0;
    case QMUON_BFLOAT16: weight_update<BF16>(*args); return 0;
    case QMUON_FLOAT16: weight_update<F16>(*args); return 0;
    default: return QMUON_ERR_BAD_DTYPE;
  }
}
