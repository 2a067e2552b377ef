// Device-independent half of the binding: argument checks, the row-major (unit column stride)
// requirement of the kernels, grouping by dtype, output allocation. binding.cpp instantiates it
// with the CPU launchers, binding_cuda.cpp with the CUDA ones.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <map>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "qmuon/block_math.h"
#include "qmuon/kernels.h"
#include "qmuon/validate.h"

namespace qmuon {

inline int64_t num_blocks(int64_t cols, int64_t block_size) { return (cols + block_size - 1) / block_size; }

inline int32_t to_qmuon_dtype(c10::ScalarType t) {
  switch (t) {
    case c10::kFloat: return QMUON_FLOAT32;
    case c10::kBFloat16: return QMUON_BFLOAT16;
    case c10::kHalf: return QMUON_FLOAT16;
    case c10::kChar: return QMUON_INT8;
    case c10::kByte: return QMUON_UINT8;
    default: return -1;
  }
}

// The kernels index element (r, c) as base + r * row_stride + c.
inline bool kernel_layout_ok(const at::Tensor& t) {
  return (t.size(1) <= 1 || t.stride(1) == 1) && (t.size(0) <= 1 || t.stride(0) >= t.size(1));
}

// A tensor the kernel may write: the tensor itself, or a contiguous copy that is written back.
// `dense`: the kernel needs it fully contiguous (no row padding), as for the sums of squares.
struct Writable {
  at::Tensor original;
  at::Tensor work;
  explicit Writable(const at::Tensor& t, bool dense = false)
      : original(t), work((dense ? t.is_contiguous() : kernel_layout_ok(t)) ? t : t.contiguous()) {}
  void write_back() const {
    if (!work.is_same(original)) original.copy_(work);
  }
  int64_t row_stride() const { return work.size(0) <= 1 ? work.size(1) : work.stride(0); }
};

// The `skip` flags of a call (qmuon/kernels.h): undefined without them, else one byte per matrix (`n`
// flags, bool or uint8, on `device`), contiguous; the caller keeps the returned tensor alive until the
// kernels have run. Kernels read flag i at skip_ptr(flags, i), on the device: nothing here reads a flag.
inline at::Tensor skip_flags(const std::optional<at::Tensor>& skip, int64_t n, std::optional<c10::Device> device,
                             const char* op) {
  if (!skip.has_value() || !skip->defined()) return at::Tensor();
  const at::Tensor& s = *skip;
  TORCH_CHECK(s.scalar_type() == c10::kBool || s.scalar_type() == c10::kByte, "qmuon: ", op,
              " skip must be bool or uint8, got ", s.scalar_type());
  TORCH_CHECK(s.numel() == n, "qmuon: ", op, " skip must hold one flag per matrix (", n, "), got ", s.numel());
  TORCH_CHECK(!device.has_value() || s.device() == *device, "qmuon: ", op, " skip is on ", s.device(),
              " but the matrices are on ", device.has_value() ? device->str() : std::string("?"));
  return s.reshape({-1}).contiguous();  // bool and uint8 are one byte per flag
}

inline const uint8_t* skip_ptr(const at::Tensor& flags, size_t i) {
  return flags.defined() ? static_cast<const uint8_t*>(flags.data_ptr()) + i : nullptr;
}

inline void check_block_size(int64_t block_size) {
  TORCH_CHECK(block_size >= 1 && block_size <= kMaxBlockSize, "qmuon: block_size must be in [1, ", kMaxBlockSize,
              "], got ", block_size);
}

inline void check_q8_state(const at::Tensor& codes, const at::Tensor& absmax, int64_t block_size, const char* what) {
  TORCH_CHECK(codes.dim() == 2, "qmuon: ", what, " codes must be 2-D, got ", codes.dim(), "-D");
  TORCH_CHECK(codes.scalar_type() == c10::kChar || codes.scalar_type() == c10::kByte, "qmuon: ", what,
              " codes must be int8 or uint8, got ", codes.scalar_type());
  TORCH_CHECK(absmax.scalar_type() == c10::kFloat, "qmuon: ", what, " absmax must be float32, got ",
              absmax.scalar_type());
  TORCH_CHECK(absmax.dim() == 2 && absmax.size(0) == codes.size(0) &&
                  absmax.size(1) == num_blocks(codes.size(1), block_size),
              "qmuon: ", what, " absmax has shape ", absmax.sizes(), " but codes ", codes.sizes(),
              " with block_size ", block_size, " need (", codes.size(0), ", ",
              num_blocks(codes.size(1), block_size), ")");
  TORCH_CHECK(absmax.device() == codes.device(), "qmuon: ", what, " codes and absmax are on different devices");
}

// The per-row-block sums of squares of tensor i go to block_sumsq[i]: caller-allocated, fp32,
// shaped like that tensor's absmax, on its device. With compute_sumsq == false they are not
// computed and block_sumsq may be empty (the benchmark prices the fused sums this way).
inline void check_block_sumsq(const at::Tensor& out, const at::Tensor& codes, int64_t block_size, size_t i) {
  TORCH_CHECK(out.scalar_type() == c10::kFloat, "qmuon: block_sumsq ", i, " must be float32, got ",
              out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == codes.size(0) && out.size(1) == num_blocks(codes.size(1), block_size),
              "qmuon: block_sumsq ", i, " has shape ", out.sizes(), " but codes ", codes.sizes(), " with block_size ",
              block_size, " need (", codes.size(0), ", ", num_blocks(codes.size(1), block_size), ")");
  TORCH_CHECK(out.device() == codes.device(), "qmuon: block_sumsq ", i, " is on ", out.device(),
              " but its codes are on ", codes.device());
}

// Launch(const std::vector<qmuon_q8_tensor>&, const qmuon_q8_params&) -> void (throws on error)
template <typename Launch>
void q8_momentum_update_multi_impl(at::TensorList codes, at::TensorList absmax, at::TensorList grads,
                                   at::TensorList block_sumsq, double beta, bool nesterov, int64_t block_size,
                                   at::IntArrayRef streams, at::IntArrayRef row_offsets,
                                   const std::optional<at::Tensor>& skip, bool compute_sumsq, Launch&& launch) {
  const size_t n = codes.size();
  TORCH_CHECK(absmax.size() == n && grads.size() == n && streams.size() == n && row_offsets.size() == n,
              "qmuon: q8_momentum_update_multi_ needs lists of equal length, got ", n, " codes, ", absmax.size(),
              " absmax, ", grads.size(), " grads, ", streams.size(), " streams, ", row_offsets.size(),
              " row_offsets");
  TORCH_CHECK(block_sumsq.size() == n || (!compute_sumsq && block_sumsq.empty()),
              "qmuon: q8_momentum_update_multi_ needs one block_sumsq output per tensor, got ", block_sumsq.size(),
              " for ", n, " tensors");
  check_block_size(block_size);
  const at::Tensor flags =
      skip_flags(skip, static_cast<int64_t>(n), n > 0 ? std::optional<c10::Device>(codes[0].device()) : std::nullopt,
                 "q8_momentum_update_multi_");
  std::vector<Writable> writables;
  writables.reserve(4 * n);
  // (code dtype, grad dtype) -> matrices
  std::map<std::pair<int32_t, int32_t>, std::vector<qmuon_q8_tensor>> groups;
  for (size_t i = 0; i < n; ++i) {
    check_q8_state(codes[i], absmax[i], block_size, "q8_momentum_update_multi_");
    TORCH_CHECK(grads[i].sizes() == codes[i].sizes(), "qmuon: grad ", i, " has shape ", grads[i].sizes(),
                " but its codes have ", codes[i].sizes());
    TORCH_CHECK(grads[i].device() == codes[i].device(), "qmuon: grad ", i, " is on ", grads[i].device(),
                " but its codes are on ", codes[i].device());
    TORCH_CHECK(i == 0 || codes[i].device() == codes[0].device(), "qmuon: all tensors must be on one device");
    const int32_t gd = to_qmuon_dtype(grads[i].scalar_type());
    TORCH_CHECK(gd == QMUON_FLOAT32 || gd == QMUON_BFLOAT16 || gd == QMUON_FLOAT16,
                "qmuon: grads must be float32, bfloat16 or float16, got ", grads[i].scalar_type());
    if (compute_sumsq) check_block_sumsq(block_sumsq[i], codes[i], block_size, i);
    const int64_t rows = codes[i].size(0), cols = codes[i].size(1);
    if (rows == 0 || cols == 0) continue;
    const size_t w0 = writables.size();
    writables.emplace_back(codes[i]);
    writables.emplace_back(absmax[i]);
    writables.emplace_back(grads[i]);
    if (compute_sumsq) writables.emplace_back(block_sumsq[i], /*dense=*/true);
    const Writable& c = writables[w0];
    const Writable& a = writables[w0 + 1];
    const Writable& g = writables[w0 + 2];
    qmuon_q8_tensor t{};
    t.codes = c.work.data_ptr();
    t.absmax = a.work.data_ptr<float>();
    t.grad = g.work.data_ptr();
    t.sumsq = compute_sumsq ? writables[w0 + 3].work.data_ptr<float>() : nullptr;
    t.rows = rows;
    t.cols = cols;
    t.codes_rs = c.row_stride();
    t.absmax_rs = a.row_stride();
    t.grad_rs = g.row_stride();
    t.row_offset = row_offsets[i];
    t.stream = streams[i] < 0 ? -1 : static_cast<int64_t>(static_cast<uint32_t>(streams[i]));
    t.skip = skip_ptr(flags, i);
    groups[{to_qmuon_dtype(codes[i].scalar_type()), gd}].push_back(t);
  }
  for (const auto& kv : groups) {
    qmuon_q8_params p{};
    p.beta = beta;
    p.nesterov = nesterov ? 1 : 0;
    p.code_dtype = kv.first.first;
    p.grad_dtype = kv.first.second;
    p.block_size = block_size;
    launch(kv.second, p);
  }
  for (const auto& w : writables) w.write_back();
}

// Launch(x_ptr, x_rs, codes_ptr, code_dtype, absmax_ptr, rows, cols) -> void (throws on error)
template <typename Launch>
std::tuple<at::Tensor, at::Tensor> quantize_rows_impl(const at::Tensor& x_in, int64_t block_size, bool is_signed,
                                                      Launch&& launch) {
  TORCH_CHECK(x_in.dim() == 2, "qmuon: quantize_rows needs a 2-D tensor, got ", x_in.dim(), "-D");
  check_block_size(block_size);
  at::Tensor x = x_in.scalar_type() == c10::kFloat ? x_in : x_in.to(c10::kFloat);
  if (!kernel_layout_ok(x)) x = x.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor codes = at::empty({rows, cols}, x.options().dtype(is_signed ? c10::kChar : c10::kByte));
  at::Tensor absmax = at::empty({rows, num_blocks(cols, block_size)}, x.options());
  if (rows > 0 && cols > 0) {
    const int64_t x_rs = rows <= 1 ? cols : x.stride(0);
    launch(x.data_ptr<float>(), x_rs, codes.data_ptr(), is_signed ? QMUON_INT8 : QMUON_UINT8,
           absmax.data_ptr<float>(), rows, cols);
  }
  return {codes, absmax};
}

// Launch(codes_ptr, codes_rs, code_dtype, absmax_ptr, absmax_rs, out_ptr, rows, cols) -> void
template <typename Launch>
at::Tensor dequantize_rows_impl(const at::Tensor& codes_in, const at::Tensor& absmax_in, int64_t block_size,
                                Launch&& launch) {
  check_block_size(block_size);
  check_q8_state(codes_in, absmax_in, block_size, "dequantize_rows");
  const at::Tensor codes = kernel_layout_ok(codes_in) ? codes_in : codes_in.contiguous();
  const at::Tensor absmax = kernel_layout_ok(absmax_in) ? absmax_in : absmax_in.contiguous();
  const int64_t rows = codes.size(0), cols = codes.size(1);
  at::Tensor out = at::empty({rows, cols}, absmax.options());
  if (rows > 0 && cols > 0) {
    const int64_t codes_rs = rows <= 1 ? cols : codes.stride(0);
    const int64_t absmax_rs = rows <= 1 ? absmax.size(1) : absmax.stride(0);
    launch(codes.data_ptr(), codes_rs, to_qmuon_dtype(codes.scalar_type()), absmax.data_ptr<float>(), absmax_rs,
           out.data_ptr<float>(), rows, cols);
  }
  return out;
}

inline const char* cpu_error_string(int code) {
  const char* text = qmuon_error_text(code);  // qmuon/validate.h, the table the CUDA one extends
  return text != nullptr ? text : "unknown error";
}

}  // namespace qmuon
