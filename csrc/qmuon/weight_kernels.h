// C ABI of the weight-write kernels (bf16 and fp32 weights; csrc/cpu/weight_cpu.cpp,
// csrc/cuda/weight_cuda.cu), called by csrc/binding_weight*.cpp. Plain C types only (the .cu file sees
// no torch header). Matrices are 2-D, row-major with unit column stride and a row stride in elements
// (the fp32 write's update: any strides).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct qmuon_weight_args {
  uint16_t* param;         // bf16 bits (rows, cols), row stride param_rs; read, then overwritten
  int8_t* ecc;             // int8 (rows, cols), row stride ecc_rs (NULL: no error correction)
  const void* update;      // fp32 / bf16 / fp16 (rows, cols), row stride update_rs
  int32_t update_dtype;    // QMUON_FLOAT32 / QMUON_BFLOAT16 / QMUON_FLOAT16 (kernels.h)
  int64_t rows;
  int64_t cols;
  int64_t param_rs;
  int64_t ecc_rs;
  int64_t update_rs;
  float alpha;             // fp32(alpha), fp32(decay): rounded once by the caller, as torch does
  float decay;
  int64_t stream;          // < 0: nearest; else the 32-bit stochastic-rounding stream (ignored with ecc)
  int64_t index0;          // global index of element (0, 0)
  int64_t index_rs;        // global-index stride of a row
  const uint8_t* skip;     // NULL: never skip; else *skip != 0 skips this matrix (device memory for CUDA)
} qmuon_weight_args;

// fp32 weights: param <- fma(update, alpha, fp32(param * decay)) (qmuon/weight_math.h,
// fp32_weight_element). The update may have any strides (a transposed Newton-Schulz output is read
// in place, no contiguous copy); the param has unit column stride.
typedef struct qmuon_fp32_weight_args {
  float* param;            // fp32 (rows, cols), row stride param_rs, unit column stride
  const void* update;      // fp32 / bf16 / fp16 (rows, cols), strides update_rs, update_cs (elements)
  int32_t update_dtype;    // QMUON_FLOAT32 / QMUON_BFLOAT16 / QMUON_FLOAT16 (kernels.h)
  int64_t rows;
  int64_t cols;
  int64_t param_rs;
  int64_t update_rs;
  int64_t update_cs;
  float alpha;             // fp32(alpha), fp32(decay): rounded once by the caller, as torch does
  float decay;
  const uint8_t* skip;     // NULL: never skip; else *skip != 0 skips this matrix (device memory for CUDA)
} qmuon_fp32_weight_args;

// Return 0, or QMUON_ERR_BAD_DTYPE (kernels.h).
int qmuon_cpu_bf16_weight_update(const qmuon_weight_args* args);
// Asynchronous on `cuda_stream` (a cudaStream_t); returns a cudaError_t or QMUON_ERR_BAD_DTYPE.
int qmuon_cuda_bf16_weight_update(const qmuon_weight_args* args, void* cuda_stream);
int qmuon_cpu_fp32_weight_update(const qmuon_fp32_weight_args* args);
int qmuon_cuda_fp32_weight_update(const qmuon_fp32_weight_args* args, void* cuda_stream);

#ifdef __cplusplus
}
#endif
