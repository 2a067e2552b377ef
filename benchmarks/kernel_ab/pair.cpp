// A/B timing of two builds of the 8-bit CPU update kernel (see README.md in this folder).
// Calls build A and build B alternately on the same buffers and prints each one's median time and
// the median of the per-pair ratios B/A (each pair ran back to back, so drift on a shared machine
// cancels). Before timing, both builds take three steps from the same state, on gradients salted with
// NaN, infinities, subnormals and an all-zero block, and the program says whether their codes,
// absmax, gradients (NS input) and sums of squares are identical byte for byte (a variant meant to be
// a pure speed-up must be). Environment: ROWS (default 4096; 32 keeps everything in L2), COLS
// (default 4096; any value, to exercise the tails), BF16=1 (bf16 gradients), STOCH=1 (stochastic
// rounding), UINT8=1 (uint8 codes), NOSS_A=1 / NOSS_B=1 (that side skips the sums of squares), and
// OMP_NUM_THREADS.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "qmuon/kernels.h"

extern "C" int upd_A(const qmuon_q8_tensor*, int64_t, qmuon_q8_params);
extern "C" int upd_B(const qmuon_q8_tensor*, int64_t, qmuon_q8_params);

int main(int argc, char** argv) {
  const int64_t rows = getenv("ROWS") ? atoi(getenv("ROWS")) : 4096;
  const int64_t cols = getenv("COLS") ? atoi(getenv("COLS")) : 4096;
  const int64_t bs = 256, nb = (cols + bs - 1) / bs;
  const int reps = argc > 1 ? atoi(argv[1]) : 41;
  const bool bf = getenv("BF16") != nullptr;
  const bool sums_a = getenv("NOSS_A") == nullptr, sums_b = getenv("NOSS_B") == nullptr;
  const bool u8 = getenv("UINT8") != nullptr;
  std::vector<int8_t> codes(rows * cols);
  std::vector<float> absmax(rows * nb, 1.0f), grad(rows * cols), sumsq(rows * nb);
  std::vector<uint16_t> grad_bf16(rows * cols);
  srand(1);
  for (auto& c : codes) c = static_cast<int8_t>(rand() % 255 - 127);
  for (size_t i = 0; i < grad.size(); ++i) {
    grad[i] = rand() / static_cast<float>(RAND_MAX) - 0.5f;
    uint32_t u;
    std::memcpy(&u, &grad[i], 4);
    grad_bf16[i] = static_cast<uint16_t>(u >> 16);
  }
  // Special values for the equality check (the timing runs on them too: they are a few elements).
  const float specials[] = {NAN, -NAN, INFINITY, -INFINITY, 1e-40f, -3e-39f, 0.0f, -0.0f, 3e38f};
  for (size_t k = 0; k < sizeof(specials) / sizeof(float); ++k) {
    const size_t i = (k * 7919u + 13u) % grad.size();
    grad[i] = specials[k];
    uint32_t u;
    std::memcpy(&u, &grad[i], 4);
    grad_bf16[i] = static_cast<uint16_t>(u >> 16);
  }
  if (rows > 2) {  // one block of zeros (absmax 0) in row 2
    for (int64_t c = 0; c < std::min<int64_t>(bs, cols); ++c) grad[2 * cols + c] = 0.0f, grad_bf16[2 * cols + c] = 0;
    for (int64_t c = 0; c < std::min<int64_t>(bs, cols); ++c) codes[2 * cols + c] = 0;
  }
  // One call of a build on the given buffers (sums == nullptr: without the sums of squares).
  auto step = [&](auto fn, std::vector<int8_t>& cd, std::vector<float>& am, std::vector<float>& g,
                  std::vector<uint16_t>& gb, float* sums) {
    qmuon_q8_tensor t{cd.data(), am.data(), bf ? static_cast<void*>(gb.data()) : g.data(), sums, rows, cols,
                      cols, nb, cols, 0, getenv("STOCH") ? 7 : -1};
    qmuon_q8_params p{0.95, 1, u8 ? QMUON_UINT8 : QMUON_INT8, bf ? QMUON_BFLOAT16 : QMUON_FLOAT32, bs};
    if (fn(&t, 1, p) != 0) {
      fprintf(stderr, "kernel error\n");
      exit(1);
    }
  };
  {
    std::vector<int8_t> ca = codes, cb = codes;
    std::vector<float> aa = absmax, ab = absmax, ga, gb, sa(sumsq.size()), sb(sumsq.size());
    std::vector<uint16_t> ha, hb;
    bool same = true;
    for (int s = 0; s < 3 && same; ++s) {  // fresh copies of the gradient each step, as an optimizer sees them
      ga = gb = grad;
      ha = hb = grad_bf16;
      step(upd_A, ca, aa, ga, ha, sa.data());
      step(upd_B, cb, ab, gb, hb, sb.data());
      same = ca == cb && std::memcmp(aa.data(), ab.data(), aa.size() * 4) == 0 &&
             std::memcmp(sa.data(), sb.data(), sa.size() * 4) == 0 &&
             (bf ? ha == hb : std::memcmp(ga.data(), gb.data(), ga.size() * 4) == 0);
    }
    printf("outputs of A and B after 3 steps: %s\n", same ? "identical" : "DIFFERENT");
  }
  auto run = [&](auto fn, bool sums) {
    const auto t0 = std::chrono::steady_clock::now();
    step(fn, codes, absmax, grad, grad_bf16, sums ? sumsq.data() : nullptr);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  std::vector<double> a, b, ratio;
  for (int i = 0; i < reps + 2; ++i) {  // two warm-up pairs
    double ta, tb;
    if (i % 2) {
      ta = run(upd_A, sums_a);
      tb = run(upd_B, sums_b);
    } else {
      tb = run(upd_B, sums_b);
      ta = run(upd_A, sums_a);
    }
    if (i >= 2) {
      a.push_back(ta);
      b.push_back(tb);
      ratio.push_back(tb / ta);
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double bytes = static_cast<double>(rows * cols) * (bf ? 6.0 : 10.0);
  printf("A %.3f ms (%.1f GB/s)  B %.3f ms (%.1f GB/s)  B/A median of %d paired ratios: %.3f\n", median(a) * 1e3,
         bytes / median(a) / 1e9, median(b) * 1e3, bytes / median(b) / 1e9, reps, median(ratio));
  return 0;
}
