// Device-independent half of the binding of the 4-bit and dense-format ops (int4 / e0m3 / dense
// multi-tensor updates and the standalone 4-bit codecs): argument checks with messages that name the
// problem, the kernels' layout (unit column stride; a contiguous copy written back otherwise),
// grouping by dtype, output allocation. `Backend` supplies the launchers (CpuBackend in binding.cpp,
// CudaBackend in binding_cuda.cpp):
//   static void int4(const std::vector<qmuon_q4_tensor>&, const qmuon_q4_params&);
//   static void e0m3(const std::vector<qmuon_q4_tensor>&, const qmuon_q4_params&);
//   static void e0m3_amax(const std::vector<qmuon_q4_tensor>&, const qmuon_q4_params&);
//   static void dense(const std::vector<qmuon_dense_tensor>&, const qmuon_dense_params&);
//   static void codec(const qmuon_codec_args&);
//   static constexpr bool kNeedsScratch;  // e0m3 / grid keep a device-side max (CUDA)
// each throwing on a kernel error.
#pragma once

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "binding_common.h"
#include "qmuon/block_math_4bit.h"

namespace qmuon {

inline int64_t packed_cols(int64_t cols) { return (cols + 1) / 2; }

inline void check_lists(const char* op, size_t n, std::initializer_list<std::pair<const char*, size_t>> others) {
  for (const auto& kv : others) {
    TORCH_CHECK(kv.second == n, "qmuon: ", op, " needs lists of equal length, got ", n, " states and ", kv.second,
                " ", kv.first);
  }
}

inline void check_grad(const at::Tensor& g, size_t i, const at::Tensor& state, const char* op) {
  TORCH_CHECK(g.dim() == 2, "qmuon: ", op, " grad ", i, " must be 2-D, got ", g.dim(), "-D");
  const int32_t gd = to_qmuon_dtype(g.scalar_type());
  TORCH_CHECK(gd == QMUON_FLOAT32 || gd == QMUON_BFLOAT16 || gd == QMUON_FLOAT16, "qmuon: ", op,
              " grads must be float32, bfloat16 or float16, got ", g.scalar_type());
  TORCH_CHECK(g.device() == state.device(), "qmuon: ", op, " grad ", i, " is on ", g.device(), " but its state is on ",
              state.device());
}

inline void check_2d(const at::Tensor& t, c10::ScalarType dtype, int64_t rows, int64_t cols, const char* what,
                     size_t i, const char* op, const char* hint) {
  TORCH_CHECK(t.scalar_type() == dtype, "qmuon: ", op, " ", what, " ", i, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == cols, "qmuon: ", op, " ", what, " ", i,
              " has shape ", t.sizes(), " but needs (", rows, ", ", cols, ")", hint);
}

// Every input of a codec must be on the device of its first one: the kernel of that device reads them
// all (a host pointer handed to a CUDA kernel is an illegal address that kills the CUDA context).
inline void check_same_device(const at::Tensor& t, const char* what, const at::Tensor& first, const char* op) {
  TORCH_CHECK(t.device() == first.device(), "qmuon: ", op, " ", what, " is on ", t.device(), " but packed is on ",
              first.device(), "; move every argument to one device");
}

// A one-element fp32 tensor on `device` (the e0m3 tensor scales, the grid scale).
inline void check_scalar(const at::Tensor& t, const char* what, size_t i, c10::Device device, const char* op) {
  TORCH_CHECK(t.scalar_type() == c10::kFloat && t.numel() == 1 && t.device() == device, "qmuon: ", op, " ", what,
              " ", i, " must be a one-element float32 tensor on ", device, ", got ", t.scalar_type(), " ", t.sizes(),
              " on ", t.device());
}

inline void check_sumsq_out(at::TensorList block_sumsq, size_t i, const at::Tensor& g, int64_t block_size,
                            const char* op) {
  TORCH_CHECK(block_sumsq.size() > i, "qmuon: ", op, " needs one block_sumsq output per tensor");
  const at::Tensor& s = block_sumsq[i];
  check_2d(s, c10::kFloat, g.size(0), num_blocks(g.size(1), block_size), "block_sumsq", i, op,
           " (rows, ceil(cols / block_size)) of its grad");
  TORCH_CHECK(s.device() == g.device(), "qmuon: ", op, " block_sumsq ", i, " is on ", s.device(),
              " but its grad is on ", g.device());
}

// ---------------------------------------------------------------------------------------------
// int4 / e0m3 multi-tensor updates
// ---------------------------------------------------------------------------------------------
enum class Q4Update { kInt4, kE0M3, kE0M3WithScale };

inline const char* q4_update_name(Q4Update kind) {
  switch (kind) {
    case Q4Update::kInt4: return "int4_momentum_update_multi_";
    case Q4Update::kE0M3: return "e0m3_momentum_update_multi_";
    default: return "e0m3_momentum_update_with_scale_multi_";
  }
}

// The e0m3 state of matrix i against its grad (shared by the updates and the amax op).
inline void check_e0m3_state(const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& tensor_scale,
                             const at::Tensor& g, size_t i, const char* op) {
  check_grad(g, i, packed, op);
  const int64_t rows = g.size(0), cols = g.size(1);
  check_2d(packed, c10::kByte, rows, packed_cols(cols), "packed", i, op, " (two 4-bit codes per byte)");
  check_2d(scales, c10::kByte, rows, num_blocks(cols, kE0M3Block), "scales", i, op,
           " (one UE4M3 scale per 16 elements)");
  check_scalar(tensor_scale, "tensor_scales", i, g.device(), op);
  TORCH_CHECK(packed.device() == scales.device(), "qmuon: ", op, " state ", i, " is on two devices");
}

// new_tensor_scales: only for kE0M3WithScale (one 0-d fp32 tensor per matrix, read).
template <typename Backend>
void q4_momentum_update_multi_impl(Q4Update kind, at::TensorList packed, at::TensorList scales,
                                   at::TensorList tensor_scales, at::TensorList new_tensor_scales,
                                   at::TensorList grads, at::TensorList block_sumsq, double beta, bool nesterov,
                                   int64_t block_size, at::IntArrayRef streams, at::IntArrayRef row_offsets,
                                   const std::optional<at::Tensor>& skip) {
  const bool e0m3 = kind != Q4Update::kInt4;
  const bool with_scale = kind == Q4Update::kE0M3WithScale;
  const char* op = q4_update_name(kind);
  const size_t n = packed.size();
  check_lists(op, n, {{"scales", scales.size()}, {"grads", grads.size()}, {"block_sumsq", block_sumsq.size()},
                      {"streams", streams.size()}, {"row_offsets", row_offsets.size()}});
  if (e0m3) check_lists(op, n, {{"tensor_scales", tensor_scales.size()}});
  if (with_scale) check_lists(op, n, {{"new_tensor_scales", new_tensor_scales.size()}});
  if (e0m3) {
    TORCH_CHECK(block_size >= 1 && block_size <= kMaxBlockSize &&
                    (block_size % kE0M3Block == 0 || kE0M3Block % block_size == 0),
                "qmuon: ", op, " needs a block_size that is a multiple or a divisor of 16 and <= ", kMaxBlockSize,
                ", got ", block_size);
  } else {
    TORCH_CHECK(block_size >= 2 && block_size <= kMaxBlockSize && block_size % 2 == 0, "qmuon: ", op,
                " needs an even block_size in [2, ", kMaxBlockSize, "] (two codes per byte), got ", block_size);
  }
  const at::Tensor flags =
      skip_flags(skip, static_cast<int64_t>(n), n > 0 ? std::optional<c10::Device>(grads[0].device()) : std::nullopt, op);
  at::Tensor scratch;
  if (Backend::kNeedsScratch && kind == Q4Update::kE0M3 && n > 0) {  // pass 1's max and the old scale
    scratch = at::zeros({static_cast<int64_t>(2 * n)}, packed[0].options().dtype(c10::kFloat));
  }
  std::vector<Writable> writables;
  writables.reserve(4 * n);
  std::map<int32_t, std::vector<qmuon_q4_tensor>> groups;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& g = grads[i];
    if (e0m3) {
      check_e0m3_state(packed[i], scales[i], tensor_scales[i], g, i, op);
      if (with_scale) check_scalar(new_tensor_scales[i], "new_tensor_scales", i, g.device(), op);
    } else {
      check_grad(g, i, packed[i], op);
      check_2d(packed[i], c10::kByte, g.size(0), packed_cols(g.size(1)), "packed", i, op,
               " (two 4-bit codes per byte)");
      check_2d(scales[i], c10::kFloat, g.size(0), num_blocks(g.size(1), block_size), "absmax", i, op,
               " (rows, ceil(cols / block_size))");
      TORCH_CHECK(packed[i].device() == scales[i].device(), "qmuon: ", op, " state ", i, " is on two devices");
    }
    const int64_t rows = g.size(0), cols = g.size(1);
    TORCH_CHECK(i == 0 || g.device() == grads[0].device(), "qmuon: ", op, ": all tensors must be on one device");
    check_sumsq_out(block_sumsq, i, g, block_size, op);
    if (rows == 0 || cols == 0) {
      // the reference's scale of an empty tensor, or the given one; a flagged matrix keeps its scale (selected
      // on the device: the flag is not read here)
      if (e0m3 && flags.defined()) {
        const at::Tensor& ts = tensor_scales[i];
        const at::Tensor unflagged = flags.select(0, static_cast<int64_t>(i)).eq(0);
        if (with_scale) ts.copy_(new_tensor_scales[i].reshape(ts.sizes()).where(unflagged, ts));
        else ts.masked_fill_(unflagged, 1.0);
      } else if (with_scale) {
        tensor_scales[i].fill_(new_tensor_scales[i].reshape({}));
      } else if (e0m3) {
        tensor_scales[i].fill_(1.0);
      }
      continue;
    }
    const size_t w0 = writables.size();
    writables.emplace_back(packed[i]);
    writables.emplace_back(scales[i]);
    writables.emplace_back(g);
    writables.emplace_back(block_sumsq[i], /*dense=*/true);
    qmuon_q4_tensor t{};
    t.packed = static_cast<uint8_t*>(writables[w0].work.data_ptr());
    t.scales = writables[w0 + 1].work.data_ptr();
    t.tensor_scale = e0m3 ? tensor_scales[i].data_ptr<float>() : nullptr;
    t.new_tensor_scale = with_scale ? new_tensor_scales[i].const_data_ptr<float>() : nullptr;
    t.grad = writables[w0 + 2].work.data_ptr();
    t.sumsq = writables[w0 + 3].work.data_ptr<float>();
    t.scratch = scratch.defined() ? scratch.data_ptr<float>() + 2 * i : nullptr;
    t.rows = rows;
    t.cols = cols;
    t.packed_rs = writables[w0].row_stride();
    t.scales_rs = writables[w0 + 1].row_stride();
    t.grad_rs = writables[w0 + 2].row_stride();
    t.row_offset = row_offsets[i];
    t.stream = streams[i] < 0 ? -1 : static_cast<int64_t>(static_cast<uint32_t>(streams[i]));
    t.skip = skip_ptr(flags, i);
    groups[to_qmuon_dtype(g.scalar_type())].push_back(t);
  }
  for (const auto& kv : groups) {
    qmuon_q4_params p{};
    p.beta = beta;
    p.nesterov = nesterov ? 1 : 0;
    p.grad_dtype = kv.first;
    p.block_size = block_size;
    if (e0m3) Backend::e0m3(kv.second, p); else Backend::int4(kv.second, p);
  }
  for (const auto& w : writables) w.write_back();
}

// max |m_new| of every e0m3 matrix: fp32 (n,) on the grads' device (CPU for an empty list).
template <typename Backend>
at::Tensor e0m3_momentum_amax_multi_impl(at::TensorList packed, at::TensorList scales, at::TensorList tensor_scales,
                                         at::TensorList grads, double beta) {
  const char* op = "e0m3_momentum_amax_multi";
  const size_t n = packed.size();
  check_lists(op, n, {{"scales", scales.size()}, {"tensor_scales", tensor_scales.size()}, {"grads", grads.size()}});
  const at::TensorOptions opts = n > 0 ? grads[0].options().dtype(c10::kFloat) : at::TensorOptions().dtype(c10::kFloat);
  at::Tensor out = at::zeros({static_cast<int64_t>(n)}, opts);
  at::Tensor scratch;
  if (Backend::kNeedsScratch && n > 0) scratch = at::zeros({static_cast<int64_t>(2 * n)}, opts);
  std::vector<at::Tensor> keep;  // unit-column-stride copies the kernel reads (nothing is written back)
  keep.reserve(3 * n);
  auto readable = [&keep](const at::Tensor& t) -> void* {
    keep.push_back(kernel_layout_ok(t) ? t : t.contiguous());
    return keep.back().data_ptr();
  };
  auto row_stride = [](const at::Tensor& t) { return t.size(0) <= 1 ? t.size(1) : t.stride(0); };
  std::map<int32_t, std::vector<qmuon_q4_tensor>> groups;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& g = grads[i];
    check_e0m3_state(packed[i], scales[i], tensor_scales[i], g, i, op);
    TORCH_CHECK(i == 0 || g.device() == grads[0].device(), "qmuon: ", op, ": all tensors must be on one device");
    if (g.size(0) == 0 || g.size(1) == 0) continue;  // out[i] stays 0
    qmuon_q4_tensor t{};
    t.packed = static_cast<uint8_t*>(readable(packed[i]));
    t.packed_rs = row_stride(keep.back());
    t.scales = readable(scales[i]);
    t.scales_rs = row_stride(keep.back());
    t.grad = readable(g);
    t.grad_rs = row_stride(keep.back());
    t.tensor_scale = tensor_scales[i].data_ptr<float>();  // read only
    t.amax_out = out.data_ptr<float>() + i;
    t.scratch = scratch.defined() ? scratch.data_ptr<float>() + 2 * i : nullptr;
    t.rows = g.size(0);
    t.cols = g.size(1);
    t.stream = -1;
    groups[to_qmuon_dtype(g.scalar_type())].push_back(t);
  }
  for (const auto& kv : groups) {
    qmuon_q4_params p{};
    p.beta = beta;
    p.grad_dtype = kv.first;
    p.block_size = kE0M3Block;
    Backend::e0m3_amax(kv.second, p);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// dense (fp32 / bf16 buffer) multi-tensor update
// ---------------------------------------------------------------------------------------------
template <typename Backend>
void dense_momentum_update_multi_impl(at::TensorList bufs, at::TensorList grads, at::TensorList block_sumsq,
                                      double beta, bool nesterov, int64_t block_size, at::IntArrayRef streams,
                                      at::IntArrayRef row_offsets, const std::optional<at::Tensor>& skip) {
  const char* op = "dense_momentum_update_multi_";
  const size_t n = bufs.size();
  check_lists(op, n, {{"grads", grads.size()}, {"block_sumsq", block_sumsq.size()}, {"streams", streams.size()},
                      {"row_offsets", row_offsets.size()}});
  check_block_size(block_size);
  const at::Tensor flags =
      skip_flags(skip, static_cast<int64_t>(n), n > 0 ? std::optional<c10::Device>(grads[0].device()) : std::nullopt, op);
  std::vector<Writable> writables;
  writables.reserve(3 * n);
  std::map<std::pair<int32_t, int32_t>, std::vector<qmuon_dense_tensor>> groups;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& g = grads[i];
    check_grad(g, i, bufs[i], op);
    const int32_t bd = to_qmuon_dtype(bufs[i].scalar_type());
    TORCH_CHECK(bd == QMUON_FLOAT32 || bd == QMUON_BFLOAT16, "qmuon: ", op, " buffers must be float32 or bfloat16, got ",
                bufs[i].scalar_type());
    TORCH_CHECK(bufs[i].sizes() == g.sizes(), "qmuon: ", op, " buffer ", i, " has shape ", bufs[i].sizes(),
                " but its grad has ", g.sizes());
    TORCH_CHECK(i == 0 || g.device() == grads[0].device(), "qmuon: ", op, ": all tensors must be on one device");
    check_sumsq_out(block_sumsq, i, g, block_size, op);
    const int64_t rows = g.size(0), cols = g.size(1);
    if (rows == 0 || cols == 0) continue;
    const size_t w0 = writables.size();
    writables.emplace_back(bufs[i]);
    writables.emplace_back(g);
    writables.emplace_back(block_sumsq[i], /*dense=*/true);
    qmuon_dense_tensor t{};
    t.buf = writables[w0].work.data_ptr();
    t.grad = writables[w0 + 1].work.data_ptr();
    t.sumsq = writables[w0 + 2].work.data_ptr<float>();
    t.rows = rows;
    t.cols = cols;
    t.buf_rs = writables[w0].row_stride();
    t.grad_rs = writables[w0 + 1].row_stride();
    t.row_offset = row_offsets[i];
    t.stream = streams[i] < 0 ? -1 : static_cast<int64_t>(static_cast<uint32_t>(streams[i]));
    t.skip = skip_ptr(flags, i);
    groups[{bd, to_qmuon_dtype(g.scalar_type())}].push_back(t);
  }
  for (const auto& kv : groups) {
    qmuon_dense_params p{};
    p.beta = beta;
    p.nesterov = nesterov ? 1 : 0;
    p.buf_dtype = kv.first.first;
    p.grad_dtype = kv.first.second;
    p.block_size = block_size;
    Backend::dense(kv.second, p);
  }
  for (const auto& w : writables) w.write_back();
}

// ---------------------------------------------------------------------------------------------
// standalone codecs (contiguous inputs, freshly allocated outputs)
// ---------------------------------------------------------------------------------------------
inline at::Tensor contiguous_as(const at::Tensor& t, c10::ScalarType dtype) {
  return (t.scalar_type() == dtype ? t : t.to(dtype)).contiguous();
}

inline void check_matrix(const at::Tensor& t, const char* what, const char* op) {
  TORCH_CHECK(t.dim() == 2, "qmuon: ", op, " ", what, " must be 2-D, got ", t.dim(), "-D");
}

inline qmuon_codec_args codec_args(int32_t op, int64_t rows, int64_t cols) {
  qmuon_codec_args a{};
  a.op = op;
  a.rows = rows;
  a.cols = cols;
  a.stream = -1;
  return a;
}

inline int64_t stream32(int64_t stream) {
  return stream < 0 ? -1 : static_cast<int64_t>(static_cast<uint32_t>(stream));
}

template <typename Backend>
at::Tensor pack_int4_impl(const at::Tensor& codes_in) {
  check_matrix(codes_in, "codes", "pack_int4");
  TORCH_CHECK(codes_in.scalar_type() == c10::kChar, "qmuon: pack_int4 codes must be int8, got ",
              codes_in.scalar_type());
  const at::Tensor codes = codes_in.contiguous();
  const int64_t rows = codes.size(0), cols = codes.size(1);
  at::Tensor out = at::empty({rows, packed_cols(cols)}, codes.options().dtype(c10::kByte));
  qmuon_codec_args a = codec_args(QMUON_CODEC_PACK_INT4, rows, cols);
  a.in0 = codes.data_ptr();
  a.out0 = out.data_ptr();
  if (rows > 0 && cols > 0) Backend::codec(a);
  return out;
}

template <typename Backend>
at::Tensor unpack_int4_impl(const at::Tensor& packed_in, int64_t cols) {
  check_matrix(packed_in, "packed", "unpack_int4");
  TORCH_CHECK(packed_in.scalar_type() == c10::kByte, "qmuon: unpack_int4 packed must be uint8, got ",
              packed_in.scalar_type());
  TORCH_CHECK(cols >= 0 && packed_cols(cols) == packed_in.size(1), "qmuon: unpack_int4: ", packed_in.size(1),
              " packed columns cannot hold ", cols, " codes (needs ceil(cols / 2))");
  const at::Tensor packed = packed_in.contiguous();
  const int64_t rows = packed.size(0);
  at::Tensor out = at::empty({rows, cols}, packed.options().dtype(c10::kChar));
  qmuon_codec_args a = codec_args(QMUON_CODEC_UNPACK_INT4, rows, cols);
  a.in0 = packed.data_ptr();
  a.out0 = out.data_ptr();
  if (rows > 0 && cols > 0) Backend::codec(a);
  return out;
}

template <typename Backend>
at::Tensor ue4m3_encode_impl(const at::Tensor& x_in, bool round_up) {
  const at::Tensor x = contiguous_as(x_in, c10::kFloat);
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(c10::kByte));
  qmuon_codec_args a = codec_args(QMUON_CODEC_UE4M3_ENCODE, 1, x.numel());
  a.flag = round_up ? 1 : 0;
  a.in0 = x.data_ptr();
  a.out0 = out.data_ptr();
  if (x.numel() > 0) Backend::codec(a);
  return out;
}

template <typename Backend>
at::Tensor ue4m3_decode_impl(const at::Tensor& bits_in) {
  TORCH_CHECK(bits_in.scalar_type() == c10::kByte, "qmuon: ue4m3_decode needs uint8 bit patterns, got ",
              bits_in.scalar_type());
  const at::Tensor bits = bits_in.contiguous();
  at::Tensor out = at::empty(bits.sizes(), bits.options().dtype(c10::kFloat));
  qmuon_codec_args a = codec_args(QMUON_CODEC_UE4M3_DECODE, 1, bits.numel());
  a.in0 = bits.data_ptr();
  a.out0 = out.data_ptr();
  if (bits.numel() > 0) Backend::codec(a);
  return out;
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor> int4_quantize_impl(const at::Tensor& x_in, int64_t block_size, int64_t stream,
                                                      int64_t row_offset) {
  check_matrix(x_in, "x", "int4_quantize");
  TORCH_CHECK(block_size >= 2 && block_size <= kMaxBlockSize && block_size % 2 == 0,
              "qmuon: int4_quantize needs an even block_size in [2, ", kMaxBlockSize, "], got ", block_size);
  const at::Tensor x = contiguous_as(x_in, c10::kFloat);
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor packed = at::empty({rows, packed_cols(cols)}, x.options().dtype(c10::kByte));
  at::Tensor absmax = at::empty({rows, num_blocks(cols, block_size)}, x.options());
  qmuon_codec_args a = codec_args(QMUON_CODEC_INT4_QUANTIZE, rows, cols);
  a.block_size = block_size;
  a.stream = stream32(stream);
  a.row_offset = row_offset;
  a.in0 = x.data_ptr();
  a.out0 = packed.data_ptr();
  a.out1 = absmax.data_ptr();
  if (rows > 0 && cols > 0) Backend::codec(a);
  return {packed, absmax};
}

template <typename Backend>
at::Tensor int4_dequantize_impl(const at::Tensor& packed_in, const at::Tensor& absmax_in, int64_t block_size,
                                int64_t cols) {
  check_matrix(packed_in, "packed", "int4_dequantize");
  TORCH_CHECK(block_size >= 1, "qmuon: int4_dequantize needs block_size >= 1, got ", block_size);
  const int64_t rows = packed_in.size(0);
  TORCH_CHECK(cols >= 0 && packed_cols(cols) == packed_in.size(1), "qmuon: int4_dequantize: ", packed_in.size(1),
              " packed columns cannot hold ", cols, " codes");
  check_2d(packed_in, c10::kByte, rows, packed_cols(cols), "packed", 0, "int4_dequantize", "");
  check_2d(absmax_in, c10::kFloat, rows, num_blocks(cols, block_size), "absmax", 0, "int4_dequantize",
           " (rows, ceil(cols / block_size))");
  check_same_device(absmax_in, "absmax", packed_in, "int4_dequantize");
  const at::Tensor packed = packed_in.contiguous(), absmax = absmax_in.contiguous();
  at::Tensor out = at::empty({rows, cols}, absmax.options());
  qmuon_codec_args a = codec_args(QMUON_CODEC_INT4_DEQUANTIZE, rows, cols);
  a.block_size = block_size;
  a.in0 = packed.data_ptr();
  a.in1 = absmax.data_ptr();
  a.out0 = out.data_ptr();
  if (rows > 0 && cols > 0) Backend::codec(a);
  return out;
}

template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor> e0m3_quantize_impl(const at::Tensor& x_in, bool two_level,
                                                                  int64_t stream, int64_t row_offset) {
  check_matrix(x_in, "x", "e0m3_quantize");
  const at::Tensor x = contiguous_as(x_in, c10::kFloat);
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor packed = at::empty({rows, packed_cols(cols)}, x.options().dtype(c10::kByte));
  at::Tensor scales = at::empty({rows, num_blocks(cols, kE0M3Block)}, x.options().dtype(c10::kByte));
  at::Tensor t = at::empty({}, x.options());
  at::Tensor scratch = Backend::kNeedsScratch ? at::zeros({1}, x.options()) : at::Tensor();
  qmuon_codec_args a = codec_args(QMUON_CODEC_E0M3_QUANTIZE, rows, cols);
  a.flag = two_level ? 1 : 0;
  a.stream = stream32(stream);
  a.row_offset = row_offset;
  a.in0 = x.data_ptr();
  a.out0 = packed.data_ptr();
  a.out1 = scales.data_ptr();
  a.out2 = t.data_ptr();
  a.scratch = scratch.defined() ? scratch.data_ptr<float>() : nullptr;
  if (rows > 0 && cols > 0) Backend::codec(a); else t.fill_(1.0);
  return {packed, scales, t};
}

template <typename Backend>
at::Tensor e0m3_dequantize_impl(const at::Tensor& packed_in, const at::Tensor& scales_in, const at::Tensor& t_in,
                                int64_t cols) {
  check_matrix(packed_in, "packed", "e0m3_dequantize");
  const int64_t rows = packed_in.size(0);
  TORCH_CHECK(cols >= 0 && packed_cols(cols) == packed_in.size(1), "qmuon: e0m3_dequantize: ", packed_in.size(1),
              " packed columns cannot hold ", cols, " codes");
  check_2d(packed_in, c10::kByte, rows, packed_cols(cols), "packed", 0, "e0m3_dequantize", "");
  check_2d(scales_in, c10::kByte, rows, num_blocks(cols, kE0M3Block), "scales", 0, "e0m3_dequantize",
           " (one UE4M3 scale per 16 elements)");
  TORCH_CHECK(t_in.numel() == 1, "qmuon: e0m3_dequantize tensor_scale must have one element, got ", t_in.sizes());
  check_same_device(scales_in, "scales", packed_in, "e0m3_dequantize");
  check_same_device(t_in, "tensor_scale", packed_in, "e0m3_dequantize");
  const at::Tensor packed = packed_in.contiguous(), scales = scales_in.contiguous();
  const at::Tensor t = contiguous_as(t_in, c10::kFloat);
  at::Tensor out = at::empty({rows, cols}, packed.options().dtype(c10::kFloat));
  qmuon_codec_args a = codec_args(QMUON_CODEC_E0M3_DEQUANTIZE, rows, cols);
  a.in0 = packed.data_ptr();
  a.in1 = scales.data_ptr();
  a.in2 = t.data_ptr();
  a.out0 = out.data_ptr();
  if (rows > 0 && cols > 0) Backend::codec(a);
  return out;
}

// grid_quantize4 (scale_in == nullptr: the scale is computed from x and returned as the 4th tensor)
// or grid_quantize4_with_scale (the given one-element fp32 scale; the 4th tensor is undefined).
template <typename Backend>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> grid_quantize4_impl(const at::Tensor& x_in,
                                                                               int64_t grid_block,
                                                                               const at::Tensor* scale_in,
                                                                               int64_t stream, int64_t row_offset) {
  const char* op = scale_in == nullptr ? "grid_quantize4" : "grid_quantize4_with_scale";
  check_matrix(x_in, "x", op);
  TORCH_CHECK(grid_block >= 1, "qmuon: ", op, " needs grid_block >= 1, got ", grid_block);
  if (scale_in != nullptr) check_scalar(*scale_in, "scale", 0, x_in.device(), op);
  const at::Tensor x = contiguous_as(x_in, c10::kFloat);
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor packed = at::empty({rows, packed_cols(cols)}, x.options().dtype(c10::kByte));
  at::Tensor row_max = at::empty({rows, num_blocks(cols, grid_block)}, x.options().dtype(c10::kByte));
  at::Tensor col_max = at::empty({num_blocks(rows, grid_block), cols}, x.options().dtype(c10::kByte));
  at::Tensor t, scale, scratch;
  const int32_t codec = scale_in == nullptr ? QMUON_CODEC_GRID_QUANTIZE : QMUON_CODEC_GRID_QUANTIZE_WITH_SCALE;
  qmuon_codec_args a = codec_args(codec, rows, cols);
  if (scale_in == nullptr) {
    t = at::empty({}, x.options());
    if (Backend::kNeedsScratch) scratch = at::zeros({1}, x.options());  // the max |x| bits
    a.out3 = t.data_ptr();
    a.scratch = scratch.defined() ? scratch.data_ptr<float>() : nullptr;
  } else {
    scale = scale_in->contiguous();
    a.in1 = scale.data_ptr();
  }
  a.block_size = grid_block;
  a.stream = stream32(stream);
  a.row_offset = row_offset;
  a.in0 = x.data_ptr();
  a.out0 = packed.data_ptr();
  a.out1 = row_max.data_ptr();
  a.out2 = col_max.data_ptr();
  if (rows > 0 && cols > 0) Backend::codec(a); else if (t.defined()) t.fill_(1.0);
  return {packed, row_max, col_max, t};
}

template <typename Backend>
at::Tensor grid_dequantize4_impl(const at::Tensor& packed_in, const at::Tensor& row_in, const at::Tensor& col_in,
                                 const at::Tensor& t_in, int64_t grid_block, int64_t cols) {
  const char* op = "grid_dequantize4";
  check_matrix(packed_in, "packed", op);
  TORCH_CHECK(grid_block >= 1, "qmuon: grid_dequantize4 needs grid_block >= 1, got ", grid_block);
  const int64_t rows = packed_in.size(0);
  TORCH_CHECK(cols >= 0 && packed_cols(cols) == packed_in.size(1), "qmuon: ", op, ": ", packed_in.size(1),
              " packed columns cannot hold ", cols, " codes");
  check_2d(packed_in, c10::kByte, rows, packed_cols(cols), "packed", 0, op, "");
  check_2d(row_in, c10::kByte, rows, num_blocks(cols, grid_block), "row maxima", 0, op, " (rows, ceil(cols / s))");
  check_2d(col_in, c10::kByte, num_blocks(rows, grid_block), cols, "column maxima", 0, op, " (ceil(rows / s), cols)");
  TORCH_CHECK(t_in.numel() == 1, "qmuon: grid_dequantize4 scale must have one element, got ", t_in.sizes());
  check_same_device(row_in, "row maxima", packed_in, op);
  check_same_device(col_in, "column maxima", packed_in, op);
  check_same_device(t_in, "scale", packed_in, op);
  const at::Tensor packed = packed_in.contiguous(), rb = row_in.contiguous(), cb = col_in.contiguous();
  const at::Tensor t = contiguous_as(t_in, c10::kFloat);
  at::Tensor out = at::empty({rows, cols}, packed.options().dtype(c10::kFloat));
  qmuon_codec_args a = codec_args(QMUON_CODEC_GRID_DEQUANTIZE, rows, cols);
  a.block_size = grid_block;
  a.in0 = packed.data_ptr();
  a.in1 = rb.data_ptr();
  a.in2 = cb.data_ptr();
  a.in3 = t.data_ptr();
  a.out0 = out.data_ptr();
  if (rows > 0 && cols > 0) Backend::codec(a);
  return out;
}

}  // namespace qmuon

// Schemas of the qmuon_C twins of the torch.ops.qmuon 4-bit / dense ops (same arguments).
#define QMUON_4BIT_SCHEMAS(m)                                                                                      \
  m.def(                                                                                                           \
      "int4_momentum_update_multi_(Tensor(a!)[] packed, Tensor(b!)[] absmax, Tensor(c!)[] grads, "                 \
      "Tensor(d!)[] block_sumsq, float beta, bool nesterov, int block_size, int[] streams, int[] row_offsets, "      \
      "Tensor? skip=None) -> ()");                                                                                 \
  m.def(                                                                                                           \
      "e0m3_momentum_update_multi_(Tensor(a!)[] packed, Tensor(b!)[] scales, Tensor(c!)[] tensor_scales, "         \
      "Tensor(d!)[] grads, Tensor(e!)[] block_sumsq, float beta, bool nesterov, int block_size, int[] streams, "   \
      "int[] row_offsets, Tensor? skip=None) -> ()");                                                              \
  m.def(                                                                                                           \
      "e0m3_momentum_update_with_scale_multi_(Tensor(a!)[] packed, Tensor(b!)[] scales, "                          \
      "Tensor(c!)[] tensor_scales, Tensor[] new_tensor_scales, Tensor(d!)[] grads, Tensor(e!)[] block_sumsq, "     \
      "float beta, bool nesterov, int block_size, int[] streams, int[] row_offsets, Tensor? skip=None) -> ()");    \
  m.def(                                                                                                           \
      "e0m3_momentum_amax_multi(Tensor[] packed, Tensor[] scales, Tensor[] tensor_scales, Tensor[] grads, "        \
      "float beta) -> Tensor");                                                                                    \
  m.def(                                                                                                           \
      "dense_momentum_update_multi_(Tensor(a!)[] bufs, Tensor(b!)[] grads, Tensor(c!)[] block_sumsq, float beta, " \
      "bool nesterov, int block_size, int[] streams, int[] row_offsets, Tensor? skip=None) -> ()");                \
  m.def("pack_int4(Tensor codes) -> Tensor");                                                                      \
  m.def("unpack_int4(Tensor packed, int cols) -> Tensor");                                                         \
  m.def("ue4m3_encode(Tensor x, bool round_up) -> Tensor");                                                        \
  m.def("ue4m3_decode(Tensor bits) -> Tensor");                                                                    \
  m.def("int4_quantize(Tensor x, int block_size, int stream, int row_offset) -> (Tensor, Tensor)");                \
  m.def("int4_dequantize(Tensor packed, Tensor absmax, int block_size, int cols) -> Tensor");                      \
  m.def("e0m3_quantize(Tensor x, bool two_level, int stream, int row_offset) -> (Tensor, Tensor, Tensor)");       \
  m.def("e0m3_dequantize(Tensor packed, Tensor scales, Tensor tensor_scale, int cols) -> Tensor");                \
  m.def(                                                                                                           \
      "grid_quantize4(Tensor x, int grid_block, int stream, int row_offset) -> (Tensor, Tensor, Tensor, Tensor)"); \
  m.def(                                                                                                           \
      "grid_quantize4_with_scale(Tensor x, int grid_block, Tensor scale, int stream, int row_offset) "             \
      "-> (Tensor, Tensor, Tensor)");                                                                              \
  m.def(                                                                                                           \
      "grid_dequantize4(Tensor packed, Tensor row_max, Tensor col_max, Tensor scale, int grid_block, int cols) "   \
      "-> Tensor")

// Registers Backend's implementations of the ops above for one dispatch key; `Guard` is a type
// constructible from a tensor's device (a no-op on CPU, CUDAGuard on CUDA).
#define QMUON_4BIT_IMPLS(m, Backend, Guard)                                                                        \
  m.impl("int4_momentum_update_multi_",                                                                            \
         [](at::TensorList packed, at::TensorList absmax, at::TensorList grads, at::TensorList sums, double beta,  \
            bool nesterov, int64_t bs, at::IntArrayRef streams, at::IntArrayRef offsets,                          \
            const std::optional<at::Tensor>& skip) {                                                               \
           std::optional<Guard> g;                                                                                 \
           if (!grads.empty()) g.emplace(grads[0].device());                                                       \
           qmuon::q4_momentum_update_multi_impl<Backend>(qmuon::Q4Update::kInt4, packed, absmax, {}, {}, grads,    \
                                                         sums, beta, nesterov, bs, streams, offsets, skip);        \
         });                                                                                                       \
  m.impl("e0m3_momentum_update_multi_",                                                                            \
         [](at::TensorList packed, at::TensorList scales, at::TensorList ts, at::TensorList grads,                 \
            at::TensorList sums, double beta, bool nesterov, int64_t bs, at::IntArrayRef streams,                  \
            at::IntArrayRef offsets, const std::optional<at::Tensor>& skip) {                                      \
           std::optional<Guard> g;                                                                                 \
           if (!grads.empty()) g.emplace(grads[0].device());                                                       \
           qmuon::q4_momentum_update_multi_impl<Backend>(qmuon::Q4Update::kE0M3, packed, scales, ts, {}, grads,    \
                                                         sums, beta, nesterov, bs, streams, offsets, skip);        \
         });                                                                                                       \
  m.impl("e0m3_momentum_update_with_scale_multi_",                                                                 \
         [](at::TensorList packed, at::TensorList scales, at::TensorList ts, at::TensorList new_ts,                \
            at::TensorList grads, at::TensorList sums, double beta, bool nesterov, int64_t bs,                     \
            at::IntArrayRef streams, at::IntArrayRef offsets, const std::optional<at::Tensor>& skip) {             \
           std::optional<Guard> g;                                                                                 \
           if (!grads.empty()) g.emplace(grads[0].device());                                                       \
           qmuon::q4_momentum_update_multi_impl<Backend>(qmuon::Q4Update::kE0M3WithScale, packed, scales, ts,      \
                                                         new_ts, grads, sums, beta, nesterov, bs, streams,         \
                                                         offsets, skip);                                           \
         });                                                                                                       \
  m.impl("e0m3_momentum_amax_multi",                                                                               \
         [](at::TensorList packed, at::TensorList scales, at::TensorList ts, at::TensorList grads, double beta) {  \
           std::optional<Guard> g;                                                                                 \
           if (!grads.empty()) g.emplace(grads[0].device());                                                       \
           return qmuon::e0m3_momentum_amax_multi_impl<Backend>(packed, scales, ts, grads, beta);                  \
         });                                                                                                       \
  m.impl("dense_momentum_update_multi_",                                                                           \
         [](at::TensorList bufs, at::TensorList grads, at::TensorList sums, double beta, bool nesterov, int64_t bs, \
            at::IntArrayRef streams, at::IntArrayRef offsets, const std::optional<at::Tensor>& skip) {             \
           std::optional<Guard> g;                                                                                 \
           if (!grads.empty()) g.emplace(grads[0].device());                                                       \
           qmuon::dense_momentum_update_multi_impl<Backend>(bufs, grads, sums, beta, nesterov, bs, streams,        \
                                                            offsets, skip);                                        \
         });                                                                                                       \
  m.impl("pack_int4", [](const at::Tensor& c) {                                                                    \
    const Guard g(c.device());                                                                                     \
    return qmuon::pack_int4_impl<Backend>(c);                                                                      \
  });                                                                                                              \
  m.impl("unpack_int4", [](const at::Tensor& p, int64_t cols) {                                                    \
    const Guard g(p.device());                                                                                     \
    return qmuon::unpack_int4_impl<Backend>(p, cols);                                                              \
  });                                                                                                              \
  m.impl("ue4m3_encode", [](const at::Tensor& x, bool up) {                                                        \
    const Guard g(x.device());                                                                                     \
    return qmuon::ue4m3_encode_impl<Backend>(x, up);                                                               \
  });                                                                                                              \
  m.impl("ue4m3_decode", [](const at::Tensor& b) {                                                                 \
    const Guard g(b.device());                                                                                     \
    return qmuon::ue4m3_decode_impl<Backend>(b);                                                                   \
  });                                                                                                              \
  m.impl("int4_quantize", [](const at::Tensor& x, int64_t bs, int64_t s, int64_t o) {                              \
    const Guard g(x.device());                                                                                     \
    return qmuon::int4_quantize_impl<Backend>(x, bs, s, o);                                                        \
  });                                                                                                              \
  m.impl("int4_dequantize", [](const at::Tensor& p, const at::Tensor& a, int64_t bs, int64_t cols) {               \
    const Guard g(p.device());                                                                                     \
    return qmuon::int4_dequantize_impl<Backend>(p, a, bs, cols);                                                   \
  });                                                                                                              \
  m.impl("e0m3_quantize", [](const at::Tensor& x, bool two, int64_t s, int64_t o) {                                \
    const Guard g(x.device());                                                                                     \
    return qmuon::e0m3_quantize_impl<Backend>(x, two, s, o);                                                       \
  });                                                                                                              \
  m.impl("e0m3_dequantize", [](const at::Tensor& p, const at::Tensor& sc, const at::Tensor& t, int64_t cols) {     \
    const Guard g(p.device());                                                                                     \
    return qmuon::e0m3_dequantize_impl<Backend>(p, sc, t, cols);                                                   \
  });                                                                                                              \
  m.impl("grid_quantize4", [](const at::Tensor& x, int64_t s, int64_t st, int64_t o) {                             \
    const Guard g(x.device());                                                                                     \
    return qmuon::grid_quantize4_impl<Backend>(x, s, nullptr, st, o);                                              \
  });                                                                                                              \
  m.impl("grid_quantize4_with_scale",                                                                              \
         [](const at::Tensor& x, int64_t s, const at::Tensor& scale, int64_t st, int64_t o) {                      \
           const Guard g(x.device());                                                                              \
           auto out = qmuon::grid_quantize4_impl<Backend>(x, s, &scale, st, o);                                    \
           return std::make_tuple(std::get<0>(out), std::get<1>(out), std::get<2>(out));                          \
         });                                                                                                       \
  m.impl("grid_dequantize4", [](const at::Tensor& p, const at::Tensor& r, const at::Tensor& c, const at::Tensor& t, \
                                int64_t s, int64_t cols) {                                                         \
    const Guard g(p.device());                                                                                     \
    return qmuon::grid_dequantize4_impl<Backend>(p, r, c, t, s, cols);                                             \
  })
