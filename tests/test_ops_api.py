"""The prototype-named functional API (qmuon.ops) and the torch.ops.qmuon operators."""

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
from qmuon.ops import (
    QuantizedMuonNormSegment as Seg,
    QuantizedMuonState,
    build_quantized_muon_norm_plan,
    quantized_muon_momentum_update_multi_,
    quantized_muon_momentum_update_multi_and_normalize_,
    quantized_muon_momentum_update_multi_and_normalize_groups_,
    reduce_block_sumsq,
)

U = 2.0**-24  # fp32 unit roundoff
BS = 32


def _states_and_grads(seed=0):
    gen = torch.Generator().manual_seed(seed)
    states = [QuantizedMuonState.zeros(24, 64, dtype=torch.int8, block_size=BS),
              QuantizedMuonState.zeros(10, 40, dtype=torch.uint8, block_size=BS)]  # 40 = 32 + 8
    grads = [torch.randn(24, 64, generator=gen), torch.randn(10, 40, generator=gen)]
    return states, grads


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
def test_update_multi_contract(nesterov):
    beta = 0.9
    states, _ = _states_and_grads()
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(s.data.shape, generator=gen) for s in states]
        m_old = [s.dequantize() for s in states]
        g_in = [g.clone() for g in grads]
        quantized_muon_momentum_update_multi_(states, grads, beta=beta, nesterov=nesterov)
        for s, g, gi, mo in zip(states, grads, g_in, m_old):
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
            amax = expand_blocks(s.absmax, BS, s.data.shape[1]).double()
            err = (s.dequantize().double() - m_new).abs()
            assert bool((err <= amax / QMAX / 2 + 6 * U * amax + tol).all())
    assert states[1].data.dtype == torch.uint8 and int(states[1].data.min()) >= 1


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
        states = [QuantizedMuonState.zeros(*s, dtype=dtype, block_size=BS) for s in shapes]
        for s in states:  # non-trivial previous momentum
            c, a = ref.quantize_rows(torch.randn(s.data.shape, generator=gen), BS, signed=dtype == torch.int8)
            s.data.copy_(c)
            s.absmax.copy_(a)
        grads = [torch.randn(s, generator=gen) for s in shapes]
        r_codes = [s.data.clone() for s in states]
        r_absmax = [s.absmax.clone() for s in states]
        r_grads = [g.clone() for g in grads]
        sums = ops.empty_block_sumsq(grads, BS)
        assert torch.ops.qmuon.q8_momentum_update_multi_(
            [s.data for s in states], [s.absmax for s in states], grads, sums, 0.95, True, BS, streams,
            [0, 4, 0]) is None
        for i in range(len(shapes)):
            r_sums = ref.q8_momentum_update_(r_codes[i], r_absmax[i], r_grads[i], beta=0.95, nesterov=True,
                                             block_size=BS, stream=None if streams[i] < 0 else streams[i],
                                             row_offset=[0, 4, 0][i])
            assert torch.equal(states[i].data, r_codes[i])
            assert torch.equal(states[i].absmax, r_absmax[i])
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


def test_update_multi_argument_errors():
    states, grads = _states_and_grads()
    with pytest.raises(ValueError, match="got 2 states but 1 grads"):
        quantized_muon_momentum_update_multi_(states, grads[:1], beta=0.9)
    with pytest.raises(ValueError, match=r"grad 0 has shape \(64, 24\) but its state has \(24, 64\)"):
        quantized_muon_momentum_update_multi_(states, [grads[0].t(), grads[1]], beta=0.9)
    with pytest.raises(ValueError, match="rounding must be 'nearest' or 'stochastic'"):
        quantized_muon_momentum_update_multi_(states, grads, beta=0.9, rounding="up")
    mixed = [states[0], QuantizedMuonState.zeros(10, 40, block_size=64)]
    with pytest.raises(ValueError, match=r"share block_size, got \[32, 64\]"):
        quantized_muon_momentum_update_multi_(mixed, grads, beta=0.9)


def test_update_and_normalize_uses_one_global_norm():
    states, grads = _states_and_grads(2)
    norm = quantized_muon_momentum_update_multi_and_normalize_(states, grads, beta=0.9)
    # reference: the same update without normalization
    ref_states, ref_grads = _states_and_grads(2)
    quantized_muon_momentum_update_multi_(ref_states, ref_grads, beta=0.9)
    n = sum(g.numel() for g in ref_grads)
    direct = torch.sqrt(sum((g.double() ** 2).sum() for g in ref_grads))
    # fp32 sum of n non-negative terms: relative error <= n*u; the sqrt halves it (+1 rounding)
    assert abs(norm.item() / direct.item() - 1) <= (n / 2 + 1) * U
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
    # plus one rounding of 1/norm and one per product
    assert abs(total - 1) <= (n / 2 + 3) * U
    for g, rg in zip(grads, ref_grads):
        assert torch.allclose(g, rg / norm, rtol=3 * U, atol=0)  # (1/norm)*x vs x/norm: <= 2 roundings


def _qkv_plan(states):
    # tensor 0 is a fused (q, k, v) matrix of 3 x 8 rows; tensor 1 one plain matrix
    cols0, cols1 = states[0].data.shape[1], states[1].data.shape[1]
    segs = [Seg(0, 0, 8 * cols0, 0), Seg(0, 8 * cols0, 8 * cols0, 1), Seg(0, 16 * cols0, 8 * cols0, 2),
            Seg(1, 0, 10 * cols1, 3)]
    rows = {0: (0, 0, 8), 1: (0, 8, 16), 2: (0, 16, 24), 3: (1, 0, 10)}
    return build_quantized_muon_norm_plan(states, segs), rows


def test_normalize_groups_sums_and_norms():
    states, grads = _states_and_grads(3)
    plan, rows = _qkv_plan(states)
    assert plan.num_groups == 4 and plan.blocks_per_tensor == (24 * 2, 10 * 2)
    sums = quantized_muon_momentum_update_multi_and_normalize_groups_(states, grads, plan, beta=0.9, normalize=False)
    assert sums.shape == (4,) and sums.dtype == torch.float32
    raw = [g.clone() for g in grads]
    for gid, (t, r0, r1) in rows.items():
        part = raw[t][r0:r1].double()
        direct = (part**2).sum().item()
        # two levels of fp32 summation of non-negative terms (within blocks, then over blocks):
        # relative error <= (number of terms + 1) * u
        assert abs(sums[gid].item() / direct - 1) <= (part.numel() + 1) * U, gid

    states2, grads2 = _states_and_grads(3)
    sums2 = quantized_muon_momentum_update_multi_and_normalize_groups_(states2, grads2, plan, beta=0.9)
    assert torch.equal(sums2, sums)
    for gid, (t, r0, r1) in rows.items():
        part = grads2[t][r0:r1].double()
        # each group divided by its own norm: norm 1 up to the sum error above (halved by the
        # sqrt) plus a few roundings (sqrt, reciprocal, product)
        assert abs(part.norm().item() - 1) <= (part.numel() / 2 + 4) * U, gid
        expected = raw[t][r0:r1] / sums[gid].sqrt()
        assert torch.allclose(grads2[t][r0:r1], expected, rtol=3 * U, atol=0)
    # the momentum itself is not normalized
    for s, s2 in zip(states, states2):
        assert torch.equal(s.data, s2.data) and torch.equal(s.absmax, s2.absmax)


def test_norm_plan_from_plain_shapes():
    plan = build_quantized_muon_norm_plan([(4, 40)], [Seg(0, 0, 80, 0), Seg(0, 80, 80, 1)], block_size=32)
    assert plan.block_group_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    sums = reduce_block_sumsq([torch.arange(8, dtype=torch.float32).reshape(4, 2)], plan)
    assert sums.tolist() == [0 + 1 + 2 + 3, 4 + 5 + 6 + 7]
    with pytest.raises(ValueError, match="pass block_size="):
        build_quantized_muon_norm_plan([(4, 40)], [Seg(0, 0, 160, 0)])
    with pytest.raises(ValueError, match="plan covers 8 blocks but the update produced 6"):
        reduce_block_sumsq([torch.zeros(3, 2)], plan)


@pytest.mark.parametrize(
    "segments,pattern",
    [
        # boundary at element 16 of a 32-element block of row 0
        ([Seg(0, 0, 16, 0), Seg(0, 16, 24 * 64 - 16, 1)], r"splits a 32-element row block of tensor 0 \(shape 24x64\)"),
        # a part that ends in the middle of a row's second block
        ([Seg(0, 0, 8 * 64 + 40, 0), Seg(0, 8 * 64 + 40, 16 * 64 - 40, 1)], "splits a 32-element row block"),
        # rows 8..16 are left out
        ([Seg(0, 0, 8 * 64, 0), Seg(0, 16 * 64, 8 * 64, 1)], r"tensor 0 \(shape 24x64\) has row blocks that no segment covers"),
        ([Seg(0, 0, 24 * 64, 0), Seg(0, 0, 64, 1)], "overlaps another segment of tensor 0"),
        ([Seg(0, 0, 24 * 64 + 32, 0)], "past tensor 0's 1536 elements"),
        ([Seg(1, 0, 64, 0)], "names tensor 1, but there are 1 tensors"),
        ([Seg(0, 0, 0, 0)], "needs start >= 0, length > 0"),
    ],
)
def test_norm_plan_errors(segments, pattern):
    st = QuantizedMuonState.zeros(24, 64, block_size=BS)
    with pytest.raises(ValueError, match=pattern):
        build_quantized_muon_norm_plan([st], segments)


def test_norm_plan_group_id_must_be_below_num_groups():
    st = QuantizedMuonState.zeros(2, 64, block_size=BS)
    with pytest.raises(ValueError, match="group id 3 >= num_groups=2"):
        build_quantized_muon_norm_plan([st], [Seg(0, 0, 128, 3)], num_groups=2)


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
