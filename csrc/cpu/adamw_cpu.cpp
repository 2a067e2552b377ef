// CPU kernel of the quantized AdamW moment step (torch.ops.qmuon.adamw_q_update_): one pass per row
// block (decode m and v, update them, emit the fp32 AdamW update, re-encode), threaded over blocks with
// at::parallel_for. Maths: csrc/qmuon/adamw_math.h (bit-exact twin of ops/reference_adamw.py).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "qmuon/adamw_kernels.h"
#include "qmuon/adamw_math.h"
#include "qmuon/kernels.h"

namespace qmuon {
namespace {

template <typename G>
void adamw_block(const qmuon_adamw_q_args& a, const AdamWConsts& c, int64_t row, int64_t blk, float* mb,
                 float* vb) {
  const int64_t c0 = blk * a.block_size;
  const int64_t n = (a.cols - c0) < a.block_size ? (a.cols - c0) : a.block_size;
  const auto* g = static_cast<const typename G::storage*>(a.grad) + row * a.grad_rs + c0;
  const uint8_t* mrow = a.m_codes + row * a.m_rs;
  const uint8_t* vrow = a.v_codes + row * a.v_rs;
  float* ms = a.m_scale + row * a.m_scale_rs + blk;
  float* vs = a.v_scale + row * a.v_scale_rs + blk;
  float* up = a.update + row * a.update_rs + c0;
  const float m_scale = *ms, v_scale = *vs;
  for (int64_t j = 0; j < n; ++j) {
    mb[j] = adamw_decode(adamw_load_code(mrow, c0 + j, a.m_kind), m_scale, a.m_kind);
    vb[j] = adamw_decode(adamw_load_code(vrow, c0 + j, a.v_kind), v_scale, a.v_kind);
  }
  uint32_t m_max = 0, v_max = 0;  // |x| bits: the unsigned order of finite floats' magnitudes
  for (int64_t j = 0; j < n; ++j) {
    up[j] = adamw_element(mb[j], vb[j], G::load(g[j]), c);
    vb[j] = adamw_stored(vb[j], a.v_kind);
    const uint32_t mbits = abs_bits(mb[j]), vbits = abs_bits(vb[j]);
    m_max = mbits > m_max ? mbits : m_max;
    v_max = vbits > v_max ? vbits : v_max;
  }
  const float new_ms = bits_f32(m_max), new_vs = bits_f32(v_max);
  const float m_safe = new_ms > 0.0f ? new_ms : 1.0f, v_safe = new_vs > 0.0f ? new_vs : 1.0f;
  *ms = new_ms;
  *vs = new_vs;
  uint8_t* mw = a.m_codes + row * a.m_rs;
  uint8_t* vw = a.v_codes + row * a.v_rs;
  if (!adamw_kind_4bit(a.m_kind)) {
    for (int64_t j = 0; j < n; ++j) mw[c0 + j] = static_cast<uint8_t>(adamw_code_bits(adamw_encode(mb[j], m_safe, a.m_kind), a.m_kind));
  } else {
    for (int64_t j = 0; j < n; j += 2) {
      const uint32_t lo = adamw_code_bits(adamw_encode(mb[j], m_safe, a.m_kind), a.m_kind);
      const uint32_t hi = j + 1 < n ? adamw_code_bits(adamw_encode(mb[j + 1], m_safe, a.m_kind), a.m_kind) : 0u;
      mw[(c0 + j) >> 1] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
  if (!adamw_kind_4bit(a.v_kind)) {
    for (int64_t j = 0; j < n; ++j) vw[c0 + j] = static_cast<uint8_t>(adamw_code_bits(adamw_encode(vb[j], v_safe, a.v_kind), a.v_kind));
  } else {
    for (int64_t j = 0; j < n; j += 2) {
      const uint32_t lo = adamw_code_bits(adamw_encode(vb[j], v_safe, a.v_kind), a.v_kind);
      const uint32_t hi = j + 1 < n ? adamw_code_bits(adamw_encode(vb[j + 1], v_safe, a.v_kind), a.v_kind) : 0u;
      vw[(c0 + j) >> 1] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

template <typename G>
void adamw_run(const qmuon_adamw_q_args& a) {
  const AdamWConsts c = make_adamw_consts(a.beta1, a.beta2, a.eps, a.neg_step_size, a.bias_correction2_sqrt);
  const int64_t nb = (a.cols + a.block_size - 1) / a.block_size;
  const int64_t total = a.rows * nb;
  const int64_t grain = std::max<int64_t>(1, 32768 / a.block_size);
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    float mb[kMaxBlockSize];
    float vb[kMaxBlockSize];
    for (int64_t i = begin; i < end; ++i) adamw_block<G>(a, c, i / nb, i % nb, mb, vb);
  });
}

}  // namespace
}  // namespace qmuon

extern "C" int qmuon_cpu_adamw_q_update(const qmuon_adamw_q_args* args) {
  using namespace qmuon;
  const qmuon_adamw_q_args& a = *args;
  if (a.block_size < 2 || a.block_size > kMaxBlockSize || (a.block_size & 1)) return QMUON_ERR_BAD_BLOCK_SIZE;
  if ((a.m_kind != kAdamM8 && a.m_kind != kAdamM4) || (a.v_kind != kAdamV8 && a.v_kind != kAdamV4))
    return QMUON_ERR_BAD_OP;
  if (a.rows <= 0 || a.cols <= 0) return 0;
  switch (a.grad_dtype) {
    case QMUON_FLOAT32: adamw_run<F32>(a); return 0;
    case QMUON_BFLOAT16: adamw_run<BF16>(a); return 0;
    case QMUON_FLOAT16: adamw_run<F16>(a); return 0;
    default: return QMUON_ERR_BAD_DTYPE;
  }
}
