// Stand-in for ATen/Parallel.h so that csrc/cpu/q8_cpu.cpp builds without torch: at::parallel_for
// over OpenMP threads, one contiguous chunk per thread, as ATen's OpenMP backend splits a range.
#pragma once
#include <omp.h>

#include <cstdint>

namespace at {
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int threads = omp_get_max_threads();
  const int64_t chunks = (end - begin + grain - 1) / grain;
  if (threads <= 1 || chunks <= 1) {
    f(begin, end);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t per = (end - begin + threads - 1) / threads;
    const int64_t b = begin + omp_get_thread_num() * per;
    const int64_t e = b + per < end ? b + per : end;
    if (b < e) f(b, e);
  }
}
}  // namespace at
