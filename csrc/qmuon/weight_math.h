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

// fp32 weights: torch's `w.mul_(decay); w.add_(u, alpha=alpha)`, i.e. fma(u, alpha, fp32(w * decay)),
// one rounding for the add (reference_weight.fp32_weight_update_). torch's CPU add kernel is
// vec::fmadd(other, alpha, self) in its vector loop and the same expression contracted to an FMA in
// its scalar tail on AVX2 / AVX-512 builds; nvcc contracts it on CUDA. A torch build that rounds
// twice (ATEN_CPU_CAPABILITY=default on x86) is detected at run time (ops/_kernels.py,
// fp32_write_matches_torch) and keeps the reference.
QMUON_HD float fp32_weight_element(float w, float u, float alpha, float decay) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(u, alpha, fmul(w, decay));
#else
  return __builtin_fmaf(u, alpha, fmul(w, decay));
#endif
}

// x = fp32(fp32(w * decay) + fp32(u * alpha))   (reference_weight.new_weight_fp32)
QMUON_HD float new_weight(float w, float u, float alpha, float decay) { return fadd(fmul(w, decay), fmul(u, alpha)); }

// The top 16 bits of the counter hash of global index `index` (reference_weight._noise_bits16).
QMUON_HD uint32_t weight_noise_bits16(uint64_t index, uint32_t stream) {
  return fmix32(static_cast<uint32_t>(index) ^ uniform_noise_key(index, stream)) >> 16;
}

// fp32 -> bf16 bits, rounding away from zero with probability (discarded bits) / 2^16; non-finite
// values round to nearest (reference_weight.stochastic_round_bf16). For +-inf the truncation already
// is the nearest rounding (the low 16 bits are zero and bits16 < 2^16 never carries), so only NaN
// needs the nearest store's canonical 0x7FC0.
// Every value is a 32-bit integer and the select is a mask: g++ 12 vectorizes the loop (a select
// mixing the 16-bit result with 32-bit operands, as `(sr & finite) | (BF16::store(x) & ~finite)`
// was, is a pattern its vectorizer rejects, and the loop stayed scalar).
QMUON_HD uint32_t stochastic_bf16_bits(float x, uint32_t bits16) {
  const uint32_t u = f32_bits(x);
  const uint32_t sr = (u + bits16) >> 16;
  const uint32_t nan = 0u - static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);  // all ones for NaN
  return (sr & ~nan) | (0x7FC0u & nan);
}

QMUON_HD uint16_t stochastic_bf16(float x, uint32_t bits16) {
  return static_cast<uint16_t>(stochastic_bf16_bits(x, bits16));
}

// 2^k, exact, for k in [-252, 254]: the product of two normal powers of two (2^(k/2) each), so a
// subnormal result (k < -126) needs no separate bit pattern or select.
QMUON_HD float pow2_exact(int32_t k) {
  const int32_t a = k >> 1, b = k - a;  // arithmetic shift: floor(k / 2)
  return fmul(bits_f32(static_cast<uint32_t>(a + 127) << 23), bits_f32(static_cast<uint32_t>(b + 127) << 23));
}

// max(biased exponent of bf16 bits wb, 1): zero and subnormals share the smallest normal's gap.
QMUON_HD int32_t ecc8_exponent(uint32_t wb) {
  const int32_t e = static_cast<int32_t>((wb >> 7) & 0xFFu);
  return e < 1 ? 1 : e;
}

// h = 2^(e(w) - 8), half the bf16 gap at w (reference_weight.ecc8_half_ulp); exact.
QMUON_HD float ecc8_half_ulp(uint16_t wb) { return pow2_exact(ecc8_exponent(wb) - 135); }  // k in [-134, 120]

// master = fp32(w) + fp32(fp32(code / 127) * h)   (reference_weight.ecc8_decode)
QMUON_HD float ecc8_decode(uint16_t wb, int8_t code) {
  const float frac = fdiv(static_cast<float>(code), kEccQMax);
  return fadd(BF16::load(wb), fmul(frac, ecc8_half_ulp(wb)));
}

// round_half_even(clamp(fp32(fp32(x - w') / h) * 127, -127, 127)) as a 32-bit integer; 0 for
// non-finite x or w' (reference_weight.ecc8_encode); `wb` = BF16::store(x) as 32 bits.
// The division by the power of two h is done as two exact multiplications by 2^a and 2^b with
// a + b = -log2(h) and both within [-60, 67] (1/h alone overflows fp32 for the smallest h): the same
// bits as the reference's division (every step is exact), and no divider in the loop. 32-bit
// integers throughout, masks for the selects: the CPU loop vectorizes (see stochastic_bf16_bits).
QMUON_HD uint32_t ecc8_encode_bits(float x, uint32_t wb) {
  const float w = bits_f32(wb << 16);
  const int32_t k = 135 - ecc8_exponent(wb);  // -log2(h), in [-120, 134]
  const int32_t a = k >> 1, b = k - a;
  const float err = fmul(fmul(fsub(x, w), bits_f32(static_cast<uint32_t>(a + 127) << 23)),
                         bits_f32(static_cast<uint32_t>(b + 127) << 23));
  float q = fmul(err, kEccQMax);
  q = q > -kEccQMax ? q : -kEccQMax;  // NaN -> -127 here; its code is masked to 0 below
  q = q < kEccQMax ? q : kEccQMax;
  const uint32_t code = static_cast<uint32_t>(static_cast<int32_t>(round_half_even(q)));
  // x finite and w' finite (w' = nearest(x) is non-finite only when x is or overflows): no NaN code
  const uint32_t ok = 0u - static_cast<uint32_t>(((f32_bits(x) & 0x7F800000u) != 0x7F800000u) &
                                                  ((wb & 0x7F80u) != 0x7F80u));
  return code & ok;
}

QMUON_HD int8_t ecc8_encode(float x, uint16_t wb) { return static_cast<int8_t>(ecc8_encode_bits(x, wb)); }

// bf16 round-to-nearest-even bits of x as a 32-bit integer (BF16::store, NaN -> 0x7FC0), for loops
// that keep every lane 32 bits wide.
QMUON_HD uint32_t bf16_nearest_bits(float x) {
#if defined(__CUDA_ARCH__)
  return BF16::store(x);
#else
  const uint32_t u = f32_bits(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = 0u - static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
  return (rounded & ~nan) | (0x7FC0u & nan);
#endif
}

// One element of each op, the update `u` already widened to fp32.
QMUON_HD uint16_t bf16_weight_element(uint16_t wb, float u, float alpha, float decay, int64_t stream,
                                      uint64_t index) {
  const float x = new_weight(BF16::load(wb), u, alpha, decay);
  return stream < 0 ? BF16::store(x) : stochastic_bf16(x, weight_noise_bits16(index, static_cast<uint32_t>(stream)));
}

// The error-corrected write of one element: new bf16 bits (low 16 bits of .w) and code (low 8 bits
// of .code), from the stored bits and code.
struct Ecc8Bits {
  uint32_t w;
  uint32_t code;
};

QMUON_HD Ecc8Bits bf16_ecc8_bits(uint16_t wb, int8_t code, float u, float alpha, float decay) {
  const float x = new_weight(ecc8_decode(wb, code), u, alpha, decay);
  Ecc8Bits out;
  out.w = bf16_nearest_bits(x);
  out.code = ecc8_encode_bits(x, out.w);
  return out;
}

QMUON_HD void bf16_ecc8_element(uint16_t* wb, int8_t* code, float u, float alpha, float decay) {
  const Ecc8Bits b = bf16_ecc8_bits(*wb, *code, u, alpha, decay);
  *code = static_cast<int8_t>(b.code);
  *wb = static_cast<uint16_t>(b.w);
}

}  // namespace qmuon
