"""The torch.ops.qmuon operators and qmuon.ops.backend."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.library import opcheck

from _helpers import QMAX, expand_blocks
from qmuon import ops
from qmuon.ops import _extension, _kernels
from qmuon.ops import reference as ref
from qmuon.ops import reference_4bit as ref4
from qmuon.quant import state as qstate

U = 2.0**-24  # fp32 unit roundoff
BS = 32


def _zero_q8(rows, cols, state_format):
    """Fresh ``int8`` / ``uint8`` momentum (codes, absmax) of a ``rows x cols`` matrix, as QMuon creates it."""
    st = qstate.init_momentum_state(state_format, rows, cols, block_size=BS, device=torch.device("cpu"))
    return st["momentum_codes"], st["momentum_absmax"]


def _reference_requested() -> bool:
    return os.environ.get("QMUON_BACKEND", "").strip().lower() == "reference"


def _compiled_expected() -> bool:
    """Whether this run must serve the ops from the compiled kernels: yes unless QMUON_BACKEND=reference
    (so a build that silently failed under ``auto`` fails here instead of testing the reference twice)."""
    if _reference_requested():
        return False
    st = _extension.status()
    assert st.cpu, (f"the compiled kernels did not load ({st.reason}); "
                    "run with QMUON_BACKEND=reference to test the reference alone")
    return True


def test_backend_is_known():
    assert ops.backend() in ("reference", "cpu-extension", "cpu+cuda-extension")
    assert (ops.backend() == "reference") == (not _compiled_expected())


@pytest.mark.parametrize("nesterov", [False, True])
def test_q8_momentum_update_contract(nesterov):
    beta = 0.9
    codes, absmax = zip(*(_zero_q8(24, 64, "int8"), _zero_q8(10, 40, "uint8")))  # 40 = 32 + 8
    codes, absmax = list(codes), list(absmax)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(c.shape, generator=gen) for c in codes]
        m_old = [torch.ops.qmuon.dequantize_rows(c, a, BS) for c, a in zip(codes, absmax)]
        g_in = [g.clone() for g in grads]
        torch.ops.qmuon.q8_momentum_update_multi_(codes, absmax, grads, ops.empty_block_sumsq(codes, BS), beta,
                                                  nesterov, BS, [-1, -1], [0, 0])
        for c, a, g, gi, mo in zip(codes, absmax, grads, g_in, m_old):
            # the momentum convention of torch.optim.Muon, in float64
            g64, mo64 = gi.double(), mo.double()
            m_new = mo64 + (1 - beta) * (g64 - mo64)
            expected = g64 + beta * (m_new - g64) if nesterov else m_new
            # the grad holds the fp32 NS input (computed before requantization). fp32 slack: two
            # chained lerps of <= 3 roundings each, on values <= |g| + |m|: 8 u (|g| + |m|).
            tol = 8 * U * (g64.abs() + mo64.abs())
            assert bool(((g.double() - expected).abs() <= tol).all())
            # the stored momentum is m_new to within half a quantization step (+ fp32 slack, as
            # in test_quantize_roundtrip_error_is_half_a_step, + the NS-input slack above)
            amax = expand_blocks(a, BS, c.shape[1]).double()
            err = (torch.ops.qmuon.dequantize_rows(c, a, BS).double() - m_new).abs()
            assert bool((err <= amax / QMAX / 2 + 6 * U * amax + tol).all())
    assert codes[1].dtype == torch.uint8 and int(codes[1].min()) >= 1


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_dispatched_kernels_match_reference(rounding):
    """torch.ops.qmuon.* (compiled kernels when built, else the reference) against the readable
    reference in ops.reference: identical codes, scales and NS input; block sums equal up to fp32
    summation order. The results cannot tell a compiled run from a fallback to the reference, so the
    guarded kernels' ``served`` counts must say that the compiled kernel ran every call."""
    compiled = _compiled_expected()
    before = _kernels.served.copy()
    gen = torch.Generator().manual_seed(11)
    shapes = [(24, 64), (10, 40), (3, 5)]
    streams = [ref.noise_stream(3, 7, k) if rounding == "stochastic" else -1 for k in range(len(shapes))]
    for dtype in (torch.int8, torch.uint8):
        # non-trivial previous momentum
        codes, absmax = map(list, zip(*(ref.quantize_rows(torch.randn(s, generator=gen), BS,
                                                          signed=dtype == torch.int8) for s in shapes)))
        grads = [torch.randn(s, generator=gen) for s in shapes]
        r_codes = [c.clone() for c in codes]
        r_absmax = [a.clone() for a in absmax]
        r_grads = [g.clone() for g in grads]
        sums = ops.empty_block_sumsq(grads, BS)
        assert torch.ops.qmuon.q8_momentum_update_multi_(
            codes, absmax, grads, sums, 0.95, True, BS, streams, [0, 4, 0]) is None
        for i in range(len(shapes)):
            r_sums = ref.q8_momentum_update_(r_codes[i], r_absmax[i], r_grads[i], beta=0.95, nesterov=True,
                                             block_size=BS, stream=None if streams[i] < 0 else streams[i],
                                             row_offset=[0, 4, 0][i])
            assert torch.equal(codes[i], r_codes[i])
            assert torch.equal(absmax[i], r_absmax[i])
            assert torch.equal(grads[i], r_grads[i])
            # sums of <= 32 non-negative terms: relative difference <= 2 * 32 u between orders
            assert torch.allclose(sums[i], r_sums, rtol=64 * U, atol=0)
    x = torch.randn(7, 70, generator=gen)
    c1, a1 = torch.ops.qmuon.quantize_rows(x, BS, True, streams[0], 2)
    noise = None if streams[0] < 0 else ref.uniform_noise(7, 70, streams[0], 2, x.device)
    c2, a2 = ref.quantize_rows(x, BS, signed=True, noise=noise)
    assert torch.equal(c1, c2) and torch.equal(a1, a2)
    assert torch.equal(torch.ops.qmuon.dequantize_rows(c1, a1, BS), ref.dequantize_rows(c2, a2, BS))
    served = _kernels.served - before
    if compiled:
        assert served == {("q8_momentum_update_multi_", "compiled"): 2, ("quantize_rows", "compiled"): 1,
                          ("dequantize_rows", "compiled"): 1}, served
    else:  # nothing compiled is registered: the ops' default (the reference) ran
        assert not served and ops.backend() == "reference"


# --------------------------------------------------------------------------- opcheck
# Every opcheck util runs, test_aot_dispatch_dynamic included: the multi-tensor updates write their
# block sums into the caller's block_sumsq list and return None, so torch auto-functionalizes them.
# These run whichever kernel is registered for CPU (compiled, or the reference under
# QMUON_BACKEND=reference; test_opcheck_under_reference_backend runs them in a subprocess with it).


def test_opcheck_q8_momentum_update_multi():
    gen = torch.Generator().manual_seed(4)
    codes = [torch.zeros(4, 40, dtype=torch.int8), torch.full((3, 64), 128, dtype=torch.uint8)]
    absmax = [torch.zeros(4, 2), torch.zeros(3, 2)]
    grads = [torch.randn(4, 40, generator=gen), torch.randn(3, 64, generator=gen)]
    # one nearest (-1) and one stochastic stream, one shard row offset
    args = (codes, absmax, grads, ops.empty_block_sumsq(codes, BS), 0.9, True, BS, [-1, 12345], [0, 6])
    opcheck(torch.ops.qmuon.q8_momentum_update_multi_.default, args)


def test_opcheck_dense_momentum_update_multi():
    gen = torch.Generator().manual_seed(5)
    bufs = [torch.randn(4, 40, generator=gen), torch.randn(3, 64, generator=gen).bfloat16()]
    grads = [torch.randn(4, 40, generator=gen), torch.randn(3, 64, generator=gen)]
    args = (bufs, grads, ops.empty_block_sumsq(bufs, BS), 0.95, False, BS, [-1, 777], [0, 0])
    opcheck(torch.ops.qmuon.dense_momentum_update_multi_.default, args)


def test_opcheck_sharded_e0m3_and_grid_ops():
    # The row-shard ops (tests/test_kernels_sharded.py compares their kernels with the reference).
    gen = torch.Generator().manual_seed(10)
    states = [ref4.e0m3_quantize(torch.randn(r, c, generator=gen)) for r, c in ((4, 40), (3, 17))]
    packed, scales, tscales = (list(x) for x in zip(*states))
    grads = [torch.randn(4, 40, generator=gen), torch.randn(3, 17, generator=gen).bfloat16()]
    opcheck(torch.ops.qmuon.e0m3_momentum_amax_multi.default, (packed, scales, tscales, grads, 0.9))
    new_scales = [torch.tensor(0.002), torch.tensor(0.01)]
    opcheck(torch.ops.qmuon.e0m3_momentum_update_with_scale_multi_.default,
            (packed, scales, tscales, new_scales, grads, ops.empty_block_sumsq(grads, 16), 0.9, True, 16, [-1, 7],
             [0, 3]))
    x = torch.randn(20, 33, generator=gen)
    opcheck(torch.ops.qmuon.grid_quantize4_with_scale.default, (x, 8, torch.tensor(0.01), 5, 16))


def test_backend_follows_qmuon_backend_env():
    if _reference_requested():
        assert ops.backend() == "reference"
        assert not hasattr(torch.ops.qmuon_C, "q8_momentum_update_multi_")
    else:
        assert ops.backend() != "reference", _extension.status().reason


@pytest.mark.skipif(os.environ.get("QMUON_BACKEND", "").strip().lower() == "reference",
                    reason="this run already uses QMUON_BACKEND=reference")
def test_opcheck_under_reference_backend():
    """The opchecks of this module again, in a process with QMUON_BACKEND=reference (nothing
    compiled is registered there, so the pure-PyTorch default of every op is what is checked)."""
    env = dict(os.environ, QMUON_BACKEND="reference")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
           "-k", "(opcheck or backend_follows or torch_compile) and not under_reference_backend"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(__file__).parent, timeout=600)
    tail = (res.stdout + res.stderr)[-4000:]
    assert res.returncode == 0, tail
    assert " passed" in res.stdout and "skipped" not in res.stdout and "deselected" in res.stdout, tail


# Inductor: ~35 s for a cold compile cache on the 2-core CI box, ~6 s warm (within budget, so the
# real backend is used rather than "aot_eager").
def test_torch_compile_q8_update_matches_eager():
    def step(codes, absmax, grads, beta):
        sums = ops.empty_block_sumsq(codes, BS)
        torch.ops.qmuon.q8_momentum_update_multi_(codes, absmax, grads, sums, beta, True, BS, [-1, 5], [0, 3])
        total = torch.stack([s.sum() for s in sums]).sum()
        return [g * total.rsqrt() for g in grads], sums

    def make():
        gen = torch.Generator().manual_seed(9)
        codes, absmax = [], []
        for (r, c), signed in (((6, 70), True), ((4, 33), False)):
            cc, aa = ref.quantize_rows(torch.randn(r, c, generator=gen), BS, signed=signed)
            codes.append(cc)
            absmax.append(aa)
        grads = [torch.randn(6, 70, generator=gen), torch.randn(4, 33, generator=gen).bfloat16()]
        return codes, absmax, grads

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(step, fullgraph=False)
    eager_state, compiled_state = make(), make()
    for beta in (0.9, 0.95):  # two steps: the second reuses the compiled graph
        out_e, sums_e = step(*eager_state, beta)
        out_c, sums_c = compiled(*compiled_state, beta)
        # the op's in-place results (codes, absmax, NS input in grads) and its sums: bit for bit
        for name, a, b in zip(("codes", "absmax", "grads"), eager_state, compiled_state):
            for x, y in zip(a, b):
                assert torch.equal(x, y), name
        for x, y in zip(sums_e, sums_c):
            assert torch.equal(x, y)
        for x, y in zip(out_e, out_c):  # inductor may fuse the scaling differently
            torch.testing.assert_close(x, y, rtol=2**-7, atol=0)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    torch._dynamo.reset()


@pytest.mark.parametrize("signed,stream", [(True, -1), (False, 99)])
@pytest.mark.parametrize("cols", [64, 40])
def test_opcheck_quantize_rows(signed, stream, cols):
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(6))
    opcheck(torch.ops.qmuon.quantize_rows.default, (x, BS, signed, stream, 2))


@pytest.mark.parametrize("cols", [64, 40])  # 40: the last block of each row is partial
def test_opcheck_dequantize_rows(cols):
    # Runs whichever kernel is registered for CPU (compiled or reference).
    gen = torch.Generator().manual_seed(7)
    codes = torch.randint(-127, 128, (5, cols), dtype=torch.int8, generator=gen)
    absmax = torch.rand(5, 2, generator=gen)
    opcheck(torch.ops.qmuon.dequantize_rows.default, (codes, absmax, BS))


@pytest.mark.parametrize("cols", [64, 40])
def test_reference_kernels_have_the_strides_of_their_fake_impls(cols):
    """The reference is the default kernel of every torch.ops.qmuon op (it runs wherever no
    compiled kernel is registered: QMUON_BACKEND=reference, a failed build, other devices). Under
    torch.compile the fake implementation's strides are trusted, so the real outputs must match:
    the fakes promise contiguous tensors."""
    gen = torch.Generator().manual_seed(8)
    codes = torch.randint(-127, 128, (5, cols), dtype=torch.int8, generator=gen)
    absmax = torch.rand(5, 2, generator=gen)
    out = ref.dequantize_rows(codes, absmax, BS)
    assert out.shape == (5, cols)
    assert out.is_contiguous(), f"reference dequantize_rows returns strides {out.stride()}, fake promises {(cols, 1)}"
    c, a = ref.quantize_rows(torch.randn(5, cols, generator=gen), BS)
    assert c.is_contiguous() and a.is_contiguous()
    sums = ref.block_sumsq(torch.randn(5, cols, generator=gen), BS)
    assert sums.is_contiguous()
