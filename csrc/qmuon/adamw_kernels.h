// C ABI of the quantized AdamW moment kernels (csrc/cpu/adamw_cpu.cpp, csrc/cuda/adamw_cuda.cu), called
// by csrc/binding_adamw*.cpp. Plain C types only (the .cu sees no torch header). Matrices are 2-D,
// row-major with unit column stride and a row stride in elements (row slices of the state are views).
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct qmuon_adamw_q_args {
  const void* grad;  // fp32 / bf16 / fp16 (qmuon_dtype), (rows, cols)
  int64_t grad_rs;
  int32_t grad_dtype;
  int32_t m_kind;    // 0: int8 m, 2: 4-bit m
  int32_t v_kind;    // 1: uint8 v, 3: 4-bit v
  int32_t pad_;
  uint8_t* m_codes;  // (rows, cols) or (rows, ceil(cols / 2)) for 4-bit; read, then overwritten
  int64_t m_rs;
  float* m_scale;    // (rows, nb) fp32
  int64_t m_scale_rs;
  uint8_t* v_codes;
  int64_t v_rs;
  float* v_scale;
  int64_t v_scale_rs;
  float* update;     // (rows, cols) fp32, written
  int64_t update_rs;
  int64_t rows;
  int64_t cols;
  int64_t block_size;  // even, 2 .. 4096
  double beta1;
  double beta2;
  double eps;
  double neg_step_size;
  double bias_correction2_sqrt;
  int64_t stream;   // < 0: nearest rounding of the codes; else the 32-bit stochastic-rounding stream
  int64_t index0;   // global (whole-parameter, row-major) index of element (0, 0); row r starts at index0 + r * cols
  const uint8_t* skip;  // NULL: never skip; else *skip != 0 skips this matrix (device memory for CUDA)
} qmuon_adamw_q_args;

// Return 0 or a QMUON_ERR_* code (CPU) / cudaError_t (CUDA, asynchronous on `cuda_stream`).
int qmuon_cpu_adamw_q_update(const qmuon_adamw_q_args* args);
int qmuon_cuda_adamw_q_update(const qmuon_adamw_q_args* args, void* cuda_stream);

#ifdef __cplusplus
}
#endif
