"""The quantized AdamW kernel (``torch.ops.qmuon.adamw_q_update_``): compiled CPU / CUDA kernels
against the pure-PyTorch reference (``ops/reference_adamw.py``), bit for bit (both compute every
fp32 operation separately rounded, in the same order: csrc/qmuon/adamw_math.h), and the reference
against a float64 evaluation of the same AdamW step (tolerance: one quantization step of the codes,
since the state is re-encoded; the emitted update uses the unquantized new moments and matches
float64 to fp32 rounding)."""

from __future__ import annotations


import pytest
import torch

from qmuon.ops import _kernels as K
from qmuon.ops import reference_adamw as refa

KINDS = [(refa.M8, refa.V8), (refa.M4, refa.V4), (refa.M8, refa.V4)]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (3, 7), (5, 300), (17, 257), (2, 1024)]


def _state(rows: int, cols: int, kinds: tuple[int, int], bs: int, *, seed: int, device="cpu"):
    """A realistic state: encoded moments of a few gradient steps (rows of very different scales)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(rows, 1).uniform_(-6.0, 0.0, generator=g))
    m = torch.randn(rows, cols, generator=g) * scale * 0.1
    v = (torch.randn(rows, cols, generator=g) * scale) ** 2 + m * m
    v[:, ::5] = 0.0  # zeros inside blocks (fresh coordinates)
    if rows > 2:
        m[1], v[1] = 0.0, 0.0  # a whole untouched row (an embedding row no token hit)
    mc, ms = refa.encode_moment(m, kinds[0], bs)
    vc, vs = refa.encode_moment(v, kinds[1], bs)
    return [t.to(device) for t in (mc, ms, vc, vs)]


def _grad(rows: int, cols: int, dtype, *, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(rows, cols, generator=g) * torch.exp(torch.empty(rows, 1).uniform_(-5.0, 0.0, generator=g))
    if rows > 2:
        x[1] = 0.0
    return x.to(dtype).to(device)


HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, neg_step_size=-1e-3 / (1 - 0.9**3),
             bias_correction2_sqrt=(1 - 0.95**3) ** 0.5)


def _run(op, grad, state, kinds, bs, hyper=HYPER, stream=-1, index0=0):
    mc, ms, vc, vs = state
    upd = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
    op(grad, mc, ms, vc, vs, upd, hyper["beta1"], hyper["beta2"], hyper["eps"], hyper["neg_step_size"],
       hyper["bias_correction2_sqrt"], kinds[0], kinds[1], bs, stream, index0)
    return [mc, ms, vc, vs, upd]


def _assert_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    assert torch.equal(a, b), f"{what}: {int((a != b).sum())} of {a.numel()} differ"


def _kernel_vs_reference(device: str, rows: int, cols: int, kinds, bs: int, gdt, seed: int) -> None:
    state = _state(rows, cols, kinds, bs, seed=seed, device=device)
    grad = _grad(rows, cols, gdt, seed=seed, device=device)
    ref_state = [t.clone() for t in state]
    before = K.served[("adamw_q_update_", "compiled")]
    out = _run(torch.ops.qmuon.adamw_q_update_, grad, [t.clone() for t in state], kinds, bs)
    assert K.served[("adamw_q_update_", "compiled")] == before + 1, "the compiled kernel did not run"
    want = _run(refa.adamw_q_update_, grad.cpu(), [t.cpu() for t in ref_state], kinds, bs)
    for a, b, what in zip(out, want, ("m codes", "m scale", "v codes", "v scale", "update")):
        _assert_bits(a.cpu(), b, f"{what} {device} {rows}x{cols} kinds={kinds} bs={bs} {gdt}")


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("gdt", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("bs", [32, 128, 256])
def test_kernel_matches_reference(kernel_device, kinds, gdt, bs):
    """The compiled kernel on each device (cuda: marked, skipped without a GPU) == the CPU reference."""
    for i, (rows, cols) in enumerate(SHAPES):
        _kernel_vs_reference(kernel_device.type, rows, cols, kinds, bs, gdt, seed=i)


def test_cpu_kernel_row_slices_and_repeated_steps(ext):
    """Row slices of a larger state (what the chunked step passes) and several steps in a row."""
    rows, cols, bs, kinds = 40, 333, 128, (refa.M4, refa.V4)
    full_k = _state(rows, cols, kinds, bs, seed=3)
    full_r = [t.clone() for t in full_k]
    for step in range(3):
        grad = _grad(rows, cols, torch.float32, seed=10 + step)
        for r0, r1 in ((0, 13), (13, 40)):
            _run(torch.ops.qmuon.adamw_q_update_, grad[r0:r1], [t[r0:r1] for t in full_k], kinds, bs)
            _run(refa.adamw_q_update_, grad[r0:r1], [t[r0:r1] for t in full_r], kinds, bs)
    for a, b, what in zip(full_k, full_r, ("m codes", "m scale", "v codes", "v scale")):
        _assert_bits(a, b, what)


def test_opcheck_adamw_q_update(ext):
    state = _state(6, 100, (refa.M8, refa.V8), 32, seed=1)
    grad = _grad(6, 100, torch.bfloat16, seed=1)
    upd = torch.empty(6, 100)
    torch.library.opcheck(torch.ops.qmuon.adamw_q_update_.default,
                          (grad, *state, upd, 0.9, 0.95, 1e-8, -1e-3, 0.5, refa.M8, refa.V8, 32, -1, 0))
    torch.library.opcheck(torch.ops.qmuon.adamw_q_update_.default,
                          (grad, *state, upd, 0.9, 0.95, 1e-8, -1e-3, 0.5, refa.M8, refa.V8, 32, 12345, 7))


def test_reference_matches_float64_adamw():
    """The emitted update is AdamW's step from the decoded state (float64 check, fp32 rounding), and
    the re-encoded state decodes to the new moments within one code step of the block's scale."""
    rows, cols, bs = 9, 200, 64
    for kinds in KINDS:
        mc, ms, vc, vs = _state(rows, cols, kinds, bs, seed=7)
        m0 = refa.decode_moment(mc, ms, kinds[0], bs, cols).double()
        v0 = refa.decode_moment(vc, vs, kinds[1], bs, cols).double()
        g = _grad(rows, cols, torch.float32, seed=7).double()
        out = _run(refa.adamw_q_update_, g.float(), [mc, ms, vc, vs], kinds, bs)
        m1 = 0.9 * m0 + 0.1 * g
        v1 = 0.95 * v0 + 0.05 * g * g
        want = HYPER["neg_step_size"] * m1 / (v1.sqrt() / HYPER["bias_correction2_sqrt"] + 1e-8)
        # fp32 rounding of m = lerp(m0, g) can cancel: absolute tolerance 1e-5 of the largest step
        torch.testing.assert_close(out[4].double(), want, rtol=2e-5, atol=1e-5 * float(want.abs().max()))
        m_dec = refa.decode_moment(out[0], out[1], kinds[0], bs, cols).double()
        blockmax = out[1].repeat_interleave(bs, 1)[:, :cols].double()
        # softsign compander: step of u is at most 2 / levels (slope of the inverse is <= 2)
        levels = 127 if kinds[0] == refa.M8 else 7
        assert ((m_dec - m1).abs() <= blockmax * (1.0 / levels) + 1e-12).all()


def test_second_moment_has_no_zero_code():
    """A tiny v next to a large one decodes to a positive value (never 0, so 1 / sqrt(v) stays finite);
    a block that is all zeros decodes to exact zeros."""
    v = torch.tensor([[1.0, 1e-12, 0.0, 1e-6] + [0.0] * 4, [0.0] * 8])
    for kind in (refa.V8, refa.V4):
        c, s = refa.encode_moment(v, kind, 4)
        d = refa.decode_moment(c, s, kind, 4, 8)
        assert (d[0, :4] > 0).all(), kind
        assert torch.equal(d[1], torch.zeros(8))
        assert d[0, 0] == 1.0  # the block max is exact


@pytest.mark.cuda
def test_cuda_optimizer_step_matches_cpu(cuda_ext):
    """QMuon's int8 / int4 AdamW step on CUDA equals the CPU step bit for bit (same kernel maths)."""
    from qmuon import QMuon

    for fam in ("int8", "int4"):
        params = {}
        for dev in ("cpu", "cuda"):
            torch.manual_seed(0)
            p = torch.nn.Parameter(torch.randn(64, 96, device=dev))
            opt = QMuon([{"params": [p], "use_muon": False}], adamw_state_format=fam)
            for s in range(3):
                p.grad = _grad(64, 96, torch.float32, seed=s, device=dev)
                opt.step()
            params[dev] = p.detach().cpu()
        _assert_bits(params["cuda"], params["cpu"], fam)


# ----------------------------------------------------------------------------- stochastic rounding
STREAM = refa.adamw_noise_stream(5, 2, 3)


def _kernel_vs_reference_stochastic(rows, cols, kinds, bs, gdt, seed, index0, device="cpu"):
    state = _state(rows, cols, kinds, bs, seed=seed, device=device)
    grad = _grad(rows, cols, gdt, seed=seed, device=device)
    ref_state = [t.cpu().clone() for t in state]
    before = K.served[("adamw_q_update_", "compiled")]
    out = _run(torch.ops.qmuon.adamw_q_update_, grad, state, kinds, bs, stream=STREAM, index0=index0)
    assert K.served[("adamw_q_update_", "compiled")] == before + 1, "the compiled kernel did not run"
    want = _run(refa.adamw_q_update_, grad.cpu(), ref_state, kinds, bs, stream=STREAM, index0=index0)
    for a, b, what in zip(out, want, ("m codes", "m scale", "v codes", "v scale", "update")):
        _assert_bits(a.cpu(), b, f"stochastic {what} {device} {rows}x{cols} kinds={kinds} bs={bs} {gdt}")


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("gdt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bs", [32, 256])
def test_kernel_stochastic_matches_reference(kernel_device, kinds, gdt, bs):
    """Stochastic rounding: the compiled kernel on each device equals the reference bit for bit (codes
    drawn with the same counter noise; index0 past 2**32 exercises the hash's high word)."""
    for i, (rows, cols) in enumerate(SHAPES):
        for index0 in (0, 12345, (1 << 32) - 7):
            _kernel_vs_reference_stochastic(rows, cols, kinds, bs, gdt, seed=i, index0=index0,
                                            device=kernel_device.type)


def test_stochastic_differs_from_nearest_and_is_reproducible(ext):
    rows, cols, bs, kinds = 16, 512, 256, (refa.M8, refa.V8)
    state = _state(rows, cols, kinds, bs, seed=4)
    grad = _grad(rows, cols, torch.float32, seed=4)
    near = _run(torch.ops.qmuon.adamw_q_update_, grad, [t.clone() for t in state], kinds, bs)
    a = _run(torch.ops.qmuon.adamw_q_update_, grad, [t.clone() for t in state], kinds, bs, stream=STREAM, index0=9)
    b = _run(torch.ops.qmuon.adamw_q_update_, grad, [t.clone() for t in state], kinds, bs, stream=STREAM, index0=9)
    c = _run(torch.ops.qmuon.adamw_q_update_, grad, [t.clone() for t in state], kinds, bs, stream=STREAM + 1,
             index0=9)
    for x, y, what in zip(a, b, ("m codes", "m scale", "v codes", "v scale", "update")):
        _assert_bits(x, y, f"same stream, {what}")
    for i, what in ((0, "m"), (2, "v")):
        # a code differs from nearest where the noise picked the farther code: a large share of elements
        assert (a[i] != near[i]).float().mean() > 0.1, what
        assert (a[i] != c[i]).float().mean() > 0.1, what
        # scales and the update do not depend on the rounding
        _assert_bits(a[i + 1], near[i + 1], f"{what} scale")
    _assert_bits(a[4], near[4], "update")
    # m and v draw distinct streams (correlated draws would make the two roundings move together)
    assert refa.moment_stream(STREAM, refa.M8) != refa.moment_stream(STREAM, refa.V8)


def test_stochastic_row_pieces_draw_the_whole_parameters_noise(ext):
    """A row shard (FSDP2 Shard(0)) and a DeepSpeed flat partition's pieces, each called with the
    global index of its first element, give the codes of one call on the whole matrix."""
    rows, cols, bs, kinds = 12, 320, 64, (refa.M4, refa.V8)
    whole = _state(rows, cols, kinds, bs, seed=8)
    grad = _grad(rows, cols, torch.float32, seed=8)
    want = _run(torch.ops.qmuon.adamw_q_update_, grad, [t.clone() for t in whole], kinds, bs, stream=STREAM)
    rows_state = [t.clone() for t in whole]
    for r0, r1 in ((0, 5), (5, 12)):
        _run(torch.ops.qmuon.adamw_q_update_, grad[r0:r1], [t[r0:r1] for t in rows_state], kinds, bs, stream=STREAM,
             index0=r0 * cols)
    for a, b, what in zip(rows_state, want, ("m codes", "m scale", "v codes", "v scale")):
        _assert_bits(a, b, f"row shards {what}")
    # a partial row on the block grid (row 3, blocks 1..): a (1, w) piece with index0 = 3 * cols + 64
    piece = [t.clone() for t in whole]
    r, c0 = 3, 64
    m_cols = (c0 // 2) if kinds[0] == refa.M4 else c0
    sl = [piece[0][r:r + 1, m_cols:], piece[1][r:r + 1, c0 // bs:], piece[2][r:r + 1, c0:], piece[3][r:r + 1, c0 // bs:]]
    _run(torch.ops.qmuon.adamw_q_update_, grad[r:r + 1, c0:], sl, kinds, bs, stream=STREAM, index0=r * cols + c0)
    _assert_bits(piece[0][r, m_cols:], want[0][r, m_cols:], "piece m codes")
    _assert_bits(piece[2][r, c0:], want[2][r, c0:], "piece v codes")


def _new_moments(state, grad, kinds, bs, hyper=HYPER):
    """The fp32 moments before re-encoding (the reference's first half, recomputed here)."""
    from qmuon.ops.reference import _fp32, _lerp_fp32

    rows, cols = grad.shape
    m = refa.decode_moment(state[0], state[1], kinds[0], bs, cols)
    v = refa.decode_moment(state[2], state[3], kinds[1], bs, cols)
    m = _lerp_fp32(m, grad, 1.0 - hyper["beta1"])
    v = v * _fp32(hyper["beta2"]) + (grad * _fp32(1.0 - hyper["beta2"])) * grad
    return m, v


@pytest.mark.parametrize("kinds", KINDS)
def test_stochastic_rounding_is_unbiased(ext, kinds):
    """Over N draws (N streams), the mean decoded moment equals the fp32 moment within Hoeffding's
    bound: the decoded value takes one of two neighbouring grid values x_lo <= x <= x_hi, so
    P(|mean - x| >= eps) <= 2 exp(-2 N eps^2 / gap^2). With gap bounded by the grid's largest step in
    the block (m: 2 scale / L, the softsign inverse's slope is <= 2; v = s^2: 2 scale^2 / L; v = s^4:
    4 scale^4 / L) and eps = gap * sqrt(ln(2 / delta) / (2 N)), delta = 1e-9, a false failure over
    all elements of all kinds has probability < 1e-4. Nearest rounding fails the same check (its error
    is deterministic). Elements below a block's smallest v code are excluded: with no zero code they
    round up by design."""
    rows, cols, bs, n = 8, 512, 256, 400
    state = _state(rows, cols, kinds, bs, seed=11)
    grad = _grad(rows, cols, torch.float32, seed=11)
    m, v = _new_moments(state, grad, kinds, bs)
    sums = [torch.zeros(rows, cols, dtype=torch.float64) for _ in range(2)]
    for trial in range(n):
        out = _run(torch.ops.qmuon.adamw_q_update_, grad, [t.clone() for t in state], kinds, bs,
                   stream=refa.adamw_noise_stream(1, 0, trial))
        sums[0] += refa.decode_moment(out[0], out[1], kinds[0], bs, cols).double()
        sums[1] += refa.decode_moment(out[2], out[3], kinds[1], bs, cols).double()
    near = _run(torch.ops.qmuon.adamw_q_update_, grad, [t.clone() for t in state], kinds, bs)
    k = (2 * n) ** -0.5 * (torch.log(torch.tensor(2e9, dtype=torch.float64))) ** 0.5
    for which, x, sc_t, kind in ((0, m, out[1], kinds[0]), (1, v, out[3], kinds[1])):
        L = {refa.M8: 127, refa.V8: 256, refa.M4: 7, refa.V4: 16}[kind]
        sc = sc_t.double().repeat_interleave(bs, 1)[:, :cols]
        gap = {refa.M8: 2 * sc, refa.M4: 2 * sc, refa.V8: 2 * sc ** 2, refa.V4: 4 * sc ** 4}[kind] / L
        keep = torch.ones_like(x, dtype=torch.bool)
        if which == 1:  # below the smallest code (s < scale / L) a v rounds up whatever the noise
            keep = refa._transform(x, kind).double() >= sc / L
        mean = sums[which] / n
        err = (mean - x.double()).abs()
        assert keep.float().mean() > 0.5
        bad = (err > k * gap + 1e-30) & keep
        assert not bad.any(), f"{'mv'[which]} kinds={kinds}: {int(bad.sum())} elements biased beyond the bound"
        dec_near = refa.decode_moment(near[2 * which], near[2 * which + 1], kind, bs, cols).double()
        near_bad = ((dec_near - x.double()).abs() > k * gap + 1e-30) & keep
        assert near_bad.float().mean() > 0.01, "the check has no power: nearest rounding passes it"


@pytest.mark.parametrize("kinds", KINDS)
def test_overflowing_square_leaves_the_rest_of_the_block_training(ext, kinds):
    """A finite gradient whose square overflows fp32 (1e20) clamps v to FLT_MAX instead of inf: the
    block scale stays finite, and once the outlier's v has decayed (beta2 = 0.5) the other elements
    of its block step again like an fp32-moment AdamW. Before the clamp the block scale was inf and
    every element of the block decoded v = inf (update 0) for good. Kernel and reference agree."""
    rows, cols, bs = 2, 64, 32
    hyper = dict(HYPER, beta2=0.5)
    zero = [t.zero_() for t in _state(rows, cols, kinds, bs, seed=0)]
    ker, ref = [t.clone() for t in zero], [t.clone() for t in zero]
    gen = torch.Generator().manual_seed(0)
    for step in range(160):
        g = torch.randn(rows, cols, generator=gen) * 1e-2
        if step == 0:
            g[0, 3] = 1e20
        out_k = _run(torch.ops.qmuon.adamw_q_update_, g, ker, kinds, bs, hyper=hyper)
        out_r = _run(refa.adamw_q_update_, g, ref, kinds, bs, hyper=hyper)
        for a, b in zip(out_k, out_r):
            _assert_bits(a, b, f"step {step}")
        assert torch.isfinite(ker[1]).all() and torch.isfinite(ker[3]).all(), f"step {step}: a block scale overflowed"
        if step == 0:
            v = refa.decode_moment(ker[2], ker[3], kinds[1], bs, cols)
            assert torch.isfinite(v).all() and v[0, 3] > 1e37  # the outlier's v ~ FLT_MAX, decoded finite
    upd = out_k[4]
    others = torch.ones(rows, cols, dtype=torch.bool)
    others[0, 3] = False
    # AdamW's update of an element whose moments track g is ~lr; frozen elements (v = inf) give 0
    assert (upd[0, :bs][others[0, :bs]].abs() > 1e-5).float().mean() > 0.9, "the outlier's block stays frozen"
    assert (upd[1].abs() > 1e-5).float().mean() > 0.9


