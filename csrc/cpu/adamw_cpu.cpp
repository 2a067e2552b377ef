// CPU kernel of the quantized AdamW moment step (torch.ops.qmuon.adamw_q_update_): one pass per row
// block (decode m and v, update them, emit the fp32 AdamW update, re-encode), threaded over blocks with
// at::parallel_for. Maths: csrc/qmuon/adamw_math.h (bit-exact twin of ops/reference_adamw.py).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "cpu/vector_width.h"
#include "qmuon/adamw_kernels.h"
#include "qmuon/adamw_math.h"
#include "qmuon/kernels.h"

namespace qmuon {
namespace {

// Code values (adamw_load_code) of the n elements of a row of codes starting at column c0 (even:
// blocks are even). 4-bit codes are unpacked a byte (two columns) at a time, so the loop has no
// per-column nibble select and vectorizes.
template <int32_t K>
QMUON_HD void load_codes(const uint8_t* __restrict row, int64_t c0, int64_t n, float* __restrict out) {
  if (!adamw_kind_4bit(K)) {
    for (int64_t j = 0; j < n; ++j) out[j] = adamw_load_code(row, c0 + j, K);
    return;
  }
  const uint8_t* __restrict b = row + (c0 >> 1);
  const int64_t pairs = n >> 1;
  const int32_t off = K == kAdamM4 ? 8 : 0;  // signed m: nibble = code + 8
  for (int64_t k = 0; k < pairs; ++k) {
    const int32_t byte = b[k];
    out[2 * k] = static_cast<float>((byte & 0x0F) - off);
    out[2 * k + 1] = static_cast<float>((byte >> 4) - off);
  }
  if (n & 1) out[n - 1] = static_cast<float>((b[pairs] & 0x0F) - off);
}

// Encode a block's n moments into the row of codes at column c0: t = their adamw_stored values, x the
// moments themselves (m: x == t), `scale` the block scale. stream < 0: nearest; else stochastic, the
// noise of element j keyed by its global index index0 + j. 4-bit: the codes go to `tmp` first and
// are then packed two a byte (the high nibble of an odd tail is 0), loops that vectorize.
template <int32_t K>
QMUON_HD void store_codes(uint8_t* __restrict row, int64_t c0, int64_t n, const float* __restrict t,
                          const float* __restrict x, float scale, uint8_t* __restrict tmp, int64_t stream,
                          int64_t index0) {
  const float safe = scale > 0.0f ? scale : 1.0f;
  uint8_t* __restrict out = adamw_kind_4bit(K) ? tmp : row + c0;
  if (stream < 0) {
    for (int64_t j = 0; j < n; ++j) out[j] = static_cast<uint8_t>(adamw_code_bits(adamw_encode(t[j], safe, K), K));
  } else {
    const uint32_t s = adamw_moment_stream(static_cast<uint32_t>(stream), K);
    for (int64_t j = 0; j < n; ++j) {
      const float u = uniform_noise(static_cast<uint64_t>(index0 + j), s);
      out[j] = static_cast<uint8_t>(adamw_code_bits(adamw_encode_stochastic(t[j], x[j], scale, safe, K, u), K));
    }
  }
  if (!adamw_kind_4bit(K)) return;
  uint8_t* __restrict b = row + (c0 >> 1);
  const int64_t pairs = n >> 1;
  for (int64_t k = 0; k < pairs; ++k) b[k] = static_cast<uint8_t>(tmp[2 * k] | (tmp[2 * k + 1] << 4));
  if (n & 1) b[pairs] = tmp[n - 1];
}

// MK / VK: the moment kinds, fixed at compile time so that the always-inline maths folds its kind
// branches and g++ can vectorize the element loops (the results are the same for any MK / VK).
template <typename G, int32_t MK, int32_t VK>
QMUON_WIDE_VECTORS void adamw_block(const qmuon_adamw_q_args& a, const AdamWConsts& c, int64_t row, int64_t blk, float* __restrict mb,
                 float* __restrict vb, float* __restrict tb, uint8_t* __restrict tmp) {
  const int64_t c0 = blk * a.block_size;
  const int64_t n = (a.cols - c0) < a.block_size ? (a.cols - c0) : a.block_size;
  const auto* __restrict g = static_cast<const typename G::storage*>(a.grad) + row * a.grad_rs + c0;
  float* ms = a.m_scale + row * a.m_scale_rs + blk;
  float* vs = a.v_scale + row * a.v_scale_rs + blk;
  float* __restrict up = a.update + row * a.update_rs + c0;
  const float m_scale = *ms, v_scale = *vs;
  load_codes<MK>(a.m_codes + row * a.m_rs, c0, n, mb);
  load_codes<VK>(a.v_codes + row * a.v_rs, c0, n, vb);
  for (int64_t j = 0; j < n; ++j) {
    mb[j] = adamw_decode(mb[j], m_scale, MK);
    vb[j] = adamw_decode(vb[j], v_scale, VK);
  }
  uint32_t m_max = 0, v_max = 0;  // |x| bits: the unsigned order of finite floats' magnitudes
  for (int64_t j = 0; j < n; ++j) {
    up[j] = adamw_element(mb[j], vb[j], G::load(g[j]), c);
    tb[j] = adamw_stored(vb[j], VK);  // the sqrt the update just took (g++ reuses it)
    const uint32_t mbits = abs_bits(mb[j]), tbits = abs_bits(tb[j]);
    m_max = mbits > m_max ? mbits : m_max;
    v_max = tbits > v_max ? tbits : v_max;
  }
  const float new_ms = bits_f32(m_max), new_vs = bits_f32(v_max);
  *ms = new_ms;
  *vs = new_vs;
  const int64_t index0 = a.index0 + row * a.cols + c0;  // global index of the block's first element
  store_codes<MK>(a.m_codes + row * a.m_rs, c0, n, mb, mb, new_ms, tmp, a.stream, index0);
  store_codes<VK>(a.v_codes + row * a.v_rs, c0, n, tb, vb, new_vs, tmp, a.stream, index0);
}

template <typename G, int32_t MK, int32_t VK>
void adamw_run(const qmuon_adamw_q_args& a) {
  const AdamWConsts c = make_adamw_consts(a.beta1, a.beta2, a.eps, a.neg_step_size, a.bias_correction2_sqrt);
  const int64_t nb = (a.cols + a.block_size - 1) / a.block_size;
  const int64_t total = a.rows * nb;
  const int64_t grain = std::max<int64_t>(1, 32768 / a.block_size);
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    float mb[kMaxBlockSize];
    float vb[kMaxBlockSize];
    float tb[kMaxBlockSize];
    uint8_t tmp[kMaxBlockSize];
    for (int64_t i = begin; i < end; ++i) adamw_block<G, MK, VK>(a, c, i / nb, i % nb, mb, vb, tb, tmp);
  });
}

template <typename G>
void adamw_dispatch(const qmuon_adamw_q_args& a) {
  if (a.m_kind == kAdamM8 && a.v_kind == kAdamV8) return adamw_run<G, kAdamM8, kAdamV8>(a);
  if (a.m_kind == kAdamM4 && a.v_kind == kAdamV4) return adamw_run<G, kAdamM4, kAdamV4>(a);
  if (a.m_kind == kAdamM8) return adamw_run<G, kAdamM8, kAdamV4>(a);
  return adamw_run<G, kAdamM4, kAdamV8>(a);
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
  if (a.grad_dtype != QMUON_FLOAT32 && a.grad_dtype != QMUON_BFLOAT16 && a.grad_dtype != QMUON_FLOAT16)
    return QMUON_ERR_BAD_DTYPE;
  if (skipped(a.skip)) return 0;  // flagged: nothing is written (moments, scales, update)
  switch (a.grad_dtype) {
    case QMUON_FLOAT32: adamw_dispatch<F32>(a); return 0;
    case QMUON_BFLOAT16: adamw_dispatch<BF16>(a); return 0;
    case QMUON_FLOAT16: adamw_dispatch<F16>(a); return 0;
    default: return QMUON_ERR_BAD_DTYPE;
  }
}
