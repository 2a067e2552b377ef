"""Compiled kernels (csrc/) against the pure-PyTorch reference (qmuon/ops/reference.py).

Contract: identical codes, absmax and grad (Newton-Schulz input) bits; per-block sums of squares
equal up to fp32 summation order, i.e. within ``sumsq_rtol(block_size)`` relative error (both sides
sum ``block_size`` non-negative fp32 squares; each sum is within ``(n - 1) * 2**-24`` of the exact
one, so they differ by at most ``2 * block_size * 2**-24`` relatively).

Everything skips (with the reason) when the extension cannot be built here; the CUDA comparison is
marked ``cuda`` and skips without a GPU; the nvcc compile check skips without nvcc.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qmuon.ops as qops
from _helpers import assert_bits_equal, assert_sumsq_close, make_grad, noise_or_none
from _dist import REPO
from qmuon.ops import _extension
from qmuon.ops import reference as ref

SHAPES = [(1, 1), (3, 5), (37, 300), (129, 513)]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CODE_DTYPES = [torch.int8, torch.uint8]
BLOCK_SIZES = [32, 128, 256]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def make_state(rows, cols, code_dtype, block_size, device="cpu", seed=0):
    """A non-trivial 8-bit state: the quantized form of a random momentum with row-varying scale."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, cols, generator=gen) * (torch.rand(rows, 1, generator=gen) * 3 + 1e-3)
    codes, absmax = ref.quantize_rows(m, block_size, signed=code_dtype == torch.int8)
    return codes.to(device), absmax.to(device)


def reference_update(codes, absmax, grads, beta, nesterov, block_size, streams, offsets):
    return [
        ref.q8_momentum_update_(c, a, g, beta=beta, nesterov=nesterov, block_size=block_size,
                                stream=None if s < 0 else s, row_offset=o)
        for c, a, g, s, o in zip(codes, absmax, grads, streams, offsets)
    ]


def nan_block_sumsq(codes, block_size):
    """block_sumsq outputs pre-filled with NaN, so an element the kernel does not write shows up."""
    return [torch.full((c.shape[0], ref.num_blocks(c.shape[1], block_size)), float("nan"), device=c.device)
            for c in codes]


def check_update(codes, absmax, grads, *, beta=0.95, nesterov=False, block_size=256, streams=None,
                 offsets=None, steps=2, op=None, make_outputs=None):
    """Run `steps` updates through the compiled op and the reference on clones; compare each step.
    `make_outputs(codes, block_size)` allocates the op's block_sumsq outputs (default: NaN-filled,
    contiguous)."""
    n = len(codes)
    streams = [-1] * n if streams is None else list(streams)
    offsets = [0] * n if offsets is None else list(offsets)
    op = op or torch.ops.qmuon.q8_momentum_update_multi_
    make_outputs = make_outputs or nan_block_sumsq

    def clone_like(ts):  # clones that keep each tensor's strides (non-contiguous stays so)
        out = []
        for t in ts:
            c = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device)
            c.copy_(t)
            out.append(c)
        return out

    k_c, k_a, k_g = codes, absmax, grads
    r_c, r_a, r_g = clone_like(codes), clone_like(absmax), clone_like(grads)
    fresh = [g.clone() for g in grads]
    for step in range(steps):
        if step:
            for kg, rg, f in zip(k_g, r_g, fresh):  # new gradient each step, same in both
                kg.copy_(f * (step + 1) * 0.5)
                rg.copy_(f * (step + 1) * 0.5)
        k_s = make_outputs(k_c, block_size)
        assert op(k_c, k_a, k_g, k_s, beta, nesterov, block_size, streams, offsets) is None
        r_s = reference_update(r_c, r_a, r_g, beta, nesterov, block_size, streams, offsets)
        for i in range(n):
            tag = f"step {step} tensor {i}"
            assert_bits_equal(k_c[i], r_c[i], f"codes ({tag})")
            assert_bits_equal(k_a[i], r_a[i], f"absmax ({tag})")
            assert_bits_equal(k_g[i], r_g[i], f"grad ({tag})")
            assert k_s[i].shape == r_s[i].shape and k_s[i].dtype == torch.float32
            assert_sumsq_close(k_s[i], r_s[i], block_size)


# ---------------------------------------------------------------------------------------------
# build / backend
# ---------------------------------------------------------------------------------------------
def test_backend_reports_extension(ext):
    assert qops.backend() == ext.backend
    assert ext.backend in ("cpu-extension", "cpu+cuda-extension")
    assert hasattr(torch.ops.qmuon_C, "q8_momentum_update_multi_")


def test_public_op_dispatches_to_compiled_kernel(ext):
    codes, absmax = make_state(8, 300, torch.int8, 128)
    grad = make_grad(8, 300, torch.float32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ops.qmuon.q8_momentum_update_multi_([codes], [absmax], [grad], nan_block_sumsq([codes], 128), 0.9,
                                                  False, 128, [-1], [0])
        torch.ops.qmuon.quantize_rows(grad, 128, True, -1, 0)
        torch.ops.qmuon.dequantize_rows(codes, absmax, 128)
    names = {e.name for e in prof.events()}
    for op in ("q8_momentum_update_multi_", "quantize_rows", "dequantize_rows"):
        assert f"qmuon_C::{op}" in names, f"torch.ops.qmuon.{op} did not run the compiled kernel: {sorted(names)}"


def test_reference_switch_and_prebuild_command(ext):
    env = dict(os.environ, QMUON_BACKEND="reference")
    code = ("import torch, qmuon.ops as o; print(o.backend()); "
            "print(hasattr(torch.ops.qmuon_C, 'q8_momentum_update_multi_'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["reference", "False"], out.stdout + out.stderr
    env["QMUON_BACKEND"] = "auto"
    out = subprocess.run([sys.executable, "-m", "qmuon.ops.build"], env=env, capture_output=True,
                         text=True, check=True)
    assert f"backend: {ext.backend}" in out.stdout, out.stdout + out.stderr
    assert "found in sys.modules" not in out.stderr, out.stderr  # no runpy double-import warning


@pytest.mark.skipif(sys.platform == "win32", reason="QMUON_CPU_ARCH is not used on Windows")
@pytest.mark.parametrize("mode", ["extension", "auto"])
def test_prebuild_command_fails_when_the_build_fails(mode, tmp_path):
    # An -march the compiler rejects makes the build fail (fast: the first compile errors out); a
    # private TORCH_EXTENSIONS_DIR keeps the failed build out of the shared cache.
    env = dict(os.environ, QMUON_BACKEND=mode, QMUON_CPU_ARCH="no-such-cpu", TORCH_EXTENSIONS_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "qmuon.ops.build"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    if mode == "extension":
        assert "error: qmuon: QMUON_BACKEND=extension but building/loading" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    else:
        assert "backend: reference" in out.stdout and "building/loading the compiled kernels failed" in out.stdout


def _has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and " avx512f" in line for line in f)
    except OSError:
        return False


def test_build_reports_its_cpu_loops(ext):
    isa = _extension.cpu_vector_isa()
    if os.environ.get("QMUON_EXPECT_CPU_LOOPS"):  # set by test_portable_build_matches_reference
        assert isa == os.environ["QMUON_EXPECT_CPU_LOOPS"]
        return
    # -march=native (the default) on a CPU with AVX-512 must compile the AVX-512 loops, elsewhere not.
    if os.environ.get("QMUON_CPU_ARCH", "native").strip() == "native" and sys.platform != "win32":
        assert isa == ("avx512" if _has_avx512f() else "portable")
    else:
        assert isa in ("avx512", "portable")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64" or not _has_avx512f(),
                    reason="needs an x86-64 CPU with AVX-512: elsewhere the native build already runs the "
                           "portable loops, which the rest of this file tests")
def test_portable_build_matches_reference(ext):
    """The CPU kernels have hand-written AVX-512 loops beside portable ones (q8_cpu.cpp); a native
    build on this machine tests only the former, and the compiler vectorizes the shared loops
    differently without AVX-512. Build again for x86-64-v3 (AVX2, no AVX-512) and run the 8-bit,
    4-bit and row-shard kernel-vs-reference comparisons on that build. The build goes to the
    extension cache the native one uses: its key (sources, flags, -march among them, torch) differs
    from the native build's, so a rerun with unchanged sources loads it instead of compiling again
    (~50 s on the 2-core CI machine), as every other build does."""
    if os.environ.get("QMUON_EXPECT_CPU_LOOPS"):
        pytest.skip("already inside the portable-build run")
    env = dict(os.environ, QMUON_CPU_ARCH="x86-64-v3", QMUON_BACKEND="extension", QMUON_EXPECT_CPU_LOOPS="portable")
    selection = ("(matches_reference or quantize_dequantize_match or all_16bit or noise_index or zero_state "
                 "or tiny_and_empty or noncontiguous or codecs or equals_torch_muon_lerp or mixed_dtypes "
                 "or amax or with_scale or row_split or build_reports_its_cpu_loops) "
                 "and not portable_build")  # not this test: no recursion
    files = [Path(__file__).with_name(f) for f in ("test_kernels.py", "test_kernels_4bit.py", "test_kernels_sharded.py")]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", selection,
                          *map(str, files)],
                         env=env, cwd=str(REPO), capture_output=True, text=True, timeout=1200)
    tail = (out.stdout + out.stderr)[-3000:]
    assert out.returncode == 0, tail
    assert " passed" in out.stdout and " failed" not in out.stdout, tail


def test_unbuildable_extension_warns_once_and_uses_reference(monkeypatch, tmp_path):
    monkeypatch.setattr(_extension, "_status", None)
    monkeypatch.setattr(_extension, "csrc_dir", lambda: tmp_path / "missing")
    monkeypatch.setenv("QMUON_BACKEND", "auto")
    with pytest.warns(RuntimeWarning, match="pure-PyTorch reference kernels because kernel sources not found"):
        st = _extension.status()
    assert st.backend == "reference" and "not found" in st.reason
    # The registered kernels fall back to the reference.
    codes, absmax = make_state(3, 40, torch.uint8, 32)
    check_update([codes], [absmax], [make_grad(3, 40, torch.float32)], block_size=32, steps=1)
    monkeypatch.setenv("QMUON_BACKEND", "extension")
    monkeypatch.setattr(_extension, "_status", None)
    with pytest.raises(RuntimeError, match="QMUON_BACKEND=extension"):
        _extension.status()


# ---------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------
def _opcheck_update_args(code_dtype, grad_dtype, stochastic, noncontig=False):
    rows, cols, bs = 9, 70, 32
    codes, absmax = make_state(rows, cols, code_dtype, bs)
    codes2, absmax2 = make_state(4, 33, code_dtype, bs, seed=3)
    g = make_grad(rows, cols, grad_dtype)
    if noncontig:
        g = make_grad(cols, rows, grad_dtype).t()
    g2 = make_grad(4, 33, grad_dtype, seed=4)
    streams = [11, 12] if stochastic else [-1, -1]
    sums = [torch.empty(rows, ref.num_blocks(cols, bs)), torch.empty(4, ref.num_blocks(33, bs))]
    if noncontig:  # a column-major output: written through a contiguous copy
        sums[0] = torch.empty(ref.num_blocks(cols, bs), rows).t()
    return ([codes, codes2], [absmax, absmax2], [g, g2], sums, 0.95, True, bs, streams, [0, 5])


# Every opcheck util runs, test_aot_dispatch_dynamic included: the op mutates its list arguments
# (block_sumsq included) and returns None, which torch auto-functionalizes.
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_opcheck_q8_momentum_update(ext, code_dtype, grad_dtype, stochastic):
    torch.library.opcheck(torch.ops.qmuon.q8_momentum_update_multi_.default,
                          _opcheck_update_args(code_dtype, grad_dtype, stochastic))


def test_opcheck_q8_momentum_update_noncontiguous(ext):
    torch.library.opcheck(torch.ops.qmuon.q8_momentum_update_multi_.default,
                          _opcheck_update_args(torch.int8, torch.bfloat16, True, noncontig=True))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("stream", [-1, 77])
def test_opcheck_quantize_dequantize(ext, signed, stream):
    x = make_grad(37, 300, torch.float32)
    torch.library.opcheck(torch.ops.qmuon.quantize_rows.default, (x, 128, signed, stream, 3))
    codes, absmax = make_state(37, 300, torch.int8 if signed else torch.uint8, 128)
    torch.library.opcheck(torch.ops.qmuon.dequantize_rows.default, (codes, absmax, 128))


# ---------------------------------------------------------------------------------------------
# kernel == reference
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("code_dtype", CODE_DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("nesterov", [False, True])
def test_update_matches_reference(kernel_device, shape, grad_dtype, code_dtype, block_size, rounding, nesterov):
    """The compiled update on each device (cuda: marked, skipped without a GPU) == the reference on that
    device, step by step; on a GPU also == the CPU reference (the reference is device-independent)."""
    rows, cols = shape
    codes, absmax = make_state(rows, cols, code_dtype, block_size, device=kernel_device)
    grad = make_grad(rows, cols, grad_dtype, device=kernel_device)
    streams = [ref.noise_stream(1234, 7, 3)] if rounding == "stochastic" else [-1]
    check_update([codes.clone()], [absmax.clone()], [grad.clone()], nesterov=nesterov, block_size=block_size,
                 streams=streams, offsets=[5], steps=2)
    if kernel_device.type != "cpu":
        k = [codes, absmax, grad]
        s = nan_block_sumsq([k[0]], block_size)
        torch.ops.qmuon.q8_momentum_update_multi_([k[0]], [k[1]], [k[2]], s, 0.95, nesterov, block_size, streams, [3])
        r = [t.cpu() for t in (codes, absmax, grad)]
        rs = reference_update([r[0]], [r[1]], [r[2]], 0.95, nesterov, block_size, streams, [3])[0]
        for a, b, what in zip(k, r, ("codes", "absmax", "grad")):
            assert_bits_equal(a.cpu(), b, f"{what} ({kernel_device} vs cpu reference)")
        assert_sumsq_close(s[0].cpu(), rs, block_size)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("nesterov", [False, True])
def test_update_matches_reference_betas(ext, beta, nesterov):
    codes, absmax = make_state(37, 300, torch.int8, 128)
    check_update([codes], [absmax], [make_grad(37, 300, torch.float32)], beta=beta, nesterov=nesterov,
                 block_size=128, streams=[99], steps=3)


def test_update_multi_tensor_mixed_dtypes(ext):
    specs = [((37, 300), torch.int8, torch.float32), ((3, 5), torch.uint8, torch.bfloat16),
             ((129, 513), torch.int8, torch.float16), ((1, 1), torch.uint8, torch.float32),
             ((64, 256), torch.int8, torch.bfloat16)]
    codes, absmax, grads = [], [], []
    for i, ((r, c), cd, gd) in enumerate(specs):
        cc, aa = make_state(r, c, cd, 128, seed=10 + i)
        codes.append(cc)
        absmax.append(aa)
        grads.append(make_grad(r, c, gd, seed=20 + i))
    streams = [ref.noise_stream(0, 1, i) if i % 2 else -1 for i in range(len(specs))]
    check_update(codes, absmax, grads, nesterov=True, block_size=128, streams=streams,
                 offsets=[0, 4, 0, 2, 64], steps=3)


def test_update_many_tensors(ext):  # more tensors than one CUDA launch batch
    codes, absmax, grads = [], [], []
    for i in range(60):
        cc, aa = make_state(1 + i % 7, 1 + 13 * i, torch.int8, 32, seed=i)
        codes.append(cc)
        absmax.append(aa)
        grads.append(make_grad(1 + i % 7, 1 + 13 * i, torch.bfloat16, seed=100 + i))
    check_update(codes, absmax, grads, block_size=32, streams=list(range(60)), offsets=list(range(60)), steps=1)


def test_update_multithreaded(ext):
    # conftest pins one intra-op thread; the kernels split row blocks over at::parallel_for.
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, os.cpu_count() or 2))
    try:
        codes, absmax = make_state(129, 513, torch.int8, 32)
        check_update([codes], [absmax], [make_grad(129, 513, torch.bfloat16)], nesterov=True, block_size=32,
                     streams=[17], steps=2)
        x = make_grad(129, 513, torch.float32)
        c_k, a_k = torch.ops.qmuon.quantize_rows(x, 32, True, 4, 0)
        c_r, a_r = ref.quantize_rows(x, 32, signed=True, noise=ref.uniform_noise(129, 513, 4, 0, x.device))
        assert_bits_equal(c_k, c_r, "codes")
        assert_bits_equal(a_k, a_r, "absmax")
    finally:
        torch.set_num_threads(threads)


def test_update_tiny_and_empty(ext):
    cases = [(1, 1), (1, 31), (1, 33), (2, 1), (0, 5), (5, 0), (0, 0)]
    codes, absmax, grads = [], [], []
    for r, c in cases:
        cc, aa = make_state(r, c, torch.uint8, 32)
        codes.append(cc)
        absmax.append(aa)
        grads.append(make_grad(r, c, torch.float16))
    check_update(codes, absmax, grads, block_size=32, streams=[3] * len(cases), steps=2)
    assert torch.ops.qmuon.q8_momentum_update_multi_([], [], [], [], 0.9, False, 32, [], []) is None


def test_update_zero_state_and_zero_grad(ext):
    codes = torch.zeros(4, 100, dtype=torch.int8)
    absmax = torch.zeros(4, 1)
    grad = torch.zeros(4, 100)
    grad[1] = torch.randn(100)
    check_update([codes], [absmax], [grad], block_size=128, streams=[5], steps=2)


@pytest.mark.parametrize("layout", ["transposed", "row-strided", "col-strided", "strided-state"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
def test_update_noncontiguous(ext, layout, grad_dtype):
    rows, cols, bs = 37, 300, 128
    codes, absmax = make_state(rows, cols, torch.int8, bs)
    if layout == "transposed":
        grad = make_grad(cols, rows, grad_dtype).t()
    elif layout == "row-strided":  # unit column stride, padded rows: handled in place
        grad = make_grad(rows, cols + 17, grad_dtype)[:, 3:3 + cols]
    elif layout == "col-strided":
        grad = make_grad(rows, 2 * cols, grad_dtype)[:, ::2]
    else:
        grad = make_grad(rows, cols, grad_dtype)
        big_c = torch.zeros(rows, cols + 9, dtype=torch.int8)
        big_c[:, 4:4 + cols] = codes
        codes = big_c[:, 4:4 + cols]
        big_a = torch.zeros(absmax.shape[1], rows)
        big_a.copy_(absmax.t())
        absmax = big_a.t()
    assert not grad.is_contiguous() or layout == "strided-state"
    check_update([codes], [absmax], [grad], nesterov=True, block_size=bs, streams=[42], steps=2)


@pytest.mark.parametrize("layout", ["transposed", "row-padded", "column-strided"])
def test_update_noncontiguous_block_sumsq_outputs(ext, layout):
    rows, cols, bs = 37, 300, 64
    nb = ref.num_blocks(cols, bs)

    def outputs(codes, block_size):
        if layout == "transposed":
            base = torch.full((nb, rows), float("nan")).t()
        elif layout == "row-padded":
            base = torch.full((rows, nb + 5), float("nan"))[:, 2:2 + nb]
        else:
            base = torch.full((rows, 2 * nb), float("nan"))[:, ::2]
        assert not base.is_contiguous()
        return [base]

    codes, absmax = make_state(rows, cols, torch.uint8, bs)
    check_update([codes], [absmax], [make_grad(rows, cols, torch.bfloat16)], nesterov=True, block_size=bs,
                 streams=[7], steps=2, make_outputs=outputs)


@pytest.mark.parametrize("bad", ["dtype", "shape", "count"])
def test_update_rejects_bad_block_sumsq_outputs(ext, bad):
    codes, absmax = make_state(5, 70, torch.int8, 32)
    grad = make_grad(5, 70, torch.float32)
    outs = {"dtype": [torch.empty(5, 3, dtype=torch.float64)], "shape": [torch.empty(5, 2)], "count": []}[bad]
    codes0, absmax0 = codes.clone(), absmax.clone()
    with pytest.raises((ValueError, RuntimeError), match="block_sumsq"):
        torch.ops.qmuon.q8_momentum_update_multi_([codes], [absmax], [grad], outs, 0.9, False, 32, [-1], [0])
    # checked before anything is written
    assert torch.equal(codes, codes0) and torch.equal(absmax, absmax0)


def test_internal_op_without_sums(ext):
    # qmuon_C's compute_sumsq=False (used by benchmarks/bench_update.py) takes an empty block_sumsq.
    codes, absmax = make_state(9, 70, torch.int8, 32)
    grad = make_grad(9, 70, torch.float32)
    r = [codes.clone(), absmax.clone(), grad.clone()]
    torch.ops.qmuon_C.q8_momentum_update_multi_([codes], [absmax], [grad], [], 0.9, True, 32, [3], [0],
                                                compute_sumsq=False)
    reference_update([r[0]], [r[1]], [r[2]], 0.9, True, 32, [3], [0])
    for a, b, what in zip((codes, absmax, grad), r, ("codes", "absmax", "grad")):
        assert_bits_equal(a, b, what)


def test_update_noise_index_crosses_2_pow_32(ext):
    # Rows of the unsharded matrix beyond 2**32 elements: the noise index's high word is non-zero and
    # changes inside a block.
    cols, bs = 513, 256
    row_offset = (2**32 - 100) // cols
    codes, absmax = make_state(6, cols, torch.int8, bs)
    check_update([codes], [absmax], [make_grad(6, cols, torch.float32)], block_size=bs, streams=[9],
                 offsets=[row_offset], steps=2)


def test_update_all_16bit_grad_patterns(ext):
    # beta = 0 makes the NS input the gradient itself, so every finite bf16 / fp16 bit pattern
    # (subnormals included) goes through the kernel's load and store conversions.
    for dtype in (torch.bfloat16, torch.float16):
        bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
        vals = bits.view(dtype)
        vals = vals[torch.isfinite(vals)]
        vals = vals[: (vals.numel() // 256) * 256].reshape(-1, 256)
        codes, absmax = make_state(vals.shape[0], 256, torch.int8, 256)
        check_update([codes], [absmax], [vals.clone()], beta=0.0, block_size=256, steps=1)
        check_update([codes], [absmax], [vals.clone()], beta=0.9, nesterov=True, block_size=256, steps=1)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("stream", [-1, 2024])
def test_quantize_dequantize_match_reference(ext, shape, signed, block_size, stream):
    rows, cols = shape
    x = make_grad(rows, cols, torch.float32) * torch.rand(rows, 1)
    codes, absmax = torch.ops.qmuon.quantize_rows(x, block_size, signed, stream, 11)
    r_codes, r_absmax = ref.quantize_rows(x, block_size, signed=signed, noise=noise_or_none(x, stream, 11))
    assert_bits_equal(codes, r_codes, "codes")
    assert_bits_equal(absmax, r_absmax, "absmax")
    assert_bits_equal(torch.ops.qmuon.dequantize_rows(codes, absmax, block_size),
                      ref.dequantize_rows(r_codes, r_absmax, block_size), "dequantized")


@pytest.mark.parametrize("layout", ["transposed", "row-strided", "bf16"])
def test_quantize_dequantize_noncontiguous(ext, layout):
    if layout == "transposed":
        x = make_grad(300, 37, torch.float32).t()
    elif layout == "row-strided":
        x = make_grad(37, 320, torch.float32)[:, 7:307]
    else:
        x = make_grad(37, 300, torch.bfloat16)
    codes, absmax = torch.ops.qmuon.quantize_rows(x, 128, True, 5, 0)
    r_codes, r_absmax = ref.quantize_rows(x, 128, signed=True, noise=ref.uniform_noise(*x.shape, 5, 0, x.device))
    assert_bits_equal(codes, r_codes, "codes")
    assert_bits_equal(absmax, r_absmax, "absmax")
    c_view = torch.zeros(37, 310, dtype=torch.int8)[:, 5:305]
    c_view.copy_(codes)
    assert_bits_equal(torch.ops.qmuon.dequantize_rows(c_view, absmax.t().contiguous().t(), 128),
                      ref.dequantize_rows(codes, absmax, 128), "dequantized")


def test_unsupported_arguments_fall_back_to_reference(ext):
    codes, absmax = make_state(5, 40, torch.int8, 32)
    check_update([codes], [absmax], [make_grad(5, 40, torch.float64)], block_size=32, steps=1)
    codes, absmax = make_state(3, 9000, torch.int8, 8192)
    check_update([codes], [absmax], [make_grad(3, 9000, torch.float32)], block_size=8192, steps=1)


def test_optimizer_path_state_through_int8_format(ext):
    # The uint8 format's update (what QMuon calls) on top of the compiled op equals the reference.
    from qmuon.quant import state as qstate

    fmt, opts = qstate.get_format("uint8"), qstate.FormatOptions(block_size=128)
    states = [fmt.init(37, 300, opts, torch.device("cpu"))]
    grads = [make_grad(37, 300, torch.bfloat16)]
    r_codes, r_absmax = states[0]["momentum_codes"].clone(), states[0]["momentum_absmax"].clone()
    r_grads = [g.clone() for g in grads]
    fmt.update(states, grads, qops.empty_block_sumsq(grads, 128), beta=0.95, nesterov=True, opts=opts,
               streams=[ref.noise_stream(3, 2, 0)], offsets=[0], keys=[0], seed=3)
    ref.q8_momentum_update_(r_codes, r_absmax, r_grads[0], beta=0.95, nesterov=True,
                            block_size=128, stream=ref.noise_stream(3, 2, 0))
    assert_bits_equal(states[0]["momentum_codes"], r_codes, "codes")
    assert_bits_equal(states[0]["momentum_absmax"], r_absmax, "absmax")
    assert_bits_equal(grads[0], r_grads[0], "grad")


# ---------------------------------------------------------------------------------------------
# On each device (cuda: marked): many matrices, odd views, the row ops, against the reference
# ---------------------------------------------------------------------------------------------
def test_noncontiguous_multi_and_rows_ops_on_each_device(kernel_device):
    dev = kernel_device
    codes, absmax, grads = [], [], []
    for i in range(40):  # > one launch batch; odd shapes and misaligned views
        r, c = 1 + i % 5, 1 + 37 * i
        cc, aa = make_state(r, c, torch.int8 if i % 2 else torch.uint8, 128, device=dev, seed=i)
        codes.append(cc)
        absmax.append(aa)
        g = make_grad(r, c + 3, torch.bfloat16 if i % 3 else torch.float32, device=dev, seed=50 + i)
        grads.append(g[:, 1:1 + c] if i % 4 else make_grad(c, r, g.dtype, device=dev).t())
    check_update(codes, absmax, grads, nesterov=True, block_size=128, streams=[i * 3 for i in range(40)],
                 offsets=list(range(40)), steps=2)
    x = make_grad(129, 513, torch.float32, device=dev)
    for stream in (-1, 8):
        c_k, a_k = torch.ops.qmuon.quantize_rows(x, 256, True, stream, 2)
        c_r, a_r = ref.quantize_rows(x.cpu(), 256, signed=True, noise=noise_or_none(x.cpu(), stream, 2))
        assert_bits_equal(c_k.cpu(), c_r, "codes")
        assert_bits_equal(a_k.cpu(), a_r, "absmax")
        assert_bits_equal(torch.ops.qmuon.dequantize_rows(c_k, a_k, 256).cpu(), ref.dequantize_rows(c_r, a_r, 256),
                          "dequantized")
    torch.library.opcheck(torch.ops.qmuon.q8_momentum_update_multi_.default,
                          ([codes[3]], [absmax[3]], [grads[3]], nan_block_sumsq([codes[3]], 128), 0.95, True, 128,
                           [1], [0]))


# ---------------------------------------------------------------------------------------------
# nvcc compile check of the CUDA sources (no GPU needed)
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_cuda_sources_build_the_gpu_library(tmp_path):
    """Every .cu under csrc/cuda compiles and links into the prebuilt GPU library for the default
    architectures, exporting the whole C ABI. The objects come from the nvcc cache that .ci/run's
    library build fills (QMUON_NVCC_CACHE), so in CI this only links; cold it compiles each file once."""
    from qmuon.ops import build_gpu

    lib = build_gpu.build(out_dir=tmp_path, log=lambda *a: None)  # cache: QMUON_NVCC_CACHE or ~/.cache/qmuon/nvcc
    assert set(build_gpu.EXPORTS) <= set(build_gpu.exported_symbols(lib))
