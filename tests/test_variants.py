"""NorMuon and cautious weight decay (qmuon.core.variants) against pure-PyTorch references
of the published algorithms, on every state format, through checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

from qmuon import QMuon, QMuonConfig, build_optimizer
from qmuon.core.newton_schulz import newton_schulz_reference
from qmuon.core.plan import lr_scale
from qmuon.core.variants import NORMUON_STATE, RowMoment, normuon_scale
from qmuon.quant import state as qstate

LR, WD, MU, BETA2 = 0.02, 0.1, 0.95, 0.95
STEPS = 4


def _grad(shape, gen):
    rows, cols = shape
    low_rank = torch.randn(rows, 2, generator=gen) @ torch.randn(2, cols, generator=gen)
    return 1e-3 * (torch.randn(shape, generator=gen) + low_rank)


def dion_normuon(u: torch.Tensor, v: torch.Tensor, beta2: float) -> torch.Tensor:
    """microsoft/dion ``_normuon_normalization_core`` (dion/normuon.py), line for line, one matrix
    (``u``: the (out, in) NS output, ``v``: (out, 1), updated in place)."""
    u = u.to(v.dtype)
    norm_u = u.norm(p=2, dim=(-2, -1), keepdim=True)
    neuron_norms = (u * u).mean(dim=-1, keepdim=True)
    v.copy_(torch.lerp(v, neuron_norms, 1 - beta2))
    normalized = u / (v.sqrt() + 1e-8)
    norm_new = normalized.norm(p=2, dim=(-2, -1), keepdim=True).clamp(min=1e-8)
    return normalized * (norm_u / norm_new)


def test_normuon_scale_equals_dion_formula():
    """The analytic rescale (modded-nanogpt's form) equals dion's explicit one in float64 to
    rounding (1e-12 relative: two orders of summation of the same positive terms)."""
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(24, 40, generator=gen, dtype=torch.float64)
    v_ref = torch.rand(24, 1, generator=gen, dtype=torch.float64)
    v = v_ref[:, 0].clone()
    for _ in range(3):
        want = dion_normuon(u, v_ref, BETA2)
        got = normuon_scale(u, RowMoment(v, BETA2))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(v, v_ref[:, 0], rtol=1e-12, atol=0)
        assert abs(got.norm() - u.norm()) < 1e-12 * u.norm()  # Frobenius norm kept
        u = torch.randn(24, 40, generator=gen, dtype=torch.float64)


CASES = {
    "tall": dict(shape=(64, 32)),
    "wide": dict(shape=(32, 64)),
    "fused_rows": dict(shape=(48, 40), parts=(16, 16, 16)),
    "in_out": dict(shape=(40, 24), orientation="in_out"),
    "in_out_cols": dict(shape=(20, 36), orientation="in_out", parts=(12, 12, 12), parts_axis=1),
}


def _blocks(case):
    """(row slice, col slice, transposed) of each matrix of a case, as plan.py defines them."""
    rows, cols = case["shape"]
    parts = case.get("parts")
    axis = case.get("parts_axis", 0)
    t = case.get("orientation") == "in_out"
    out, at = [], 0
    for n in parts or ((rows,) if axis == 0 else (cols,)):
        out.append((slice(at, at + n), slice(None)) if axis == 0 else (slice(None), slice(at, at + n)))
        at += n
    return [(r, c, t) for r, c in out]


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_normuon_fp32_matches_published_algorithm(case):
    """QMuon(variant="normuon", fp32 state, fp32 NS) against Muon (torch.optim.Muon's momentum and
    Nesterov blend, textbook NS in fp32) followed by dion's NorMuon normalization per (out, in)
    matrix. Tolerance 2e-5 relative to the update: both run fp32 NS (unit roundoff 6e-8) with the
    1/norm folded in vs applied first, amplified by 5 iterations; measured <= 3e-6."""
    spec = CASES[case]
    shape = spec["shape"]
    group_kw = {k: v for k, v in spec.items() if k != "shape"}
    gen = torch.Generator().manual_seed(1)
    p0 = 0.02 * torch.randn(shape, generator=gen)
    p = torch.nn.Parameter(p0.clone())
    opt = QMuon([{"params": [p], **group_kw}], lr=LR, weight_decay=WD, momentum=MU, state_format="fp32", newton_schulz={"dtype": "fp32"}, update={"variant": "normuon", "normuon_beta2": BETA2})
    ref = p0.clone().double()
    buf = torch.zeros(shape)
    blocks = _blocks(spec)
    vs = [None] * len(blocks)
    for _ in range(STEPS):
        g = _grad(shape, gen)
        p.grad = g.clone()
        opt.step()
        buf.lerp_(g, 1 - MU)
        ns_in = g.lerp(buf, MU)
        new = ref * (1 - LR * WD)
        for j, (rs, cs, t) in enumerate(blocks):
            m = ns_in[rs, cs]
            m = m.T if t else m
            o = newton_schulz_reference(m, "muon", 5, eps=1e-7, dtype=torch.float32)
            if vs[j] is None:
                vs[j] = torch.zeros(o.shape[0], 1)
            o = dion_normuon(o, vs[j], BETA2)
            o = o.T if t else o
            new[rs, cs] -= LR * lr_scale(None, *(m.shape)) * o.double()
        step_norm = (new - ref * (1 - LR * WD)).norm()
        err = ((p.detach().double() - new).norm() / step_norm).item()
        assert err < 2e-5, err
        ref = p.detach().double().clone()  # compare per step (no drift of two trajectories)
    v = opt.state[p][NORMUON_STATE]
    want = torch.cat([x[:, 0] for x in vs]) if not blocks[0][2] else torch.stack([x[:, 0] for x in vs])
    got = v[:, 0] if not blocks[0][2] else v
    if not blocks[0][2] and v.shape[1] > 1:
        got = v.T.reshape(-1)
    torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("fmt", sorted(qstate.STATE_FORMATS))  # the Muon momentum formats
def test_normuon_every_state_format(fmt):
    """NorMuon runs on every momentum format: one fp32 value per output row beside the momentum,
    finite updates, the update's Frobenius norm equal to plain Muon's with the same momentum."""
    gen = torch.Generator().manual_seed(2)
    shape = (64, 96)
    p0 = 0.02 * torch.randn(shape, generator=gen)
    pa, pb = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    kw = dict(lr=LR, weight_decay=0.0, state_format=fmt, newton_schulz={"dtype": "fp32"})
    a, b = QMuon([pa], update={"variant": "normuon"}, **kw), QMuon([pb], **kw)
    for _ in range(3):
        g = _grad(shape, gen)
        pa.grad, pb.grad = g.clone(), g.clone()
        before_a, before_b = pa.detach().clone(), pb.detach().clone()
        a.step()
        b.step()
        da, db = before_a - pa.detach(), before_b - pb.detach()
        assert torch.isfinite(da).all()
        # same momentum bits, same NS output; NorMuon only redistributes it over rows (norm kept
        # to fp32 rounding: 1e-5 relative)
        assert abs(da.norm() - db.norm()) <= 1e-5 * db.norm()
        assert not torch.allclose(da, db)
    v = a.state[pa][NORMUON_STATE]
    assert v.shape == (64, 1) and v.dtype == torch.float32 and (v > 0).all()


def _cautious_expected(p0: torch.Tensor, p_nodecay: torch.Tensor, lr: float, wd: float) -> torch.Tensor:
    """dion's cautious decay: ``X -= lr wd X * [X * U >= 0]`` with ``U`` the subtracted update
    (``p0 - p_nodecay``), then ``X -= U``."""
    u = p0 - p_nodecay
    mask = (p0 * u) >= 0
    return p0 - lr * wd * p0 * mask - u


@pytest.mark.parametrize("use_muon", [True, False], ids=["muon", "adamw"])
def test_cautious_weight_decay(use_muon):
    """Cautious decay equals the no-decay step plus decay on the agreeing coordinates only; some
    coordinates are decayed and some are not (the mask is not trivially all or nothing).
    Tolerance: one fp32 rounding of the difference (1e-7 absolute at weights of 0.1)."""
    gen = torch.Generator().manual_seed(3)
    shape = (32, 48)
    p0 = 0.1 * torch.randn(shape, generator=gen)
    pc, pn = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    lr = LR if use_muon else 1e-2
    mk = lambda p, wd, c: QMuon([{"params": [p], "use_muon": use_muon, "weight_decay": wd, "lr": lr}],  # noqa: E731
                                state_format="fp32", newton_schulz={"dtype": "fp32"}, update={"cautious_weight_decay": c})
    oc, on = mk(pc, WD, True), mk(pn, 0.0, False)
    for _ in range(3):
        g = _grad(shape, gen)
        start = pc.detach().clone()
        with torch.no_grad():
            pn.copy_(start)
        pc.grad, pn.grad = g.clone(), g.clone()
        oc.step()
        on.step()
        want = _cautious_expected(start, pn.detach(), lr, WD)
        torch.testing.assert_close(pc.detach(), want, rtol=0, atol=1e-7)
        decayed = ((start * (start - pn.detach())) >= 0).float().mean()
        assert 0.05 < decayed < 0.95


def _train(opt, ps, gen, steps):
    for _ in range(steps):
        for p in ps:
            p.grad = _grad(tuple(p.shape), gen) if p.ndim == 2 else 1e-3 * torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("fmt", ["int8", "grasp4"])
def test_resume_bit_exact(fmt):
    """A NorMuon + cautious run resumed from ``state_dict`` continues with the same bits."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(0.02 * torch.randn(64, 64)), torch.nn.Parameter(0.02 * torch.randn(32, 64))]
    kw = dict(state_format=fmt, update={"variant": "normuon", "cautious_weight_decay": True})
    opt = QMuon(ps, **kw)
    gen = torch.Generator().manual_seed(4)
    _train(opt, ps, gen, 2)
    sd = copy.deepcopy(opt.state_dict())
    saved = [p.detach().clone() for p in ps]
    gstate = gen.get_state()
    _train(opt, ps, gen, 2)
    ps2 = [torch.nn.Parameter(s) for s in saved]
    opt2 = QMuon(ps2, **kw)
    opt2.load_state_dict(sd)
    gen.set_state(gstate)
    _train(opt2, ps2, gen, 2)
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)
    for a, b in zip(ps, ps2):
        assert torch.equal(opt.state[a][NORMUON_STATE], opt2.state[b][NORMUON_STATE])


def test_bad_normuon_state_and_options_raise():
    p = torch.nn.Parameter(torch.randn(16, 24))
    opt = QMuon([p], update={"variant": "normuon"})
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    sd["state"][0][NORMUON_STATE] = torch.zeros(15, 1)
    with pytest.raises(ValueError, match="normuon_v has shape"):
        QMuon([p], update={"variant": "normuon"}).load_state_dict(sd)
    with pytest.raises(ValueError, match="variant must be one of"):
        QMuon([p], update={"variant": "adamuon"})
    with pytest.raises(ValueError, match="normuon_beta2"):
        QMuonConfig(update={"normuon_beta2": 1.0}).validate()
    with pytest.raises(ValueError, match="cautious_weight_decay"):
        QMuon([p], update={"cautious_weight_decay": "yes"})


def test_build_optimizer_passes_variants():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    opt = build_optimizer(model, update={"variant": "normuon", "cautious_weight_decay": True})
    muon = [g for g in opt.param_groups if g["use_muon"]]
    adamw = [g for g in opt.param_groups if not g["use_muon"]]
    assert muon and all(g["variant"] == "normuon" and g["cautious_weight_decay"] for g in muon)
    assert adamw and all(g["cautious_weight_decay"] for g in adamw)
