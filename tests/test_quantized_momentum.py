"""8-bit momentum: round trip of the quantizer, error of the quantized momentum against an fp32
shadow over a long run, and stochastic rounding (unbiased and reproducible)."""

from __future__ import annotations

import pytest
import torch

from _helpers import QMAX, blocked_absmax, expand_blocks, momentum_fp32, realistic_grads
from qmuon import QMuon
from qmuon.ops import reference as ref
from qmuon.quant import state as qstate

FP32_U = 2.0**-24  # fp32 unit roundoff


# --------------------------------------------------------------------------- round trip
def _test_matrix(rows, cols, gen):
    # per-row magnitudes spanning 6 decades, so blocks have very different scales
    mag = 10.0 ** torch.empty(rows, 1).uniform_(-4, 2, generator=gen)
    return (torch.randn(rows, cols, generator=gen) * mag).float()


@pytest.mark.parametrize("rows,cols,block_size", [(6, 300, 128), (4, 64, 32), (1, 1, 32), (3, 5, 256), (5, 96, 32)])
def test_quantize_roundtrip_error_is_half_a_step(rows, cols, block_size):
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    x = _test_matrix(rows, cols, gen)
    if rows > 2:
        x[2] = 0.0  # a whole zero row
    if cols > block_size:
        x[0, :block_size] = 0.0  # one zero block inside an otherwise non-zero row
    codes_i8, amax_i8 = torch.ops.qmuon.quantize_rows(x, block_size, True, -1, 0)
    codes_u8, amax_u8 = torch.ops.qmuon.quantize_rows(x, block_size, False, -1, 0)
    nb = (cols + block_size - 1) // block_size
    assert codes_i8.dtype == torch.int8 and codes_u8.dtype == torch.uint8
    assert codes_i8.shape == (rows, cols) and amax_i8.shape == (rows, nb)
    assert amax_i8.dtype == torch.float32
    # the scale is the exact per-block max |x|
    assert torch.equal(amax_i8, blocked_absmax(x, block_size))
    assert torch.equal(amax_u8, amax_i8)
    # symmetric range, and uint8 is int8 with zero point 128
    assert int(codes_i8.min()) >= -127 and int(codes_i8.max()) <= 127
    assert torch.equal(codes_u8.int() - 128, codes_i8.int())

    dq_i8 = torch.ops.qmuon.dequantize_rows(codes_i8, amax_i8, block_size)
    dq_u8 = torch.ops.qmuon.dequantize_rows(codes_u8, amax_u8, block_size)
    assert torch.equal(dq_u8, dq_i8)
    amax_el = expand_blocks(amax_i8.double(), block_size, cols)
    err = (x.double() - dq_i8.double()).abs()
    # Round-to-nearest: at most half a step, absmax/127/2. fp32 slack: quantizing rounds 3 times
    # (1/a, *127, x*inv: code error <= 0.5 + 3u*127) and dequantizing twice (a/127, code*scale),
    # each <= u*absmax back in x units: 5u*absmax, 6u with second-order terms.
    assert bool((err <= amax_el / QMAX / 2 + 6 * FP32_U * amax_el).all()), float((err / amax_el.clamp_min(1e-30)).max())

    # zero blocks stay exactly zero, with code 0 (int8) / 128 (uint8)
    zero = x == 0
    if rows > 2:
        assert bool((amax_i8[2] == 0).all())
    assert bool((dq_i8[zero] == 0).all())
    assert bool((codes_i8[zero] == 0).all()) and bool((codes_u8[zero] == 128).all())
    # the block maximum is represented exactly by the code +-127
    at_max = x.abs() == expand_blocks(amax_i8, block_size, cols)
    at_max &= x != 0
    assert bool((codes_i8[at_max].abs() == 127).all())


def test_quantize_noncontiguous_input_matches_contiguous():
    gen = torch.Generator().manual_seed(5)
    x = _test_matrix(40, 7, gen).t()  # (7, 40) non-contiguous view
    assert not x.is_contiguous()
    a = ref.quantize_rows(x, 32)
    b = ref.quantize_rows(x.contiguous(), 32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_uint8_zero_point_in_fresh_state():
    cpu = torch.device("cpu")
    st = qstate.init_momentum_state("uint8", 3, 70, block_size=32, device=cpu)
    codes, absmax = st["momentum_codes"], st["momentum_absmax"]
    assert codes.dtype == torch.uint8 and bool((codes == 128).all())
    assert absmax.dtype == torch.float32 and absmax.shape == (3, 3) and not bool(absmax.any())
    assert torch.equal(qstate.dequantize_momentum(st, 32), torch.zeros(3, 70))
    st8 = qstate.init_momentum_state("int8", 3, 70, block_size=32, device=cpu)
    assert st8["momentum_codes"].dtype == torch.int8 and bool((st8["momentum_codes"] == 0).all())


# --------------------------------------------------------------------------- long-run error
ROWS, COLS, BLOCK, BETA, STEPS = 32, 640, 256, 0.95, 100  # 640 = 256 + 256 + 128 (partial block)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", ["int8", "uint8"])
def test_8bit_momentum_tracks_fp32_shadow(fmt, rounding):
    torch.manual_seed(0)
    grads = realistic_grads(ROWS, COLS, STEPS, seed=11, scale=1e-3)
    p = torch.nn.Parameter(torch.zeros(ROWS, COLS))
    # lr=0: the weights do not matter here, only the momentum.
    opt = QMuon([p], lr=0.0, weight_decay=0.0, momentum=BETA, state_format=fmt, state={"block_size": BLOCK, "rounding": rounding, "seed": 3})
    shadow = torch.zeros(ROWS, COLS)  # fp32 momentum exactly as torch.optim.Muon keeps it
    # Each step the state is dequantized, updated in fp32 and requantized, so
    #   e_t = beta * e_{t-1} + r_t,  |r_t| <= c * absmax_t / 127
    # with c = 1/2 for round-to-nearest and c = 1 for stochastic rounding (floor(x + u)).
    # Recursive per-block bound B_t = beta B_{t-1} + c absmax_t/127 (+ fp32 slack per step: the
    # quantizer's 5 roundings (see the round-trip test) and the two lerps' (ours and the shadow's)
    # roundings of values ~absmax: 8 * 2^-24 * absmax).
    c = 0.5 if rounding == "nearest" else 1.0
    bound = torch.zeros(ROWS, (COLS + BLOCK - 1) // BLOCK)
    max_step = torch.zeros_like(bound)
    rel_errs = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        shadow.lerp_(g, 1.0 - BETA)
        absmax = opt.state[p]["momentum_absmax"]
        bound = BETA * bound + (c / QMAX + 8 * FP32_U) * absmax
        max_step = torch.maximum(max_step, absmax / QMAX)
        m_q = momentum_fp32(opt, p)
        err = blocked_absmax(m_q - shadow, BLOCK)
        assert bool((err <= bound).all()), float((err / bound).max())
        # The simple form of the same bound: k = c / (1 - beta) steps of the largest scale the
        # block has had (k = 10 for nearest, 20 for stochastic at beta = 0.95).
        # (+ the recursion's fp32 slack summed geometrically: 8u * 127 / (1 - beta) steps).
        k = c / (1.0 - BETA)
        assert bool((err <= (k + 8 * FP32_U * QMAX / (1.0 - BETA)) * max_step).all())
        rel_errs.append(((m_q - shadow).norm() / shadow.norm()).item())
    # Aggregate error: one quantization of a ~Gaussian 256-block has rms error
    # (absmax/127)/sqrt(12) ~ (3 sigma/127)/3.5 ~ 0.7% of the block rms (stochastic: rms
    # sqrt(1/6) instead of sqrt(1/12) of a step, ~1.0%); accumulated with weights beta^k that is
    # x sqrt(1/(1-beta^2)) = 3.2, i.e. ~2.2% (nearest, measured max 2.3%) and ~3.2% (stochastic,
    # measured max 3.2%). Bound 5%; and > 0 so that the test would notice a state that is not
    # quantized at all.
    assert 0.0 < max(rel_errs) < 5e-2, max(rel_errs)


# --------------------------------------------------------------------------- stochastic rounding
def test_stochastic_rounding_is_unbiased_on_a_constant():
    rows, cols, bs, draws = 64, 256, 256, 16
    x = torch.full((rows, cols), 0.3)
    x[:, 0] = 1.0  # absmax 1 in every block: 0.3 sits at 38.1 code steps
    step = 1.0 / QMAX
    codes_n, amax = torch.ops.qmuon.quantize_rows(x, bs, True, -1, 0)
    bias_nearest = (torch.ops.qmuon.dequantize_rows(codes_n, amax, bs)[:, 1:] - 0.3).double().mean().item()
    errs, frac_up = [], []
    for d in range(draws):
        stream = ref.noise_stream(seed=7, step=d + 1, key=0)
        codes_s, amax_s = torch.ops.qmuon.quantize_rows(x, bs, True, stream, 0)
        vals = codes_s[:, 1:]
        assert bool(((vals == 38) | (vals == 39)).all())  # floor or ceil, never further
        frac_up.append((vals == 39).double().mean().item())
        errs.append((torch.ops.qmuon.dequantize_rows(codes_s, amax_s, bs)[:, 1:] - 0.3).double())
    mean_err = torch.cat([e.flatten() for e in errs]).mean().item()
    n = draws * rows * (cols - 1)
    # nearest rounds 38.1 down: bias -0.1 step (0.3*127 = 38.1 exactly up to fp32 error ~1e-5
    # step; 1e-3 is loose)
    assert abs(bias_nearest / step + 0.1) < 1e-3
    # stochastic: per-sample std = sqrt(0.1 * 0.9) = 0.3 step, so the mean over n = 261k samples
    # has std 0.3/sqrt(n) = 6e-4 step; 0.01 step is > 15 sigma and 10x below nearest's bias.
    assert abs(mean_err) / step < 0.01, mean_err / step
    assert n > 200_000
    # P(round up) = 0.1: over all draws within 15 sigma (sigma = sqrt(.09/n) = 6e-4)
    assert abs(sum(frac_up) / draws - 0.1) < 0.01


def _stochastic_codes(seed, steps=3, params=1, grads=None):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.zeros(16, 96)) for _ in range(params)]
    opt = QMuon(ps, lr=0.01, state_format="int8", state={"block_size": 32, "rounding": "stochastic", "seed": seed})
    grads = grads or realistic_grads(16, 96, steps, seed=21)
    for g in grads:
        for p in ps:
            p.grad = g.clone()
        opt.step()
    return [opt.state[p]["momentum_codes"].clone() for p in ps], opt


# "Different codes" threshold: two independent stochastic roundings of a value with fractional
# part f differ with probability 2 f (1 - f), i.e. 1/3 on average over uniform f; requiring more
# than 5% of the codes to differ is far below that and far above 0 (identical noise).
def test_stochastic_rounding_is_reproducible_and_depends_on_seed_step_and_key():
    a, _ = _stochastic_codes(seed=5)
    b, _ = _stochastic_codes(seed=5)
    c, _ = _stochastic_codes(seed=6)
    assert torch.equal(a[0], b[0])  # same seed, step, key -> same codes
    assert (a[0] != c[0]).sum() > 0.05 * a[0].numel()  # a different seed draws different noise

    # two parameters with identical gradients (keys 0 and 1) draw different noise
    (k0, k1), _ = _stochastic_codes(seed=5, params=2)
    assert torch.equal(k0, a[0])
    assert (k0 != k1).sum() > 0.05 * k0.numel()

    # the same update at a different step count draws different noise
    g = realistic_grads(16, 96, 1, seed=22)
    (s1,), _ = _stochastic_codes(seed=5, grads=g)
    p = torch.nn.Parameter(torch.zeros(16, 96))
    opt = QMuon([p], lr=0.01, state_format="int8", state={"block_size": 32, "rounding": "stochastic", "seed": 5})
    p.grad = torch.zeros(16, 96)
    opt.step()  # creates the state (zero momentum stays zero)
    assert bool((opt.state[p]["momentum_codes"] == 0).all())
    opt.state[p]["step"].fill_(41.0)  # the next step is step 42
    p.grad = g[0].clone()
    opt.step()
    s42 = opt.state[p]["momentum_codes"]
    assert (s1 != s42).sum() > 0.05 * s1.numel()
    # ... yet both are valid stochastic roundings of the same value (within one code)
    assert int((s1.int() - s42.int()).abs().max()) <= 1
