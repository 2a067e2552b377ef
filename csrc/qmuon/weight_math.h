// Per-element maths of the bf16 weight writes (stochastic rounding, FlashOptim-style 8-bit error
// correction), shared by the CPU (csrc/cpu/weight_cpu.cpp) and CUDA (csrc/cuda/weight_cuda.cu)
// kernels. The C++ twin of qmuon_lightning/ops/reference_weight.py, bit for bit: every fp32
// operation is separately rounded (fmul / fadd / fsub / fdiv from block_math.h), integers do the
// rest. No torch headers.
#pragma once

#include <stdint.h>

#include "qmuon/block_math.h"

namespace qmuon {

constexpr float kEccQMax = 127.0f;

// x = fp32(fp32(w * decay) + fp32(u * alpha))   (reference_weight.new_weight_fp32)
QMUON_HD float new_weight(float w, float u, float alpha, float decay) { return fadd(fmul(w, decay), fmul(u, alpha)); }

QMUON_HD bool finite_f32(float x) { return (f32_bits(x) & 0x7F800000u) != 0x7F800000u; }

// The top 16 bits of the counter hash of global index `index` (reference_weight._noise_bits16).
QMUON_HD uint32_t weight_noise_bits16(uint64_t index, uint32_t stream) {
  return fmix32(static_cast<uint32_t>(index) ^ uniform_noise_key(index, stream)) >> 16;
}

// fp32 -> bf16 bits, rounding away from zero with probability (discarded bits) / 2^16; non-finite
// values round to nearest (reference_weight.stochastic_round_bf16).
// Branch-free (an integer select), so the CPU loop vectorizes.
QMUON_HD uint16_t stochastic_bf16(float x, uint32_t bits16) {
  const uint32_t sr = (f32_bits(x) + bits16) >> 16;
  const uint32_t nearest = BF16::store(x);
  const uint32_t finite = 0u - static_cast<uint32_t>(finite_f32(x));  // all ones when finite
  return static_cast<uint16_t>((sr & finite) | (nearest & ~finite));
}

// h = 2^(e(w) - 8), half the bf16 gap at w (reference_weight.ecc8_half_ulp); exact, from bits.
QMUON_HD float ecc8_half_ulp(uint16_t wb) {
  int32_t e = static_cast<int32_t>((wb >> 7) & 0xFFu);
  e = e < 1 ? 1 : e;
  const int32_t k = e - 127 - 8;  // [-134, 120]
  return k >= -126 ? bits_f32(static_cast<uint32_t>(k + 127) << 23) : bits_f32(1u << (k + 149));
}

// master = fp32(w) + fp32(fp32(code / 127) * h)   (reference_weight.ecc8_decode)
QMUON_HD float ecc8_decode(uint16_t wb, int8_t code) {
  const float frac = fdiv(static_cast<float>(code), kEccQMax);
  return fadd(BF16::load(wb), fmul(frac, ecc8_half_ulp(wb)));
}

// round_half_even(clamp(fp32(fp32(x - w') / h) * 127, -127, 127)); 0 for non-finite x or w'
// (reference_weight.ecc8_encode).
// The division by the power of two h is done as two exact multiplications by 2^a and 2^b with
// a + b = -log2(h) and both within [-60, 67] (1/h alone overflows fp32 for the smallest h): the same
// bits as the reference's division (every step is exact), and no divider in the loop.
QMUON_HD int8_t ecc8_encode(float x, uint16_t wb) {
  const float w = BF16::load(wb);
  int32_t e = static_cast<int32_t>((wb >> 7) & 0xFFu);
  e = e < 1 ? 1 : e;
  const int32_t k = 135 - e;  // -log2(h), in [-120, 134]
  const int32_t a = k >> 1, b = k - a;  // arithmetic shift: floor(k / 2)
  const float err = fmul(fmul(fsub(x, w), bits_f32(static_cast<uint32_t>(a + 127) << 23)),
                         bits_f32(static_cast<uint32_t>(b + 127) << 23));
  float q = fmul(err, kEccQMax);
  q = q < -kEccQMax ? -kEccQMax : (q > kEccQMax ? kEccQMax : q);
  const int32_t code = static_cast<int32_t>(round_half_even(q));
  const uint32_t ok = 0u - static_cast<uint32_t>(finite_f32(x) & finite_f32(w) & (q == q));  // NaN-free codes
  return static_cast<int8_t>(static_cast<uint32_t>(code) & ok);
}

// One element of each op, the update `u` already widened to fp32.
QMUON_HD uint16_t bf16_weight_element(uint16_t wb, float u, float alpha, float decay, int64_t stream,
                                      uint64_t index) {
  const float x = new_weight(BF16::load(wb), u, alpha, decay);
  return stream < 0 ? BF16::store(x) : stochastic_bf16(x, weight_noise_bits16(index, static_cast<uint32_t>(stream)));
}

QMUON_HD void bf16_ecc8_element(uint16_t* wb, int8_t* code, float u, float alpha, float decay) {
  const float x = new_weight(ecc8_decode(*wb, *code), u, alpha, decay);
  const uint16_t nb = BF16::store(x);
  *code = ecc8_encode(x, nb);
  *wb = nb;
}

}  // namespace qmuon
