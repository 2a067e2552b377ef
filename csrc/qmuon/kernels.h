// The C ABI between the binding (csrc/binding*.cpp, which knows torch) and the kernels
// (csrc/cpu/*.cpp and csrc/cuda/*.cu, which see only raw pointers). Plain C types only, so the
// .cu files compile with nvcc alone, without any torch header.
//
// Every matrix is 2-D and row-major with unit column stride; rows may be padded (a row stride in
// elements). Row blocks: `block_size` consecutive elements within a row, the last block of a row
// may be partial, nb = ceil(cols / block_size) blocks per row (see reference.py).
//
// Every struct that describes a matrix a kernel writes ends with `skip`: a flag the kernel reads where
// the data is (device memory for CUDA: never read on the host) before it does anything else for that
// matrix; nonzero leaves everything of the matrix (state, grad, sums, weights) as it was.
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
  const uint8_t* skip;  // NULL: never skip; else *skip != 0 skips this matrix (device memory for CUDA)
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

// Which vector loops the CPU kernels were compiled with: "avx512" (hand-written AVX-512 forms of the
// hot loops, see q8_cpu.cpp) or "portable" (only the compiler-vectorized C++ loops).
const char* qmuon_cpu_vector_isa(void);

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

// ---- The prebuilt GPU library only (csrc/cuda/lib_info.cu); none of them needs a GPU or a driver.
int64_t qmuon_cuda_abi_layout(int64_t* out, int64_t capacity);  // see qmuon/abi_layout.h
int64_t qmuon_cpu_abi_layout(int64_t* out, int64_t capacity);   // the CPU build's (csrc/cpu/q8_cpu.cpp)
const char* qmuon_cuda_build_info(void);                         // JSON from qmuon/ops/build_gpu.py
int qmuon_cuda_runtime_version(void);                            // CUDART_VERSION it was linked with
int qmuon_cuda_probe(int* driver_version, int* device_count);    // cudaError_t of cudaGetDeviceCount

// ---- 4-bit and dense-format momentum updates (csrc/cpu/q4_cpu.cpp, csrc/cuda/q4_cuda.cu) ----------
// One matrix of a multi-tensor int4 / e0m3 update. Codes: two 4-bit codes per byte, (rows, ceil(cols/2)).
typedef struct qmuon_q4_tensor {
  uint8_t* packed;      // uint8 (rows, ceil(cols / 2)), row stride packed_rs; read, then overwritten
  void* scales;         // int4: fp32 absmax (rows, ceil(cols / block_size)); e0m3: uint8 UE4M3 (rows, ceil(cols / 16))
  float* tensor_scale;  // e0m3: the fp32 per-tensor scale (one element; read, then overwritten); int4: NULL
  void* grad;           // fp32 / bf16 / fp16 (rows, cols), row stride grad_rs; overwritten with the NS input
  float* sumsq;         // fp32 (rows, ceil(cols / block_size)) contiguous; written (NULL: not computed)
  float* scratch;       // e0m3 on CUDA: 2 zeroed floats of device memory (amax bits, old scale); else NULL
  // e0m3 update: the new tensor scale to encode with (one float, read), or NULL to compute it from the
  // new momentum of this matrix. A row shard passes its whole matrix's (see qmuon_*_e0m3_momentum_amax).
  const float* new_tensor_scale;
  float* amax_out;      // e0m3 amax: where max |m_new| of this matrix goes (one float); else NULL
  int64_t rows;
  int64_t cols;
  int64_t packed_rs;
  int64_t scales_rs;
  int64_t grad_rs;
  int64_t row_offset;   // first row of this matrix in the unsharded matrix (noise index)
  int64_t stream;       // < 0: nearest rounding; else the 32-bit stochastic-rounding stream
  const uint8_t* skip;  // NULL: never skip; else *skip != 0 skips this matrix (device memory for CUDA)
                        // (the update ops; the e0m3 amax pass writes nothing of the state and ignores it)
} qmuon_q4_tensor;

// int4: block_size is the quantization block (even, 2 .. 4096). e0m3: the quantization block is 16 and
// block_size (a multiple or a divisor of 16, <= 4096) is only the granularity of the sums of squares.
typedef struct qmuon_q4_params {
  double beta;
  int32_t nesterov;
  int32_t grad_dtype;  // QMUON_FLOAT32 / QMUON_BFLOAT16 / QMUON_FLOAT16
  int64_t block_size;
} qmuon_q4_params;

// One matrix of a dense (fp32 / bf16 momentum buffer) update.
typedef struct qmuon_dense_tensor {
  void* buf;     // fp32 / bf16 (rows, cols), row stride buf_rs
  void* grad;    // fp32 / bf16 / fp16 (rows, cols), row stride grad_rs
  float* sumsq;  // fp32 (rows, ceil(cols / block_size)) contiguous, or NULL
  int64_t rows;
  int64_t cols;
  int64_t buf_rs;
  int64_t grad_rs;
  int64_t row_offset;
  int64_t stream;  // bf16 buffers: stochastic rounding stream (< 0: nearest); ignored for fp32
  const uint8_t* skip;  // NULL: never skip; else *skip != 0 skips this matrix (device memory for CUDA)
} qmuon_dense_tensor;

typedef struct qmuon_dense_params {
  double beta;
  int32_t nesterov;
  int32_t buf_dtype;   // QMUON_FLOAT32 / QMUON_BFLOAT16
  int32_t grad_dtype;  // QMUON_FLOAT32 / QMUON_BFLOAT16 / QMUON_FLOAT16
  int64_t block_size;  // 1 .. 4096
} qmuon_dense_params;

// The standalone 4-bit codecs, on contiguous tensors (the binding makes inputs contiguous and
// allocates the outputs). Which fields an op reads and writes is listed with its QMUON_CODEC_* id.
enum qmuon_codec_op {
  QMUON_CODEC_PACK_INT4 = 1,        // in0 int8 codes (rows, cols) -> out0 uint8 (rows, ceil(cols/2))
  QMUON_CODEC_UNPACK_INT4 = 2,      // in0 uint8 (rows, ceil(cols/2)) -> out0 int8 (rows, cols)
  QMUON_CODEC_UE4M3_ENCODE = 3,     // in0 fp32 [numel] -> out0 uint8 [numel]; flag: round up
  QMUON_CODEC_UE4M3_DECODE = 4,     // in0 uint8 [numel] -> out0 fp32 [numel]
  QMUON_CODEC_INT4_QUANTIZE = 5,    // in0 fp32 (rows, cols) -> out0 packed, out1 fp32 absmax (rows, nb)
  QMUON_CODEC_INT4_DEQUANTIZE = 6,  // in0 packed, in1 fp32 absmax -> out0 fp32 (rows, cols)
  QMUON_CODEC_E0M3_QUANTIZE = 7,    // in0 fp32 -> out0 packed, out1 uint8 scales (rows, ceil(cols/16)),
                                    //   out2 fp32 tensor scale [1]; flag: two-level
  QMUON_CODEC_E0M3_DEQUANTIZE = 8,  // in0 packed, in1 uint8 scales, in2 fp32 tensor scale [1] -> out0 fp32
  QMUON_CODEC_GRID_QUANTIZE = 9,    // in0 fp32 -> out0 packed, out1 uint8 row maxima (rows, ceil(cols/s)),
                                    //   out2 uint8 column maxima (ceil(rows/s), cols), out3 fp32 scale [1]
  QMUON_CODEC_GRID_DEQUANTIZE = 10,  // in0 packed, in1 row maxima, in2 column maxima, in3 fp32 scale [1] -> out0
  QMUON_CODEC_GRID_QUANTIZE_WITH_SCALE = 11  // GRID_QUANTIZE with the scale given: in0 fp32, in1 fp32 scale [1]
                                             //   -> out0 packed, out1 row maxima, out2 column maxima
};

typedef struct qmuon_codec_args {
  int32_t op;          // qmuon_codec_op
  int32_t flag;
  const void* in0;
  const void* in1;
  const void* in2;
  const void* in3;
  void* out0;
  void* out1;
  void* out2;
  void* out3;
  float* scratch;      // CUDA e0m3 / grid quantize: 1 zeroed float of device memory; else NULL
  int64_t rows;
  int64_t cols;        // UE4M3 ops: rows = 1, cols = numel
  int64_t block_size;  // int4 block / grid tile side
  int64_t stream;      // < 0: nearest
  int64_t row_offset;
} qmuon_codec_args;

int qmuon_cpu_int4_momentum_update(const qmuon_q4_tensor* tensors, int64_t num_tensors, qmuon_q4_params params);
int qmuon_cpu_e0m3_momentum_update(const qmuon_q4_tensor* tensors, int64_t num_tensors, qmuon_q4_params params);
// The first pass of the e0m3 update alone: *amax_out = max |m_new| of each matrix (a NaN gives the quiet NaN
// 0x7FC00000), nothing else written; params.nesterov and params.block_size are not used.
int qmuon_cpu_e0m3_momentum_amax(const qmuon_q4_tensor* tensors, int64_t num_tensors, qmuon_q4_params params);
int qmuon_cpu_dense_momentum_update(const qmuon_dense_tensor* tensors, int64_t num_tensors,
                                    qmuon_dense_params params);
int qmuon_cpu_codec(const qmuon_codec_args* args);

int qmuon_cuda_int4_momentum_update(const qmuon_q4_tensor* tensors, int64_t num_tensors, qmuon_q4_params params,
                                    void* cuda_stream);
int qmuon_cuda_e0m3_momentum_update(const qmuon_q4_tensor* tensors, int64_t num_tensors, qmuon_q4_params params,
                                    void* cuda_stream);
int qmuon_cuda_e0m3_momentum_amax(const qmuon_q4_tensor* tensors, int64_t num_tensors, qmuon_q4_params params,
                                  void* cuda_stream);  // scratch as for the update; amax_out in device memory
int qmuon_cuda_dense_momentum_update(const qmuon_dense_tensor* tensors, int64_t num_tensors,
                                     qmuon_dense_params params, void* cuda_stream);
int qmuon_cuda_codec(const qmuon_codec_args* args, void* cuda_stream);

// Error codes of the launchers that are not CUDA errors (CUDA's own codes are < 10000).
#define QMUON_ERR_BAD_DTYPE 10001
#define QMUON_ERR_BAD_BLOCK_SIZE 10002
#define QMUON_ERR_BAD_OP 10003

#ifdef __cplusplus
}  // extern "C"
#endif
