"""What goes wrong on a first GPU run, tested where it would: the CUDA kernels against the pure-PyTorch
reference running on the same CUDA device (``torch.ops.qmuon.<op>`` vs ``OPS[<op>].reference``), for
every momentum format (q8, int4, e0m3, dense fp32 / bf16):

* more than 24 matrices in one call (the kernels batch 24 per launch), storage offsets of 1-3 elements,
  padded rows, mixed code / grad dtypes in one call, a 4096-wide block, and a ``row_offset`` that makes
  the global element index cross 2**32 inside a block (the 64-bit noise index), with stochastic rounding;
* a second device (``cuda:1``) when there is one;
* NaN / +-Inf gradients: the kernel equals the CPU kernel bit for bit on every 16-bit value (NaN is
  written as the CPU's 0x7FC0 / 0x7E00, not the GPU conversion's 0x7FFF) and the reference up to NaN
  payloads (fp32 NaNs from arithmetic carry the hardware's payload on both sides);
* updates on a side stream, and captured in a ``torch.cuda.graph`` after warm-up, replayed twice, equal
  bit for bit to eager runs; stochastic rounding refuses capture with a clear error (docs/kernels.md);
* a CPU tensor passed beside CUDA ones raises a clear error and leaves the CUDA context usable.

Tolerance: bits everywhere except the per-block sums of squares (fp32 summation order, ``sumsq_rtol``).
Every test here is ``cuda``-marked (skipped without a GPU); the entry-point validation tests at the end
also run on the CPU through the compiled library's C symbols.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch

from _helpers import assert_bits_equal, assert_sumsq_close, float_bits
from qmuon.ops import reference as ref
from qmuon.ops import reference_4bit as ref4
from qmuon.ops._library import OPS

OP = {"q8": "q8_momentum_update_multi_", "int4": "int4_momentum_update_multi_",
      "e0m3": "e0m3_momentum_update_multi_", "dense": "dense_momentum_update_multi_",
      "dense_bf16": "dense_momentum_update_multi_"}
FORMATS = list(OP)
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _offset_view(t: torch.Tensor, offset: int, pad: int) -> torch.Tensor:
    """``t``'s values in a view whose storage starts ``offset`` elements in, rows padded by ``pad``."""
    rows, cols = t.shape
    flat = torch.empty(offset + rows * (cols + pad) + 4, dtype=t.dtype, device=t.device)
    v = flat[offset: offset + rows * (cols + pad)].view(rows, cols + pad)[:, :cols]
    v.copy_(t)
    return v


def _state(fmt: str, m: torch.Tensor, bs: int, code_dtype: torch.dtype = torch.int8) -> list[torch.Tensor]:
    """The format's state of momentum ``m`` (built by the reference on the CPU, moved to m's device)."""
    mc = m.cpu()
    if fmt == "q8":
        st = list(ref.quantize_rows(mc, bs, signed=code_dtype == torch.int8))
    elif fmt == "int4":
        st = list(ref4.int4_quantize(mc, bs))
    elif fmt == "e0m3":
        st = list(ref4.e0m3_quantize(mc))
        st[2] = st[2].reshape(1)
    else:
        st = [mc.to(torch.bfloat16 if fmt == "dense_bf16" else torch.float32)]
    return [t.to(m.device) for t in st]


def _args(fmt, states, grads, bs, streams, offsets, nesterov=True, beta=0.95):
    sums = [torch.full((g.shape[0], ref.num_blocks(g.shape[1], bs)), float("nan"), device=g.device) for g in grads]
    lists = [list(x) for x in zip(*states)]
    return (*lists, grads, sums, beta, nesterov, bs, list(streams), list(offsets))


def _clone(args):
    return tuple([t.clone() for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                 else a for a in args)


def _assert_same(fmt, kernel_args, ref_args, bs, what, nan_payloads_equal=False):
    """Every tensor list of the two argument tuples equal (states and grads bitwise, sums within the
    summation-order tolerance); with ``nan_payloads_equal`` a NaN equals any NaN."""
    n_lists = len([a for a in kernel_args if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)])
    for j in range(n_lists):
        for i, (a, b) in enumerate(zip(kernel_args[j], ref_args[j])):
            tag = f"{what}: {fmt} list {j} tensor {i}"
            if j == n_lists - 1:  # block_sumsq
                assert_sumsq_close(a, b, bs)
            elif nan_payloads_equal and a.is_floating_point():
                a, b = a.cpu(), b.cpu()
                both_nan = torch.isnan(a) & torch.isnan(b)
                eq = (float_bits(a) == float_bits(b)) | both_nan
                assert bool(eq.all()), f"{tag}: {int((~eq).sum())} elements differ"
            else:
                assert_bits_equal(a, b, tag)


def _run_both(fmt, args, steps=2, fresh_grads=None):
    """The op (CUDA kernel) on ``args`` and the op's reference (on the same device) on clones, ``steps``
    times with the same new gradients; returns both argument tuples."""
    op = OPS[OP[fmt]]
    k_args, r_args = args, _clone(args)
    grads_at = [i for i, a in enumerate(args) if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)][-2]
    fresh = fresh_grads or [g.clone() for g in args[grads_at]]
    for step in range(steps):
        if step:
            for kg, rg, f in zip(k_args[grads_at], r_args[grads_at], fresh):
                kg.copy_(f * (step + 1) * 0.5)
                rg.copy_(f * (step + 1) * 0.5)
        getattr(torch.ops.qmuon, op.name)(*k_args)
        op.reference(*r_args)
    return k_args, r_args


def _many(fmt, device, n=30, bs=64, cross_2_32=False, seed=0):
    """``n`` matrices (> 24: two launches), storage offsets 1-3, padded rows, mixed grad dtypes (and
    mixed int8 / uint8 codes for q8), stochastic rounding with distinct streams."""
    gen = torch.Generator().manual_seed(seed)
    states, grads, streams, offsets = [], [], [], []
    for i in range(n):
        rows = 1 + (i * 7) % 9
        cols = 1000 if cross_2_32 else 1 + (i * 37) % 300
        m = (torch.randn(rows, cols, generator=gen) * 0.05).to(device)
        st = _state(fmt, m, bs, torch.int8 if i % 2 else torch.uint8)
        states.append([_offset_view(t, 1 + i % 3, i % 2) if t.dim() == 2 else t for t in st])
        g = (torch.randn(rows, cols, generator=gen) * 0.1).to(GRAD_DTYPES[i % 3]).to(device)
        grads.append(_offset_view(g, 1 + (i + 1) % 3, (i + 1) % 2))
        streams.append(ref.noise_stream(99, 4, i))
        # 2**32 // 1000 = 4294967: rows around it make (row_offset + r) * 1000 + c cross 2**32 at c = 296,
        # inside a block of 64 / 256 / 4096.
        offsets.append((1 << 32) // cols - rows // 2 if cross_2_32 else (i * 13) % 50)
    return states, grads, streams, offsets


# ---------------------------------------------------------------------------------------------
# CUDA kernel vs CUDA reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_many_tensors_offsets_mixed_dtypes(cuda_ext, fmt):
    states, grads, streams, offsets = _many(fmt, "cuda", n=30, bs=64)
    k, r = _run_both(fmt, _args(fmt, states, grads, 64, streams, offsets))
    _assert_same(fmt, k, r, 64, "30 tensors, offsets 1-3, mixed dtypes")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_block_4096(cuda_ext, fmt):
    gen = torch.Generator().manual_seed(3)
    states, grads = [], []
    for rows, cols in ((3, 4096), (2, 2 * 4096 + 5), (1, 4095)):
        m = (torch.randn(rows, cols, generator=gen) * 0.05).cuda()
        states.append(_state(fmt, m, 4096))
        grads.append((torch.randn(rows, cols, generator=gen) * 0.1).to(torch.bfloat16).cuda())
    k, r = _run_both(fmt, _args(fmt, states, grads, 4096, [11, -1, 12], [0, 1, 2]))
    _assert_same(fmt, k, r, 4096, "block 4096")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bs", [64, 4096])
def test_noise_index_crosses_2_32(cuda_ext, fmt, bs):
    states, grads, streams, offsets = _many(fmt, "cuda", n=3, bs=bs, cross_2_32=True, seed=5)
    k, r = _run_both(fmt, _args(fmt, states, grads, bs, streams, offsets))
    _assert_same(fmt, k, r, bs, "global index across 2**32")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_second_device(cuda_ext, fmt):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs a second CUDA device (cuda:1)")
    states, grads, streams, offsets = _many(fmt, "cuda:1", n=26, bs=64, seed=9)
    k, r = _run_both(fmt, _args(fmt, states, grads, 64, streams, offsets))
    _assert_same(fmt, k, r, 64, "cuda:1")
    assert all(t.device == torch.device("cuda:1") for t in k[0])


def _nonfinite(g: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(g.shape, generator=gen).to(g.device)
    g = g.clone()
    g[u < 0.03] = float("nan")
    g[(u >= 0.03) & (u < 0.06)] = float("inf")
    g[(u >= 0.06) & (u < 0.09)] = float("-inf")
    return g


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_grads(cuda_ext, fmt):
    gen = torch.Generator().manual_seed(21)
    states, grads = [], []
    for i, (rows, cols) in enumerate(((5, 300), (7, 129), (3, 64))):
        m = (torch.randn(rows, cols, generator=gen) * 0.05).cuda()
        states.append(_state(fmt, m, 64))
        g = (torch.randn(rows, cols, generator=gen) * 0.1).to(GRAD_DTYPES[i]).cuda()
        grads.append(_nonfinite(g, i))
    args = _args(fmt, states, grads, 64, [-1, 5, -1], [0, 3, 9])
    cpu_args = tuple([t.cpu() for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor) else a
                     for a in args)
    k, r = _run_both(fmt, args, steps=1)
    _assert_same(fmt, k, r, 64, "NaN / Inf grads vs CUDA reference", nan_payloads_equal=True)
    getattr(torch.ops.qmuon, OP[fmt])(*cpu_args)  # the CPU kernel: 16-bit outputs must match bit for bit
    n_lists = len([a for a in k if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)])
    for j in range(n_lists - 1):
        for a, c in zip(k[j], cpu_args[j]):
            if a.dtype in (torch.bfloat16, torch.float16):
                assert_bits_equal(a, c, f"{fmt} 16-bit output vs the CPU kernel")
                nan_bits = float_bits(a.cpu())[torch.isnan(a.cpu())]
                want = 0x7FC0 if a.dtype == torch.bfloat16 else 0x7E00
                assert bool((nan_bits == want).all()), f"{fmt}: NaN written as {nan_bits.unique().tolist()}"


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_side_stream(cuda_ext, fmt):
    states, grads, streams, offsets = _many(fmt, "cuda", n=26, bs=64, seed=13)
    args = _args(fmt, states, grads, 64, streams, offsets)
    ref_args = _clone(args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        getattr(torch.ops.qmuon, OP[fmt])(*args)
    torch.cuda.current_stream().wait_stream(side)
    getattr(torch.ops.qmuon, OP[fmt])(*ref_args)  # the same kernel on the default stream
    torch.cuda.synchronize()
    _assert_same(fmt, args, ref_args, 64, "side stream vs default stream")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_capture_replays_like_eager(cuda_ext, fmt):
    """Nearest rounding: captured after a warm-up, replayed twice == two eager steps, bit for bit."""
    states, grads, _, offsets = _many(fmt, "cuda", n=26, bs=64, seed=17)
    streams = [-1] * len(grads)
    args = _args(fmt, states, grads, 64, streams, offsets)
    eager = _clone(args)
    fresh = [g.clone() for g in grads]
    op = getattr(torch.ops.qmuon, OP[fmt])
    grads_at = len([a for a in args if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)]) - 2
    warm = _clone(args)  # the warm-up (probes, allocator) runs on copies, on a side stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(*warm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(*args)
    # capture ran nothing: restore the inputs the replays start from
    for lst_k, lst_e in zip(args, eager):
        if isinstance(lst_k, list) and lst_k and isinstance(lst_k[0], torch.Tensor):
            for a, b in zip(lst_k, lst_e):
                a.copy_(b)
    for step in range(2):
        for g, f in zip(args[grads_at], fresh):
            g.copy_(f * (step + 1))
        for g, f in zip(eager[grads_at], fresh):
            g.copy_(f * (step + 1))
        graph.replay()
        op(*eager)
        torch.cuda.synchronize()
        _assert_same(fmt, args, eager, 64, f"graph replay {step} vs eager")


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_graph_refuses_stochastic_rounding(cuda_ext, fmt):
    states, grads, streams, offsets = _many(fmt, "cuda", n=3, bs=64, seed=19)
    args = _args(fmt, states, grads, 64, streams, offsets)
    op = getattr(torch.ops.qmuon, OP[fmt])
    op(*_clone(args))  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="stochastic rounding cannot be captured"):
        with torch.cuda.graph(graph):
            op(*args)


@pytest.mark.cuda
def test_cpu_tensor_beside_cuda_raises(cuda_ext):
    m = torch.randn(8, 64) * 0.05
    pk, am = ref4.int4_quantize(m, 32)
    pe, sc, t = ref4.e0m3_quantize(m)
    pg, rb, cb, gt = ref4.grid_quantize4(m, 32)
    q8c, q8a = ref.quantize_rows(m, 32, signed=True)
    g = torch.randn(8, 64).cuda()
    calls = {
        "int4_dequantize absmax": lambda: torch.ops.qmuon.int4_dequantize(pk.cuda(), am, 32, 64),
        "e0m3_dequantize scales": lambda: torch.ops.qmuon.e0m3_dequantize(pe.cuda(), sc, t.cuda(), 64),
        "grid_dequantize4 row maxima": lambda: torch.ops.qmuon.grid_dequantize4(pg.cuda(), rb, cb.cuda(), gt.cuda(),
                                                                               32, 64),
        "grid_dequantize4 column maxima": lambda: torch.ops.qmuon.grid_dequantize4(pg.cuda(), rb.cuda(), cb,
                                                                                  gt.cuda(), 32, 64),
        "dequantize_rows absmax": lambda: torch.ops.qmuon.dequantize_rows(q8c.cuda(), q8a, 32),
        "int4 update absmax": lambda: torch.ops.qmuon.int4_momentum_update_multi_(
            [pk.cuda()], [am], [g.clone()], [torch.empty(8, 2, device="cuda")], 0.9, False, 32, [-1], [0]),
        "q8 update absmax": lambda: torch.ops.qmuon.q8_momentum_update_multi_(
            [q8c.cuda()], [q8a], [g.clone()], [torch.empty(8, 2, device="cuda")], 0.9, False, 32, [-1], [0]),
    }
    for what, call in calls.items():
        with pytest.raises((RuntimeError, ValueError)) as info:
            call()
        assert "device" in str(info.value).lower() or "cuda" in str(info.value).lower(), (what, str(info.value))
    torch.cuda.synchronize()  # the context survived: no illegal address
    # A 0-d CPU tensor scale is a scalar to torch (as in `cuda_tensor * cpu_scalar`): the op runs the
    # reference instead of handing the kernel a host pointer, and the result is the all-CUDA one.
    assert_bits_equal(torch.ops.qmuon.e0m3_dequantize(pe.cuda(), sc.cuda(), t, 64),
                      torch.ops.qmuon.e0m3_dequantize(pe.cuda(), sc.cuda(), t.cuda(), 64), "CPU 0-d tensor scale")
    assert torch.ops.qmuon.int4_dequantize(pk.cuda(), am.cuda(), 32, 64).is_cuda


# ---------------------------------------------------------------------------------------------
# Entry-point validation: CPU and CUDA reject the same calls with the same code (C symbols)
# ---------------------------------------------------------------------------------------------
class _Codec(ctypes.Structure):
    _fields_ = [("op", ctypes.c_int32), ("flag", ctypes.c_int32)] + \
               [(f"in{i}", ctypes.c_void_p) for i in range(4)] + [(f"out{i}", ctypes.c_void_p) for i in range(4)] + \
               [("scratch", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("stream", ctypes.c_int64), ("row_offset", ctypes.c_int64)]


class _Q4Params(ctypes.Structure):
    _fields_ = [("beta", ctypes.c_double), ("nesterov", ctypes.c_int32), ("grad_dtype", ctypes.c_int32),
                ("block_size", ctypes.c_int64)]


class _DenseParams(ctypes.Structure):
    _fields_ = [("beta", ctypes.c_double), ("nesterov", ctypes.c_int32), ("buf_dtype", ctypes.c_int32),
                ("grad_dtype", ctypes.c_int32), ("block_size", ctypes.c_int64)]


BAD_DTYPE, BAD_BLOCK_SIZE, BAD_OP = 10001, 10002, 10003
# codec op ids (csrc/qmuon/kernels.h)
INT4_QUANTIZE, INT4_DEQUANTIZE, GRID_QUANTIZE, GRID_DEQUANTIZE, GRID_WITH_SCALE = 5, 6, 9, 10, 11


def _validation_cases(buf: ctypes.Array) -> list[tuple[str, str, Any, int]]:
    p = ctypes.cast(buf, ctypes.c_void_p)

    def codec(op, bs, rows=2, cols=4, **ptrs):
        a = _Codec(op=op, rows=rows, cols=cols, block_size=bs, stream=-1)
        for k in ("in0", "out0", "out1", "out2", "out3"):
            setattr(a, k, p)
        for k, v in ptrs.items():
            setattr(a, k, v)
        return a

    return [
        ("codec", "int4_quantize block 8192", codec(INT4_QUANTIZE, 8192), BAD_BLOCK_SIZE),
        ("codec", "int4_quantize block 3", codec(INT4_QUANTIZE, 3), BAD_BLOCK_SIZE),
        ("codec", "grid_quantize block 0", codec(GRID_QUANTIZE, 0, scratch=p), BAD_BLOCK_SIZE),
        ("codec", "grid_with_scale block 0", codec(GRID_WITH_SCALE, 0, in1=p), BAD_BLOCK_SIZE),
        ("codec", "grid_dequantize block 0", codec(GRID_DEQUANTIZE, 0, in1=p, in2=p, in3=p), BAD_BLOCK_SIZE),
        ("codec", "grid_with_scale without its scale", codec(GRID_WITH_SCALE, 2, in1=None), BAD_OP),
        ("codec", "int4_dequantize without absmax", codec(INT4_DEQUANTIZE, 2, in1=None), BAD_OP),
        ("codec", "unknown op", codec(42, 2), BAD_OP),
        ("codec", "grid_with_scale, empty, without its scale", codec(GRID_WITH_SCALE, 2, rows=0, in1=None), BAD_OP),
        ("int4", "block 8192", _Q4Params(0.9, 0, 0, 8192), BAD_BLOCK_SIZE),
        ("int4", "bad grad dtype, no tensors", _Q4Params(0.9, 0, 77, 32), BAD_DTYPE),
        ("e0m3", "block 24", _Q4Params(0.9, 0, 0, 24), BAD_BLOCK_SIZE),
        ("e0m3", "bad grad dtype, no tensors", _Q4Params(0.9, 0, 77, 32), BAD_DTYPE),
        ("dense", "block 0", _DenseParams(0.9, 0, 0, 0, 0), BAD_BLOCK_SIZE),
        ("dense", "bad buffer dtype, no tensors", _DenseParams(0.9, 0, 9, 0, 32), BAD_DTYPE),
    ]


def _call(lib, device: str, kind: str, arg) -> int:
    stream = [] if device == "cpu" else [ctypes.c_void_p(0)]
    if kind == "codec":
        fn = getattr(lib, f"qmuon_{device}_codec")
        return fn(ctypes.byref(arg), *stream)
    fn = getattr(lib, f"qmuon_{device}_{kind}_momentum_update")
    return fn(None, ctypes.c_int64(0), arg, *stream)


def _library(ext):
    lib = ctypes.CDLL(ext.library)
    for name in ("qmuon_cpu_codec", "qmuon_cpu_int4_momentum_update"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def test_cpu_entry_points_validate(ext):
    lib = _library(ext)
    buf = (ctypes.c_float * 64)()
    for kind, what, arg, want in _validation_cases(buf):
        assert _call(lib, "cpu", kind, arg) == want, f"qmuon_cpu {kind}: {what}"


@pytest.mark.cuda
def test_cuda_entry_points_validate_like_cpu(cuda_ext):
    """The same calls (host pointers are never dereferenced: each is rejected before any launch)."""
    lib = _library(cuda_ext)
    buf = (ctypes.c_float * 64)()
    for kind, what, arg, want in _validation_cases(buf):
        assert _call(lib, "cuda", kind, arg) == want, f"qmuon_cuda {kind}: {what}"
        assert _call(lib, "cpu", kind, arg) == want, f"qmuon_cpu {kind}: {what}"


def test_capture_refusal_logic(monkeypatch):
    """The refusal every op with a stream argument gets on CUDA builds of torch (CPU-only torch has
    nothing to capture, so the wrapper is not installed there): simulated capture, stochastic streams
    refused with the policy's message, nearest rounding passed through."""
    op = OPS["q8_momentum_update_multi_"]
    calls = []
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    capturing = {"now": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    kernel = op._refusing_capture(lambda *args: calls.append(args))
    args = ([], [], [], [], 0.9, False, 32, [-1, 3], [0, 0])
    with pytest.raises(RuntimeError, match="stochastic rounding cannot be captured in a CUDA graph"):
        kernel(*args)
    kernel(*args[:7], [-1, -1], [0, 0])  # nearest rounding: captured like any kernel
    capturing["now"] = False
    kernel(*args)  # not capturing: stochastic rounding runs
    assert len(calls) == 2
    single = OPS["quantize_rows"]._refusing_capture(lambda *a: "ran")
    capturing["now"] = True
    with pytest.raises(RuntimeError, match="stochastic rounding"):
        single(torch.zeros(2, 2), 32, True, 7, 0)
    assert single(torch.zeros(2, 2), 32, True, -1, 0) == "ran"
