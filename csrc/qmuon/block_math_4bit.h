// Per-element / per-block maths of the 4-bit formats (int4, e0m3, grid), shared by the CPU (g++) and
// CUDA (nvcc) kernels; the C++ twin of qmuon_lightning/ops/reference_4bit.py. Same rules as
// block_math.h: every fp32 operation separately rounded (fmul/fadd/fsub/fdiv), the reference's
// formulas in the reference's order, so codes, scales and the Newton-Schulz input are bit-identical.
//
// Nibbles: sign-magnitude codes -7..7, nibble = (c < 0) << 3 | |c|; column 2j in the low nibble of
// byte j, column 2j + 1 in the high nibble (an odd last column leaves the high nibble 0).
// UE4M3: the bit pattern of a float8_e4m3fn (4 exponent bits, bias 7, 3 mantissa bits); encode and
// decode are ports of c10's fp8e4m3fn_from_fp32_value / fp8e4m3fn_to_fp32_value (what the
// reference's `.to(torch.float8_e4m3fn)` / `.view(float8_e4m3fn).float()` run), so they agree with
// torch on every bit pattern, NaN included.
#pragma once

#include "qmuon/block_math.h"

namespace qmuon {

constexpr float kQMax4 = 7.0f;
constexpr int64_t kE0M3Block = 16;
constexpr float kUE4M3Max = 448.0f;
constexpr float kE0M3ScaleDiv = 3136.0f;  // QMAX4 * UE4M3_MAX, the per-tensor scale's divisor (exact)

// ---------------------------------------------------------------------------------------------
// Nibbles
// ---------------------------------------------------------------------------------------------
// q: an integer-valued float in [-7, 7] (a clamped code; -0.0 packs as 0).
QMUON_HD uint32_t code_to_nibble(float q) {
  const int32_t c = static_cast<int32_t>(q);
  return static_cast<uint32_t>(c < 0 ? 8 - c : c);
}

// Nibble -> code as a float; nibble 8 ("-0", never written) decodes to +0 like the reference.
QMUON_HD float nibble_to_code(uint32_t n) {
  const int32_t mag = static_cast<int32_t>(n & 7u);
  const int32_t neg = -static_cast<int32_t>((n >> 3) & 1u);  // 0 or -1: branch-free negate (vectorizes)
  return static_cast<float>((mag ^ neg) - neg);
}

QMUON_HD uint8_t pack_nibbles(uint32_t lo, uint32_t hi) { return static_cast<uint8_t>(lo | (hi << 4)); }

// clamp(q, -7, 7), NaN -> 0 (reference._round_codes).
QMUON_HD float clamp_code4(float q) {
  q = q < -kQMax4 ? -kQMax4 : q;
  q = q > kQMax4 ? kQMax4 : q;
  return q != q ? 0.0f : q;
}

// round(x) or floor(x + u), then clamp (reference._round_codes on an already-scaled value).
QMUON_HD float round_code4(float scaled, bool stochastic, float u) {
  return clamp_code4(stochastic ? round_down(fadd(scaled, u)) : round_half_even(scaled));
}

// ---------------------------------------------------------------------------------------------
// UE4M3 (float8_e4m3fn bit patterns)
// ---------------------------------------------------------------------------------------------
QMUON_HD uint32_t clz32(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return static_cast<uint32_t>(__clz(x));
#else
  return x != 0 ? static_cast<uint32_t>(__builtin_clz(x)) : 32u;
#endif
}

// c10::detail::fp8e4m3fn_to_fp32_value.
QMUON_HD float ue4m3_decode(uint32_t input) {
  const uint32_t w = (input & 0xFFu) << 24;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t nonsign = w & 0x7FFFFFFFu;
  uint32_t renorm_shift = clz32(nonsign);
  renorm_shift = renorm_shift > 4 ? renorm_shift - 4 : 0;
  const int32_t inf_nan_mask = (static_cast<int32_t>(nonsign + 0x01000000u) >> 8) & INT32_C(0x7F800000);
  const int32_t zero_mask = static_cast<int32_t>(nonsign - 1) >> 31;
  const uint32_t result =
      sign | ((((nonsign << renorm_shift >> 4) + ((0x78u - renorm_shift) << 23)) | static_cast<uint32_t>(inf_nan_mask)) &
              ~static_cast<uint32_t>(zero_mask));
  return bits_f32(result);
}

// c10::detail::fp8e4m3fn_from_fp32_value (round to nearest even, saturating).
QMUON_HD uint32_t fp8e4m3fn_from_f32(float f) {
  const uint32_t fp8_max = 1087u << 20;
  const uint32_t denorm_mask = 141u << 23;
  uint32_t f_bits = f32_bits(f);
  uint32_t result = 0u;
  const uint32_t sign = f_bits & 0x80000000u;
  f_bits ^= sign;
  if (f_bits >= fp8_max) {
    result = f_bits > 0x7F800000u ? 0x7Fu : 0x7Eu;
  } else if (f_bits < (121u << 23)) {
    f_bits = f32_bits(fadd(bits_f32(f_bits), bits_f32(denorm_mask)));
    result = (f_bits - denorm_mask) & 0xFFu;
  } else {
    const uint32_t mant_odd = (f_bits >> 20) & 1u;
    f_bits += (static_cast<uint32_t>(7 - 127) << 23) + 0x7FFFFu;
    f_bits += mant_odd;
    result = (f_bits >> 20) & 0xFFu;
    if (result == 0x7Fu) result = 0x7Eu;
  }
  return result | (sign >> 24);
}

// reference_4bit.ue4m3_encode: nan_to_num(0), clamp(0, 448) (a -0.0 stays -0.0, as torch.clamp
// keeps it), nearest even; round_up: the next pattern when the decoded value is below x.
QMUON_HD uint32_t ue4m3_encode(float x, bool round_up) {
  x = x != x ? 0.0f : x;
  x = x < 0.0f ? 0.0f : x;
  x = x > kUE4M3Max ? kUE4M3Max : x;
  uint32_t bits = fp8e4m3fn_from_f32(x);
  if (round_up && ue4m3_decode(bits) < x) bits = (bits + 1u) & 0xFFu;
  return bits;
}

// ---------------------------------------------------------------------------------------------
// int4 (blockwise absmax, QMAX 7)
// ---------------------------------------------------------------------------------------------
QMUON_HD float int4_dequant_scale(float absmax) { return fdiv(absmax, kQMax4); }  // a / 7 (true division)

QMUON_HD float int4_quant_inv(float absmax) {  // reciprocal(a) * 7
  const float safe = absmax > 0.0f ? absmax : 1.0f;
  return fmul(fdiv(1.0f, safe), kQMax4);
}

// ---------------------------------------------------------------------------------------------
// e0m3 (two-level scales)
// ---------------------------------------------------------------------------------------------
// reference_4bit.e0m3_tensor_scale from the tensor's max |x| (as bits, NaN above everything):
// t = amax / 3136, 1 when t is not a positive finite number.
QMUON_HD float e0m3_tensor_scale_from_amax(float amax) {
  const float t = fdiv(amax, kE0M3ScaleDiv);
  const bool ok = t > 0.0f && t <= 3.4028234663852886e38f;  // false for NaN and inf
  return ok ? t : 1.0f;
}

// max |m| reported from its bits (abs_bits, max-reduced): NaN as the one quiet NaN 0x7FC00000, the pattern
// reference_4bit.e0m3_momentum_amax returns (a max over bits keeps whichever NaN payload is largest).
QMUON_HD float amax_from_bits(uint32_t bits) { return bits_f32(bits > 0x7F800000u ? 0x7FC00000u : bits); }

// Block scale bits: ue4m3_ceil(block_amax / (7 * t)).
QMUON_HD uint32_t e0m3_scale_bits(float block_amax, float t) {
  return ue4m3_encode(fdiv(block_amax, fmul(kQMax4, t)), true);
}

// Decoded step of a block: decode(s) * t.
QMUON_HD float e0m3_step(uint32_t s_bits, float t) { return fmul(ue4m3_decode(s_bits), t); }

// Code of x in a block with decoded step `step` (0 when step is not > 0).
QMUON_HD float e0m3_code(float x, float step, bool stochastic, float u) {
  const float safe = step > 0.0f ? step : 1.0f;
  const float q = round_code4(fdiv(x, safe), stochastic, u);
  return step > 0.0f ? q : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Grid (GRASP residual)
// ---------------------------------------------------------------------------------------------
// t = amax / 448, 1 when not a positive finite number.
QMUON_HD float grid_scale_from_amax(float amax) {
  const float t = fdiv(amax, kUE4M3Max);
  const bool ok = t > 0.0f && t <= 3.4028234663852886e38f;
  return ok ? t : 1.0f;
}

// min(decode(row_bits) * t, decode(col_bits) * t)
QMUON_HD float grid_den(uint32_t row_bits, uint32_t col_bits, float t) {
  const float r = fmul(ue4m3_decode(row_bits), t);
  const float c = fmul(ue4m3_decode(col_bits), t);
  return c < r ? c : (r != r ? r : (c != c ? c : r));  // torch.minimum: NaN propagates
}

// round(x / safe * 7), 0 when den is not > 0.
QMUON_HD float grid_code(float x, float den, bool stochastic, float u) {
  const float safe = den > 0.0f ? den : 1.0f;
  const float q = round_code4(fmul(fdiv(x, safe), kQMax4), stochastic, u);
  return den > 0.0f ? q : 0.0f;
}

// c * (den / 7)
QMUON_HD float grid_dequant(float code, float den) { return fmul(code, fdiv(den, kQMax4)); }

// ---------------------------------------------------------------------------------------------
// Dense momentum (torch.lerp as torch computes it: one fused multiply-add)
// ---------------------------------------------------------------------------------------------
// torch's CPU lerp kernel (vectorized: fmadd(coeff, end - start, base) with coeff = w or w - 1 and
// base = start or end; its scalar tail is contracted to the same FMA) and its CUDA kernel (nvcc
// contracts `start + w * diff`) round once: base + coeff * diff with a single rounding. The binding
// checks at load time that this torch build does so (see _extension.py), else dense stays on the
// reference.
QMUON_HD float fused_lerp(float start, float end, const LerpWeight& lw) {
  const float diff = fsub(end, start);
  const float base = lw.small ? start : end;
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(lw.coef, diff, base);
#else
  return __builtin_fmaf(lw.coef, diff, base);
#endif
}

// fp32 -> bf16 bits, stochastically: (bits + (h >> 16)) & 0xFFFF0000 for finite x
// (reference._round_to_bf16 with r = trunc(u * 65536) = h >> 16); non-finite x round to nearest.
QMUON_HD uint16_t bf16_stochastic(float x, uint32_t r16) {
  const uint32_t u = f32_bits(x);
  if ((u & 0x7F800000u) == 0x7F800000u) return BF16::store(x);
  return static_cast<uint16_t>((u + r16) >> 16);
}

// The 16 random bits of element `index`: h >> 16 where u = (h >> 8) * 2**-24 is its uniform noise.
QMUON_HD uint32_t noise_bits16(uint64_t index, uint32_t stream) {
  return fmix32(static_cast<uint32_t>(index) ^ uniform_noise_key(index, stream)) >> 16;
}

}  // namespace qmuon
