// CPU kernels of the bf16 weight writes (nearest, stochastic, 8-bit error-corrected): one row at a
// time, threads over rows with at::parallel_for; the per-element maths is qmuon/weight_math.h, shared
// with the CUDA kernel, so results equal the reference (ops/reference_weight.py) bit for bit.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "qmuon/block_math.h"
#include "qmuon/kernels.h"
#include "qmuon/weight_kernels.h"
#include "qmuon/weight_math.h"

namespace qmuon {
namespace {

template <typename U>
void weight_rows(const qmuon_weight_args& a, int64_t r0, int64_t r1) {
  using S = typename U::storage;
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* __restrict w = a.param + r * a.param_rs;
    const S* __restrict u = static_cast<const S*>(a.update) + r * a.update_rs;
    if (a.ecc != nullptr) {
      int8_t* __restrict code = a.ecc + r * a.ecc_rs;
      for (int64_t c = 0; c < a.cols; ++c) bf16_ecc8_element(w + c, code + c, U::load(u[c]), a.alpha, a.decay);
    } else if (a.stream < 0) {
      for (int64_t c = 0; c < a.cols; ++c) w[c] = BF16::store(new_weight(BF16::load(w[c]), U::load(u[c]), a.alpha, a.decay));
    } else {
      const uint64_t base = static_cast<uint64_t>(a.index0 + r * a.index_rs);
      const uint32_t stream = static_cast<uint32_t>(a.stream);
      for (int64_t c = 0; c < a.cols; ++c) {
        const float x = new_weight(BF16::load(w[c]), U::load(u[c]), a.alpha, a.decay);
        w[c] = stochastic_bf16(x, weight_noise_bits16(base + static_cast<uint64_t>(c), stream));
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
