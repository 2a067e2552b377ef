"""The first-use canary (qmuon/ops/_canary.py): every compiled op is checked once per device type against
its reference, over cases that reach every code path of its kernels, and an op whose kernel disagrees
falls back to the reference, loudly.

The planted faults are wrappers around the real compiled kernel that flip one bit of one result (or
raise), put in place of ``_kernels.compiled_op`` or handed to ``_canary.run_check``; the canary must catch
each, the op must then return the reference's bits, and ``_canary.failures()`` (what qmuon-doctor lists)
must name it. One fault per op shows only in one of the canary's coverage cases (a second matrix, a half
4-bit byte, rows past an index, one dtype or rounding): the canary catches it in that case, the old
single-sample canary (``_canary_samples.samples()``, 9 x 100) passes it. The CUDA cases cannot run here: they are
built on the CPU at an H200's size, checked for their launch shapes (a second wave of CTAs, a second
launch of matrices) and run through the CPU kernels.
"""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch

from qmuon.ops import _canary, _canary_cases, _canary_inputs, _canary_samples, _kernels
from qmuon.ops import reference_adamw as refa
from qmuon.ops._library import OPS

COMPILED = sorted(n for n, op in OPS.items() if op.supported is not None)


@pytest.fixture
def fresh_canary():
    _canary.reset()
    yield
    _canary.reset()


def test_every_compiled_op_has_a_canary_sample():
    assert set(_canary_samples.samples(torch.device("cpu"))) == set(COMPILED)


def test_every_compiled_op_has_canary_cases():
    """Every op: a ``shapes`` (or ``specials``) case and a ``grid`` case at least, labels unique."""
    cases = _canary_cases.cases(torch.device("cpu"))
    assert set(cases) == set(COMPILED)
    for name, calls in cases.items():
        labels = [label for label, _ in calls]
        assert len(labels) == len(set(labels)) >= 2, (name, labels)
        assert {"shapes", "specials"} & set(labels) and "grid" in labels, (name, labels)


def test_every_kernel_passes_its_canary(kernel_device, fresh_canary):
    """The real kernels agree with their references on the canary's inputs; the cost of all of them
    together is what a process pays at most once (each op only when it is first used)."""
    t0 = time.perf_counter()
    problems = {name: _canary.run_check(OPS[name], _kernels.compiled_op(name, kernel_device.type), kernel_device)
                for name in COMPILED}
    elapsed = time.perf_counter() - t0
    assert {k: v for k, v in problems.items() if v is not None} == {}
    calls = sum(len(c) for c in _canary_cases.cases(kernel_device).values())
    print(f"canary: {len(COMPILED)} ops, {calls} calls in {elapsed * 1e3:.1f} ms")


def _flip_one_bit(out: torch.Tensor) -> None:
    flat = out.view(-1)
    if out.dtype == torch.float32:
        flat.view(torch.int32)[3] ^= 1
    else:
        flat.view(torch.uint8)[3] ^= 1


def test_a_wrong_kernel_falls_back_to_the_reference(ext, fresh_canary, monkeypatch, caplog):
    """quantize_rows whose compiled kernel flips one bit of its absmax: the first call's canary catches
    it, logs an error naming the op, the call returns the reference's result, and later calls too."""
    real = _kernels.compiled_op

    def planted(name, device_type):
        fn = real(name, device_type)
        if name != "quantize_rows":
            return fn

        def wrong(*args):
            codes, absmax = fn(*args)
            _flip_one_bit(absmax)
            return codes, absmax

        return wrong

    monkeypatch.setattr(_kernels, "compiled_op", planted)
    _canary.reset()
    x = torch.randn(6, 70, generator=torch.Generator().manual_seed(0))
    before = _kernels.served[("quantize_rows", "reference")]
    with caplog.at_level(logging.ERROR, logger="qmuon.ops"):
        codes, absmax = torch.ops.qmuon.quantize_rows(x, 32, True, -1, 0)
    want = OPS["quantize_rows"].reference(x, 32, True, -1, 0)
    assert torch.equal(codes, want[0]) and torch.equal(absmax.view(torch.int32), want[1].view(torch.int32))
    assert ("quantize_rows", "cpu") in _canary.failures()
    assert "1 of" in _canary.failures()[("quantize_rows", "cpu")]
    assert any(r.levelno == logging.ERROR and "quantize_rows" in r.getMessage() for r in caplog.records)
    torch.ops.qmuon.quantize_rows(x, 32, True, -1, 0)
    assert _kernels.served[("quantize_rows", "reference")] == before + 2
    # the other ops are unaffected
    before_c = _kernels.served[("dequantize_rows", "compiled")]
    torch.ops.qmuon.dequantize_rows(*want, 32)
    assert _kernels.served[("dequantize_rows", "compiled")] == before_c + 1


def test_a_wrong_in_place_update_falls_back(ext, fresh_canary, monkeypatch):
    """A mutating op (the int8 momentum update) that writes one wrong bit into the momentum codes."""
    real = _kernels.compiled_op

    def planted(name, device_type):
        fn = real(name, device_type)
        if name != "q8_momentum_update_multi_":
            return fn

        def wrong(codes, *rest):
            fn(codes, *rest)
            _flip_one_bit(codes[0])

        return wrong

    monkeypatch.setattr(_kernels, "compiled_op", planted)
    _canary.reset()
    from qmuon.ops import reference as ref

    g = torch.Generator().manual_seed(1)
    codes, absmax = ref.quantize_rows(torch.randn(5, 40, generator=g) * 0.01, 16, signed=True)
    grad = torch.randn(5, 40, generator=g)
    args = ([codes.clone()], [absmax.clone()], [grad.clone()], [torch.empty(5, 3)], 0.9, True, 16, [-1], [0])
    want = _canary.clone_args(args)
    torch.ops.qmuon.q8_momentum_update_multi_(*args)
    OPS["q8_momentum_update_multi_"].reference(*want)
    assert torch.equal(args[0][0], want[0][0])
    assert ("q8_momentum_update_multi_", "cpu") in _canary.failures()


def test_a_kernel_that_raises_is_a_failed_canary(ext, fresh_canary, monkeypatch):
    real = _kernels.compiled_op

    def planted(name, device_type):
        if name == "pack_int4":
            def boom(*args):
                raise RuntimeError("no kernel image is available for execution on the device")
            return boom
        return real(name, device_type)

    monkeypatch.setattr(_kernels, "compiled_op", planted)
    _canary.reset()
    codes = torch.randint(-7, 8, (3, 9), dtype=torch.int8)
    assert torch.equal(torch.ops.qmuon.pack_int4(codes), OPS["pack_int4"].reference(codes))
    assert "no kernel image" in _canary.failures()[("pack_int4", "cpu")]


def test_canary_off(ext, fresh_canary, monkeypatch):
    """QMUON_CANARY=0: no check, the compiled kernel serves from the first call."""
    monkeypatch.setenv("QMUON_CANARY", "0")
    before = _kernels.served[("pack_int4", "compiled")]
    torch.ops.qmuon.pack_int4(torch.zeros(2, 4, dtype=torch.int8))
    assert _kernels.served[("pack_int4", "compiled")] == before + 1
    assert _canary.timings() == {}


# --------------------------------------------------------------------------------------------- coverage
def _old_canary(name: str, fn) -> str | None:
    """What the canary checked before its coverage cases: the one sample call (9 x 100)."""
    op = OPS[name]
    args_a = _canary_samples.samples(torch.device("cpu"))[name]()
    args_b = _canary.clone_args(args_a)
    return _canary.compare(op, fn(*args_a), op.reference(*args_b), args_a, args_b)


def _flip(t: torch.Tensor, r: int = 0, c: int = 0) -> None:
    """Flip the lowest bit of element (r, c) of ``t`` (through views; element r of a 1-D tensor)."""
    x = t[r, c] if t.dim() == 2 else t[r]
    x.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]).bitwise_xor_(1)


def _bf16_index(ts) -> int:
    return next(i for i, t in enumerate(ts) if t.dtype == torch.bfloat16)


# op -> (the case that must catch it, when the fault fires (the call's arguments), what it corrupts (out, args))
PLANTED = {
    # a multi-tensor call's second matrix
    "q8_momentum_update_multi_": ("shapes", lambda a: len(a[0]) > 1, lambda out, a: _flip(a[0][1])),
    "e0m3_momentum_amax_multi": ("shapes", lambda a: len(a[0]) > 1, lambda out, a: _flip(out, 1)),
    # one dtype: bf16 buffers, bf16 grads, fp16 updates, bf16 input, uint8 codes
    "dense_momentum_update_multi_": ("shapes", lambda a: any(b.dtype == torch.bfloat16 for b in a[0]),
                                     lambda out, a: _flip(a[0][_bf16_index(a[0])])),
    "e0m3_momentum_update_with_scale_multi_": ("shapes", lambda a: any(g.dtype == torch.bfloat16 for g in a[4]),
                                               lambda out, a: _flip(a[4][_bf16_index(a[4])], 2, 7)),
    "bf16_ecc8_weight_update_": ("grid", lambda a: a[2].dtype == torch.float16, lambda out, a: _flip(a[1])),
    "grid_quantize4_with_scale": ("grid", lambda a: a[0].dtype == torch.bfloat16, lambda out, a: _flip(out[0])),
    "dequantize_rows": ("shapes", lambda a: a[0].dtype == torch.uint8, lambda out, a: _flip(out)),
    # one rounding / mode / layout / kind
    "int4_momentum_update_multi_": ("shapes", lambda a: not a[5], lambda out, a: _flip(a[2][0])),
    "ue4m3_encode": ("specials", lambda a: not a[1], lambda out, a: _flip(out, 3, 3)),
    "e0m3_quantize": ("shapes", lambda a: not a[1], lambda out, a: _flip(out[0])),
    "bf16_weight_update_": ("grid", lambda a: a[4] < 0, lambda out, a: _flip(a[0], 1, 1)),
    "adamw_q_update_": ("shapes", lambda a: a[11] == refa.M4, lambda out, a: _flip(a[5])),
    "fp32_weight_update_": ("grid-rows", lambda a: a[1].stride(1) == 1, lambda out, a: _flip(a[0], 1, 2)),
    # the last partial 4-bit byte of a row (odd cols), an odd block, a block of 8, strided rows
    "pack_int4": ("shapes", lambda a: a[0].shape[1] % 2, lambda out, a: _flip(out, 1, out.shape[1] - 1)),
    "int4_dequantize": ("shapes", lambda a: a[2] % 2, lambda out, a: _flip(out, 0, 20)),
    "e0m3_momentum_update_multi_": ("shapes", lambda a: a[7] < 16, lambda out, a: _flip(a[0][0])),
    "unpack_int4": ("shapes", lambda a: not a[0].is_contiguous(), lambda out, a: _flip(out, 2, 5)),
    # stochastic noise of indices past 2**32
    "int4_quantize": ("shapes", lambda a: a[2] >= 0 and (a[3] + a[0].shape[0]) * a[0].shape[1] > 2**32,
                      lambda out, a: _flip(out[0], 1)),
    # rows past an index (a large grid), a wide row, small tiles
    "quantize_rows": ("grid", lambda a: a[0].shape[0] > 32, lambda out, a: _flip(out[0], 40, 0)),
    "ue4m3_decode": ("grid", lambda a: a[0].numel() > 1000, lambda out, a: _flip(out, 40, 0)),
    "e0m3_dequantize": ("grid", lambda a: a[0].shape[0] > 16, lambda out, a: _flip(out, 20, 0)),
    "grid_dequantize4": ("shapes", lambda a: a[5] > 256, lambda out, a: _flip(out, 0, a[5] - 1)),
    "grid_quantize4": ("shapes", lambda a: a[1] < 8, lambda out, a: _flip(out[1], 2, 100)),  # small tiles
}


def _planted(name: str, fn):
    _, when, corrupt = PLANTED[name]

    def wrong(*args):
        out = fn(*args)
        if when(args):
            corrupt(out, args)
        return out

    return wrong


def test_every_op_has_a_planted_fault():
    assert set(PLANTED) == set(COMPILED)


@pytest.mark.parametrize("name", COMPILED)
def test_a_fault_only_a_coverage_case_shows_is_caught(ext, name):
    """A kernel wrong only on the calls of one coverage case: the single-sample canary passes it, the
    canary fails it in that case."""
    wrong = _planted(name, _kernels.compiled_op(name, "cpu"))
    assert _old_canary(name, wrong) is None
    problem = _canary.run_check(OPS[name], wrong, torch.device("cpu"))
    assert problem is not None and problem.startswith(f"case {PLANTED[name][0]}:"), problem


def test_a_fault_in_a_second_matrix_falls_back_on_first_use(ext, fresh_canary, monkeypatch, caplog):
    """Through the public op: a q8 update wrong on the second matrix of a call. A one-matrix call (which
    would never show the fault itself) triggers the canary, which catches it in its shapes case: the call
    gets the reference's bits, the log and failures() name the case."""
    real = _kernels.compiled_op

    def planted(name, device_type):
        fn = real(name, device_type)
        return _planted(name, fn) if name == "q8_momentum_update_multi_" else fn

    monkeypatch.setattr(_kernels, "compiled_op", planted)
    _canary.reset()
    from qmuon.ops import reference as ref

    g = torch.Generator().manual_seed(2)
    codes, absmax = ref.quantize_rows(torch.randn(4, 48, generator=g) * 0.01, 16, signed=True)
    args = ([codes.clone()], [absmax.clone()], [torch.randn(4, 48, generator=g)], [torch.empty(4, 3)], 0.9, True,
            16, [-1], [0])
    want = _canary.clone_args(args)
    before = _kernels.served[("q8_momentum_update_multi_", "reference")]
    with caplog.at_level(logging.ERROR, logger="qmuon.ops"):
        torch.ops.qmuon.q8_momentum_update_multi_(*args)
    OPS["q8_momentum_update_multi_"].reference(*want)
    assert torch.equal(args[0][0], want[0][0]) and torch.equal(args[2][0], want[2][0])
    assert _kernels.served[("q8_momentum_update_multi_", "reference")] == before + 1
    assert _canary.failures()[("q8_momentum_update_multi_", "cpu")].startswith("case shapes: codes[1]")
    assert any("case shapes" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


# --------------------------------------------------------------------------------------------- the cases
CPU = torch.device("cpu")
H200 = _canary_inputs.H200_GEOMETRY


def _tensors(args) -> list[torch.Tensor]:
    return _canary._tensors(list(args))


@pytest.mark.parametrize("sizing", ["cpu", "cuda"])
def test_every_case_is_a_call_the_compiled_kernel_serves(ext, sizing):
    """The canary calls the compiled kernel directly: each case must be one its guard would hand it (else
    it would check a call no training step makes, or fail on a legal one)."""
    for name, calls in _canary_cases.cases(CPU, sizing=sizing, geometry=H200).items():
        for label, make in calls:
            assert OPS[name].supported(*make()), (name, label)


def test_cpu_cases_stay_small():
    """The CPU cases stay within 2048 elements a tensor, where the references' rounding ops run on one
    thread (_canary_cases' docstring, "Not reached"), and they are the same on any geometry."""
    for name, calls in _canary_cases.cases(CPU, geometry=(8, 1024)).items():
        for label, make in calls:
            assert max(t.numel() for t in _tensors(make())) <= _canary_inputs.CPU_CASE_ELEMENTS, (name, label)


def test_cuda_runs_the_same_cases():
    """On CUDA the canary runs the CPU's cases, in the same order; only the sizes differ."""
    cpu = _canary_cases.cases(CPU)
    cuda = _canary_cases.cases(CPU, sizing="cuda", geometry=H200)
    assert {n: [label for label, _ in c] for n, c in cpu.items()} == \
        {n: [label for label, _ in c] for n, c in cuda.items()}


def _nb(cols: int, block: int) -> int:
    return (cols + block - 1) // block


def _launches(name: str, a: tuple) -> list[tuple[int, int]]:
    """(CTAs, threads a CTA) of each kernel launch the op makes for the (one-matrix) call ``a``, re-derived
    from csrc/cuda/*.cu: the update kernels' warps a CTA and work per warp, the codecs' threads per item."""
    def per(items: int, threads: int = 256) -> tuple[int, int]:
        return math.ceil(items / threads), threads

    if name in ("q8_momentum_update_multi_", "int4_momentum_update_multi_"):  # a warp a row block
        g, bs = a[2][0], a[6]
        warps = max(1, min(8, 8192 // bs))
        return [(math.ceil(g.shape[0] * _nb(g.shape[1], bs) / warps), 32 * warps)]
    if name == "dense_momentum_update_multi_":  # (the grid matrix; the other one is in another dtype group)
        g = a[1][0]
        return [(math.ceil(g.shape[0] * _nb(g.shape[1], a[5]) / 8), 256)]
    if name in ("e0m3_momentum_update_multi_", "e0m3_momentum_amax_multi",
                "e0m3_momentum_update_with_scale_multi_"):
        g = a[4] if name == "e0m3_momentum_update_with_scale_multi_" else a[3]
        g = g[0]
        pass1 = (math.ceil(g.shape[0] * _nb(g.shape[1], 256) / 32), 256)  # 8 warps x 4 chunks of 256
        if name == "e0m3_momentum_amax_multi":
            return [pass1]
        bs = a[8] if name == "e0m3_momentum_update_with_scale_multi_" else a[7]
        pass2 = (math.ceil(g.shape[0] * _nb(g.shape[1], max(bs, 32)) / 8), 256)
        return [pass2] if name == "e0m3_momentum_update_with_scale_multi_" else [pass1, pass2]
    if name in ("quantize_rows", "dequantize_rows"):  # 8 warps a CTA, a warp a row block
        x, bs = a[0], a[1] if name == "quantize_rows" else a[2]
        return [(math.ceil(x.shape[0] * _nb(x.shape[1], bs) / 8), 256)]
    if name == "adamw_q_update_":  # a CTA a row block
        return [(a[0].shape[0] * _nb(a[0].shape[1], a[13]), 256)]
    if name in ("bf16_weight_update_", "bf16_ecc8_weight_update_"):
        return [per(a[0].numel())]
    if name == "fp32_weight_update_":
        p, u = a[0], a[1]
        if u.stride(1) != 1 and u.stride(0) == 1:  # 32 x 32 tiles
            return [(_nb(p.shape[0], 32) * _nb(p.shape[1], 32), 256)]
        return [per(p.numel())]
    x = a[0]
    rows, cols = x.shape
    if name == "pack_int4":
        return [per(rows * _nb(cols, 2))]
    if name == "int4_quantize":
        return [per(rows * _nb(cols, a[1]))]
    if name == "e0m3_quantize":
        return [per(rows * cols), per(rows * _nb(cols, 16))] if a[1] else [per(rows * _nb(cols, 16))]
    if name in ("grid_quantize4", "grid_quantize4_with_scale"):
        s = a[1]
        maxima = per(rows * _nb(cols, s) + _nb(rows, s) * cols)
        return ([per(rows * cols)] if name == "grid_quantize4" else []) + [maxima, per(rows * _nb(cols, 2))]
    if name in ("unpack_int4", "int4_dequantize", "e0m3_dequantize", "grid_dequantize4"):
        return [per(rows * a[-1])]
    return [per(x.numel())]  # ue4m3_encode / ue4m3_decode: a thread an element


def test_cuda_grid_cases_need_a_second_wave():
    """At an H200's size every grid case launches more CTAs than 132 SMs keep resident (2048 threads an SM,
    at most 32 CTAs), in each of its kernels."""
    for name, calls in _canary_cases.cases(CPU, sizing="cuda", geometry=H200).items():
        for label, make in calls:
            if not label.startswith("grid"):
                continue
            for ctas, threads in _launches(name, make()):
                assert ctas > 132 * min(32, 2048 // threads), (name, label, ctas, threads)


def test_cuda_shapes_cases_need_a_second_launch():
    """On CUDA a multi-tensor shapes case holds more than 24 non-empty matrices of one dtype group (the
    kernels' batch), so that group takes two launches; on the CPU it holds 4 or 5."""
    for sizing, want in (("cuda", lambda n: n > _canary_inputs.CUDA_MATRICES_PER_LAUNCH), ("cpu", lambda n: n <= 5)):
        for name, calls in _canary_cases.cases(CPU, sizing=sizing, geometry=H200).items():
            if not name.endswith("_multi_") and name != "e0m3_momentum_amax_multi":
                continue
            args = dict(calls)["shapes"]()
            grads = args[_canary._params(OPS[name].reference)[0].index("grads")]
            groups: dict = {}
            for s, g in zip(args[0], grads):  # the compiled kernels group by (state dtype, grad dtype)
                if g.numel():
                    groups[(s.dtype, g.dtype)] = groups.get((s.dtype, g.dtype), 0) + 1
            assert want(max(groups.values())) and len(groups) >= 2, (sizing, name, groups)


def test_cuda_sized_cases_pass_on_the_cpu_kernels(ext):
    """The CUDA cases, at an H200's size, through the CPU kernels: valid calls that agree with the
    references, and cut into several at::parallel_for chunks, which the canary's CPU cases are not."""
    t0 = time.perf_counter()
    problems = {}
    for name in COMPILED:
        op = OPS[name]
        for label, make in _canary_cases.cases(CPU, name, sizing="cuda", geometry=H200)[name]:
            problems[(name, label)] = _canary._check_one(op, _kernels.compiled_op(name, "cpu"), make)
    assert {k: v for k, v in problems.items() if v is not None} == {}
    print(f"{len(problems)} CUDA-sized cases on the CPU kernels in {time.perf_counter() - t0:.1f} s")


def test_straddle_offset_crosses_2_32_inside_a_block():
    for cols in (603, 1100):
        r = _canary_inputs.straddle_offset(cols)
        first, last = (r + 1) * cols, (r + 2) * cols - 1
        assert first < 2**32 <= last and (2**32 - first) % 16


def test_cuda_bigblock_is_the_largest_block():
    """bigblock: on CUDA one block of 4096 (kMaxBlockSize), whose updates run 2 warps a CTA."""
    for name in ("q8_momentum_update_multi_", "int4_momentum_update_multi_"):
        args = dict(_canary_cases.cases(CPU, name, sizing="cuda", geometry=H200)[name])["bigblock"]()
        assert args[6] == 4096 and _launches(name, args) == [(1, 64)]


def test_cases_through_the_ctypes_twin(ext):
    """The prebuilt GPU library is called through the C-ABI twin (qmuon/ops/_cabi.py): every case, and the
    CUDA-sized shapes cases (28 matrices in a call, an empty one), through the twin of the CPU build agree
    with the references."""
    import ctypes

    from qmuon.ops import _cabi

    twin = _cabi.CAbiOps(ctypes.CDLL(ext.library), "cpu")
    problems = {}
    for sizing in ("cpu", "cuda"):
        for name, calls in _canary_cases.cases(CPU, sizing=sizing, geometry=H200).items():
            for label, make in calls:
                if sizing == "cpu" or label == "shapes":
                    problems[(sizing, name, label)] = _canary._check_one(OPS[name], twin.get(name), make)
    assert {k: v for k, v in problems.items() if v is not None} == {}
