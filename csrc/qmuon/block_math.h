// Per-element / per-block maths of the quantized-momentum kernels, shared by the CPU (g++) and the
// CUDA (nvcc) kernels. No torch headers: plain C++17, every function is `__host__ __device__` under
// nvcc (QMUON_HD) and a plain inline function under a host compiler.
//
// This header is the C++ twin of qmuon_lightning/ops/reference.py and must reproduce it bit for bit
// (codes, absmax and the Newton-Schulz input written into the grad). Three rules make that possible:
//   * every fp32 operation is a separate, correctly rounded IEEE operation: host code is built with
//     -ffp-contract=off and device code uses __fmul_rn / __fadd_rn / __fsub_rn / __fdiv_rn, so no
//     multiply-add is ever fused (an FMA rounds once where the reference rounds twice);
//   * the formulas are the reference's, in the reference's order (see the comments below);
//   * conversions (bf16 / fp16 stores) round to nearest even, as torch's `Tensor.copy_` does.
// Only the per-block sums of squares may differ from the reference (fp32 summation order).
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define QMUON_HD __host__ __device__ __forceinline__
#else
#define QMUON_HD inline __attribute__((always_inline))
#endif

namespace qmuon {

// The `skip` flag of a matrix (qmuon/kernels.h): NULL never skips, else a nonzero byte does. CUDA kernels
// read it (device memory) first thing, CPU kernels before they start on the matrix.
QMUON_HD bool skipped(const uint8_t* skip) { return skip != nullptr && *skip != 0; }

// Largest block_size the kernels accept (the CPU kernel keeps two blocks of fp32 on the stack).
constexpr int64_t kMaxBlockSize = 4096;
constexpr float kQMax = 127.0f;

// ---------------------------------------------------------------------------------------------
// Bit casts and non-contracted fp32 arithmetic
// ---------------------------------------------------------------------------------------------
QMUON_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

QMUON_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, sizeof(x));
  return x;
#endif
}

#if defined(__CUDA_ARCH__)
QMUON_HD float fmul(float a, float b) { return __fmul_rn(a, b); }
QMUON_HD float fadd(float a, float b) { return __fadd_rn(a, b); }
QMUON_HD float fsub(float a, float b) { return __fsub_rn(a, b); }
QMUON_HD float fdiv(float a, float b) { return __fdiv_rn(a, b); }
QMUON_HD float round_half_even(float x) { return rintf(x); }
QMUON_HD float round_down(float x) { return floorf(x); }
#else
// Host code is compiled with -ffp-contract=off (see _extension.py), so these stay separate ops.
QMUON_HD float fmul(float a, float b) { return a * b; }
QMUON_HD float fadd(float a, float b) { return a + b; }
QMUON_HD float fsub(float a, float b) { return a - b; }
QMUON_HD float fdiv(float a, float b) { return a / b; }
QMUON_HD float round_half_even(float x) { return __builtin_rintf(x); }  // default rounding mode
// floor through rint (exact: rint's result is an integer, and r - 1 is exact whenever r > x), because
// g++ vectorizes rintf but not floorf unless -fno-trapping-math. The 1 is selected through an
// integer mask and always subtracted (r - 0 is r, -0 included): written as `r > x ? r - 1 : r`, or
// even `r - (r > x ? 1 : 0)`, g++ makes a branch, which it may not turn back into a vector select
// with trapping math on targets without masked vector operations, so the loop stayed scalar there
// (AVX2 builds: stochastic rounding 6x slower than nearest).
QMUON_HD float round_down(float x) {
  const float r = __builtin_rintf(x);
  const uint32_t one_if_above = f32_bits(1.0f) & (0u - static_cast<uint32_t>(r > x));
  return fsub(r, bits_f32(one_if_above));
}
#endif

// ---------------------------------------------------------------------------------------------
// Stochastic-rounding noise: reference.fmix32 / reference.uniform_noise
// ---------------------------------------------------------------------------------------------
QMUON_HD uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

// U[0, 1) for element `index` = (row_offset + row) * cols + col of the unsharded matrix:
// fmix32(lo32(index) ^ hi32(index) * 0x27D4EB2F ^ stream) >> 8, times 2^-24.
// `key` = hi32(index) * 0x27D4EB2F ^ stream is constant along a run of indices with the same high
// word, which lets loops keep a 32-bit counter (see uniform_noise_key).
QMUON_HD uint32_t uniform_noise_key(uint64_t index, uint32_t stream) {
  return static_cast<uint32_t>(index >> 32) * 0x27D4EB2Fu ^ stream;
}

QMUON_HD float uniform_noise_lo(uint32_t lo, uint32_t key) {
  const uint32_t h = fmix32(lo ^ key);
  return static_cast<float>(static_cast<int32_t>(h >> 8)) * (1.0f / 16777216.0f);  // exact
}

QMUON_HD float uniform_noise(uint64_t index, uint32_t stream) {
  return uniform_noise_lo(static_cast<uint32_t>(index), uniform_noise_key(index, stream));
}

// ---------------------------------------------------------------------------------------------
// Momentum update: reference._lerp_fp32 (torch.lerp's formula, each operation rounded separately)
//   weight small (|w| < 0.5):  start + w * (end - start)
//   otherwise:                 end - (end - start) * (1 - w)
// ---------------------------------------------------------------------------------------------
struct LerpWeight {
  float w;            // fp32(weight)
  float one_minus_w;  // fp32(1 - fp32(weight))
  bool small;         // |w| < 0.5
  // Branch-free form used by lerp(): base + diff * coef with base = start (small) or end, and
  // coef = w (small) or -(1 - w); x + d * -(c) equals x - d * c bit for bit (negation is exact).
  uint32_t start_mask;  // all ones when small
  float coef;
};

QMUON_HD LerpWeight make_lerp_weight(double weight) {
  LerpWeight lw;
  lw.w = static_cast<float>(weight);
  lw.one_minus_w = fsub(1.0f, lw.w);
  lw.small = (lw.w < 0.0f ? -lw.w : lw.w) < 0.5f;
  lw.start_mask = lw.small ? 0xFFFFFFFFu : 0u;
  lw.coef = lw.small ? lw.w : -lw.one_minus_w;
  return lw;
}

// Select through integer masks so that the loop stays branch-free (and g++ vectorizes it).
QMUON_HD float lerp(float start, float end, const LerpWeight& lw) {
  const float diff = fsub(end, start);
  const float base = bits_f32((f32_bits(start) & lw.start_mask) | (f32_bits(end) & ~lw.start_mask));
  return fadd(base, fmul(diff, lw.coef));
}

// lerp with the weight's branch known at compile time (SMALL: |w| < 0.5); equal to lerp() bit for
// bit when lw.small == SMALL. Lets a loop that was dispatched on lw.small drop the per-element select.
template <bool SMALL>
QMUON_HD float lerp_fixed(float start, float end, const LerpWeight& lw) {
  const float diff = fsub(end, start);
  return fadd(SMALL ? start : end, fmul(diff, lw.coef));
}

// m_new = lerp(m_old, g, 1 - beta);  ns_input = lerp(g, m_new, beta) if nesterov else m_new.
struct MomentumWeights {
  LerpWeight to_grad;  // weight 1 - beta (computed in double, as Python does)
  LerpWeight to_mom;   // weight beta (Nesterov blend)
};

QMUON_HD MomentumWeights make_momentum_weights(double beta) {
  MomentumWeights mw;
  mw.to_grad = make_lerp_weight(1.0 - beta);
  mw.to_mom = make_lerp_weight(beta);
  return mw;
}

// ---------------------------------------------------------------------------------------------
// 8-bit absmax quantization: reference.quantize_rows / reference.dequantize_rows
// ---------------------------------------------------------------------------------------------
// Dequantization scale a / 127 (one true division).
QMUON_HD float dequant_scale(float absmax) { return fdiv(absmax, kQMax); }

// Quantization multiplier: the reference evaluates `127 / a` as reciprocal(a) * 127 (two roundings);
// a block whose absmax is not > 0 uses a = 1.
QMUON_HD float quant_inv(float absmax) {
  const float safe = absmax > 0.0f ? absmax : 1.0f;
  return fmul(fdiv(1.0f, safe), kQMax);
}

// clamp(q, -127, 127), and NaN -> 0 (reference: clamp_(-127, 127).nan_to_num_(nan=0)).
// Written so that g++ emits x86 maxps / minps for the two clamps: `a > b ? a : b` is exactly
// maxps(a, b), NaN included (it yields b), so the NaN test is taken first and applied last. The
// result is the same for every input as clamping first and mapping NaN to 0 (measured 3-6% faster
// CPU update than compare-and-blend sequences).
QMUON_HD float clamp_code(float q) {
  const bool is_nan = q != q;
  q = q > -kQMax ? q : -kQMax;
  q = q < kQMax ? q : kQMax;
  return is_nan ? 0.0f : q;
}

// clamp(round_half_even(x * inv))
QMUON_HD float quantize_nearest(float x, float inv) { return clamp_code(round_half_even(fmul(x, inv))); }

// clamp(floor(x * inv + u)), u in [0, 1)
QMUON_HD float quantize_stochastic(float x, float inv, float u) {
  return clamp_code(round_down(fadd(fmul(x, inv), u)));
}

// |x| as bits: for non-NaN floats the unsigned order of these bits is the order of |x|, and a NaN
// compares above every number (torch's amax propagates NaN, so does an integer max over these).
QMUON_HD uint32_t abs_bits(float x) { return f32_bits(x) & 0x7FFFFFFFu; }

// Code storage. int8 stores the code, uint8 stores code + 128.
template <typename CodeT>
struct CodeIO;

// store_int takes the code as an integer in [-127, 127]; store takes it as an integer-valued float.
template <>
struct CodeIO<int8_t> {
  QMUON_HD static float load(int8_t c) { return static_cast<float>(c); }
  QMUON_HD static int8_t store_int(int32_t q) { return static_cast<int8_t>(q); }
  QMUON_HD static int8_t store(float q) { return store_int(static_cast<int32_t>(q)); }
};

template <>
struct CodeIO<uint8_t> {
  QMUON_HD static float load(uint8_t c) { return static_cast<float>(static_cast<int32_t>(c) - 128); }
  QMUON_HD static uint8_t store_int(int32_t q) { return static_cast<uint8_t>(q + 128); }
  QMUON_HD static uint8_t store(float q) { return store_int(static_cast<int32_t>(q)); }
};

// ---------------------------------------------------------------------------------------------
// Gradient storage: fp32, bf16, fp16 (the fp32 value is the maths type; stores round to nearest
// even like torch's copy_). The 16-bit types are carried as uint16_t bit patterns.
// ---------------------------------------------------------------------------------------------
struct F32 {
  using storage = float;
  QMUON_HD static float load(float v) { return v; }
  QMUON_HD static float store(float v) { return v; }
};

struct BF16 {
  using storage = uint16_t;
  QMUON_HD static float load(uint16_t v) { return bits_f32(static_cast<uint32_t>(v) << 16); }
  QMUON_HD static uint16_t store(float v) {
#if defined(__CUDA_ARCH__)
    // cvt.rn.bf16.f32 turns every NaN into 0x7FFF; the CPU (and torch's CPU conversion) writes the one
    // quiet NaN 0x7FC0, so NaNs are canonicalized to that pattern on both sides.
    const uint32_t u = __float_as_uint(v);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7FC0u) : __bfloat16_as_ushort(__float2bfloat16_rn(v));
#else
    // c10::BFloat16's round_to_nearest_even.
    const uint32_t u = f32_bits(v);
    const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
#endif
  }
};

struct F16 {
  using storage = uint16_t;
  QMUON_HD static float load(uint16_t v) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(v));
#else
    // fp16_ieee_to_fp32_value (the FP16 library c10::Half uses), branch-free so loops vectorize.
    const uint32_t w = static_cast<uint32_t>(v) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = fmul(bits_f32((two_w >> 4) + (0xE0u << 23)), 0x1.0p-112f);
    const float denormalized = fsub(bits_f32((two_w >> 17) | (126u << 23)), 0.5f);
    const uint32_t denormal_mask = 0u - static_cast<uint32_t>(two_w < (1u << 27));  // integer select
    return bits_f32(sign | (f32_bits(denormalized) & denormal_mask) | (f32_bits(normalized) & ~denormal_mask));
#endif
  }
  QMUON_HD static uint16_t store(float v) {
#if defined(__CUDA_ARCH__)
    // NaN -> 0x7E00 as on the CPU (cvt.rn.f16.f32 writes 0x7FFF).
    const uint32_t u = __float_as_uint(v);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>(0x7E00u) : __half_as_ushort(__float2half_rn(v));
#else
    // fp16_ieee_from_fp32_value: round to nearest even, overflow to inf, NaN -> 0x7E00.
    float base = fmul(fmul(bits_f32(f32_bits(v) & 0x7FFFFFFFu), 0x1.0p+112f), 0x1.0p-110f);
    const uint32_t w = f32_bits(v);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = fadd(bits_f32((bias >> 1) + 0x07800000u), base);
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
  }
};

}  // namespace qmuon
