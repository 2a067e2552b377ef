// CPU kernels of the 4-bit (int4, e0m3, grid) and dense-format (fp32 / bf16) momentum ops: threads
// over row blocks with at::parallel_for; per-element maths from qmuon/block_math_4bit.h, so the
// results equal qmuon_lightning/ops/reference_4bit.py (and reference.dense_momentum_update_) bit for
// bit, sums of squares up to fp32 summation order.
//
// e0m3 has one fp32 scale per tensor that depends on the new momentum of the whole tensor, so its
// update takes two passes: pass 1 recomputes the new momentum block by block only to find its max
// |m| (nothing written), pass 2 recomputes it again, writes the Newton-Schulz input, the codes and
// the block scales. The state is not written until pass 2, so both passes read the same old state.
// A row shard runs the passes as two ops (qmuon_cpu_e0m3_momentum_amax, then the update with
// new_tensor_scale set to its matrix's scale), with a MAX all-reduce of the amax between them.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/block_reduce_cpu.h"
#include "qmuon/block_math_4bit.h"
#include "qmuon/kernels.h"
#include "qmuon/validate.h"

namespace qmuon {
namespace {

using cpu::absmax_bits;
using cpu::kLanes;
using cpu::sum_squares;
constexpr int64_t kPrefetchBlocks = 4;  // software prefetch distance of the int4 update, in row blocks

int64_t grain_units(int64_t unit) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(unit, 1)); }

inline uint64_t elem_index(int64_t row_offset, int64_t r, int64_t cols, int64_t c) {
  return static_cast<uint64_t>(row_offset + r) * static_cast<uint64_t>(cols) + static_cast<uint64_t>(c);
}

// Codes of x[0:n] (scaled by `mul` or divided by `div`, see Scale) packed two per byte into out.
// `first` is the noise index of x[0]; n may be odd (the last high nibble is 0).
template <typename CodeFn>
inline void pack_codes(uint8_t* __restrict out, int64_t n, CodeFn&& code_of) {
  for (int64_t j = 0; 2 * j < n; ++j) {
    const uint32_t lo = code_to_nibble(code_of(2 * j));
    const uint32_t hi = 2 * j + 1 < n ? code_to_nibble(code_of(2 * j + 1)) : 0u;
    out[j] = pack_nibbles(lo, hi);
  }
}

inline float unpacked_code(const uint8_t* __restrict p, int64_t i) {
  const uint32_t byte = p[i >> 1];
  return nibble_to_code((i & 1) ? (byte >> 4) : (byte & 15u));
}

// Unpacking and packing go through a byte array of nibbles, one per element, which the packed bytes
// map to by a widening / narrowing of 16-bit pairs (little-endian: byte j of the packed run holds
// nibbles 2j and 2j + 1), so every loop is element-wise and g++ vectorizes it.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "q4_cpu.cpp assumes a little-endian host (16-bit nibble pairs)"
#endif

// Codes of elements [0, n) of a run that starts at an even column; p points at its first byte.
inline void unpack_run(const uint8_t* __restrict p, int64_t n, float* __restrict c) {
  alignas(64) uint16_t pairs[kMaxBlockSize / 2];
  for (int64_t s0 = 0; s0 < n; s0 += kMaxBlockSize) {  // kMaxBlockSize is even: chunks start on a byte
    const int64_t m = std::min(kMaxBlockSize, n - s0);
    const int64_t nbytes = (m + 1) / 2;
    const uint8_t* __restrict ps = p + s0 / 2;
    for (int64_t j = 0; j < nbytes; ++j) {
      const uint32_t b = ps[j];
      pairs[j] = static_cast<uint16_t>((b & 15u) | ((b >> 4) << 8));
    }
    const uint8_t* __restrict nib = reinterpret_cast<const uint8_t*>(pairs);  // char access: no aliasing issue
    float* __restrict cs = c + s0;
    for (int64_t i = 0; i < m; ++i) cs[i] = nibble_to_code(nib[i]);
  }
}

// The same packing for a run of any length held in a byte array with room for n + 1 bytes.
inline void pack_bytes(uint8_t* __restrict nib, int64_t n, uint8_t* __restrict out) {
  if (n & 1) nib[n] = 0;
  const int64_t nbytes = (n + 1) / 2;
  for (int64_t j = 0; j < nbytes; ++j) out[j] = static_cast<uint8_t>((nib[2 * j] & 15u) | (nib[2 * j + 1] << 4));
}

// u[i] = uniform noise of element first + i (32-bit counter when the high word is constant).
inline void fill_noise(float* __restrict u, int64_t n, uint64_t first, uint32_t stream) {
  const uint32_t lo0 = static_cast<uint32_t>(first);
  if (static_cast<uint64_t>(lo0) + static_cast<uint64_t>(n) <= (uint64_t{1} << 32)) {
    const uint32_t key = uniform_noise_key(first, stream);
    const int32_t n32 = static_cast<int32_t>(n);
    for (int32_t i = 0; i < n32; ++i) u[i] = uniform_noise_lo(lo0 + static_cast<uint32_t>(i), key);
  } else {
    for (int64_t i = 0; i < n; ++i) u[i] = uniform_noise(first + static_cast<uint64_t>(i), stream);
  }
}

// Nibbles of a run, one byte per element, readable as 16-bit pairs by pack_run.
struct NibbleRun {
  alignas(64) uint16_t pairs[kMaxBlockSize / 2 + 1];
  uint8_t* bytes() { return reinterpret_cast<uint8_t*>(pairs); }
};

// out[j] = nib[2j] | nib[2j + 1] << 4 (an odd n leaves the last high nibble 0).
inline void pack_run(NibbleRun& run, int64_t n, uint8_t* __restrict out) {
  if (n & 1) run.bytes()[n] = 0;
  const int64_t nbytes = (n + 1) / 2;
  for (int64_t j = 0; j < nbytes; ++j) {
    const uint32_t w = run.pairs[j];
    out[j] = static_cast<uint8_t>((w & 15u) | ((w >> 8) << 4));
  }
}

// ---------------------------------------------------------------------------------------------
// int4 update
// ---------------------------------------------------------------------------------------------
template <typename G, bool NESTEROV, bool STOCHASTIC>
void int4_update_matrix(const qmuon_q4_tensor& t, const MomentumWeights& mw, int64_t bs) {
  using GS = typename G::storage;
  const int64_t nb = (t.cols + bs - 1) / bs;
  const uint32_t stream = static_cast<uint32_t>(t.stream);
  at::parallel_for(0, t.rows * nb, grain_units(bs), [&](int64_t begin, int64_t end) {
    alignas(64) float m_new[kMaxBlockSize];
    alignas(64) float ns[kMaxBlockSize];
    alignas(64) float u[kMaxBlockSize];
    NibbleRun nib;
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r = blk / nb;
      const int64_t b = blk - r * nb;
      const int64_t c0 = b * bs;  // even: bs is even
      const int64_t n = std::min(bs, t.cols - c0);
      uint8_t* __restrict pk = t.packed + r * t.packed_rs + c0 / 2;
      GS* __restrict grad = static_cast<GS*>(t.grad) + r * t.grad_rs + c0;
      float* absmax = static_cast<float*>(t.scales) + r * t.scales_rs + b;
      {
        // Software prefetch kPrefetchBlocks ahead, as the 8-bit kernel: the requantize phase below
        // touches no memory, so keep DRAM busy meanwhile (prefetches never fault).
        const uintptr_t pg = reinterpret_cast<uintptr_t>(grad) + kPrefetchBlocks * bs * sizeof(GS);
        const uintptr_t pp = reinterpret_cast<uintptr_t>(pk) + kPrefetchBlocks * bs / 2;
        for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(GS)); off += 64) {
          __builtin_prefetch(reinterpret_cast<const void*>(pg + off), 1);
        }
        for (int64_t off = 0; off < n / 2; off += 64) __builtin_prefetch(reinterpret_cast<const void*>(pp + off), 1);
      }
      const float scale = int4_dequant_scale(*absmax);
      const MomentumWeights w = mw;
      unpack_run(pk, n, m_new);  // codes, overwritten by the new momentum below
      for (int64_t i = 0; i < n; ++i) {
        const float m_old = fmul(m_new[i], scale);
        const float g = G::load(grad[i]);
        const float m = lerp(m_old, g, w.to_grad);
        const float v = NESTEROV ? lerp(g, m, w.to_mom) : m;
        grad[i] = G::store(v);
        m_new[i] = m;
        ns[i] = v;
      }
      const float amax = bits_f32(absmax_bits(m_new, n));
      if (t.sumsq != nullptr) t.sumsq[r * nb + b] = sum_squares(ns, n);
      *absmax = amax;
      const float inv = int4_quant_inv(amax);
      if (STOCHASTIC) fill_noise(u, n, elem_index(t.row_offset, r, t.cols, c0), stream);
      uint8_t* __restrict nb8 = nib.bytes();
      for (int64_t i = 0; i < n; ++i) {
        nb8[i] = static_cast<uint8_t>(
            code_to_nibble(round_code4(fmul(m_new[i], inv), STOCHASTIC, STOCHASTIC ? u[i] : 0.0f)));
      }
      pack_run(nib, n, pk);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// e0m3 update
// ---------------------------------------------------------------------------------------------
// Work unit: U = max(block_size, 16) consecutive elements of a row (block_size is a multiple or a
// divisor of 16, so a unit holds whole 16-element scale blocks and whole sum-of-squares blocks).
template <typename G, bool NESTEROV>
inline void e0m3_momentum_unit(const qmuon_q4_tensor& t, const MomentumWeights& w, float t_old, int64_t r,
                               int64_t c0, int64_t n, float* __restrict m_new, float* __restrict ns) {
  using GS = typename G::storage;
  const uint8_t* __restrict pk = t.packed + r * t.packed_rs + c0 / 2;
  const uint8_t* __restrict sc = static_cast<const uint8_t*>(t.scales) + r * t.scales_rs + c0 / kE0M3Block;
  const GS* __restrict grad = static_cast<const GS*>(t.grad) + r * t.grad_rs + c0;
  alignas(64) float step[kMaxBlockSize + kE0M3Block];  // each element's decoded block step (one vector loop below)
  {
    // Software prefetch of the units kPrefetchBlocks ahead (same row layout assumed; never faults).
    const uintptr_t pg = reinterpret_cast<uintptr_t>(grad) + kPrefetchBlocks * n * sizeof(GS);
    const uintptr_t pp = reinterpret_cast<uintptr_t>(pk) + kPrefetchBlocks * n / 2;
    for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(GS)); off += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(pg + off), 0);
    }
    for (int64_t off = 0; off < n / 2; off += 64) __builtin_prefetch(reinterpret_cast<const void*>(pp + off), 0);
  }
  unpack_run(pk, n, m_new);
  for (int64_t k = 0; k * kE0M3Block < n; ++k) {
    const float sk = e0m3_step(sc[k], t_old);
    for (int i = 0; i < kE0M3Block; ++i) step[k * kE0M3Block + i] = sk;  // may run past n: step has room
  }
  for (int64_t i = 0; i < n; ++i) {
    const float g = G::load(grad[i]);
    const float m = lerp(fmul(m_new[i], step[i]), g, w.to_grad);
    m_new[i] = m;
    if (ns != nullptr) ns[i] = NESTEROV ? lerp(g, m, w.to_mom) : m;
  }
}

// Pass 1: bits of max |m_new| over the matrix (nothing written). The max does not depend on the
// order it is taken in, so any unit (a multiple or divisor of 16) gives the same bits.
template <typename G>
uint32_t e0m3_amax_bits(const qmuon_q4_tensor& t, const MomentumWeights& mw, int64_t unit) {
  const int64_t nu = (t.cols + unit - 1) / unit;
  const float t_old = *t.tensor_scale;
  return at::parallel_reduce(
      0, t.rows * nu, grain_units(unit), uint32_t{0},
      [&](int64_t begin, int64_t end, uint32_t acc) {
        alignas(64) float m_new[kMaxBlockSize];
        const MomentumWeights w = mw;
        for (int64_t u = begin; u < end; ++u) {
          const int64_t r = u / nu;
          const int64_t c0 = (u - r * nu) * unit;
          const int64_t n = std::min(unit, t.cols - c0);
          e0m3_momentum_unit<G, false>(t, w, t_old, r, c0, n, m_new, nullptr);
          const uint32_t m = absmax_bits(m_new, n);
          acc = m > acc ? m : acc;
        }
        return acc;
      },
      [](uint32_t a, uint32_t b) { return a > b ? a : b; });
}

// Pass 2 (after pass 1, or with the tensor scale given: t.new_tensor_scale).
template <typename G, bool NESTEROV, bool STOCHASTIC>
void e0m3_update_matrix(const qmuon_q4_tensor& t, const MomentumWeights& mw, int64_t bs) {
  using GS = typename G::storage;
  const int64_t unit = std::max<int64_t>(bs, kE0M3Block);
  const int64_t nu = (t.cols + unit - 1) / unit;
  const int64_t nb = (t.cols + bs - 1) / bs;
  const float t_old = *t.tensor_scale;
  const float t_new = t.new_tensor_scale != nullptr
                          ? *t.new_tensor_scale
                          : e0m3_tensor_scale_from_amax(bits_f32(e0m3_amax_bits<G>(t, mw, unit)));
  const uint32_t stream = static_cast<uint32_t>(t.stream);
  // Pass 2: NS input, sums of squares, codes and block scales at t_new.
  at::parallel_for(0, t.rows * nu, grain_units(unit), [&](int64_t begin, int64_t end) {
    alignas(64) float m_new[kMaxBlockSize];
    alignas(64) float ns[kMaxBlockSize];
    alignas(64) float u[kMaxBlockSize];
    alignas(64) float step[kMaxBlockSize + kE0M3Block];
    NibbleRun nib;
    const MomentumWeights w = mw;
    for (int64_t un = begin; un < end; ++un) {
      const int64_t r = un / nu;
      const int64_t c0 = (un - r * nu) * unit;
      const int64_t n = std::min(unit, t.cols - c0);
      e0m3_momentum_unit<G, NESTEROV>(t, w, t_old, r, c0, n, m_new, ns);
      GS* __restrict grad = static_cast<GS*>(t.grad) + r * t.grad_rs + c0;
      for (int64_t i = 0; i < n; ++i) grad[i] = G::store(ns[i]);
      if (t.sumsq != nullptr) {
        for (int64_t s0 = 0; s0 < n; s0 += bs) {
          t.sumsq[r * nb + (c0 + s0) / bs] = sum_squares(ns + s0, std::min(bs, n - s0));
        }
      }
      if (STOCHASTIC) fill_noise(u, n, elem_index(t.row_offset, r, t.cols, c0), stream);
      uint8_t* __restrict sc = static_cast<uint8_t*>(t.scales) + r * t.scales_rs + c0 / kE0M3Block;
      // Block scales first (scalar, per 16 elements), then one long loop of divisions that pipeline.
      for (int64_t k0 = 0; k0 < n; k0 += kE0M3Block) {
        const int64_t kn = std::min(kE0M3Block, n - k0);
        uint32_t mb = 0;
        if (kn == kE0M3Block) {
          for (int i = 0; i < kE0M3Block; ++i) {
            const uint32_t ab = abs_bits(m_new[k0 + i]);
            mb = ab > mb ? ab : mb;
          }
        } else {
          mb = absmax_bits(m_new + k0, kn);  // the partial block at the end of a row
        }
        const uint32_t s_bits = e0m3_scale_bits(bits_f32(mb), t_new);
        sc[k0 / kE0M3Block] = static_cast<uint8_t>(s_bits);
        const float sk = e0m3_step(s_bits, t_new);
        for (int i = 0; i < kE0M3Block; ++i) step[k0 + i] = sk;
      }
      uint8_t* __restrict nb8 = nib.bytes();
      for (int64_t i = 0; i < n; ++i) {
        nb8[i] = static_cast<uint8_t>(
            code_to_nibble(e0m3_code(m_new[i], step[i], STOCHASTIC, STOCHASTIC ? u[i] : 0.0f)));
      }
      pack_run(nib, n, t.packed + r * t.packed_rs + c0 / 2);
    }
  });
  *t.tensor_scale = t_new;
}

// ---------------------------------------------------------------------------------------------
// dense update
// ---------------------------------------------------------------------------------------------
template <typename B, typename G, bool NESTEROV, bool STOCHASTIC>
void dense_update_matrix(const qmuon_dense_tensor& t, const MomentumWeights& mw, int64_t bs) {
  using BS = typename B::storage;
  using GS = typename G::storage;
  const int64_t nb = (t.cols + bs - 1) / bs;
  const uint32_t stream = static_cast<uint32_t>(t.stream);
  at::parallel_for(0, t.rows * nb, grain_units(bs), [&](int64_t begin, int64_t end) {
    alignas(64) float ns[kMaxBlockSize];
    const MomentumWeights w = mw;
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r = blk / nb;
      const int64_t b = blk - r * nb;
      const int64_t c0 = b * bs;
      const int64_t n = std::min(bs, t.cols - c0);
      BS* __restrict buf = static_cast<BS*>(t.buf) + r * t.buf_rs + c0;
      GS* __restrict grad = static_cast<GS*>(t.grad) + r * t.grad_rs + c0;
      const uint64_t first = elem_index(t.row_offset, r, t.cols, c0);
      for (int64_t i = 0; i < n; ++i) {
        const float g = G::load(grad[i]);
        const float m = fused_lerp(B::load(buf[i]), g, w.to_grad);
        const float v = NESTEROV ? fused_lerp(g, m, w.to_mom) : m;
        if (STOCHASTIC) {
          buf[i] = static_cast<BS>(bf16_stochastic(m, noise_bits16(first + static_cast<uint64_t>(i), stream)));
        } else {
          buf[i] = B::store(m);
        }
        grad[i] = G::store(v);
        ns[i] = v;
      }
      if (t.sumsq != nullptr) t.sumsq[r * nb + b] = sum_squares(ns, n);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// dispatch helpers
// ---------------------------------------------------------------------------------------------
template <template <typename, bool, bool> class Kernel, typename T, typename... Args>
int dispatch_g_flags(int32_t grad_dtype, bool nesterov, bool stochastic, const T& t, Args&&... args) {
  auto run = [&](auto g_tag) -> int {
    using G = decltype(g_tag);
    if (nesterov && stochastic) Kernel<G, true, true>::run(t, args...);
    else if (nesterov) Kernel<G, true, false>::run(t, args...);
    else if (stochastic) Kernel<G, false, true>::run(t, args...);
    else Kernel<G, false, false>::run(t, args...);
    return 0;
  };
  switch (grad_dtype) {
    case QMUON_FLOAT32: return run(F32{});
    case QMUON_BFLOAT16: return run(BF16{});
    case QMUON_FLOAT16: return run(F16{});
    default: return QMUON_ERR_BAD_DTYPE;
  }
}

template <typename G, bool N, bool S>
struct Int4Kernel {
  static void run(const qmuon_q4_tensor& t, const MomentumWeights& mw, int64_t bs) { int4_update_matrix<G, N, S>(t, mw, bs); }
};
template <typename G, bool N, bool S>
struct E0M3Kernel {
  static void run(const qmuon_q4_tensor& t, const MomentumWeights& mw, int64_t bs) { e0m3_update_matrix<G, N, S>(t, mw, bs); }
};
template <typename G, bool N, bool S>
struct DenseF32Kernel {  // stochastic rounding does not apply to an fp32 buffer
  static void run(const qmuon_dense_tensor& t, const MomentumWeights& mw, int64_t bs) {
    dense_update_matrix<F32, G, N, false>(t, mw, bs);
  }
};
template <typename G, bool N, bool S>
struct DenseBF16Kernel {
  static void run(const qmuon_dense_tensor& t, const MomentumWeights& mw, int64_t bs) {
    dense_update_matrix<BF16, G, N, S>(t, mw, bs);
  }
};

// ---------------------------------------------------------------------------------------------
// standalone codecs
// ---------------------------------------------------------------------------------------------
// grid_quantize4 of x (rows, cols) with the maxima scale t: codes into out0, UE4M3 row / column maxima
// into out1 / out2.
void grid_quantize_cpu(const qmuon_codec_args& a, float t) {
  const int64_t rows = a.rows, cols = a.cols, pc = (cols + 1) / 2;
  const bool stoch = a.stream >= 0;
  const uint32_t stream = static_cast<uint32_t>(a.stream);
  const int64_t s = a.block_size, nbc = (cols + s - 1) / s, nbr = (rows + s - 1) / s;
  const float* x = static_cast<const float*>(a.in0);
  uint8_t* pk = static_cast<uint8_t*>(a.out0);
  uint8_t* row_bits = static_cast<uint8_t*>(a.out1);
  uint8_t* col_bits = static_cast<uint8_t*>(a.out2);
  at::parallel_for(0, rows * nbc, grain_units(s), [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r = blk / nbc, c0 = (blk - r * nbc) * s;
      const float m = bits_f32(absmax_bits(x + r * cols + c0, std::min(s, cols - c0)));
      row_bits[blk] = static_cast<uint8_t>(ue4m3_encode(fdiv(m, t), true));
    }
  });
  at::parallel_for(0, nbr, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint32_t> m(static_cast<size_t>(cols));
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t r0 = g * s, r1 = std::min(rows, r0 + s);
      std::fill(m.begin(), m.end(), 0u);
      for (int64_t r = r0; r < r1; ++r) {
        const float* xr = x + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const uint32_t b = abs_bits(xr[c]);
          m[c] = b > m[c] ? b : m[c];
        }
      }
      for (int64_t c = 0; c < cols; ++c) {
        col_bits[g * cols + c] = static_cast<uint8_t>(ue4m3_encode(fdiv(bits_f32(m[c]), t), true));
      }
    }
  });
  // Decoded maxima (times t), once: the codes loop then reads two floats per element.
  std::vector<float> row_dec(static_cast<size_t>(rows * nbc)), col_dec(static_cast<size_t>(nbr * cols));
  for (int64_t i = 0; i < rows * nbc; ++i) row_dec[i] = fmul(ue4m3_decode(row_bits[i]), t);
  for (int64_t i = 0; i < nbr * cols; ++i) col_dec[i] = fmul(ue4m3_decode(col_bits[i]), t);
  at::parallel_for(0, rows, grain_units(cols), [&](int64_t r0, int64_t r1) {
    std::vector<float> u(static_cast<size_t>(stoch ? cols : 0));
    std::vector<uint8_t> nib(static_cast<size_t>(cols + 1));
    std::vector<float> rrow(static_cast<size_t>(cols));
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * cols;
      const float* rd = row_dec.data() + r * nbc;
      const float* cd = col_dec.data() + (r / s) * cols;
      for (int64_t k = 0; k < nbc; ++k) {
        for (int64_t c = k * s; c < std::min(cols, (k + 1) * s); ++c) rrow[c] = rd[k];
      }
      if (stoch) fill_noise(u.data(), cols, elem_index(a.row_offset, r, cols, 0), stream);
      for (int64_t c = 0; c < cols; ++c) {
        const float rv = rrow[c], cv = cd[c];
        // torch.minimum (NaN propagates), as grid_den
        const float den = cv < rv ? cv : (rv != rv ? rv : (cv != cv ? cv : rv));
        nib[c] = static_cast<uint8_t>(code_to_nibble(grid_code(xr[c], den, stoch, stoch ? u[c] : 0.0f)));
      }
      pack_bytes(nib.data(), cols, pk + r * pc);
    }
  });
}

int codec_cpu(const qmuon_codec_args& a) {
  const int64_t rows = a.rows, cols = a.cols, pc = (cols + 1) / 2;
  const bool stoch = a.stream >= 0;
  const uint32_t stream = static_cast<uint32_t>(a.stream);
  auto noise = [&](int64_t r, int64_t c) {
    return stoch ? uniform_noise(elem_index(a.row_offset, r, cols, c), stream) : 0.0f;
  };
  if (rows <= 0 || cols <= 0) {
    if (a.op == QMUON_CODEC_E0M3_QUANTIZE || a.op == QMUON_CODEC_GRID_QUANTIZE) {
      float* ts = static_cast<float*>(a.op == QMUON_CODEC_E0M3_QUANTIZE ? a.out2 : a.out3);
      *ts = 1.0f;  // the scale of an empty tensor
    }
    return 0;
  }
  switch (a.op) {
    case QMUON_CODEC_PACK_INT4: {
      const int8_t* in = static_cast<const int8_t*>(a.in0);
      uint8_t* out = static_cast<uint8_t*>(a.out0);
      at::parallel_for(0, rows, grain_units(cols), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int8_t* c = in + r * cols;
          for (int64_t j = 0; j < pc; ++j) {
            const int32_t lo = c[2 * j];
            const int32_t hi = 2 * j + 1 < cols ? c[2 * j + 1] : 0;
            const uint32_t nl = static_cast<uint32_t>(lo < 0 ? 8 - lo : lo);
            const uint32_t nh = static_cast<uint32_t>(hi < 0 ? 8 - hi : hi);
            out[r * pc + j] = static_cast<uint8_t>((nl | (nh << 4)) & 0xFFu);
          }
        }
      });
      return 0;
    }
    case QMUON_CODEC_UNPACK_INT4: {
      const uint8_t* in = static_cast<const uint8_t*>(a.in0);
      int8_t* out = static_cast<int8_t*>(a.out0);
      at::parallel_for(0, rows, grain_units(cols), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = static_cast<int8_t>(unpacked_code(in + r * pc, c));
        }
      });
      return 0;
    }
    case QMUON_CODEC_UE4M3_ENCODE: {
      const float* in = static_cast<const float*>(a.in0);
      uint8_t* out = static_cast<uint8_t*>(a.out0);
      const bool up = a.flag != 0;
      at::parallel_for(0, cols, 32768, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) out[i] = static_cast<uint8_t>(ue4m3_encode(in[i], up));
      });
      return 0;
    }
    case QMUON_CODEC_UE4M3_DECODE: {
      const uint8_t* in = static_cast<const uint8_t*>(a.in0);
      float* out = static_cast<float*>(a.out0);
      at::parallel_for(0, cols, 32768, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) out[i] = ue4m3_decode(in[i]);
      });
      return 0;
    }
    case QMUON_CODEC_INT4_QUANTIZE: {
      const int64_t bs = a.block_size, nb = (cols + bs - 1) / bs;
      const float* x = static_cast<const float*>(a.in0);
      uint8_t* pk = static_cast<uint8_t*>(a.out0);
      float* absmax = static_cast<float*>(a.out1);
      at::parallel_for(0, rows * nb, grain_units(bs), [&](int64_t b0, int64_t b1) {
        for (int64_t blk = b0; blk < b1; ++blk) {
          const int64_t r = blk / nb, c0 = (blk - r * nb) * bs, n = std::min(bs, cols - c0);
          const float* xb = x + r * cols + c0;
          const float amax = bits_f32(absmax_bits(xb, n));
          absmax[blk] = amax;
          const float inv = int4_quant_inv(amax);
          pack_codes(pk + r * pc + c0 / 2, n,
                     [&](int64_t i) { return round_code4(fmul(xb[i], inv), stoch, noise(r, c0 + i)); });
        }
      });
      return 0;
    }
    case QMUON_CODEC_INT4_DEQUANTIZE: {
      const int64_t bs = a.block_size, nb = (cols + bs - 1) / bs;
      const uint8_t* pk = static_cast<const uint8_t*>(a.in0);
      const float* absmax = static_cast<const float*>(a.in1);
      float* out = static_cast<float*>(a.out0);
      at::parallel_for(0, rows * nb, grain_units(bs), [&](int64_t b0, int64_t b1) {
        for (int64_t blk = b0; blk < b1; ++blk) {
          const int64_t r = blk / nb, c0 = (blk - r * nb) * bs, n = std::min(bs, cols - c0);
          const float scale = int4_dequant_scale(absmax[blk]);
          const uint8_t* p = pk + r * pc;
          for (int64_t i = c0; i < c0 + n; ++i) out[r * cols + i] = fmul(unpacked_code(p, i), scale);
        }
      });
      return 0;
    }
    case QMUON_CODEC_E0M3_QUANTIZE: {
      const int64_t nb = (cols + kE0M3Block - 1) / kE0M3Block;
      const float* x = static_cast<const float*>(a.in0);
      uint8_t* pk = static_cast<uint8_t*>(a.out0);
      uint8_t* sc = static_cast<uint8_t*>(a.out1);
      float t = 1.0f;
      if (a.flag) {
        const uint32_t amax = at::parallel_reduce(
            0, rows, grain_units(cols), uint32_t{0},
            [&](int64_t r0, int64_t r1, uint32_t acc) {
              for (int64_t r = r0; r < r1; ++r) {
                const uint32_t m = absmax_bits(x + r * cols, cols);
                acc = m > acc ? m : acc;
              }
              return acc;
            },
            [](uint32_t p, uint32_t q) { return p > q ? p : q; });
        t = e0m3_tensor_scale_from_amax(bits_f32(amax));
      }
      *static_cast<float*>(a.out2) = t;
      at::parallel_for(0, rows * nb, grain_units(kE0M3Block), [&](int64_t b0, int64_t b1) {
        for (int64_t blk = b0; blk < b1; ++blk) {
          const int64_t r = blk / nb, c0 = (blk - r * nb) * kE0M3Block, n = std::min(kE0M3Block, cols - c0);
          const float* xb = x + r * cols + c0;
          const uint32_t s_bits = e0m3_scale_bits(bits_f32(absmax_bits(xb, n)), t);
          sc[blk] = static_cast<uint8_t>(s_bits);
          const float step = e0m3_step(s_bits, t);
          pack_codes(pk + r * pc + c0 / 2, n,
                     [&](int64_t i) { return e0m3_code(xb[i], step, stoch, noise(r, c0 + i)); });
        }
      });
      return 0;
    }
    case QMUON_CODEC_E0M3_DEQUANTIZE: {
      const int64_t nb = (cols + kE0M3Block - 1) / kE0M3Block;
      const uint8_t* pk = static_cast<const uint8_t*>(a.in0);
      const uint8_t* sc = static_cast<const uint8_t*>(a.in1);
      const float t = *static_cast<const float*>(a.in2);
      float* out = static_cast<float*>(a.out0);
      at::parallel_for(0, rows, grain_units(cols), [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            out[r * cols + c] = fmul(unpacked_code(pk + r * pc, c), e0m3_step(sc[r * nb + c / kE0M3Block], t));
          }
        }
      });
      return 0;
    }
    case QMUON_CODEC_GRID_QUANTIZE: {
      const float* x = static_cast<const float*>(a.in0);
      // The maxima are found as bits (|x| bit order == value order, NaN on top, as torch's amax).
      const uint32_t amax = at::parallel_reduce(
          0, rows, grain_units(cols), uint32_t{0},
          [&](int64_t r0, int64_t r1, uint32_t acc) {
            for (int64_t r = r0; r < r1; ++r) {
              const uint32_t m = absmax_bits(x + r * cols, cols);
              acc = m > acc ? m : acc;
            }
            return acc;
          },
          [](uint32_t p, uint32_t q) { return p > q ? p : q; });
      const float t = grid_scale_from_amax(bits_f32(amax));
      *static_cast<float*>(a.out3) = t;
      grid_quantize_cpu(a, t);
      return 0;
    }
    case QMUON_CODEC_GRID_QUANTIZE_WITH_SCALE:
      grid_quantize_cpu(a, *static_cast<const float*>(a.in1));
      return 0;
    case QMUON_CODEC_GRID_DEQUANTIZE: {
      const int64_t s = a.block_size, nbc = (cols + s - 1) / s;
      const uint8_t* pk = static_cast<const uint8_t*>(a.in0);
      const uint8_t* rb = static_cast<const uint8_t*>(a.in1);
      const uint8_t* cb = static_cast<const uint8_t*>(a.in2);
      const float t = *static_cast<const float*>(a.in3);
      float* out = static_cast<float*>(a.out0);
      const int64_t nbr = (rows + s - 1) / s;
      std::vector<float> col_dec(static_cast<size_t>(nbr * cols));
      for (int64_t i = 0; i < nbr * cols; ++i) col_dec[i] = fmul(ue4m3_decode(cb[i]), t);
      at::parallel_for(0, rows, grain_units(cols), [&](int64_t r0, int64_t r1) {
        std::vector<float> code(static_cast<size_t>(cols)), rrow(static_cast<size_t>(cols));
        for (int64_t r = r0; r < r1; ++r) {
          unpack_run(pk + r * pc, cols, code.data());
          for (int64_t k = 0; k < nbc; ++k) {
            const float v = fmul(ue4m3_decode(rb[r * nbc + k]), t);
            for (int64_t c = k * s; c < std::min(cols, (k + 1) * s); ++c) rrow[c] = v;
          }
          const float* cd = col_dec.data() + (r / s) * cols;
          float* o = out + r * cols;
          for (int64_t c = 0; c < cols; ++c) {
            const float rv = rrow[c], cv = cd[c];
            const float den = cv < rv ? cv : (rv != rv ? rv : (cv != cv ? cv : rv));
            o[c] = grid_dequant(code[c], den);
          }
        }
      });
      return 0;
    }
    default: return QMUON_ERR_BAD_OP;
  }
}

}  // namespace
}  // namespace qmuon

extern "C" int qmuon_cpu_int4_momentum_update(const qmuon_q4_tensor* tensors, int64_t num_tensors,
                                              qmuon_q4_params params) {
  using namespace qmuon;
  const int64_t bs = params.block_size;
  if (const int err = check_int4_update(params)) return err;
  const MomentumWeights mw = make_momentum_weights(params.beta);
  for (int64_t i = 0; i < num_tensors; ++i) {
    const qmuon_q4_tensor& t = tensors[i];
    if (t.rows <= 0 || t.cols <= 0 || skipped(t.skip)) continue;  // a flagged matrix: nothing is written
    const int err = dispatch_g_flags<Int4Kernel>(params.grad_dtype, params.nesterov != 0, t.stream >= 0, t, mw, bs);
    if (err) return err;
  }
  return 0;
}

extern "C" int qmuon_cpu_e0m3_momentum_update(const qmuon_q4_tensor* tensors, int64_t num_tensors,
                                              qmuon_q4_params params) {
  using namespace qmuon;
  const int64_t bs = params.block_size;
  if (const int err = check_e0m3_update(params)) return err;
  const MomentumWeights mw = make_momentum_weights(params.beta);
  for (int64_t i = 0; i < num_tensors; ++i) {
    const qmuon_q4_tensor& t = tensors[i];
    if (skipped(t.skip)) continue;  // a flagged matrix: nothing is written, its tensor scale included
    if (t.rows <= 0 || t.cols <= 0) {
      // The reference's scale of an empty tensor is 1.
      if (t.tensor_scale != nullptr) *t.tensor_scale = 1.0f;
      continue;
    }
    const int err = dispatch_g_flags<E0M3Kernel>(params.grad_dtype, params.nesterov != 0, t.stream >= 0, t, mw, bs);
    if (err) return err;
  }
  return 0;
}

extern "C" int qmuon_cpu_e0m3_momentum_amax(const qmuon_q4_tensor* tensors, int64_t num_tensors,
                                            qmuon_q4_params params) {
  using namespace qmuon;
  constexpr int64_t kUnit = 256;  // any multiple of 16 gives the same max; this one is the default block
  if (const int err = check_e0m3_amax(params)) return err;
  const MomentumWeights mw = make_momentum_weights(params.beta);
  for (int64_t i = 0; i < num_tensors; ++i) {
    const qmuon_q4_tensor& t = tensors[i];
    if (t.amax_out == nullptr) return QMUON_ERR_BAD_OP;
    uint32_t bits = 0;  // an empty matrix: 0, as the reference
    if (t.rows > 0 && t.cols > 0) {
      switch (params.grad_dtype) {
        case QMUON_FLOAT32: bits = e0m3_amax_bits<F32>(t, mw, kUnit); break;
        case QMUON_BFLOAT16: bits = e0m3_amax_bits<BF16>(t, mw, kUnit); break;
        case QMUON_FLOAT16: bits = e0m3_amax_bits<F16>(t, mw, kUnit); break;
        default: return QMUON_ERR_BAD_DTYPE;
      }
    }
    *t.amax_out = amax_from_bits(bits);
  }
  return 0;
}

extern "C" int qmuon_cpu_dense_momentum_update(const qmuon_dense_tensor* tensors, int64_t num_tensors,
                                               qmuon_dense_params params) {
  using namespace qmuon;
  const int64_t bs = params.block_size;
  if (const int err = check_dense_update(params)) return err;
  const MomentumWeights mw = make_momentum_weights(params.beta);
  for (int64_t i = 0; i < num_tensors; ++i) {
    const qmuon_dense_tensor& t = tensors[i];
    if (t.rows <= 0 || t.cols <= 0 || skipped(t.skip)) continue;  // a flagged matrix: nothing is written
    int err = 0;
    const bool nest = params.nesterov != 0, stoch = t.stream >= 0;
    switch (params.buf_dtype) {
      case QMUON_FLOAT32: err = dispatch_g_flags<DenseF32Kernel>(params.grad_dtype, nest, stoch, t, mw, bs); break;
      case QMUON_BFLOAT16: err = dispatch_g_flags<DenseBF16Kernel>(params.grad_dtype, nest, stoch, t, mw, bs); break;
      default: err = QMUON_ERR_BAD_DTYPE;
    }
    if (err) return err;
  }
  return 0;
}

extern "C" int qmuon_cpu_codec(const qmuon_codec_args* args) {
  if (args == nullptr) return QMUON_ERR_BAD_OP;
  const qmuon_codec_args& a = *args;
  if (const int err = qmuon::check_codec(a)) return err;  // the same checks as qmuon_cuda_codec
  return qmuon::codec_cpu(a);
}
