"""The first-use canary (qmuon/ops/_canary.py): every compiled op is checked once per device type against
its reference, and an op whose kernel disagrees falls back to the reference, loudly.

The planted faults are wrappers around the real compiled kernel that flip one bit of one result (or
raise), put in place of ``_kernels.compiled_op``; the canary must catch each, the op must then return
the reference's bits, and ``_canary.failures()`` (what qmuon-doctor lists) must name it.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from qmuon.ops import _canary, _kernels
from qmuon.ops._library import OPS

COMPILED = sorted(n for n, op in OPS.items() if op.supported is not None)


@pytest.fixture
def fresh_canary():
    _canary.reset()
    yield
    _canary.reset()


def test_every_compiled_op_has_a_canary_sample():
    assert set(_canary.samples(torch.device("cpu"))) == set(COMPILED)


def test_every_kernel_passes_its_canary(kernel_device, fresh_canary):
    """The real kernels agree with their references on the canary's inputs; the cost of all of them
    together is what a process pays at most once (each op only when it is first used)."""
    t0 = time.perf_counter()
    problems = {name: _canary.run_check(OPS[name], _kernels.compiled_op(name, kernel_device.type), kernel_device)
                for name in COMPILED}
    elapsed = time.perf_counter() - t0
    assert {k: v for k, v in problems.items() if v is not None} == {}
    print(f"canary: {len(COMPILED)} ops in {elapsed * 1e3:.1f} ms")


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
