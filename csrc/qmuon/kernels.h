// The C ABI between the binding (csrc/binding*.cpp, which knows torch) and the kernels
// (csrc/cpu/*.cpp and csrc/cuda/*.cu, which see only raw pointers). Plain C types only, so the
// .cu files compile with nvcc alone, without any torch header.
//
// Every matrix is 2-D and row-major with unit column stride; rows may be padded (a row stride in
// elements). Row blocks: `block_size` consecutive elements within a row, the last block of a row
// may be partial, nb = ceil(cols / block_size) blocks per row (see reference.py).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum qmuon_dtype {
  QMUON_FLOAT32 = 0,
  QMUON_BFLOAT16 = 1,
  QMUON_FLOAT16 = 2,
  QMUON_INT8 = 3,
  QMUON_UINT8 = 4,
};

// One matrix of a multi-tensor 8-bit momentum update.
typedef struct qmuon_q8_tensor {
  void* codes;         // int8 / uint8, (rows, cols), row stride codes_rs
  float* absmax;       // fp32, (rows, nb), row stride absmax_rs; read, then overwritten
  void* grad;          // fp32 / bf16 / fp16, (rows, cols), row stride grad_rs; overwritten with the NS input
  float* sumsq;        // fp32, (rows, nb) contiguous; written (NULL: not computed)
  int64_t rows;
  int64_t cols;
  int64_t codes_rs;
  int64_t absmax_rs;
  int64_t grad_rs;
  int64_t row_offset;  // first row of this matrix in the unsharded matrix (noise index)
  int64_t stream;      // < 0: nearest rounding; else the 32-bit stochastic-rounding stream
} qmuon_q8_tensor;

// Shared by all matrices of one call; all matrices of one call share code and grad dtypes.
typedef struct qmuon_q8_params {
  double beta;
  int32_t nesterov;
  int32_t code_dtype;  // QMUON_INT8 / QMUON_UINT8
  int32_t grad_dtype;  // QMUON_FLOAT32 / QMUON_BFLOAT16 / QMUON_FLOAT16
  int64_t block_size;  // 1 .. 4096
} qmuon_q8_params;

// ---- CPU (csrc/cpu/q8_cpu.cpp; threads through at::parallel_for). Return 0, or an error code.
int qmuon_cpu_q8_momentum_update(const qmuon_q8_tensor* tensors, int64_t num_tensors, qmuon_q8_params params);

int qmuon_cpu_quantize_rows(const float* x, int64_t x_rs, void* codes, int32_t code_dtype, float* absmax,
                            int64_t rows, int64_t cols, int64_t block_size, int64_t stream, int64_t row_offset);

int qmuon_cpu_dequantize_rows(const void* codes, int64_t codes_rs, int32_t code_dtype, const float* absmax,
                              int64_t absmax_rs, float* out, int64_t rows, int64_t cols, int64_t block_size);

// ---- CUDA (csrc/cuda/q8_cuda.cu). `cuda_stream` is a cudaStream_t. Return a cudaError_t (0 = ok)
// or one of the QMUON_ERR_* codes; the launch is asynchronous on `cuda_stream`.
int qmuon_cuda_q8_momentum_update(const qmuon_q8_tensor* tensors, int64_t num_tensors, qmuon_q8_params params,
                                  void* cuda_stream);

int qmuon_cuda_quantize_rows(const float* x, int64_t x_rs, void* codes, int32_t code_dtype, float* absmax,
                             int64_t rows, int64_t cols, int64_t block_size, int64_t stream, int64_t row_offset,
                             void* cuda_stream);

int qmuon_cuda_dequantize_rows(const void* codes, int64_t codes_rs, int32_t code_dtype, const float* absmax,
                               int64_t absmax_rs, float* out, int64_t rows, int64_t cols, int64_t block_size,
                               void* cuda_stream);

const char* qmuon_cuda_error_string(int code);

// Error codes of the launchers that are not CUDA errors (CUDA's own codes are < 10000).
#define QMUON_ERR_BAD_DTYPE 10001
#define QMUON_ERR_BAD_BLOCK_SIZE 10002

#ifdef __cplusplus
}  // extern "C"
#endif
