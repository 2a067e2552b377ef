"""QMuon's auxiliary AdamW: fp32 / bf16 / int8 / int4 moments (``adamw_state_format``), the
chunked per-tensor step (no foreach temporaries), checkpoints (versioned, validated, converted to
and from ``torch.optim.AdamW``), the non-finite gradient policy, and the one format registry.

Peers in the same run: ``torch.optim.AdamW`` (the fp32 family must equal it bit for bit: every
operation is torch's own, in its order)."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from qmuon import QMuon, build_optimizer
from qmuon.core import adamw as core_adamw
from qmuon.optim.qmuon import FORMAT_VERSION
from qmuon.quant import adamw as qadamw
from qmuon.quant import state as qstate

FAMILIES = ("fp32", "bf16", "int8", "int4")
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _params(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # an embedding-like table (quantized), a 3-D tensor, a 1-D gain and a small matrix (both fp32)
    return [torch.randn(200, 48, generator=g), torch.randn(8, 40, 16, generator=g), torch.randn(33, generator=g),
            torch.randn(10, 12, generator=g)]


def _grads(params, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for p in params:
        rows = p.shape[0]
        row_scale = torch.exp(torch.linspace(-4, 0, rows)).reshape(rows, *([1] * (p.ndim - 1)))
        out.append(torch.randn(p.shape, generator=g) * row_scale)
    return out


def _qmuon(params, family: str, **kw) -> QMuon:
    return QMuon([{"params": params, "use_muon": False}], adamw_lr=HP["lr"], update={"adamw_betas": HP["betas"], "adamw_eps": HP["eps"]}, adamw_weight_decay=HP["weight_decay"], adamw_state_format=family, **kw)


def _run(opt, params, steps: range) -> None:
    for s in steps:
        for p, g in zip(params, _grads(params, s)):
            p.grad = g
        opt.step()


# ----------------------------------------------------------------------------- fp32: torch.optim.AdamW exactly
@pytest.mark.parametrize("foreach", [False, True])
def test_fp32_family_equals_torch_adamw_bit_for_bit(foreach):
    init = _params()
    a = [p.clone().requires_grad_() for p in init]
    b = [p.clone().requires_grad_() for p in init]
    ta = torch.optim.AdamW(a, foreach=foreach, **HP)
    qb = _qmuon(b, "fp32")
    _run(ta, a, range(6))
    _run(qb, b, range(6))
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    for x, y in zip(a, b):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(ta.state[x][k], qb.state[y][k]), k


def test_chunked_step_equals_one_block():
    """Blocks of rows (the bounded transient) give the same bits as one block, for every family."""
    for fam in FAMILIES:
        p1, p2 = torch.randn(64, 96), None
        p2 = p1.clone()
        g = torch.randn(64, 96)
        group = {"state_format": fam, "bf16_update": "nearest", **HP}
        s1 = core_adamw.init_state(fam, p1.shape, p1, "nearest")
        s2 = core_adamw.init_state(fam, p2.shape, p2, "nearest")
        for _ in range(3):
            core_adamw.adamw_param_step(p1, g, s1, group, global_shape=p1.shape)
            core_adamw.adamw_param_step(p2, g, s2, group, global_shape=p2.shape, chunk_elements=96 * 5)
        assert torch.equal(p1, p2), fam
        for k in s1:
            assert torch.equal(s1[k], s2[k]), (fam, k)


def test_chunk_rows_bounds_the_block():
    assert core_adamw.chunk_rows(50257, 768) * 768 <= core_adamw.DEFAULT_CHUNK_ELEMENTS
    assert core_adamw.chunk_rows(3, 10**8) == 1  # one row at least
    assert core_adamw.chunk_rows(10, 7) == 10


# ----------------------------------------------------------------------------- quantized families track fp32
@pytest.mark.parametrize("family,tol", [("bf16", 0.01), ("int8", 0.02), ("int4", 0.3)])
def test_quantized_families_track_torch_adamw(family, tol):
    """After 20 steps the distance travelled by every quantized weight matrix stays close to
    torch.optim.AdamW's (relative Frobenius error of the displacement). Measured on the two large
    tensors: bf16 0.22 %, int8 0.72-0.84 %, int4 13.8-14.8 %; the bounds leave 2-4x margin."""
    init = _params()
    a = [p.clone().requires_grad_() for p in init]
    b = [p.clone().requires_grad_() for p in init]
    ta = torch.optim.AdamW(a, **HP)
    qb = _qmuon(b, family)
    _run(ta, a, range(20))
    _run(qb, b, range(20))
    for p0, x, y in zip(init, a, b):
        err = ((y - p0) - (x - p0)).norm() / (x - p0).norm()
        assert err < tol, (family, tuple(p0.shape), float(err))


def test_state_layout_and_bytes():
    params = [p.requires_grad_() for p in _params()]
    rows, cols = params[0].shape  # 200 x 48: one (short) block per row
    for fam, per_row in (("int8", 2 * (cols + 4 * math.ceil(cols / 256))),
                         ("int4", 2 * (cols // 2 + 4 * math.ceil(cols / 128))), ("bf16", 4 * cols), ("fp32", 8 * cols)):
        opt = _qmuon(params, fam)
        _run(opt, params, range(1))
        big = opt.state[params[0]]
        nbytes = sum(t.numel() * t.element_size() for k, t in big.items() if k != "step")
        assert nbytes == per_row * rows, fam
        # 1-D tensors and tensors under 4096 elements keep torch's fp32 moments
        for small in (params[2], params[3]):
            st = opt.state[small]
            assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == small.shape
        assert opt.state[params[1]].keys() == big.keys()
        assert qadamw.describe_adamw_state(big).startswith(f"adamw_m_{fam}")


# ----------------------------------------------------------------------------- validation and routing
def test_bad_state_format_errors():
    p = nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"adamw state_format must be one of \('fp32', 'bf16', 'int8', 'int4'\)"):
        QMuon([p], adamw_state_format="int3")
    with pytest.raises(ValueError, match="param group 0 \\(AdamW\\).*got 'grasp4'"):
        QMuon([{"params": [p], "use_muon": False, "state_format": "grasp4"}])
    with pytest.raises(TypeError, match="unknown QMuon option .adamw_state_formt.; did you mean .adamw_state_format."):
        build_optimizer(nn.Linear(4, 4), verbose=False, adamw_state_formt="int8")
    # AdamW moment formats are not Muon momentum formats
    with pytest.raises(qstate.StateFormatError, match="unknown state_format 'adamw_m_int8'"):
        QMuon([p], state_format="adamw_m_int8")


def test_per_group_state_format_keeps_one_parameter_full_precision():
    emb, head = nn.Parameter(torch.randn(100, 64)), nn.Parameter(torch.randn(100, 64))
    opt = QMuon([{"params": [emb], "use_muon": False},
                 {"params": [head], "use_muon": False, "state_format": "fp32"}], adamw_state_format="int4")
    emb.grad, head.grad = torch.randn(100, 64), torch.randn(100, 64)
    opt.step()
    assert "exp_avg_q4" in opt.state[emb] and opt.state[head]["exp_avg"].dtype == torch.float32


def test_build_optimizer_routes_embedding_to_the_quantized_family():
    model = nn.Sequential(nn.Embedding(300, 32), nn.Linear(32, 32), nn.LayerNorm(32))
    opt = build_optimizer(model, verbose=False, adamw_state_format="int8")
    adamw = [g for g in opt.param_groups if not g["use_muon"]]
    assert adamw and all(g["state_format"] == "int8" for g in adamw)
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.randn_like(p)
    opt.step()
    emb = model[0].weight
    assert opt.state[emb]["exp_avg_q8"].dtype == torch.int8
    assert opt.state[model[2].weight]["exp_avg"].dtype == torch.float32  # 1-D gain


def test_registry_holds_every_role():
    roles = {f.role for f in qstate.FORMATS.values()}
    assert roles == {"momentum", "adamw_m", "adamw_v", "weight_correction"}  # + the ecc8 weight correction
    assert "adamw_m_int8" not in qstate.STATE_FORMATS and "int8" in qstate.STATE_FORMATS
    assert qadamw.adamw_state_families() == FAMILIES
    m, v = qadamw.moment_formats("int4", (1000, 64))
    assert (m.role, v.role) == ("adamw_m", "adamw_v") and m.default_block_size == 128
    assert qstate.get_format("adamw_v_int8", role="adamw_v") is qadamw.moment_formats("int8", (1000, 64))[1]


def test_a_registered_adamw_family_is_looked_up_at_once():
    """The family lookups read an index that register_format / unregister_format rebuild: a family
    registered (or removed) at run time is a choice (or not) at once, with its own two formats."""
    import copy
    import dataclasses

    m8, v8 = qadamw.moment_formats("int8", (1000, 64))
    toy = [copy.copy(f) for f in (m8, v8)]
    for f in toy:
        f.family = "toy8"
        f.spec = dataclasses.replace(f.spec, name=f"{f.spec.name}_toy8")
    assert qadamw._pair("toy8") is None
    with pytest.raises(ValueError, match="toy8"):
        qadamw.check_adamw_state_format("toy8", "test")
    for f in toy:
        qstate.register_format(f)
    try:
        assert qadamw.moment_formats("toy8", (1000, 64)) == tuple(toy)
        assert "toy8" in qadamw.adamw_state_families()
        assert qadamw.moment_formats("toy8", (10,))[0] is qadamw.moment_formats("fp32", (10,))[0]  # small: fp32
    finally:
        for f in toy:
            qstate.unregister_format(f.name)
    assert qadamw._pair("toy8") is None and qadamw._pair(["unhashable"]) is None
    assert qstate.weight_state_keys() == frozenset(qstate.FORMATS["ecc8"].spec.keys)


# ----------------------------------------------------------------------------- non-finite gradients
@pytest.mark.parametrize("family", ["fp32", "int8"])
def test_nan_gradient_never_reaches_adamw_state(family):
    params = [p.requires_grad_() for p in _params()[:2]]
    opt = _qmuon(params, family)
    _run(opt, params, range(2))
    before = [p.detach().clone() for p in params]
    state_before = {k: v.clone() for k, v in opt.state[params[0]].items()}
    params[0].grad = torch.full_like(params[0], float("nan"))
    params[0].grad[0, 0] = float("inf")
    params[1].grad = torch.randn_like(params[1])
    opt.step()
    assert torch.equal(params[0], before[0]) and not torch.equal(params[1], before[1])
    assert opt.nonfinite_skips == 1  # reads the step's flags: the skipped step counter is rolled back
    for k, v in opt.state[params[0]].items():
        assert torch.equal(v, state_before[k]), k


# ----------------------------------------------------------------------------- checkpoints
def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_is_bit_exact(family):
    init = _params()
    a = [p.clone().requires_grad_() for p in init]
    oa = _qmuon(a, family)
    _run(oa, a, range(6))
    b = [p.clone().requires_grad_() for p in init]
    ob = _qmuon(b, family)
    _run(ob, b, range(3))
    sd = _roundtrip(ob.state_dict())
    assert all(g["qmuon_version"] == FORMAT_VERSION == 2 for g in sd["param_groups"])
    c = [p.detach().clone().requires_grad_() for p in b]
    oc = _qmuon(c, family)
    oc.load_state_dict(sd)
    _run(oc, c, range(3, 6))
    for x, y in zip(a, c):
        assert torch.equal(x, y), family


def test_torch_adamw_state_converts_in_and_out():
    init = _params()
    a = [p.clone().requires_grad_() for p in init]
    ta = torch.optim.AdamW(a, **HP)
    _run(ta, a, range(4))
    # in: torch.optim.AdamW -> QMuon int8 (moments quantized on load)
    b = [p.detach().clone().requires_grad_() for p in a]
    qb = _qmuon(b, "int8")
    qb.load_state_dict(_roundtrip(ta.state_dict()))
    st = qb.state[b[0]]
    assert st["exp_avg_q8"].dtype == torch.int8 and float(st["step"]) == 4.0
    back = qb.torch_adamw_state(b[0])
    ref = ta.state[a[0]]
    for k, tol in (("exp_avg", 1.0 / 127), ("exp_avg_sq", 2.0 / 256)):
        err = (back[k] - ref[k]).abs().max() / ref[k].abs().max()
        assert err <= tol, (k, float(err))
    # out: QMuon int8 -> torch.optim.AdamW (dequantized), both continue alike
    c = [p.detach().clone().requires_grad_() for p in b]
    tc = torch.optim.AdamW(c, **HP)
    tc.load_state_dict({"state": {i: qb.torch_adamw_state(p) for i, p in enumerate(b)},
                        "param_groups": ta.state_dict()["param_groups"]})
    _run(qb, b, range(4, 6))
    _run(tc, c, range(4, 6))
    for x, y, p0 in zip(b, c, a):
        assert ((x - p0) - (y - p0)).norm() <= 0.05 * (y - p0).norm()


def test_family_change_on_load_converts():
    params = [p.requires_grad_() for p in _params()]
    o8 = _qmuon(params, "int8")
    _run(o8, params, range(2))
    sd = _roundtrip(o8.state_dict())
    o4 = _qmuon([p.detach().clone().requires_grad_() for p in params], "int4")
    o4.load_state_dict(sd)
    p4 = o4.param_groups[0]["params"][0]
    assert "exp_avg_q4" in o4.state[p4]
    m8 = o8.torch_adamw_state(params[0])["exp_avg"]
    m4 = o4.torch_adamw_state(p4)["exp_avg"]
    assert (m4 - m8).abs().max() <= m8.abs().max() * 0.3


def _snapshot(opt) -> dict:
    """Everything a load_state_dict could change: the state of each parameter (by position, cloned)
    and the param groups' hyperparameters."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = {i: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()}
             for i, p in enumerate(params) if p in opt.state}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return {"state": state, "groups": groups, "param_ids": [id(p) for p in params]}


def _assert_unchanged(opt, before: dict, what: str) -> None:
    after = _snapshot(opt)
    assert after["param_ids"] == before["param_ids"], what
    assert after["groups"] == before["groups"], f"{what}: param groups changed"
    assert after["state"].keys() == before["state"].keys(), f"{what}: state entries changed"
    for i, st in before["state"].items():
        assert after["state"][i].keys() == st.keys(), f"{what}: state keys of parameter {i} changed"
        for k, v in st.items():
            w = after["state"][i][k]
            same = (torch.equal(w, v) and w.dtype == v.dtype) if torch.is_tensor(v) else w == v
            assert same, f"{what}: state {k!r} of parameter {i} changed"


def test_bad_checkpoints_raise_clear_errors():
    params = [p.requires_grad_() for p in _params()[:1]]
    opt = _qmuon(params, "int8")
    _run(opt, params, range(1))
    good = _roundtrip(opt.state_dict())

    def fresh():
        return _qmuon([p.detach().clone().requires_grad_() for p in params], "int8")

    # Each bad load is attempted on an optimizer that already holds other state (3 steps, not the
    # checkpoint's 1) and on a fresh one: the rejected checkpoint must leave both as they were.
    held_params = [p.detach().clone().requires_grad_() for p in params]
    held = _qmuon(held_params, "int8")
    held.param_groups[0]["lr"] *= 0.5  # a hyperparameter the checkpoint would overwrite
    _run(held, held_params, range(3))
    empty = fresh()
    before = {"held": _snapshot(held), "fresh": _snapshot(empty)}
    assert before["held"]["state"] and not before["fresh"]["state"]

    def rejected(bad, error, match, what):
        for name, target in (("held", held), ("fresh", empty)):
            with pytest.raises(error, match=match):
                target.load_state_dict(bad)
            _assert_unchanged(target, before[name], f"{what} ({name} optimizer)")

    bad = _roundtrip(good)
    bad["state"][0]["exp_avg_absmax"] = torch.zeros(200, 2)
    rejected(bad, qstate.StateFormatError, r"exp_avg_absmax has shape \(200, 2\), expected \(200, 1\) for block_size=256",
             "mis-shaped absmax")
    bad = _roundtrip(good)
    del bad["state"][0]["exp_avg_sq_absmax"]
    rejected(bad, qstate.StateFormatError, "exp_avg_sq_q8 present without exp_avg_sq_absmax", "missing absmax")
    bad = _roundtrip(good)
    bad["state"][0]["exp_avg_q8"] = bad["state"][0]["exp_avg_q8"][:10]
    rejected(bad, qstate.StateFormatError, r"exp_avg_q8 has shape \(10, 48\)", "truncated codes")
    bad = _roundtrip(good)
    bad["param_groups"][0]["qmuon_version"] = FORMAT_VERSION + 1
    rejected(bad, ValueError, "newer than this", "newer version")
    bad = _roundtrip(good)
    bad["state"][0] = {"step": torch.tensor(1.0), "exp_avg": torch.full((200, 48), float("nan")),
                       "exp_avg_sq": torch.ones(200, 48)}
    rejected(bad, qstate.StateFormatError, "NaN/Inf", "NaN moments")
    # and the good checkpoint still loads into the optimizer that refused the bad ones
    held.load_state_dict(good)
    assert torch.equal(held.state[held_params[0]]["exp_avg_q8"], opt.state[params[0]]["exp_avg_q8"])
    assert held.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_version_1_adamw_state_loads():
    """A version-1 checkpoint (AdamW state as torch's fp32 moments; the AdamW group carried the Muon
    default state_format) loads into an int8 QMuon."""
    params = [p.requires_grad_() for p in _params()[:1]]
    old = _qmuon(params, "fp32")
    _run(old, params, range(2))
    sd = _roundtrip(old.state_dict())
    for g in sd["param_groups"]:
        g["qmuon_version"] = 1
        g["state_format"] = "int8"  # what a v1 AdamW group held (QMuon's Muon default)
    new = _qmuon([p.detach().clone().requires_grad_() for p in params], "int8")
    new.load_state_dict(sd)
    st = new.state[new.param_groups[0]["params"][0]]
    assert st["exp_avg_q8"].dtype == torch.int8 and math.isclose(float(st["step"]), 2.0)


# ----------------------------------------------------------------------------- stochastic rounding of the moments
@pytest.mark.parametrize("family", ["int8", "int4"])
def test_stochastic_rounding_of_quantized_moments(family):
    """rounding='stochastic' reaches the AdamW groups' quantized moments: the codes differ from
    nearest rounding's, two runs with one seed are bit-identical, another seed differs, and the run
    still tracks fp32-moment AdamW (tolerance of test_quantized_families_track_torch_adamw)."""
    init = _params()
    runs = {}
    for name, kw in (("near", {}), ("sr", {"state": {"rounding": "stochastic", "seed": 3}}),
                     ("sr2", {"state": {"rounding": "stochastic", "seed": 3}}), ("sr_other", {"state": {"rounding": "stochastic", "seed": 4}}),
                     ("fp32", {"state": {"rounding": "stochastic"}})):
        ps = [p.clone().requires_grad_() for p in init]
        opt = _qmuon(ps, "fp32" if name == "fp32" else family, **kw)
        _run(opt, ps, range(5))
        runs[name] = (ps, opt.state[ps[0]])
    codes = [k for k, v in runs["sr"][1].items() if v.dtype in (torch.int8, torch.uint8)]
    assert codes, "the embedding-like table has no quantized moments"
    for k in codes:
        assert not torch.equal(runs["sr"][1][k], runs["near"][1][k]), k
        assert torch.equal(runs["sr"][1][k], runs["sr2"][1][k]), k
        assert not torch.equal(runs["sr"][1][k], runs["sr_other"][1][k]), k
    for x, y in zip(runs["sr"][0], runs["sr2"][0]):
        assert torch.equal(x, y)
    tol = {"int8": 0.02, "int4": 0.3}[family]
    ref, got = runs["fp32"][0][0], runs["sr"][0][0]
    assert float((got - ref).detach().norm() / (ref.detach() - init[0]).norm()) < tol


@pytest.mark.parametrize("family", ["int8", "int4"])
def test_stochastic_resume_is_bit_exact(family):
    """Save mid-run, load into a fresh optimizer, continue: the noise is a function of (seed, parameter,
    step, element), so the resumed run equals the uninterrupted one bit for bit. The checkpoint's
    AdamW group records rounding and seed (structural keys: the constructed optimizer's win)."""
    init = _params()
    kw = {"state": {"rounding": "stochastic", "seed": 11}}
    a = [p.clone().requires_grad_() for p in init]
    oa = _qmuon(a, family, **kw)
    _run(oa, a, range(6))
    b = [p.clone().requires_grad_() for p in init]
    ob = _qmuon(b, family, **kw)
    _run(ob, b, range(3))
    sd = _roundtrip(ob.state_dict())
    assert sd["param_groups"][0]["rounding"] == "stochastic" and sd["param_groups"][0]["seed"] == 11
    c = [p.detach().clone().requires_grad_() for p in b]
    oc = _qmuon(c, family, **kw)
    oc.load_state_dict(sd)
    _run(oc, c, range(3, 6))
    for x, y in zip(a, c):
        assert torch.equal(x, y), family
    for k, v in oa.state[a[0]].items():
        assert torch.equal(v, oc.state[c[0]][k]), k


def test_stochastic_moments_and_bf16_weights_draw_distinct_streams():
    """One (seed, key, step) gives three different streams: Muon momentum, bf16 weights, AdamW moments."""
    from qmuon.ops import reference as ref
    from qmuon.ops import reference_weight as refw

    s = {ref.noise_stream(0, 1, 2), refw.weight_noise_stream(0, 2, 1), qadamw.moment_noise_stream(0, 2, 1)}
    assert len(s) == 3


@pytest.mark.parametrize("family", ["int8", "int4"])
def test_overflowing_gradient_square_freezes_only_its_element(family):
    """One finite gradient element of 1e20 (its square overflows fp32; finite, so the non-finite
    policy lets it through): the block scales stay finite, and after the outlier's v has decayed
    (beta2 = 0.5) the other elements of its block move like fp32-moment AdamW again. Before the
    FLT_MAX clamp the block's v scale was inf and its other elements never moved again. beta1 = 0
    keeps m out of it (a spike in m dominates its block's m scale for ~log(1e21) / -log(beta1)
    steps, a property of any block-scaled m, overflow or not)."""
    torch.manual_seed(0)
    p = torch.randn(64, 256, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    kw = dict(adamw_lr=1e-3, update={"adamw_betas": (0.0, 0.5)}, adamw_weight_decay=0.0)
    opt = QMuon([{"params": [p], "use_muon": False}], adamw_state_format=family, **kw)
    ref = QMuon([{"params": [q], "use_muon": False}], adamw_state_format="fp32", **kw)
    gen = torch.Generator().manual_seed(1)
    for step in range(160):
        g = torch.randn(64, 256, generator=gen) * 1e-2
        if step == 0:
            g[0, 3] = 1e20
        p.grad, q.grad = g, g.clone()
        before, before_ref = p.detach().clone(), q.detach().clone()
        opt.step()
        ref.step()
    st = opt.state[p]
    assert all(torch.isfinite(v).all() for k, v in st.items() if v.dtype == torch.float32), "a scale overflowed"
    moved = (p.detach() - before)[0, :128]
    others = torch.ones(128, dtype=torch.bool)
    others[3] = False
    assert (moved[others].abs() > 1e-5).float().mean() > 0.9, "the outlier's block stays frozen"
    # the rest of the block steps like fp32-moment AdamW (same sign of step almost everywhere)
    want = (q.detach() - before_ref)[0, :128]
    assert (torch.sign(moved[others]) == torch.sign(want[others])).float().mean() > 0.9
