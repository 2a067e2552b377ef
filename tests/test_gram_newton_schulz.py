"""Gram Newton-Schulz (core.gram_newton_schulz) against float64 standard Newton-Schulz, and its
selection by ``ns_method``."""

from __future__ import annotations

import copy

import pytest
import torch

from qmuon import QMuon
from qmuon.core.gram_newton_schulz import (GRAM_AUTO_ASPECT, GRAM_AUTO_MIN_SIDE, GRAM_AUTO_MIN_SIDE_FP32,
                                                     default_restarts, newton_schulz_gram, pick_ns_method)
from qmuon.core.newton_schulz import newton_schulz_folded, newton_schulz_reference, resolve_schedule

SHAPES = [(64, 256), (256, 64), (96, 192)]
SCHEDULES = [("muon", 5), ("polar_express", 6)]


def _gradlike(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    low = torch.randn(1, rows, 4, generator=g) @ torch.randn(1, 4, cols, generator=g)
    return 0.5 * low + torch.randn(1, rows, cols, generator=g)


def _sigma_err(o):
    return (torch.linalg.svdvals(o.double()) - 1).abs().mean().item()


@pytest.mark.parametrize("coeffs,steps", SCHEDULES)
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gram_close_to_float64_newton_schulz(shape, coeffs, steps, dtype):
    """Tolerances (relative Frobenius error vs float64 NS of the same schedule). fp32: 2e-5 (both
    methods measure 1-5e-6: fp32 roundoff 6e-8 amplified by the iterations). bf16: 2.5e-2, where
    standard NS measures 0.6-1.2e-2 and gram 1.1-1.3e-2 (bf16 roundoff 3.9e-3 amplified); the mean
    |sigma - 1| of gram stays within 0.01 of standard's (measured: +0.0056 at most, Polar Express)."""
    sch = resolve_schedule(coeffs, steps)
    g = _gradlike(*shape, seed=hash(shape) % 1000)
    inv = g.flatten(1).norm(dim=1).reciprocal()
    ref = newton_schulz_reference(g[0].double(), sch, steps, dtype=torch.float64)
    std = newton_schulz_folded(g, inv, sch, steps, dtype)[0].double()
    gram = newton_schulz_gram(g, inv, sch, steps, dtype)[0].double()
    assert gram.dtype == torch.float64 and gram.shape == shape
    err = ((gram - ref).norm() / ref.norm()).item()
    tol = 2e-5 if dtype == torch.float32 else 2.5e-2
    assert err < tol, err
    assert _sigma_err(gram) <= _sigma_err(std) + 0.01


def test_pick_ns_method():
    assert pick_ns_method("standard", 64, 256, "cpu") == "standard"
    assert pick_ns_method("gram", 64, 256, "cuda:0") == "gram"
    assert pick_ns_method("gram", 128, 128, "cpu") == "standard"  # square: no gain, worse in bf16
    n, m = int(GRAM_AUTO_ASPECT), GRAM_AUTO_MIN_SIDE
    assert pick_ns_method("auto", m, m * n, "cpu") == "gram"
    assert pick_ns_method("auto", m * n, m, "cpu") == "gram"
    assert pick_ns_method("auto", m, m * n - 1, "cpu") == "standard"
    assert pick_ns_method("auto", m, m * n, "cuda:0") == "standard"  # not measured there: opt-in
    # small matrices: gram's fixed cost per product outweighs the saved flops (measured slower)
    assert pick_ns_method("auto", m - 1, (m - 1) * 8, "cpu") == "standard"
    assert pick_ns_method("auto", 64, 1024, "cpu", torch.bfloat16) == "standard"
    m32 = GRAM_AUTO_MIN_SIDE_FP32
    assert pick_ns_method("auto", m32, m32 * 4, "cpu", torch.float32) == "gram"
    assert pick_ns_method("auto", m32 - 1, (m32 - 1) * 4, "cpu", torch.float32) == "standard"
    # fp32 (no restart) pays from 3:1 on; bf16 only from 4:1
    assert pick_ns_method("auto", 256 * 3, 256, "cpu", torch.float32) == "gram"
    assert pick_ns_method("auto", 256 * 3, 256, "cpu", torch.bfloat16) == "standard"
    assert pick_ns_method("auto", 256 * 3 - 1, 256, "cpu", torch.float32) == "standard"


def test_qmuon_ns_method_runs_gram_and_resumes():
    """QMuon(ns_method="gram") uses the Gram iteration (its update differs from standard's in the
    last bits but is within the bf16 tolerance above) and resumes bit-exact."""
    torch.manual_seed(0)
    p0 = [0.02 * torch.randn(64, 256), 0.02 * torch.randn(128, 32)]
    out = {}
    for method in ("standard", "gram"):
        ps = [torch.nn.Parameter(p.clone()) for p in p0]
        opt = QMuon(ps, newton_schulz={"method": method}, weight_decay=0.0)
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        out[method] = (ps, opt, gen)
    (ps_s, _, _), (ps_g, opt_g, gen) = out["standard"], out["gram"]
    for a, b, p in zip(ps_s, ps_g, p0):
        da, db = a.detach() - p, b.detach() - p
        assert not torch.equal(da, db)
        assert ((da - db).norm() / da.norm()).item() < 5e-2
    sd = copy.deepcopy(opt_g.state_dict())
    saved = [p.detach().clone() for p in ps_g]
    state = gen.get_state()
    for p in ps_g:
        p.grad = torch.randn(p.shape, generator=gen)
    opt_g.step()
    ps2 = [torch.nn.Parameter(s) for s in saved]
    opt2 = QMuon(ps2, newton_schulz={"method": "gram"}, weight_decay=0.0)
    opt2.load_state_dict(sd)
    gen.set_state(state)
    for p in ps2:
        p.grad = torch.randn(p.shape, generator=gen)
    opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(ps_g, ps2))


def test_auto_keeps_bf16_polar_express_on_the_standard_iteration():
    """bf16 gram with Polar Express measured 3-6x standard's mean |sigma - 1|: "auto" (the default)
    keeps it standard; the "muon" schedule at any length, and fp32 with any schedule, may pick gram."""
    m = GRAM_AUTO_MIN_SIDE
    pe, mu = resolve_schedule("polar_express", 6), resolve_schedule("muon", 7)
    assert pick_ns_method("auto", m, 4 * m, "cpu", torch.bfloat16, pe) == "standard"
    assert pick_ns_method("auto", m, 4 * m, "cpu", torch.bfloat16, mu) == "gram"
    assert pick_ns_method("auto", m, 4 * m, "cpu", torch.float32, pe) == "gram"
    assert pick_ns_method("gram", m, 4 * m, "cpu", torch.bfloat16, pe) == "gram"  # explicit: honoured


def test_default_is_auto_and_a_checkpoint_keeps_its_method():
    """The default ``ns_method`` is "auto"; a QMuon checkpoint names its method and a resume keeps it
    (bit for bit when it is the method the run used)."""
    torch.manual_seed(0)
    p0 = [0.02 * torch.randn(64, 256)]  # fp32 NS would pick gram (aspect 4, short side 64)

    def run(opt, ps, gen, steps):
        for _ in range(steps):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()

    ps = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = QMuon(ps, newton_schulz={"dtype": "fp32", "method": "standard"})
    gen = torch.Generator().manual_seed(1)
    run(opt, ps, gen, 2)
    sd = copy.deepcopy(opt.state_dict())
    saved, state = [p.detach().clone() for p in ps], gen.get_state()
    run(opt, ps, gen, 2)
    for want in ("standard", "gram"):
        ps2 = [torch.nn.Parameter(s.clone()) for s in saved]
        opt2 = QMuon(ps2, newton_schulz={"dtype": "fp32"})
        assert opt2.param_groups[0]["ns_method"] == "auto"
        if want == "gram":
            sd = copy.deepcopy(sd)
            sd["param_groups"][0]["ns_method"] = "gram"
        opt2.load_state_dict(sd)
        assert opt2.param_groups[0]["ns_method"] == want
        gen.set_state(state)
        run(opt2, ps2, gen, 2)
        assert torch.equal(ps2[0], ps[0]) is (want == "standard")


def test_bad_ns_method_raises():
    with pytest.raises(ValueError, match="newton_schulz.method must be one of"):
        QMuon([torch.nn.Parameter(torch.randn(4, 4))], newton_schulz={"method": "fast"})


@pytest.mark.parametrize("shape", [(64, 256), (256, 64)], ids=["wide", "tall"])
def test_restarts_keep_low_rank_inputs_stable(shape):
    """Rank-8 updates (gradients of a small batch): in bf16 the restart keeps gram's largest
    singular value where standard NS puts it (measured 1.14-1.15 vs 1.13; without the restart R
    drifts and it reaches 8-50: the check fails); in fp32 no restart is needed (relative error vs
    standard NS measured <= 2e-4; the bound is 1e-3). Tall results come back contiguous."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, shape[0], 8, generator=g) @ torch.randn(2, 8, shape[1], generator=g)
    inv = x.flatten(1).norm(dim=1).reciprocal()
    sch = resolve_schedule("muon", 5)
    std = newton_schulz_folded(x, inv, sch, 5, torch.bfloat16).double()
    out = newton_schulz_gram(x, inv, sch, 5, torch.bfloat16)
    assert out.is_contiguous() and out.shape == x.shape
    assert torch.linalg.svdvals(out.double()).max() <= torch.linalg.svdvals(std).max() + 0.2
    unstable = newton_schulz_gram(x, inv, sch, 5, torch.bfloat16, restarts=())
    assert not torch.linalg.svdvals(unstable.double()).max() <= torch.linalg.svdvals(std).max() + 0.2
    std32 = newton_schulz_folded(x, inv, sch, 5, torch.float32).double()
    out32 = newton_schulz_gram(x, inv, sch, 5, torch.float32).double()  # default: no restart in fp32
    assert ((out32 - std32).norm() / std32.norm()).item() < 1e-3


def _gram_plain(g, inv_norm, schedule, steps, dtype, restarts):
    """The Gram iteration written out plainly (frozen copy of ``newton_schulz_gram`` before its
    buffers, fused scaling and tall layout, commit 8a6c9ab): fresh tensors for every product,
    ``.float()`` round trips for the fp32 steps, a tall input iterated as a transposed view.
    Same operations as DeepSpeed's ``zeropower_via_gram_newtonschulz``, plus the folded
    ``1 / ||G||`` and the schedule."""
    x_in = g.to(dtype)
    transposed = x_in.size(-2) > x_in.size(-1)
    x = x_in.mT if transposed else x_in
    s = inv_norm.to(torch.float32).reshape(-1, 1, 1) / schedule.norm_safety
    r = torch.bmm(x, x.mT).float().mul_(s * s).to(dtype)
    scale, q = s, None
    for i in range(steps):
        a, b, c = schedule.coefficient(i)
        if i in restarts and i != 0:
            x = torch.bmm(q, x)
            r = torch.bmm(x, x.mT)
            q, scale = None, None
        z = torch.baddbmm(r, r, r, beta=b, alpha=c)
        if q is None:
            q = z.float().clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
            if scale is not None:
                q.mul_(scale)
            q = q.to(dtype)
        else:
            q = torch.baddbmm(q, q, z, beta=a)
        if i < steps - 1 and (i + 1) not in restarts:
            rz = torch.baddbmm(r, r, z, beta=a)
            r = torch.baddbmm(rz, z, rz, beta=a)
    return torch.bmm(x.mT, q.mT) if transposed else torch.bmm(q, x)


@pytest.mark.parametrize("coeffs,steps", SCHEDULES + [("muon", 1), ("muon", 2), ("muon", 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("restarts", [None, (), (2, 4)], ids=["default", "none", "2-4"])
def test_gram_equals_plain_form(coeffs, steps, dtype, restarts):
    """The buffered implementation performs the plain form's arithmetic: bit-identical on wide
    matrices (every product, rounding and fp32 step is the same); on tall ones it iterates
    ``X^T`` in its own layout, so the long products (``x Q^T`` instead of ``(Q x^T)^T``) sum in
    another order: measured up to 2.8e-3 relative in bf16 (one bf16 rounding is 3.9e-3), so the
    bound is 1e-2 there; in fp32 the bound is 1e-5 (fp32 roundoff 6e-8 amplified, as above)."""
    sch = resolve_schedule(coeffs, steps)
    rs = default_restarts(dtype) if restarts is None else restarts
    gen = torch.Generator().manual_seed(7)
    for rows, cols in [(64, 256), (256, 64), (96, 192), (128, 512)]:
        g = torch.randn(3, rows, cols, generator=gen)
        g[1] *= 1e-3  # a different norm per matrix: the fp32 scaling is per matrix
        inv = g.flatten(1).norm(dim=1).reciprocal()
        new = newton_schulz_gram(g.to(dtype), inv, sch, steps, dtype, restarts=restarts)
        old = _gram_plain(g, inv, sch, steps, dtype, rs)
        assert new.shape == g.shape and new.dtype == dtype and new.is_contiguous()
        if rows <= cols:
            assert torch.equal(new, old), (rows, cols)
        else:
            err = ((new.double() - old.double()).norm() / old.double().norm()).item()
            assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (rows, cols, err)


def test_gram_edge_batches():
    """Zero steps (the normalized input), an empty batch, and a batch of one."""
    sch = resolve_schedule("muon", 5)
    g = torch.randn(2, 32, 96)
    inv = g.flatten(1).norm(dim=1).reciprocal()
    zero = newton_schulz_gram(g, inv, sch, 0, torch.float32)
    assert torch.allclose(zero, g * inv.view(-1, 1, 1))
    empty = newton_schulz_gram(g[:0], inv[:0], sch, 5, torch.bfloat16)
    assert empty.shape == (0, 32, 96)
    one = newton_schulz_gram(g[:1], inv[:1], sch, 5, torch.float32)
    both = newton_schulz_gram(g, inv, sch, 5, torch.float32)
    assert torch.allclose(one[0], both[0], rtol=0, atol=1e-5)


def test_auto_choices_are_recorded_and_a_resume_elsewhere_keeps_them(monkeypatch):
    """What ``"auto"`` chose on the first step (the NS dtype; the device type whose rules pick the
    method and the batch size) is written into the group and saved: an optimizer on a machine where
    ``"auto"`` would choose otherwise (here: the QMUON_NS_DTYPE override flips the CPU's choice)
    resumes with the saved arithmetic and continues bit for bit."""
    from qmuon.core.newton_schulz import NS_DTYPE_ENV

    def make():
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(256, 64))
        return w, QMuon([w], state_format="int8")

    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(256, 64, generator=g) for _ in range(4)]
    monkeypatch.setenv(NS_DTYPE_ENV, "fp32")
    w, opt = make()
    assert opt.param_groups[0]["ns_dtype"] == "auto"
    for gr in grads[:2]:
        w.grad = gr.clone()
        opt.step()
    assert (opt.param_groups[0]["ns_dtype"], opt.param_groups[0]["auto_device"]) == ("fp32", "cpu")
    saved = copy.deepcopy(opt.state_dict())
    monkeypatch.setenv(NS_DTYPE_ENV, "bf16")  # "another CPU": auto would now pick bf16
    w2, opt2 = make()
    with torch.no_grad():
        w2.copy_(w)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["ns_dtype"] == "fp32"
    for gr in grads[2:]:
        for p, o in ((w, opt), (w2, opt2)):
            p.grad = gr.clone()
            o.step()
    assert torch.equal(w, w2)
    # a fresh run there does choose the other dtype: the resume above is what kept fp32
    w3, opt3 = make()
    w3.grad = grads[0].clone()
    opt3.step()
    assert opt3.param_groups[0]["ns_dtype"] == "bf16"
