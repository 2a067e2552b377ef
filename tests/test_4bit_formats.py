"""4-bit momentum formats: int4 (naive blockwise absmax), e0m3 (E0M3 + UE4M3 two-level scales) and
grasp4 (GRASP: 8-bit rank-k factors + grid-quantized 4-bit residual). Codecs against float64
references with stated error bounds, the UE4M3 subnormal-floor collapse, GRASP's subspace tracking,
custom-op checks, and the fidelity metric."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.library import opcheck

from qmuon import QMuon
from qmuon.ops import reference_4bit as ref4
from qmuon.optim.fidelity import per_layer_update_cosine
from qmuon.quant import fidelity
from qmuon.quant.formats import grasp4 as qgrasp
from qmuon.quant import state as qstate

FP32_U = 2.0**-24


def _momentum_like(rows, cols, seed, lo=1e-6, hi=1e-3):
    """Values with magnitudes spread log-uniformly over [lo, hi] (Muon momentum's typical range),
    random signs, and whole rows at different scales."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(rows, cols).uniform_(math.log(lo), math.log(hi), generator=g))
    row = torch.exp(torch.empty(rows, 1).uniform_(math.log(0.1), 0.0, generator=g))
    sign = torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    return (mag * row * sign).float()


# --------------------------------------------------------------------------- nibble packing
def test_pack_unpack_every_code_and_layout():
    codes = torch.arange(-7, 8, dtype=torch.int8).repeat(3, 1)  # 15 columns: odd
    packed = torch.ops.qmuon.pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 8)
    assert torch.equal(torch.ops.qmuon.unpack_int4(packed, 15), codes)
    # column 0 (-7 -> 0b1111) low nibble, column 1 (-6 -> 0b1110) high nibble; odd tail padded with 0
    assert packed[0, 0].item() == 0xEF
    assert packed[0, 7].item() == 0x07
    c = torch.tensor([[3, -3]], dtype=torch.int8)
    assert torch.ops.qmuon.pack_int4(c).item() == (0b1011 << 4) | 0b0011


def test_pack_empty_and_noncontiguous():
    assert torch.ops.qmuon.pack_int4(torch.zeros(0, 6, dtype=torch.int8)).shape == (0, 3)
    c = torch.randint(-7, 8, (10, 8), dtype=torch.int8).T  # non-contiguous
    assert torch.equal(torch.ops.qmuon.unpack_int4(torch.ops.qmuon.pack_int4(c), 10), c)


# --------------------------------------------------------------------------- int4
@pytest.mark.parametrize("block_size", [32, 128])
def test_int4_roundtrip_error_is_half_a_step(block_size):
    x = torch.randn(7, 200, generator=torch.Generator().manual_seed(0)) * 1e-3
    x[2, 5] = 0.5  # an outlier inflates one block's step only
    packed, absmax = torch.ops.qmuon.int4_quantize(x, block_size, -1, 0)
    assert packed.shape == (7, 100) and absmax.shape == (7, math.ceil(200 / block_size))
    xh = torch.ops.qmuon.int4_dequantize(packed, absmax, block_size, 200).double()
    amax = absmax.double().repeat_interleave(block_size, dim=1)[:, :200]
    err = (xh - x.double()).abs()
    assert bool((err <= amax / 7 / 2 + 8 * FP32_U * amax).all())
    codes = torch.ops.qmuon.unpack_int4(packed, 200)
    assert int(codes.abs().max()) == 7


def test_int4_stochastic_rounding_is_unbiased_and_bounded():
    x = torch.full((64, 128), 0.3)
    x[:, 0] = 1.0  # absmax 1: x * 7 = 2.1 sits between codes 2 and 3
    outs = []
    for s in range(40):
        p, a = torch.ops.qmuon.int4_quantize(x, 128, 1000 + s, 0)
        outs.append(torch.ops.qmuon.int4_dequantize(p, a, 128, 128))
        assert bool(((outs[-1] - x).abs() <= 1 / 7 + 1e-6).all())
    mean = torch.stack(outs)[:, :, 1:].mean()
    assert abs(mean.item() - 0.3) < 2e-3
    # reproducible: same stream -> same codes
    assert torch.equal(torch.ops.qmuon.int4_quantize(x, 128, 1000, 0)[0], torch.ops.qmuon.int4_quantize(x, 128, 1000, 0)[0])


# --------------------------------------------------------------------------- UE4M3
def test_ue4m3_representable_values_roundtrip_exactly():
    bits = torch.arange(0, 127, dtype=torch.uint8)  # 0x7F is NaN, never written
    vals = ref4.ue4m3_decode(bits)
    assert vals[1].item() == 2.0**-9 and vals[8].item() == 2.0**-6 and vals[126].item() == 448.0
    assert bool((vals[1:] > vals[:-1]).all())  # bit order is value order
    for round_up in (False, True):
        assert torch.equal(torch.ops.qmuon.ue4m3_encode(vals, round_up), bits)
    assert torch.equal(torch.ops.qmuon.ue4m3_decode(bits), vals)


def test_ue4m3_rounding_is_monotonic_nearest_and_round_up_bounds():
    x = torch.exp(torch.linspace(math.log(1e-4), math.log(500.0), 20001))
    near = ref4.ue4m3_encode(x)
    up = ref4.ue4m3_encode(x, round_up=True)
    assert bool((near[1:] >= near[:-1]).all()) and bool((up[1:] >= up[:-1]).all())
    grid = ref4.ue4m3_decode(torch.arange(0, 127, dtype=torch.uint8)).double()
    xd = x.double().clamp(max=448.0)
    # nearest: no representable value is closer
    dn = (ref4.ue4m3_decode(near).double() - xd).abs()
    best = (grid[None, :] - xd[:, None]).abs().amin(dim=1)
    assert torch.equal(dn, best)
    # round up: the decoded value is >= x and the next lower code is < x
    du = ref4.ue4m3_decode(up).double()
    assert bool((du >= xd).all())
    lower = ref4.ue4m3_decode((up.int() - 1).clamp(min=0).to(torch.uint8)).double()
    assert bool(((lower < xd) | (up == 0)).all())
    assert ref4.ue4m3_encode(torch.tensor([1e6])).item() == 126  # saturates at 448


# --------------------------------------------------------------------------- e0m3
def test_e0m3_roundtrip_error_is_half_a_step_of_the_decoded_scale():
    x = _momentum_like(9, 70, seed=1)  # 70 columns: a partial 16-block per row
    packed, scales, t = torch.ops.qmuon.e0m3_quantize(x, True, -1, 0)
    assert packed.shape == (9, 35) and scales.shape == (9, 5) and scales.dtype == torch.uint8 and t.shape == ()
    xh = torch.ops.qmuon.e0m3_dequantize(packed, scales, t, 70).double()
    step = (ref4.ue4m3_decode(scales).double() * t.double()).repeat_interleave(16, dim=1)[:, :70]
    err = (xh - x.double()).abs()
    assert bool((err <= step / 2 + 4 * FP32_U * step * 7).all())
    # the largest block scale lands at the top of UE4M3's range
    assert ref4.ue4m3_decode(scales).max().item() == 448.0


def test_e0m3_single_level_collapses_at_the_subnormal_floor_two_level_does_not():
    """Momentum values 1e-6..1e-3 give block scales amax / 7 below UE4M3's smallest subnormal
    (2**-9): without a tensor scale they collapse; the two-level form keeps them in range."""
    x = _momentum_like(32, 256, seed=2)
    # single level (tensor scale 1)
    p1, s1, t1 = torch.ops.qmuon.e0m3_quantize(x, False, -1, 0)
    assert t1.item() == 1.0
    dec1 = ref4.ue4m3_decode(s1)
    assert bool((dec1 <= ref4.UE4M3_MIN_SUBNORMAL).all())  # every block scale is at the floor (or 0)
    x1 = torch.ops.qmuon.e0m3_dequantize(p1, s1, t1, 256)
    assert fidelity.cosine(x1, x) < 0.5
    assert fidelity.momentum_relative_error(x1, x) > 0.9
    # nearest-rounded single-level scales fall to exactly zero
    assert int((ref4.ue4m3_encode(x.abs().amax() / 7) == 0).item()) == 1
    # two level
    p2, s2, t2 = torch.ops.qmuon.e0m3_quantize(x, True, -1, 0)
    dec2 = ref4.ue4m3_decode(s2)
    assert bool((dec2 >= ref4.UE4M3_MIN_NORMAL).all())  # no block scale is subnormal
    x2 = torch.ops.qmuon.e0m3_dequantize(p2, s2, t2, 256)
    assert fidelity.cosine(x2, x) > 0.99
    assert fidelity.momentum_relative_error(x2, x) < 0.15


def test_e0m3_zero_and_nonfinite_tensor_scale():
    z = torch.zeros(3, 32)
    p, s, t = torch.ops.qmuon.e0m3_quantize(z, True, -1, 0)
    assert t.item() == 1.0 and int(p.sum()) == 0 and int(s.sum()) == 0
    assert torch.equal(torch.ops.qmuon.e0m3_dequantize(p, s, t, 32), z)


# --------------------------------------------------------------------------- grid quantization
def test_grid_quantization_error_bound_and_outliers():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 90, generator=g) * 1e-4
    x[5, :] *= 50.0  # outlier row
    x[:, 7] *= 50.0  # outlier column
    s = 32
    packed, rmax, cmax, t = torch.ops.qmuon.grid_quantize4(x, s, -1, 0)
    assert rmax.shape == (70, 3) and cmax.shape == (3, 90) and rmax.dtype == cmax.dtype == torch.uint8
    xh = torch.ops.qmuon.grid_dequantize4(packed, rmax, cmax, t, s, 90).double()
    r = (ref4.ue4m3_decode(rmax).double() * t.double()).repeat_interleave(s, 1)[:, :90]
    c = (ref4.ue4m3_decode(cmax).double() * t.double()).repeat_interleave(s, 0)[:70, :]
    den = torch.minimum(r, c)
    err = (xh - x.double()).abs()
    assert bool((err <= den / 7 / 2 + 8 * FP32_U * den).all())
    # the decoded maxima are >= the true ones (rounded up), and at most one UE4M3 step (12.5 %) above
    true_r = x.abs().double().reshape(70, 1, 90)
    assert bool((den + 1e-30 >= x.abs().double()).all())
    # entries away from the outlier row/column keep a small step: compare with per-tile absmax
    ok = torch.ones(70, 90, dtype=torch.bool)
    ok[5, :] = False
    ok[:, 7] = False
    tile_amax = x.abs().double().reshape(70, 1, 90).amax()  # a single outlier bounds plain absmax steps
    assert err[ok].max() < tile_amax / 7 / 2 / 10
    del true_r


# --------------------------------------------------------------------------- GRASP factor tracking
def _principal_cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    qa, _ = torch.linalg.qr(a.double())
    qb, _ = torch.linalg.qr(b.double())
    return torch.linalg.svdvals(qa.T @ qb)  # cosines of the principal angles


def test_power_iteration_finds_the_dominant_subspace():
    g = torch.Generator().manual_seed(5)
    rows, cols, k = 96, 64, 4
    u, _ = torch.linalg.qr(torch.randn(rows, rows, generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, cols, generator=g))
    sv = torch.cat([torch.tensor([10.0, 9.0, 8.0, 7.0]), 0.5 * torch.rand(cols - k, generator=g)])
    m = (u[:, :cols] * sv) @ v.T
    q = torch.randn(cols, k, generator=g)
    for _ in range(4):
        p, q = qgrasp.power_iteration(m, q)
    cos = _principal_cosines(p, u[:, :k])
    assert cos.min().item() > 0.999  # largest principal angle < 2.6 degrees
    assert torch.allclose(p.T @ p, torch.eye(k), atol=1e-5)


def test_grasp_state_tracks_the_momentum_subspace_across_steps():
    """Warm-started power iteration inside the optimizer: after a few steps on gradients with a
    fixed dominant subspace, the stored P spans the momentum's top-k left singular subspace."""
    g = torch.Generator().manual_seed(6)
    rows, cols, k = 80, 48, 4
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=g))
    w = nn.Parameter(torch.zeros(rows, cols))
    opt = QMuon([w], state_format="grasp4", lr=0.0, state={"rank": k, "grid_block": 16})
    for _ in range(6):
        coef = torch.tensor([8.0, 6.0, 4.0, 3.0]) * (1 + 0.1 * torch.randn(k, generator=g))
        w.grad = (u * coef) @ v.T + 0.05 * torch.randn(rows, cols, generator=g)
        opt.step()
    p, r = qgrasp.grasp_factors(opt.state[w])
    assert _principal_cosines(p, u).min().item() > 0.99
    m = qstate.dequantize_momentum(opt.state[w], opts=qstate.format_options(opt.param_groups[0]))
    top = torch.linalg.svd(m.double())[0][:, :k]
    assert _principal_cosines(p, top).min().item() > 0.99
    # the factors carry the top subspace: P R^T alone is close to the momentum
    assert fidelity.momentum_relative_error(p @ r.T, m) < 0.2  # the rest is (averaged) noise


def test_grasp_first_step_init_is_seeded_and_reproducible():
    torch.manual_seed(0)
    a, b = nn.Parameter(torch.randn(40, 24)), nn.Parameter(torch.randn(40, 24))
    b.data.copy_(a.data)
    oa, ob = (QMuon([a], state_format="grasp4", state={"seed": 3, "grid_block": 16}),
              QMuon([b], state_format="grasp4", state={"seed": 3, "grid_block": 16}))
    grad = torch.randn(40, 24)
    for p, o in ((a, oa), (b, ob)):
        p.grad = grad.clone()
        torch.manual_seed(123 if p is a else 456)  # global RNG must not matter
        o.step()
    for key, v in oa.state[a].items():
        assert torch.equal(v, ob.state[b][key]), key


@pytest.mark.parametrize("shape", [(768, 768), (2304, 768), (3072, 768), (768, 3072)])
def test_bytes_per_param_on_gpt_small_shapes(shape):
    rows, cols = shape
    n = rows * cols
    assert qstate.momentum_nbytes("grasp4", rows, cols) / n <= 0.58
    assert qstate.momentum_nbytes("int4", rows, cols) / n == 0.5 + 4 / 128
    assert qstate.momentum_nbytes("e0m3", rows, cols) / n == pytest.approx(0.5 + 1 / 16, abs=1e-5)
    # what an optimizer really allocates (every tensor, step included) matches
    w = nn.Parameter(torch.zeros(shape))
    opt = QMuon([w], state_format="grasp4")
    w.grad = torch.randn(shape) * 1e-3
    opt.step()
    assert (opt.state_nbytes() - 4) / n <= 0.58


# --------------------------------------------------------------------------- optimizer behaviour
@pytest.mark.parametrize("fmt", ["int4", "e0m3", "grasp4"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_new_formats_train_and_ns_input_matches_fp32_momentum_formula(fmt, rounding):
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(24, 40))
    opt = QMuon([w], state_format=fmt, state={"rounding": rounding, "block_size": 32, "grid_block": 16}, lr=0.01)
    grads = fidelity.synthetic_gradients(24, 40, 3, seed=1)
    for gr in grads:
        m_old = qstate.dequantize_momentum(opt.state[w], opts=qstate.format_options(opt.param_groups[0]), cols=40) \
            if opt.state[w] else torch.zeros(24, 40)
        w.grad = gr.clone()
        opt.step()
        m_new = torch.lerp(m_old, gr, 0.05)
        ns_in = torch.lerp(gr, m_new, 0.95)
        assert torch.allclose(w.grad, ns_in, rtol=1e-5, atol=1e-9)
    assert opt.param_groups[0]["block_size"] == 32
    assert opt.state[w]["step"].item() == 3.0


def test_default_block_size_per_format():
    for fmt, bs in (("int8", 256), ("int4", 128), ("e0m3", 256), ("grasp4", 256)):
        assert QMuon([nn.Parameter(torch.zeros(4, 8))], state_format=fmt).param_groups[0]["block_size"] == bs
    g = QMuon([nn.Parameter(torch.zeros(4, 8))], state_format="grasp4").param_groups[0]
    assert (g["state_format"], g["rank"], g["grid_block"]) == ("grasp4", 4, 32)


@pytest.mark.parametrize("kwargs,pattern", [
    ({"state_format": "grasp4", "state": {"rank": 0}}, r"rank must be a positive int, got 0"),
    ({"state_format": "grasp4", "state": {"grid_block": 1}}, r"grid_block must be an int in \[2, 4096\], got 1"),
])
def test_bad_grasp_options(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        QMuon([nn.Parameter(torch.zeros(4, 8))], **kwargs)


# --------------------------------------------------------------------------- custom ops
def test_opcheck_4bit_elementwise_ops():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 37, generator=gen) * 1e-3
    codes = torch.randint(-7, 8, (6, 37), dtype=torch.int8, generator=gen)
    opcheck(torch.ops.qmuon.pack_int4.default, (codes,))
    opcheck(torch.ops.qmuon.unpack_int4.default, (torch.ops.qmuon.pack_int4(codes), 37))
    opcheck(torch.ops.qmuon.ue4m3_encode.default, (x.abs() * 1e5, True))
    opcheck(torch.ops.qmuon.ue4m3_decode.default, (torch.arange(0, 127, dtype=torch.uint8),))
    opcheck(torch.ops.qmuon.int4_quantize.default, (x, 32, 77, 3))
    p, a = torch.ops.qmuon.int4_quantize(x, 32, -1, 0)
    opcheck(torch.ops.qmuon.int4_dequantize.default, (p, a, 32, 37))
    opcheck(torch.ops.qmuon.e0m3_quantize.default, (x, True, -1, 0))
    p, s, t = torch.ops.qmuon.e0m3_quantize(x, True, -1, 0)
    opcheck(torch.ops.qmuon.e0m3_dequantize.default, (p, s, t, 37))
    opcheck(torch.ops.qmuon.grid_quantize4.default, (x, 16, 5, 0))
    q = torch.ops.qmuon.grid_quantize4(x, 16, -1, 0)
    opcheck(torch.ops.qmuon.grid_dequantize4.default, (*q, 16, 37))


def test_opcheck_4bit_momentum_updates():
    from qmuon import ops

    gen = torch.Generator().manual_seed(10)
    grads = [torch.randn(4, 40, generator=gen), torch.randn(3, 64, generator=gen)]
    packed = [torch.zeros(4, 20, dtype=torch.uint8), torch.zeros(3, 32, dtype=torch.uint8)]
    absmax = [torch.zeros(4, 2), torch.zeros(3, 2)]
    args = (packed, absmax, grads, ops.empty_block_sumsq(grads, 32), 0.9, True, 32, [-1, 4242], [0, 6])
    opcheck(torch.ops.qmuon.int4_momentum_update_multi_.default, args)
    scales = [torch.zeros(4, 3, dtype=torch.uint8), torch.zeros(3, 4, dtype=torch.uint8)]
    tscale = [torch.ones(()), torch.ones(())]
    grads = [g.clone() for g in grads]
    args = (packed, scales, tscale, grads, ops.empty_block_sumsq(grads, 32), 0.95, False, 32, [-1, 99], [0, 0])
    opcheck(torch.ops.qmuon.e0m3_momentum_update_multi_.default, args)


# --------------------------------------------------------------------------- fidelity
def test_update_cosine_is_one_for_the_reference_and_high_for_int8():
    shapes = [(32, 48), (48, 32)]
    grads = [list(t) for t in zip(*[fidelity.synthetic_gradients(r, c, 4, seed=i) for i, (r, c) in enumerate(shapes)])]
    res = per_layer_update_cosine(shapes, grads, ("fp32", "int8"), state={"block_size": 32})
    assert set(res) == {"fp32", "int8"} and all(len(v) == 2 for v in res.values())
    assert all(c == pytest.approx(1.0, abs=1e-12) for c in res["fp32"])
    assert all(c > 0.97 for c in res["int8"])
    last = per_layer_update_cosine(shapes, grads, ("int8",), reduce="last", state={"block_size": 32})
    assert len(last["int8"]) == 2
    with pytest.raises(ValueError, match="reduce must be"):
        per_layer_update_cosine(shapes, grads, ("int8",), reduce="max")


def test_grasp4_update_cosine_beats_int4_on_realistic_gradients():
    """The measured comparison behind GRASP: low-rank + noise gradients with outlier rows and
    columns; GRASP (defaults) beats naive int4 (default block 128) by a wide margin."""
    shapes = [(128, 128), (256, 128)]
    grads = [list(t) for t in zip(*[fidelity.synthetic_gradients(r, c, 10, seed=10 + i)
                                    for i, (r, c) in enumerate(shapes)])]
    res = per_layer_update_cosine(shapes, grads, ("int4", "e0m3", "grasp4"), skip=3)
    for i in range(len(shapes)):
        assert res["grasp4"][i] > res["int4"][i] + 0.1, res
        assert res["grasp4"][i] > 0.8, res
    print({k: [round(c, 4) for c in v] for k, v in res.items()})


@pytest.mark.parametrize("shape", [(768, 768), (2304, 768), (33, 17)])
def test_bytes_per_element_formula_matches_the_registry(shape):
    from qmuon.ops.reference import bytes_per_element

    rows, cols = shape
    for fmt in qstate.STATE_FORMATS:
        formula = bytes_per_element(fmt, cols, None, rows=rows)
        assert formula == pytest.approx(qstate.momentum_nbytes(fmt, rows, cols) / (rows * cols), abs=1e-12), fmt


def test_registry_protocol_for_every_format():
    """init -> encode -> validate -> dequantize works through the registry alone for every format."""
    x = _momentum_like(20, 50, seed=4)
    for name in qstate.STATE_FORMATS:  # momentum formats (the ecc8 weight correction is tested with the weights)
        fmt = qstate.FORMATS[name]
        opts = qstate.FormatOptions(block_size=32, rank=3, grid_block=16)
        st = fmt.encode(x, opts)
        fmt.validate(st, 20, 50, opts, name)
        assert fmt.owns(st) and qstate.detect_state_format(st) == name
        assert set(st) == set(fmt.spec.keys)
        zero = fmt.init(20, 50, opts, torch.device("cpu"))
        assert {k: (v.shape, v.dtype) for k, v in zero.items()} == {k: (v.shape, v.dtype) for k, v in st.items()}
        assert fmt.nbytes(20, 50, opts) == sum(v.numel() * v.element_size() for v in st.values())
        err = fidelity.momentum_relative_error(fmt.dequantize(st, opts, 50), x)
        assert err < {"fp32": 1e-12, "bf16": 5e-3, "int8": 0.05, "uint8": 0.05}.get(name, 0.5), (name, err)
        assert torch.equal(fmt.dequantize(zero, opts, 50), torch.zeros(20, 50)), name


@pytest.mark.parametrize("nesterov", [True, False])
def test_grasp4_bf16_gradient_is_widened_per_row_chunk_with_the_same_bits(nesterov):
    """A bf16 gradient goes through grasp4's momentum one fp32 row chunk at a time (no whole fp32
    copies): the momentum, the block sums and the NS input written back into the gradient are the
    bits of the same step on that gradient widened to fp32 first (the NS input then rounded to bf16)."""
    fmt = qstate.get_format("grasp4")
    rows, cols = 300, 512  # 512 columns: 128 rows per chunk of 2^16 elements, a partial last chunk
    opts = qstate.format_options({"state_format": "grasp4"})
    st = fmt.init(rows, cols, opts, torch.device("cpu"))
    nb = math.ceil(cols / opts.block_size)
    fmt.update([st], [_momentum_like(rows, cols, seed=5)], [torch.empty(rows, nb)], beta=0.95, nesterov=nesterov,
               opts=opts, streams=[-1], offsets=[0], keys=[0], seed=0)  # a non-zero momentum state
    g16 = (torch.randn(rows, cols, generator=torch.Generator().manual_seed(6)) * 1e-3).to(torch.bfloat16)
    g32 = g16.float()
    out16, out32 = torch.empty(rows, nb), torch.empty(rows, nb)
    m16 = fmt._momentum(st, g16, out16, 0.95, nesterov, opts)
    m32 = fmt._momentum(st, g32, out32, 0.95, nesterov, opts)
    assert torch.equal(m16, m32)
    assert torch.equal(out16, out32)
    assert torch.equal(g16, g32.to(torch.bfloat16))


def test_grasp4_block_sums_of_a_partial_block_have_the_reference_bits():
    """A row width that is not a multiple of the block size is padded to whole blocks in one reused
    buffer (not a padded copy and its square per row chunk): the block sums are those of
    ``ref.block_sumsq`` on the same NS input, bit for bit."""
    from qmuon.ops import reference as ref

    fmt = qstate.get_format("grasp4")
    rows, cols = 700, 200  # 327 rows per chunk of 2^16 elements: 3 chunks, the last partial
    opts = qstate.format_options({"state_format": "grasp4"})
    assert cols % opts.block_size
    st = fmt.init(rows, cols, opts, torch.device("cpu"))
    nb = math.ceil(cols / opts.block_size)
    fmt.update([st], [_momentum_like(rows, cols, seed=7)], [torch.empty(rows, nb)], beta=0.95, nesterov=True,
               opts=opts, streams=[-1], offsets=[0], keys=[0], seed=0)
    g = torch.randn(rows, cols, generator=torch.Generator().manual_seed(8)) * 1e-3
    out = torch.empty(rows, nb)
    fmt._momentum(st, g, out, 0.95, True, opts)  # g now holds the NS input
    assert torch.equal(out, ref.block_sumsq(g, opts.block_size))
