"""Compiled 4-bit and dense-format kernels (csrc/cpu/q4_cpu.cpp, csrc/cuda/q4_cuda.cu) against the
pure-PyTorch references (qmuon/ops/reference_4bit.py, reference.dense_momentum_update_).

Contract (as for the 8-bit kernels in test_kernels.py): identical codes, scales, tensor scales, grads
(the Newton-Schulz input) and momentum buffers, bit for bit; per-block sums of squares equal up to
fp32 summation order: both sides add ``n <= block_size`` non-negative fp32 squares, each sum is within
``(n - 1) * 2**-24`` (relative) of the exact one, so they differ by at most ``2 * block_size * 2**-24``.
The dense fp32 update must stay identical to ``torch.optim.Muon`` (``buf.lerp_(grad, 1 - beta)``),
which the reference runs.

Everything skips (with the reason) when the extension cannot be built here; ``cuda`` tests skip
without a GPU.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch

from _helpers import assert_bits_equal, assert_sumsq_close, make_grad, momentum, nan_sums, noise_or_none
from qmuon.ops import _kernels
from qmuon.ops import reference as ref
from qmuon.ops import reference_4bit as ref4

SHAPES = [(1, 1), (1, 2), (3, 5), (2, 17), (37, 300), (65, 513)]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
STREAM = ref.noise_stream(1234, 7, 3)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def _s(stream):
    return None if stream < 0 else stream


# One entry per format: (state keys, op, reference for one matrix, initial state for a momentum).
def _int4_state(m, block_size):
    return list(ref4.int4_quantize(m.cpu(), block_size))


def _e0m3_state(m, block_size):
    return list(ref4.e0m3_quantize(m.cpu()))


def _ref_int4(state, g, out_bs, beta, nesterov, stream, offset):
    return ref4.int4_momentum_update_(*state, g, beta=beta, nesterov=nesterov, block_size=out_bs,
                                      stream=_s(stream), row_offset=offset)


def _ref_e0m3(state, g, out_bs, beta, nesterov, stream, offset):
    return ref4.e0m3_momentum_update_(*state, g, beta=beta, nesterov=nesterov, block_size=out_bs,
                                      stream=_s(stream), row_offset=offset)


def _ref_dense(state, g, out_bs, beta, nesterov, stream, offset):
    return ref.dense_momentum_update_(*state, g, beta=beta, nesterov=nesterov, block_size=out_bs,
                                      stream=_s(stream), row_offset=offset)


FORMATS = {
    "int4": (lambda: torch.ops.qmuon.int4_momentum_update_multi_, _ref_int4),
    "e0m3": (lambda: torch.ops.qmuon.e0m3_momentum_update_multi_, _ref_e0m3),
    "dense": (lambda: torch.ops.qmuon.dense_momentum_update_multi_, _ref_dense),
}


def check_update(fmt, states, grads, *, block_size, beta=0.95, nesterov=False, streams=None, offsets=None,
                 steps=2, make_outputs=None):
    """Run `steps` updates through torch.ops.qmuon (compiled kernel) and the reference on clones of
    the same states and grads (on the CPU); compare every tensor bit for bit after every step."""
    n = len(states)
    streams = [-1] * n if streams is None else list(streams)
    offsets = [0] * n if offsets is None else list(offsets)
    make_outputs = make_outputs or nan_sums
    op, reference = FORMATS[fmt][0](), FORMATS[fmt][1]
    r_states = [[t.cpu().clone() for t in st] for st in states]
    r_grads = [g.cpu().clone() for g in grads]
    fresh = [g.clone() for g in grads]
    for step in range(steps):
        if step:
            for kg, rg, f in zip(grads, r_grads, fresh):  # a new gradient each step, the same for both
                new = f.cpu() * (step + 1) * 0.5
                kg.copy_(new)
                rg.copy_(new)
        outs = make_outputs(grads, block_size)
        lists = [list(x) for x in zip(*states)]
        assert op(*lists, grads, outs, beta, nesterov, block_size, streams, offsets) is None
        r_sums = [reference(rs, rg, block_size, beta, nesterov, s, o)
                  for rs, rg, s, o in zip(r_states, r_grads, streams, offsets)]
        for i in range(n):
            tag = f"{fmt} step {step} tensor {i}"
            for j, (k, r) in enumerate(zip(states[i], r_states[i])):
                assert_bits_equal(k, r, f"state {j} ({tag})")
            assert_bits_equal(grads[i], r_grads[i], f"grad ({tag})")
            assert outs[i].dtype == torch.float32 and outs[i].shape == r_sums[i].shape
            assert_sumsq_close(outs[i], r_sums[i], block_size)


def fmt_state(fmt, m, block_size, buf_dtype=torch.float32):
    if fmt == "int4":
        st = _int4_state(m, block_size)
    elif fmt == "e0m3":
        st = _e0m3_state(m, block_size)
    else:
        st = [m.cpu().to(buf_dtype)]
    return [t.to(m.device) for t in st]


# ---------------------------------------------------------------------------------------------
# dispatch
# ---------------------------------------------------------------------------------------------
def test_public_ops_dispatch_to_compiled_kernels(ext):
    m = momentum(8, 64)
    g = make_grad(8, 64, torch.float32)
    pk4, am = ref4.int4_quantize(m, 32)
    pk, sc, t = ref4.e0m3_quantize(m)
    pg, rb, cb, gt = ref4.grid_quantize4(m, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ops.qmuon.int4_momentum_update_multi_([pk4], [am], [g.clone()], nan_sums([g], 32), 0.9, True, 32,
                                                    [-1], [0])
        torch.ops.qmuon.e0m3_momentum_update_multi_([pk], [sc], [t], [g.clone()], nan_sums([g], 32), 0.9, True, 32,
                                                    [-1], [0])
        torch.ops.qmuon.dense_momentum_update_multi_([m.clone()], [g.clone()], nan_sums([g], 32), 0.9, True, 32,
                                                     [-1], [0])
        torch.ops.qmuon.pack_int4(torch.zeros(3, 5, dtype=torch.int8))
        torch.ops.qmuon.unpack_int4(pk, 64)
        torch.ops.qmuon.ue4m3_encode(m.abs(), True)
        torch.ops.qmuon.ue4m3_decode(sc)
        torch.ops.qmuon.int4_quantize(m, 32, -1, 0)
        torch.ops.qmuon.int4_dequantize(pk4, am, 32, 64)
        torch.ops.qmuon.e0m3_quantize(m, True, -1, 0)
        torch.ops.qmuon.e0m3_dequantize(pk, sc, t, 64)
        torch.ops.qmuon.grid_quantize4(m, 32, -1, 0)
        torch.ops.qmuon.grid_dequantize4(pg, rb, cb, gt, 32, 64)
    names = {e.name for e in prof.events()}
    for op in ("int4_momentum_update_multi_", "e0m3_momentum_update_multi_", "dense_momentum_update_multi_",
               "pack_int4", "unpack_int4", "ue4m3_encode", "ue4m3_decode", "int4_quantize", "int4_dequantize",
               "e0m3_quantize", "e0m3_dequantize", "grid_quantize4", "grid_dequantize4"):
        assert f"qmuon_C::{op}" in names, f"torch.ops.qmuon.{op} did not run the compiled kernel"


# ---------------------------------------------------------------------------------------------
# fused updates == reference
# ---------------------------------------------------------------------------------------------
# (format, block_size, momentum buffer dtype): int4 blocks are even; e0m3's block_size is only the
# sums' granularity (a multiple or a divisor of 16); dense has fp32 and bf16 buffers.
UPDATE_CASES = [("int4", 32, torch.float32), ("int4", 128, torch.float32), ("e0m3", 256, torch.float32),
                ("e0m3", 16, torch.float32), ("e0m3", 8, torch.float32), ("e0m3", 48, torch.float32),
                ("dense", 256, torch.float32), ("dense", 256, torch.bfloat16)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("fmt,block_size,buf_dtype", UPDATE_CASES,
                         ids=[f"{f}-{b}" + ("-bf16buf" if d == torch.bfloat16 else "") for f, b, d in UPDATE_CASES])
def test_update_matches_reference(kernel_device, shape, grad_dtype, fmt, block_size, buf_dtype):
    """The compiled update on each device (cuda: marked, skipped without a GPU) == the reference."""
    rows, cols = shape
    for stream, nesterov in itertools.product([-1, STREAM], [False, True]):
        st = fmt_state(fmt, momentum(rows, cols, device=kernel_device), block_size, buf_dtype)
        check_update(fmt, [st], [make_grad(rows, cols, grad_dtype, device=kernel_device)], block_size=block_size,
                     nesterov=nesterov, streams=[stream], offsets=[5], steps=3 if fmt == "dense" else 2)


@pytest.mark.parametrize("numel", [1, 7, 8, 15, 16, 17, 31, 33, 1000, 4099])
def test_dense_fp32_equals_torch_muon_lerp(ext, numel):
    # torch.optim.Muon: buf.lerp_(grad, 1 - momentum); grad.lerp(buf, momentum) for Nesterov. Sizes
    # around the vector width exercise torch's vectorized body and its scalar tail.
    rows = 1 if numel < 100 else 7
    cols = numel if rows == 1 else numel // rows
    buf = momentum(rows, cols)
    grad = make_grad(rows, cols, torch.float32)
    t_buf = buf.clone().lerp_(grad, 1 - 0.95)
    t_ns = grad.lerp(t_buf, 0.95)
    torch.ops.qmuon.dense_momentum_update_multi_([buf], [grad], nan_sums([grad], 64), 0.95, True, 64, [-1], [0])
    assert_bits_equal(buf, t_buf, "momentum_buffer vs torch lerp_")
    assert_bits_equal(grad, t_ns, "NS input vs torch lerp")


def test_dense_stays_on_reference_when_torch_lerp_rounds_differently(ext, monkeypatch):
    # A torch build whose lerp rounds twice (no FMA) makes the probe fail: the dense op must then run
    # the reference (torch's own lerp_), not the kernel.
    monkeypatch.setitem(_kernels._lerp_fused, "cpu", False)
    buf, grad = momentum(3, 40), make_grad(3, 40, torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        check_update("dense", [[buf]], [grad], block_size=32, steps=1)
    names = {e.name for e in prof.events()}
    assert "qmuon::dense_momentum_update_multi_" in names
    assert "qmuon_C::dense_momentum_update_multi_" not in names


def test_multi_tensor_mixed_dtypes_and_shapes(ext):
    specs = [((3, 5), torch.float32), ((1, 1), torch.bfloat16), ((65, 513), torch.float16), ((2, 300), torch.float32),
             ((37, 64), torch.bfloat16)]
    for fmt, bs in (("int4", 64), ("e0m3", 32), ("dense", 64)):
        states, grads = [], []
        for i, ((r, c), gd) in enumerate(specs):
            states.append(fmt_state(fmt, momentum(r, c, seed=10 + i), bs,
                                    torch.bfloat16 if i % 2 else torch.float32))
            grads.append(make_grad(r, c, gd, seed=20 + i))
        check_update(fmt, states, grads, block_size=bs, nesterov=True,
                     streams=[STREAM + i if i % 2 else -1 for i in range(len(specs))], offsets=[0, 4, 0, 2, 64],
                     steps=2)


@pytest.mark.parametrize("fmt", ["int4", "e0m3", "dense"])
def test_tiny_and_empty(ext, fmt):
    cases = [(1, 1), (1, 3), (2, 1), (0, 5), (5, 0), (0, 0)]
    bs = 16
    states = [fmt_state(fmt, momentum(r, c), bs, torch.bfloat16) for r, c in cases]
    check_update(fmt, states, [make_grad(r, c, torch.float16) for r, c in cases], block_size=bs,
                 streams=[3] * len(cases), steps=2)
    if fmt == "e0m3":  # an empty tensor's scale is 1 (reference e0m3_tensor_scale)
        assert [float(s[2]) for s in states[3:]] == [1.0, 1.0, 1.0]
    op = FORMATS[fmt][0]()
    nlists = {"int4": 2, "e0m3": 3, "dense": 1}[fmt]
    assert op(*([[]] * nlists), [], [], 0.9, False, bs, [], []) is None


@pytest.mark.parametrize("fmt", ["int4", "e0m3", "dense"])
def test_zero_state_zero_and_nonfinite_grads(ext, fmt):
    rows, cols = 4, 100
    st = fmt_state(fmt, torch.zeros(rows, cols), 32)
    g = torch.zeros(rows, cols)
    g[1] = torch.randn(cols)
    check_update(fmt, [st], [g], block_size=32, streams=[5], steps=2)
    # NaN / inf reach the kernels only if the optimizer's nonfinite check is off; still identical.
    st = fmt_state(fmt, momentum(rows, cols), 32)
    g = make_grad(rows, cols, torch.float32)
    g[0, 3], g[2, 50], g[3, 99] = float("nan"), float("inf"), -float("inf")
    check_update(fmt, [st], [g], block_size=32, streams=[-1], steps=1)


@pytest.mark.parametrize("layout", ["transposed", "row-strided", "col-strided", "strided-state", "sums"])
@pytest.mark.parametrize("fmt", ["int4", "e0m3", "dense"])
def test_noncontiguous(ext, fmt, layout):
    rows, cols, bs = 37, 300, 64
    st = fmt_state(fmt, momentum(rows, cols), bs)
    grad = make_grad(rows, cols, torch.bfloat16)
    make_outputs = None
    if layout == "transposed":
        grad = make_grad(cols, rows, torch.bfloat16).t()
    elif layout == "row-strided":
        grad = make_grad(rows, cols + 17, torch.bfloat16)[:, 3:3 + cols]
    elif layout == "col-strided":
        grad = make_grad(rows, 2 * cols, torch.bfloat16)[:, ::2]
    elif layout == "strided-state":  # every 2-D state tensor a row-padded view (the kernel works in place)
        views = []
        for t in st:
            if t.dim() == 2:
                big = torch.zeros(t.shape[0], t.shape[1] + 9, dtype=t.dtype)
                big[:, 4:4 + t.shape[1]] = t
                views.append(big[:, 4:4 + t.shape[1]])
            else:
                views.append(t)
        st = views
    else:
        def make_outputs(grads, block_size):
            nb = ref.num_blocks(cols, block_size)
            return [torch.full((nb, rows), float("nan")).t()]
    check_update(fmt, [st], [grad], block_size=bs, nesterov=True, streams=[42], steps=2, make_outputs=make_outputs)


@pytest.mark.parametrize("fmt", ["int4", "e0m3", "dense"])
def test_noise_index_crosses_2_pow_32(ext, fmt):
    cols, bs = 513, 256 if fmt != "int4" else 128
    row_offset = (2**32 - 100) // cols
    st = fmt_state(fmt, momentum(6, cols), bs, torch.bfloat16)
    check_update(fmt, [st], [make_grad(6, cols, torch.float32)], block_size=bs, streams=[9], offsets=[row_offset])


def test_multithreaded(ext):
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, os.cpu_count() or 2))
    try:
        for fmt, bs in (("int4", 32), ("e0m3", 16), ("dense", 32)):
            st = fmt_state(fmt, momentum(97, 301), bs, torch.bfloat16)
            check_update(fmt, [st], [make_grad(97, 301, torch.bfloat16)], block_size=bs, nesterov=True,
                         streams=[17], steps=1)
        x = momentum(97, 301)
        for a, b in zip(torch.ops.qmuon.grid_quantize4(x, 32, 4, 0),
                        ref4.grid_quantize4(x, 32, noise=ref.uniform_noise(97, 301, 4, 0, x.device))):
            assert_bits_equal(a, b, "grid_quantize4 (threads)")
        for a, b in zip(torch.ops.qmuon.e0m3_quantize(x, True, 4, 0),
                        ref4.e0m3_quantize(x, noise=ref.uniform_noise(97, 301, 4, 0, x.device))):
            assert_bits_equal(a, b, "e0m3_quantize (threads)")
    finally:
        torch.set_num_threads(threads)


def test_unsupported_arguments_fall_back_to_reference(ext):
    # odd int4 block (a byte would straddle two blocks), e0m3 sums block neither multiple nor divisor
    # of 16, float64 grads, block_size above 4096: the reference runs, results still match it.
    check_update("int4", [fmt_state("int4", momentum(3, 40), 7)], [make_grad(3, 40, torch.float32)], block_size=7)
    check_update("e0m3", [fmt_state("e0m3", momentum(3, 40), 24)], [make_grad(3, 40, torch.float32)],
                 block_size=24)
    check_update("dense", [fmt_state("dense", momentum(3, 40), 32)], [make_grad(3, 40, torch.float64)],
                 block_size=32)
    check_update("int4", [fmt_state("int4", momentum(2, 9000), 8192)], [make_grad(2, 9000, torch.float32)],
                 block_size=8192, steps=1)


@pytest.mark.parametrize("bad", ["packed-shape", "absmax-shape", "sums-shape", "count"])
def test_bad_arguments_raise_before_writing(ext, bad):
    m = momentum(5, 70)
    pk, am = ref4.int4_quantize(m, 32)
    g = make_grad(5, 70, torch.float32)
    sums = nan_sums([g], 32)
    if bad == "packed-shape":
        pk = torch.zeros(5, 36, dtype=torch.uint8)
    elif bad == "absmax-shape":
        am = torch.zeros(5, 2)
    elif bad == "sums-shape":
        sums = [torch.empty(5, 2)]
    pk0, am0, g0 = pk.clone(), am.clone(), g.clone()
    grads = [g, g.clone()] if bad == "count" else [g]
    with pytest.raises((RuntimeError, ValueError), match="packed|absmax|block_sumsq|grads|lists"):
        torch.ops.qmuon_C.int4_momentum_update_multi_([pk], [am], grads, sums, 0.9, False, 32, [-1], [0])
    assert torch.equal(pk, pk0) and torch.equal(am, am0) and torch.equal(g, g0)


# ---------------------------------------------------------------------------------------------
# standalone codecs == reference
# ---------------------------------------------------------------------------------------------
def test_ue4m3_all_patterns_and_special_values(ext):
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert_bits_equal(torch.ops.qmuon.ue4m3_decode(bits), ref4.ue4m3_decode(bits), "decode, all 256 patterns")
    # every decoded value, its neighbours one ulp away, midpoints, out of range, signed zero, NaN, inf
    vals = ref4.ue4m3_decode(bits[:127])
    mids = (vals[1:] + vals[:-1]) / 2
    up = torch.nextafter(vals, torch.tensor(float("inf")))
    down = torch.nextafter(vals, torch.tensor(0.0))
    special = torch.tensor([0.0, -0.0, -1.0, float("nan"), float("inf"), -float("inf"), 448.0, 449.0, 464.0, 480.0,
                            1e30, 2.0**-10, 2.0**-11, 3 * 2.0**-11, 1e-30])
    gen = torch.Generator().manual_seed(0)
    rand = torch.rand(20000, generator=gen) * 10.0 ** (torch.rand(20000, generator=gen) * 14 - 11)
    x = torch.cat([vals, mids, up, down, special, rand])
    for round_up in (False, True):
        assert_bits_equal(torch.ops.qmuon.ue4m3_encode(x, round_up), ref4.ue4m3_encode(x, round_up=round_up),
                          f"encode round_up={round_up}")
    # non-2-D and non-contiguous inputs, bf16 input
    y = x[: 3 * 7 * 11].reshape(3, 7, 11).transpose(0, 2)
    assert_bits_equal(torch.ops.qmuon.ue4m3_encode(y, True), ref4.ue4m3_encode(y, round_up=True), "encode 3-D view")
    yb = rand[:999].to(torch.bfloat16)
    assert_bits_equal(torch.ops.qmuon.ue4m3_encode(yb, False), ref4.ue4m3_encode(yb), "encode bf16")
    b3 = bits.repeat(3).reshape(3, 256)[:, ::3]
    assert_bits_equal(torch.ops.qmuon.ue4m3_decode(b3), ref4.ue4m3_decode(b3), "decode strided")


@pytest.mark.parametrize("shape", SHAPES + [(0, 4), (3, 0)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_pack_unpack(ext, shape):
    rows, cols = shape
    gen = torch.Generator().manual_seed(3)
    c = torch.randint(-7, 8, (rows, cols), generator=gen, dtype=torch.int8)
    assert_bits_equal(torch.ops.qmuon.pack_int4(c), ref4.pack_int4(c), "pack")
    p = ref4.pack_int4(c)
    assert_bits_equal(torch.ops.qmuon.unpack_int4(p, cols), ref4.unpack_int4(p, cols), "unpack")
    if cols > 1:  # non-contiguous input
        ct = torch.randint(-7, 8, (cols, rows), generator=gen, dtype=torch.int8).t()
        assert_bits_equal(torch.ops.qmuon.pack_int4(ct), ref4.pack_int4(ct), "pack (transposed)")
    # every byte unpacks like the reference (nibble 8, "-0", included)
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(2, 128)
    assert_bits_equal(torch.ops.qmuon.unpack_int4(allb, 255), ref4.unpack_int4(allb, 255), "unpack all bytes")
    # codes outside -7..7 pack with the reference's integer arithmetic too
    wide = torch.arange(-128, 128, dtype=torch.int32).to(torch.int8).reshape(4, 64)
    assert_bits_equal(torch.ops.qmuon.pack_int4(wide), ref4.pack_int4(wide), "pack wide codes")


@pytest.mark.parametrize("shape", SHAPES + [(0, 4), (3, 0)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("stream", [-1, STREAM])
def test_int4_and_e0m3_codecs(ext, shape, stream):
    rows, cols = shape
    x = momentum(rows, cols, seed=4)
    for bs in (2, 32, 128):
        k = torch.ops.qmuon.int4_quantize(x, bs, stream, 11)
        r = ref4.int4_quantize(x, bs, noise=noise_or_none(x, stream, 11))
        for a, b, w in zip(k, r, ("packed", "absmax")):
            assert_bits_equal(a, b, f"int4_quantize {w} bs={bs}")
        assert_bits_equal(torch.ops.qmuon.int4_dequantize(*r, bs, cols), ref4.int4_dequantize(*r, bs, cols),
                          f"int4_dequantize bs={bs}")
    for two_level in (True, False):
        k = torch.ops.qmuon.e0m3_quantize(x, two_level, stream, 11)
        r = ref4.e0m3_quantize(x, two_level=two_level, noise=noise_or_none(x, stream, 11))
        for a, b, w in zip(k, r, ("packed", "scales", "tensor scale")):
            assert_bits_equal(a, b, f"e0m3_quantize {w} two_level={two_level}")
        assert_bits_equal(torch.ops.qmuon.e0m3_dequantize(*r, cols), ref4.e0m3_dequantize(*r, cols),
                          "e0m3_dequantize")


@pytest.mark.parametrize("shape", SHAPES + [(70, 33), (0, 4)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("stream", [-1, STREAM])
def test_grid_codecs(ext, shape, stream):
    rows, cols = shape
    x = momentum(rows, cols, seed=5) - momentum(rows, cols, seed=6) * 0.01
    for s in (32, 5, 1):
        k = torch.ops.qmuon.grid_quantize4(x, s, stream, 3)
        r = ref4.grid_quantize4(x, s, noise=noise_or_none(x, stream, 3))
        for a, b, w in zip(k, r, ("packed", "row maxima", "column maxima", "scale")):
            assert_bits_equal(a, b, f"grid_quantize4 {w} s={s}")
        assert_bits_equal(torch.ops.qmuon.grid_dequantize4(*r, s, cols), ref4.grid_dequantize4(*r, s, cols),
                          f"grid_dequantize4 s={s}")


def test_codecs_noncontiguous_and_special_inputs(ext):
    x = momentum(300, 37).t()  # transposed view
    x[0, 0], x[3, 5] = 0.0, -0.0
    for a, b in zip(torch.ops.qmuon.grid_quantize4(x, 32, 7, 0), ref4.grid_quantize4(x, 32, noise=noise_or_none(x, 7, 0))):
        assert_bits_equal(a, b, "grid_quantize4 (transposed input)")
    for a, b in zip(torch.ops.qmuon.e0m3_quantize(x, True, -1, 0), ref4.e0m3_quantize(x)):
        assert_bits_equal(a, b, "e0m3_quantize (transposed input)")
    z = torch.zeros(4, 40)  # all-zero tensor: scale 1, zero codes
    for a, b in zip(torch.ops.qmuon.e0m3_quantize(z, True, -1, 0), ref4.e0m3_quantize(z)):
        assert_bits_equal(a, b, "e0m3_quantize (zeros)")
    for a, b in zip(torch.ops.qmuon.grid_quantize4(z, 8, -1, 0), ref4.grid_quantize4(z, 8)):
        assert_bits_equal(a, b, "grid_quantize4 (zeros)")
    y = momentum(6, 50)
    y[1, 2], y[4, 40] = float("inf"), float("nan")
    for a, b in zip(torch.ops.qmuon.e0m3_quantize(y, True, -1, 0), ref4.e0m3_quantize(y)):
        assert_bits_equal(a, b, "e0m3_quantize (non-finite)")
    for a, b in zip(torch.ops.qmuon.int4_quantize(y, 16, -1, 0), ref4.int4_quantize(y, 16)):
        assert_bits_equal(a, b, "int4_quantize (non-finite)")
    p, rb, cb, t = ref4.grid_quantize4(momentum(40, 50), 16)
    pv = torch.zeros(40, 30, dtype=torch.uint8)[:, 2:27]
    pv.copy_(p)
    assert_bits_equal(torch.ops.qmuon.grid_dequantize4(pv, rb.t().contiguous().t(), cb, t, 16, 50),
                      ref4.grid_dequantize4(p, rb, cb, t, 16, 50), "grid_dequantize4 (strided inputs)")


# ---------------------------------------------------------------------------------------------
# opcheck (schemas, fake kernels, autograd registration, torch.compile / AOT dispatch)
# ---------------------------------------------------------------------------------------------
def _update_args(fmt, grad_dtype, stochastic, bs):
    states = [fmt_state(fmt, momentum(9, 70), bs), fmt_state(fmt, momentum(4, 33, seed=3), bs)]
    grads = [make_grad(9, 70, grad_dtype), make_grad(4, 33, grad_dtype, seed=4)]
    streams = [11, 12] if stochastic else [-1, -1]
    lists = [list(x) for x in zip(*states)]
    return (*lists, grads, [torch.empty(9, ref.num_blocks(70, bs)), torch.empty(4, ref.num_blocks(33, bs))],
            0.95, True, bs, streams, [0, 5])


@pytest.mark.parametrize("fmt", ["int4", "e0m3", "dense"])
@pytest.mark.parametrize("grad_dtype,stochastic", [(torch.float32, False), (torch.bfloat16, True)],
                         ids=["fp32-nearest", "bf16-stochastic"])
def test_opcheck_updates(kernel_device, fmt, grad_dtype, stochastic):
    args = tuple([t.to(kernel_device) for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor)
                 else a for a in _update_args(fmt, grad_dtype, stochastic, 32))
    torch.library.opcheck(FORMATS[fmt][0]().default, args)


def test_opcheck_codecs(ext):
    x = momentum(37, 65)
    c = torch.randint(-7, 8, (5, 9), dtype=torch.int8)
    pk4, am = ref4.int4_quantize(x, 32)
    pk, sc, t = ref4.e0m3_quantize(x)
    pg, rb, cb, gt = ref4.grid_quantize4(x, 16)
    cases = [
        (torch.ops.qmuon.pack_int4, (c,)),
        (torch.ops.qmuon.unpack_int4, (ref4.pack_int4(c), 9)),
        (torch.ops.qmuon.ue4m3_encode, (x.abs(), True)),
        (torch.ops.qmuon.ue4m3_decode, (sc,)),
        (torch.ops.qmuon.int4_quantize, (x, 32, 5, 1)),
        (torch.ops.qmuon.int4_dequantize, (pk4, am, 32, 65)),
        (torch.ops.qmuon.e0m3_quantize, (x, True, 5, 1)),
        (torch.ops.qmuon.e0m3_dequantize, (pk, sc, t, 65)),
        (torch.ops.qmuon.grid_quantize4, (x, 16, 5, 1)),
        (torch.ops.qmuon.grid_dequantize4, (pg, rb, cb, gt, 16, 65)),
    ]
    for op, args in cases:
        torch.library.opcheck(op.default, args)


# ---------------------------------------------------------------------------------------------
# On each device (cuda: marked): kernel == CPU reference (the reference is device-independent)
# ---------------------------------------------------------------------------------------------
def test_multi_tensor_noncontiguous_on_each_device(kernel_device):
    for fmt, bs in (("int4", 64), ("e0m3", 32), ("dense", 64)):
        states, grads = [], []
        for i in range(30):
            r, c = 1 + i % 5, 1 + 37 * i
            states.append(fmt_state(fmt, momentum(r, c, seed=i, device=kernel_device), bs,
                                    torch.bfloat16 if i % 2 else torch.float32))
            g = make_grad(r, c + 3, torch.bfloat16 if i % 3 else torch.float32, seed=50 + i, device=kernel_device)
            grads.append(g[:, 1:1 + c] if i % 4 else make_grad(c, r, g.dtype, device=kernel_device).t())
        check_update(fmt, states, grads, block_size=bs, nesterov=True, streams=[i * 3 for i in range(30)],
                     offsets=list(range(30)), steps=2)


@pytest.mark.parametrize("stream", [-1, STREAM])
def test_codecs_match_reference_on_each_device(kernel_device, stream):
    for rows, cols in SHAPES + [(300, 1000)]:
        x = momentum(rows, cols, seed=7)
        xc = x.to(kernel_device)
        nz = noise_or_none(x, stream, 2)
        pairs = [
            (torch.ops.qmuon.int4_quantize(xc, 128, stream, 2), ref4.int4_quantize(x, 128, noise=nz)),
            (torch.ops.qmuon.e0m3_quantize(xc, True, stream, 2), ref4.e0m3_quantize(x, noise=nz)),
            (torch.ops.qmuon.grid_quantize4(xc, 32, stream, 2), ref4.grid_quantize4(x, 32, noise=nz)),
        ]
        for k, r in pairs:
            for a, b in zip(k, r):
                assert_bits_equal(a, b, f"{kernel_device} quantize {rows}x{cols}")
        r4, re, rg = (p[1] for p in pairs)
        assert_bits_equal(torch.ops.qmuon.int4_dequantize(*(t.to(kernel_device) for t in r4), 128, cols),
                          ref4.int4_dequantize(*r4, 128, cols), f"{kernel_device} int4_dequantize")
        assert_bits_equal(torch.ops.qmuon.e0m3_dequantize(*(t.to(kernel_device) for t in re), cols),
                          ref4.e0m3_dequantize(*re, cols), f"{kernel_device} e0m3_dequantize")
        assert_bits_equal(torch.ops.qmuon.grid_dequantize4(*(t.to(kernel_device) for t in rg), 32, cols),
                          ref4.grid_dequantize4(*rg, 32, cols), f"{kernel_device} grid_dequantize4")
        c = torch.randint(-7, 8, (rows, cols), dtype=torch.int8)
        assert_bits_equal(torch.ops.qmuon.pack_int4(c.to(kernel_device)), ref4.pack_int4(c), f"{kernel_device} pack")
        p = ref4.pack_int4(c)
        assert_bits_equal(torch.ops.qmuon.unpack_int4(p.to(kernel_device), cols), ref4.unpack_int4(p, cols),
                          f"{kernel_device} unpack")
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert_bits_equal(torch.ops.qmuon.ue4m3_decode(bits.to(kernel_device)), ref4.ue4m3_decode(bits), f"{kernel_device} decode")
    v = torch.cat([ref4.ue4m3_decode(bits[:127]), torch.rand(5000) * 10.0 ** (torch.rand(5000) * 14 - 11)])
    for up in (False, True):
        assert_bits_equal(torch.ops.qmuon.ue4m3_encode(v.to(kernel_device), up), ref4.ue4m3_encode(v, round_up=up),
                          f"{kernel_device} encode")



