// Per-element maths of the quantized AdamW moments, shared by the CPU (g++) and CUDA (nvcc) kernels
// (csrc/cpu/adamw_cpu.cpp, csrc/cuda/adamw_cuda.cu). No torch headers.
//
// The C++ twin of qmuon_lightning/ops/reference_adamw.py, bit for bit: the rules of block_math.h
// (separately rounded fp32 operations in the reference's order, no FMA, correctly rounded sqrt).
//
// Moment kinds (reference_adamw.MOMENT_KINDS), blocks of `block_size` elements along a row, one fp32
// scale per block:
//   0  m, int8:      c = 2u / (1 + |u|), u = m / max|m|; code = rint(127 c)       (softsign compander)
//   1  v, uint8:     t = sqrt(v) / max sqrt(v); code = rint(256 t) - 1 in [0, 255]; s = (code + 1) / 256 * scale
//   2  m, 4-bit:     as 0 with 7 levels, nibble = code + 8
//   3  v, 4-bit:     t = v^(1/4) / max v^(1/4); code = rint(16 t) - 1 in [0, 15]; v = (s s)(s s)
// The second-moment maps have no zero code: a stored v is 0 only when its whole block is.
//
// Rounding of the codes: nearest (adamw_encode), or stochastic (adamw_encode_stochastic): between the
// two codes around the moment x, the upper with probability (x - x_lo) / (x_hi - x_lo) of their
// *decoded* values, so the decoded moment is unbiased (E[decode] = x, also through the non-linear
// maps). Noise: uniform_noise(global element index, adamw_moment_stream(stream, kind)) of block_math.h.
#pragma once

#include "qmuon/block_math.h"

namespace qmuon {

enum AdamWMomentKind : int32_t { kAdamM8 = 0, kAdamV8 = 1, kAdamM4 = 2, kAdamV4 = 3 };

QMUON_HD bool adamw_kind_signed(int32_t kind) { return kind == kAdamM8 || kind == kAdamM4; }
QMUON_HD bool adamw_kind_4bit(int32_t kind) { return kind == kAdamM4 || kind == kAdamV4; }

QMUON_HD float adamw_levels(int32_t kind) {
  return kind == kAdamM8 ? 127.0f : kind == kAdamV8 ? 256.0f : kind == kAdamM4 ? 7.0f : 16.0f;
}

QMUON_HD float fabs_bits(float x) { return bits_f32(abs_bits(x)); }

// The largest finite fp32. A finite gradient whose square overflows (|g| > ~1.8e19) would make v
// infinite, and an infinite block scale freezes every element of its block for good; the new moments
// are clamped to +-kFltMax instead (NaN passes through; the optimizer never feeds NaN gradients).
constexpr float kFltMax = 3.40282346638528859812e+38f;

QMUON_HD float clamp_finite(float x) {
  x = x > kFltMax ? kFltMax : x;
  return x < -kFltMax ? -kFltMax : x;
}

QMUON_HD float fsqrt(float x) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(x);
#else
  return __builtin_sqrtf(x);  // IEEE correctly rounded (no -ffast-math)
#endif
}

// The fp32 constants of one step, rounded from the Python doubles as the reference does.
struct AdamWConsts {
  LerpWeight to_grad;  // weight 1 - beta1 (m = lerp(m, g, 1 - beta1))
  float beta2;
  float one_minus_beta2;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
  float bias_correction2_sqrt;
};

QMUON_HD AdamWConsts make_adamw_consts(double beta1, double beta2, double eps, double neg_step_size,
                                       double bias_correction2_sqrt) {
  AdamWConsts c;
  c.to_grad = make_lerp_weight(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.neg_step_size = static_cast<float>(neg_step_size);
  c.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
  return c;
}

// One element: new m, v (in place) and the AdamW update (neg_step * m) / (sqrt(v) / bc2 + eps).
QMUON_HD float adamw_element(float& m, float& v, float g, const AdamWConsts& c) {
  m = clamp_finite(lerp(m, g, c.to_grad));
  v = clamp_finite(fadd(fmul(v, c.beta2), fmul(fmul(g, c.one_minus_beta2), g)));
  const float denom = fadd(fdiv(fsqrt(v), c.bias_correction2_sqrt), c.eps);
  return fdiv(fmul(m, c.neg_step_size), denom);
}

// The stored quantity whose block max is the scale: m, sqrt(v) or v^(1/4).
QMUON_HD float adamw_stored(float x, int32_t kind) {
  if (adamw_kind_signed(kind)) return x;
  const float s = fsqrt(x);
  return kind == kAdamV4 ? fsqrt(s) : s;
}

// Code value (as a float: signed -L..L for m, 0..L-1 for v) -> the moment.
QMUON_HD float adamw_decode(float q, float scale, int32_t kind) {
  const float L = adamw_levels(kind);
  if (adamw_kind_signed(kind)) {
    const float cc = fdiv(q, L);
    const float u = fdiv(cc, fsub(2.0f, fabs_bits(cc)));
    return fmul(u, scale);
  }
  const float s = fmul(fdiv(fadd(q, 1.0f), L), scale);
  if (kind == kAdamV8) return fmul(s, s);
  const float s2 = fmul(s, s);
  return fmul(s2, s2);
}

// Stored quantity t (adamw_stored) and the block's safe scale (scale > 0 ? scale : 1) -> code value.
QMUON_HD float adamw_encode(float t, float safe, int32_t kind) {
  const float L = adamw_levels(kind);
  const float u = fdiv(t, safe);
  if (adamw_kind_signed(kind)) {
    const float cc = fdiv(fmul(u, 2.0f), fadd(fabs_bits(u), 1.0f));
    float q = round_half_even(fmul(cc, L));
    q = q > -L ? q : -L;
    return q < L ? q : L;
  }
  float q = fsub(round_half_even(fmul(u, L)), 1.0f);
  q = q > 0.0f ? q : 0.0f;
  const float top = fsub(L, 1.0f);
  return q < top ? q : top;
}

// The stochastic twin of adamw_encode: t = adamw_stored(x), x the moment itself (m, or v), `scale` the
// block's scale (0 for an all-zero block), safe = scale > 0 ? scale : 1, noise in [0, 1).
// The two codes around t: lo = clamp(floor(y), qmin, qmax - 1), hi = lo + 1, with y the continuous
// code (127 c for m, 256 t / scale - 1 for v); the upper is taken when noise < p, p = (x - x_lo) /
// (x_hi - x_lo) of the decoded values. Below the smallest v code (no zero code) p < 0: lo, as nearest.
QMUON_HD float adamw_encode_stochastic(float t, float x, float scale, float safe, int32_t kind, float noise) {
  const float L = adamw_levels(kind);
  const float u = fdiv(t, safe);
  float y, qmin, qmax;
  if (adamw_kind_signed(kind)) {
    y = fmul(fdiv(fmul(u, 2.0f), fadd(fabs_bits(u), 1.0f)), L);
    qmin = -L;
    qmax = L;
  } else {
    y = fsub(fmul(u, L), 1.0f);
    qmin = 0.0f;
    qmax = fsub(L, 1.0f);
  }
  float lo = round_down(y);
  lo = lo > qmin ? lo : qmin;
  const float top = fsub(qmax, 1.0f);
  lo = lo < top ? lo : top;
  const float hi = fadd(lo, 1.0f);
  const float x_lo = adamw_decode(lo, scale, kind);
  const float gap = fsub(adamw_decode(hi, scale, kind), x_lo);
  const float p = gap > 0.0f ? fdiv(fsub(x, x_lo), gap) : 0.0f;
  return noise < p ? hi : lo;
}

// The noise stream of one moment from the op's stream (reference_adamw.moment_stream): distinct for
// m and v, so the two roundings of an element draw independent bits.
constexpr uint32_t kAdamMStreamSalt = 0x68E31DA4u;
constexpr uint32_t kAdamVStreamSalt = 0xB5297A4Du;

QMUON_HD uint32_t adamw_moment_stream(uint32_t stream, int32_t kind) {
  return fmix32(stream ^ (adamw_kind_signed(kind) ? kAdamMStreamSalt : kAdamVStreamSalt));
}

// Storage of one code: the int8 / uint8 byte (8-bit) or the 4-bit nibble (m: code + 8).
QMUON_HD uint32_t adamw_code_bits(float q, int32_t kind) {
  const int32_t qi = static_cast<int32_t>(q);
  if (kind == kAdamM8) return static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(qi)));
  if (kind == kAdamM4) return static_cast<uint32_t>(qi + 8);
  return static_cast<uint32_t>(qi);
}

// Code value of element `col` of a row of codes (8-bit: one byte each; 4-bit: two a byte, even low).
QMUON_HD float adamw_load_code(const uint8_t* row, int64_t col, int32_t kind) {
  if (kind == kAdamM8) return static_cast<float>(static_cast<int8_t>(row[col]));
  if (kind == kAdamV8) return static_cast<float>(row[col]);
  const uint32_t byte = row[col >> 1];
  const uint32_t nib = (col & 1) ? (byte >> 4) : (byte & 0x0Fu);
  return kind == kAdamM4 ? static_cast<float>(static_cast<int32_t>(nib) - 8) : static_cast<float>(nib);
}

}  // namespace qmuon
