"""QMuon keeps the ``torch.optim.Optimizer`` contract that tools rely on.

Modelled on PyTorch's generic optimizer tests (``test/test_optim.py``, driven by the
``OptimizerInfo`` table of ``torch/testing/_internal/common_optimizers.py``): the same checks, run
here against QMuon for every momentum format (``qmuon.quant.state.STATE_FORMATS``) and for fp32 and
bf16 weights (``model.to(torch.bfloat16)``): state-dict determinism (step, save, load into a fresh
optimizer, step both: identical), ``torch.save`` / ``torch.load(weights_only=True)``, every hook
(step pre / post, state-dict pre / post, load-state-dict pre / post), ``copy.deepcopy`` and pickle,
a tensor ``lr`` (torch's "Tensor lr" optimizer input), a ``step`` saved as a Python number
(``test_load_nontensor_step``), parameters without gradients (``test_step_is_noop_when_params_have_no_grad``),
zero gradients (``test_step_is_noop_for_zero_grads``) and printing
(``test_optimizer_can_be_printed``); then ``add_param_group`` (torch's
``test_param_groups_*``), which QMuon routes like ``build_optimizer``.

torch's helpers cannot be imported here (``common_optimizers`` pulls in ``expecttest``, a torch
development dependency), so the table of inputs is this module's :data:`CONFIGS`. Gradients are
drawn from a seeded generator instead of computed, so two optimizers compared "with the same
gradients" get the same bits. Tiny shapes: the file runs in seconds.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

from _helpers import assert_same, roundtrip_state_dict
from qmuon import QMuon, build_optimizer
from qmuon.quant.state import STATE_FORMATS, StateFormatError

WEIGHTS = ("fp32", "bf16")
CONFIGS = [pytest.param(fmt, w, id=f"{fmt}-{w}") for fmt in STATE_FORMATS for w in WEIGHTS]
LR, ADAMW_LR = 0.02, 3e-3


class Net(nn.Module):
    """Every routing target: an embedding (AdamW, 4096 elements: quantized AdamW moments), two
    hidden matrices (Muon), a norm (AdamW without decay) and a classifier head (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(128, 32)
        self.hidden = nn.Linear(32, 48)
        self.mid = nn.Linear(48, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.mid(torch.relu(self.hidden(self.embed(x))))))


def _model(weights: str, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    model = Net()
    return model.to(torch.bfloat16) if weights == "bf16" else model


def _build(model: nn.Module, fmt: str, **kw) -> QMuon:
    kw = {"lr": LR, "adamw_lr": ADAMW_LR, "state": {"block_size": 32, "seed": 3}, **kw}
    return build_optimizer(model, state_format=fmt, verbose=False, **kw)


def _set_grads(model: nn.Module, step: int, skip: tuple[nn.Parameter, ...] = ()) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        grad = (torch.randn(p.shape, generator=g) * 0.01).to(p.dtype)
        p.grad = None if any(p is q for q in skip) else grad


def _train(model: nn.Module, opt: QMuon, steps) -> None:
    for s in steps:
        _set_grads(model, s)
        opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _assert_params_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert_same(p.detach(), q.detach(), name)


def _names(opt: QMuon) -> list[str]:
    return [g["name"] for g in opt.param_groups]


# --------------------------------------------------------------------------- state dict
@pytest.mark.parametrize("via", ["state_dict", "torch.save"])
@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_state_dict_deterministic(fmt: str, weights: str, via: str) -> None:
    """torch's test_state_dict_deterministic / test_save_load_equality_with_weights_only: a fresh
    optimizer loaded from the state dict continues exactly as the original."""
    model = _model(weights)
    opt = _build(model, fmt)
    _train(model, opt, range(2))
    sd = opt.state_dict()
    sd = roundtrip_state_dict(sd) if via == "torch.save" else copy.deepcopy(sd)
    twin = copy.deepcopy(model)
    twin_opt = _build(twin, fmt)
    twin_opt.load_state_dict(sd)
    assert_same(twin_opt.state_dict(), opt.state_dict(), "loaded")
    _train(model, opt, range(2, 4))
    _train(twin, twin_opt, range(2, 4))
    _assert_params_equal(model, twin)
    assert_same(twin_opt.state_dict(), opt.state_dict(), "after 2 more steps")
    assert _names(twin_opt) == _names(opt) == ["muon", "adamw", "adamw_no_decay"]


def test_group_names_survive_a_checkpoint_and_old_checkpoints_keep_todays() -> None:
    model = _model("fp32")
    opt = _build(model, "int8")
    _train(model, opt, range(1))
    sd = roundtrip_state_dict(opt.state_dict())
    assert [g["name"] for g in sd["param_groups"]] == ["muon", "adamw", "adamw_no_decay"]
    old = copy.deepcopy(sd)
    for g in old["param_groups"]:
        del g["name"]  # saved before groups had names
    fresh = _build(copy.deepcopy(model), "int8")
    fresh.load_state_dict(old)
    assert _names(fresh) == ["muon", "adamw", "adamw_no_decay"]


# --------------------------------------------------------------------------- hooks
@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_step_hooks(fmt: str, weights: str) -> None:
    """Step pre-hooks run before the step and may replace its arguments; post-hooks run after it
    (torch's test_step_pre_hook / test_step_post_hook / test_step_all_hooks)."""
    model = _model(weights)
    opt = _build(model, fmt)
    calls: list[str] = []
    before = _params(model)

    def closure() -> torch.Tensor:
        calls.append("closure")
        _set_grads(model, 0)
        return torch.tensor(1.5)

    def pre(o, args, kwargs):
        assert o is opt and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
        calls.append("pre")
        return args, {"closure": closure}  # the step runs with this closure instead of none

    def post(o, args, kwargs):
        calls.append("post")
        assert kwargs == {"closure": closure}
        assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), before))

    handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
    assert opt.step() == 1.5
    assert calls == ["pre", "closure", "post"]
    for h in handles:
        h.remove()
    _set_grads(model, 1)
    opt.step()
    assert calls == ["pre", "closure", "post"]


@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_state_dict_hooks(fmt: str, weights: str) -> None:
    """torch's test_state_dict_pre_hook / test_state_dict_post_hook: the pre-hook runs before the
    packing (its edits are saved), the post-hook gets the finished dict and may replace it."""
    model = _model(weights)
    opt = _build(model, fmt)
    _train(model, opt, range(1))

    def pre(o):
        o.state["test"] = 1

    def post(o, sd):
        assert sd["state"]["test"] == 1
        assert all(g["qmuon_version"] for g in sd["param_groups"])  # the finished dict
        return {**sd, "ran_state_dict_post_hook": True}

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_post_hook(post)
    sd = opt.state_dict()
    assert sd["ran_state_dict_post_hook"] and sd["state"]["test"] == 1
    del opt.state["test"]


@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_load_state_dict_hooks(fmt: str, weights: str) -> None:
    """torch's test_load_state_dict_pre_hook_and_prepend / test_load_state_dict_post_hook: pre-hooks
    get the caller's whole state dict (a shallow copy), in order (``prepend``), may edit it or
    return a replacement, and what they give is loaded; post-hooks run once it is in place."""
    model = _model(weights)
    opt = _build(model, fmt)
    _train(model, opt, range(2))
    sd = opt.state_dict()
    n_state = len(sd["state"])
    twin = copy.deepcopy(model)
    fresh = _build(twin, fmt)
    order: list[str] = []

    def pre1(o, state_dict):
        order.append("pre1")
        assert state_dict is not sd and len(state_dict["state"]) == n_state  # the user's state, not an empty one
        state_dict["param_groups"][0]["lr"] = 0.002  # an in-place edit of the copy

    def pre2(o, state_dict):
        order.append("pre2")
        groups = copy.deepcopy(state_dict["param_groups"])
        groups[1]["lr"] = 0.0005
        return {"state": state_dict["state"], "param_groups": groups}  # a replacement

    def first(o, state_dict):
        order.append("first")

    def post(o):
        order.append("post")
        assert o.param_groups[0]["lr"] == 0.002 and o.param_groups[1]["lr"] == 0.0005
        assert sum(1 for p in twin.parameters() if o.state.get(p)) == n_state

    fresh.register_load_state_dict_pre_hook(pre1)
    fresh.register_load_state_dict_pre_hook(pre2)
    fresh.register_load_state_dict_pre_hook(first, prepend=True)
    fresh.register_load_state_dict_post_hook(post)
    fresh.load_state_dict(sd)
    assert order == ["first", "pre1", "pre2", "post"]
    assert sd["param_groups"][1]["lr"] == ADAMW_LR  # pre2's replacement is not the caller's dict
    fresh.param_groups[0]["lr"], fresh.param_groups[1]["lr"] = opt.param_groups[0]["lr"], opt.param_groups[1]["lr"]
    _train(model, opt, range(2, 3))
    _train(twin, fresh, range(2, 3))
    _assert_params_equal(model, twin)


# --------------------------------------------------------------------------- copies
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_copy_is_a_full_optimizer(fmt: str, weights: str, how: str) -> None:
    """A model + optimizer pair copied together (copy.deepcopy, or a pickle round trip) steps
    exactly as the original: torch's test_deepcopy_copies_all_public_attrs, and a step after it."""
    model = _model(weights)
    opt = _build(model, fmt, safety={"max_nonfinite_skips": 3})
    _train(model, opt, range(2))
    pair = {"model": model, "opt": opt}
    pair2 = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
    model2, opt2 = pair2["model"], pair2["opt"]
    assert type(opt2) is QMuon
    assert {id(p) for g in opt2.param_groups for p in g["params"]} == {id(p) for p in model2.parameters()}
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public <= set(vars(opt2)), public - set(vars(opt2))
    assert opt2.config == opt.config and opt2.max_nonfinite_skips == 3 and opt2.routing == opt.routing
    assert (opt2.router.model is model2) if how == "deepcopy" else opt2.router.model is None
    _train(model, opt, range(2, 4))
    _train(model2, opt2, range(2, 4))
    _assert_params_equal(model, model2)
    assert_same(opt2.state_dict(), opt.state_dict(), how)


def test_copy_with_gradient_release_is_refused_and_points_to_state_dict() -> None:
    model = _model("fp32")
    opt = _build(model, "int8", gradient_release=True)
    for copier in (copy.deepcopy, pickle.dumps, lambda o: torch.save(o, io.BytesIO())):
        with pytest.raises(RuntimeError, match=r"gradient release.*state_dict\(\)"):
            copier(opt)
    assert opt.gradient_release is not None  # nothing changed
    opt.gradient_release.detach()
    copy.deepcopy(opt)  # without release, a copy is fine


# --------------------------------------------------------------------------- tensor lr
@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_tensor_lr(fmt: str, weights: str) -> None:
    """A one-element tensor lr / weight_decay (Muon and AdamW groups) steps bit for bit as the
    Python float of the same value (the step reads it with ``float()``). Against the decimal
    literal (0.02 is not an fp32 number) the lr differs in its 9th digit, and so may the updates:
    fp32 weights agree to rtol 1e-6 (bf16 weights can round to the neighbouring bf16 value)."""
    lrs = {"lr": torch.tensor(LR), "adamw_lr": torch.tensor(ADAMW_LR), "weight_decay": torch.tensor(0.1)}
    runs = {}
    for kind in ("tensor", "float", "literal"):
        model = _model(weights)
        kw = {"tensor": lrs, "float": {k: float(v) for k, v in lrs.items()},
              "literal": {"lr": LR, "adamw_lr": ADAMW_LR, "weight_decay": 0.1}}[kind]
        opt = _build(model, fmt, **kw)
        _train(model, opt, range(3))
        runs[kind] = (model, opt)
    model, opt = runs["tensor"]
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor) and isinstance(opt.param_groups[1]["lr"], torch.Tensor)
    _assert_params_equal(model, runs["float"][0])
    if weights == "fp32":
        for p, q in zip(model.parameters(), runs["literal"][0].parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    sd = roundtrip_state_dict(opt.state_dict())  # a tensor lr saves and loads (weights_only)
    fresh = _build(copy.deepcopy(model), fmt, **lrs)
    fresh.load_state_dict(sd)
    assert torch.equal(fresh.param_groups[0]["lr"], lrs["lr"])


def test_tensor_lr_must_have_one_element() -> None:
    with pytest.raises(ValueError, match=r"lr must be >= 0 \(a number or a one-element tensor\)"):
        _build(_model("fp32"), "int8", lr=torch.tensor([0.02, 0.02]))
    with pytest.raises(ValueError, match="lr must be a number or a one-element tensor"):
        _build(_model("fp32"), "int8", adamw_lr=torch.tensor([1e-3, 1e-3]))


# --------------------------------------------------------------------------- loading
@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_load_nontensor_step(fmt: str, weights: str) -> None:
    """torch's test_load_nontensor_step: ``step`` saved as a Python number (older torch, fused
    Adam) loads as a 0-d fp32 tensor and the run continues as with tensor steps."""
    model = _model(weights)
    opt = _build(model, fmt)
    _train(model, opt, range(2))
    sd = opt.state_dict()
    numbers = copy.deepcopy(sd)
    for st in numbers["state"].values():
        st["step"] = int(st["step"].item())
    runs = []
    for saved in (sd, numbers):
        twin = copy.deepcopy(model)
        fresh = _build(twin, fmt)
        fresh.load_state_dict(saved)
        for st in fresh.state.values():
            assert isinstance(st["step"], torch.Tensor) and st["step"].dtype == torch.float32 and st["step"].dim() == 0
        _train(twin, fresh, range(2, 4))
        runs.append((twin, fresh))
    _assert_params_equal(*[m for m, _ in runs])
    assert_same(runs[0][1].state_dict(), runs[1][1].state_dict())


def _bad_checkpoints(opt: QMuon) -> dict[str, dict]:
    """State dicts that fail late: the bad entry is the last parameter of its group."""
    sd = opt.state_dict()
    muon_last = sd["param_groups"][0]["params"][-1]
    adamw_last = sd["param_groups"][-1]["params"][-1]
    out = {}
    bad = copy.deepcopy(sd)
    bad["state"][adamw_last]["step"] = "three"
    out["AdamW step not a number"] = bad
    bad = copy.deepcopy(sd)
    bad["state"][muon_last]["step"] = [3]
    out["Muon step not a number"] = bad
    bad = copy.deepcopy(sd)
    st = bad["state"][muon_last]
    key = next(k for k, v in st.items() if k != "step" and isinstance(v, torch.Tensor) and v.dim() >= 1)
    st[key] = st[key][:1]
    out["Muon momentum of the wrong shape"] = bad
    bad = copy.deepcopy(sd)
    bad["param_groups"] = bad["param_groups"][:-1]
    out["a group missing"] = bad
    return out


@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_failing_load_changes_nothing(fmt: str, weights: str) -> None:
    model = _model(weights)
    opt = _build(model, fmt)
    _train(model, opt, range(2))
    before = copy.deepcopy(opt.state_dict())
    for what, bad in _bad_checkpoints(opt).items():
        with pytest.raises((ValueError, StateFormatError)):
            opt.load_state_dict(bad)
        assert_same(opt.state_dict(), before, what)
    _train(model, opt, range(2, 3))  # and it still steps


# --------------------------------------------------------------------------- what a step skips
@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_params_without_grads_are_skipped(fmt: str, weights: str) -> None:
    """torch's test_step_is_noop_when_params_have_no_grad: a parameter without a gradient is not
    changed, nor is its state (none is created for it)."""
    model = _model(weights)
    opt = _build(model, fmt)
    never = (model.mid.weight, model.norm.weight)  # a Muon and an AdamW parameter
    _set_grads(model, 0, skip=never)
    opt.step()
    assert not any(opt.state.get(p) for p in never)
    later = (model.hidden.weight, model.embed.weight)
    saved = {id(p): copy.deepcopy(opt.state[p]) for p in later}
    values = [p.detach().clone() for p in later]
    _set_grads(model, 1, skip=later)
    opt.step()
    for p, v in zip(later, values):
        assert_same(p.detach(), v, "parameter")
        assert_same(opt.state[p], saved[id(p)], "state")
    for p in model.parameters():  # none at all: a no-op
        p.grad = None
    before, state = _params(model), copy.deepcopy(opt.state_dict())
    opt.step()
    for p, v in zip(model.parameters(), before):
        assert_same(p.detach(), v)
    assert_same(opt.state_dict(), state)


@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_zero_grads_leave_params_unchanged(fmt: str, weights: str) -> None:
    """torch's test_step_is_noop_for_zero_grads: without weight decay, a zero gradient on zero
    state moves nothing (Muon's NS of a zero matrix is zero; AdamW's m / (sqrt(v) + eps) is 0)."""
    model = _model(weights)
    opt = _build(model, fmt, weight_decay=0.0, adamw_weight_decay=0.0)
    before = _params(model)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    for (name, p), v in zip(model.named_parameters(), before):
        assert_same(p.detach(), v, name)
    assert all(opt.state[p] for p in model.parameters())
    assert opt.nonfinite_skips == 0


# --------------------------------------------------------------------------- printing
@pytest.mark.parametrize("fmt,weights", CONFIGS)
def test_optimizer_can_be_printed(fmt: str, weights: str) -> None:
    opt = _build(_model(weights), fmt)
    text = repr(opt)
    assert text.startswith("QMuon (") and str(opt) == text
    assert "Parameter Group 0 'muon' (Muon, 2 parameters)" in text
    assert "Parameter Group 1 'adamw' (AdamW, 2 parameters)" in text
    assert "Parameter Group 2 'adamw_no_decay' (AdamW, 5 parameters)" in text
    assert f"state_format: {fmt}" in text
    assert "['hidden.bias', 'mid.bias', 'norm.weight', ... (5 names)]" in text


# --------------------------------------------------------------------------- add_param_group
class Finetune(nn.Module):
    """A backbone frozen at build time (the optimizer holds only the head, on AdamW) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.LayerNorm(32))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _frozen_backbone(**kw) -> tuple[Finetune, QMuon]:
    torch.manual_seed(0)
    model = Finetune()
    model.backbone.requires_grad_(False)
    opt = build_optimizer(model, lr=LR, adamw_lr=ADAMW_LR, verbose=False, **kw)
    model.backbone.requires_grad_(True)
    return model, opt


def test_add_param_group_routes_like_build_optimizer() -> None:
    model, opt = _frozen_backbone()
    assert _names(opt) == ["adamw", "adamw_no_decay"]  # the head: AdamW (an output head, by role)
    lr = opt.param_groups[0]["lr"] / 10  # what Lightning's BaseFinetuning passes
    opt.add_param_group({"params": list(model.backbone.parameters()), "lr": lr})
    muon, bias = opt.param_groups[2:]
    assert muon["use_muon"] and muon["name"] == "muon" and muon["param_names"] == ["backbone.0.weight", "backbone.2.weight"]
    assert not bias["use_muon"] and bias["name"] == "adamw_no_decay_2" and bias["weight_decay"] == 0.0
    assert bias["param_names"] == ["backbone.0.bias", "backbone.2.bias", "backbone.3.weight", "backbone.3.bias"]
    # lr: read in param_groups[0]'s units (AdamW): the AdamW part gets it as it is, the Muon part
    # the Muon / AdamW ratio (no Muon group yet: the defaults, 0.02 / 3e-3) times it.
    assert bias["lr"] == lr and muon["lr"] == pytest.approx(lr * LR / ADAMW_LR)
    # the last group (BackboneFinetuning writes param_groups[-1]) is of param_groups[0]'s family
    assert opt.param_groups[-1] is bias and muon["lr_follows"] == "adamw_no_decay_2"
    _set_grads(model, 0)
    opt.step()
    assert {"momentum_codes", "momentum_absmax", "step"} <= set(opt.state[model.backbone[0].weight])
    assert set(opt.state[model.backbone[0].bias]) >= {"exp_avg", "exp_avg_sq", "step"}


def test_add_param_group_lr_rule_with_a_muon_first_group_and_without_lr() -> None:
    torch.manual_seed(0)
    model = Finetune()
    model.head.requires_grad_(False)
    opt = build_optimizer(model, lr=LR, adamw_lr=ADAMW_LR, verbose=False)
    assert opt.param_groups[0]["name"] == "muon"
    opt.param_groups[0]["lr"] = opt.param_groups[1]["lr"] = 0  # a scheduler at 0: the defaults give the ratio
    model.head.requires_grad_(True)
    opt.add_param_group({"params": [model.head.weight], "lr": 0.004})
    assert opt.param_groups[-1]["name"] == "adamw" and opt.param_groups[-1]["lr"] == pytest.approx(0.004 * ADAMW_LR / LR)
    extra = nn.Linear(6, 6)  # not in the model: labels, routed by shape
    opt.add_param_group({"params": list(extra.parameters())})
    b, w = opt.param_groups[-2:]  # the leader last: param_groups[0]'s family, Muon
    assert (w["name"], w["lr"], w["param_names"]) == ("muon_2", LR, ["param_groups[3].params[0]"])
    assert (b["name"], b["lr"], b["param_names"]) == ("adamw_no_decay_2", ADAMW_LR, ["param_groups[3].params[1]"])


def test_added_groups_follow_their_leader_until_set() -> None:
    model, opt = _frozen_backbone()
    opt.add_param_group({"params": list(model.backbone.parameters()), "lr": 1e-4})
    muon, lead = opt.param_groups[2:]
    ratio = muon["lr"] / lead["lr"]
    lead["lr"] = 2e-4  # BackboneFinetuning's next epoch
    _train(model, opt, range(1))
    assert muon["lr"] == pytest.approx(2e-4 * ratio)
    muon["lr"] = 0.5  # set by someone else: no longer follows
    lead["lr"] = 3e-4
    _train(model, opt, range(1, 2))
    assert muon["lr"] == 0.5 and "lr_follows" not in muon
    sd = roundtrip_state_dict(opt.state_dict())
    model2, opt2 = _frozen_backbone()
    opt2.add_param_group({"params": list(model2.backbone.parameters()), "lr": 1e-4})
    opt2.load_state_dict(sd)
    assert _names(opt2) == _names(opt) and opt2.param_groups[2]["lr"] == 0.5


def test_add_param_group_keeps_the_callers_keys_and_name() -> None:
    model, opt = _frozen_backbone()
    opt.add_param_group({"params": list(model.backbone.parameters()), "name": "backbone", "momentum": 0.9,
                         "betas": (0.8, 0.9), "weight_decay": 0.05, "tag": "x"})
    muon, bias = opt.param_groups[2:]
    assert (muon["name"], bias["name"]) == ("backbone_muon", "backbone_adamw_no_decay")
    assert muon["momentum"] == 0.9 and muon["weight_decay"] == 0.05 and muon["tag"] == "x" and "betas" not in muon
    assert bias["betas"] == (0.8, 0.9) and bias["weight_decay"] == 0.0 and bias["tag"] == "x"


def test_explicit_groups_are_added_as_given_with_names() -> None:
    model, opt = _frozen_backbone()
    opt.add_param_group({"params": [model.backbone[0].weight], "use_muon": False})
    g = opt.param_groups[-1]
    assert not g["use_muon"] and g["param_names"] == ["backbone.0.weight"] and g["name"] == "adamw_2"
    plain = QMuon([model.backbone[2].weight])  # no names anywhere: none are added
    plain.add_param_group({"params": [model.backbone[2].bias]})
    assert "param_names" not in plain.param_groups[-1] and not plain.param_groups[-1]["use_muon"]


@pytest.mark.parametrize("bad", ["duplicate", "bad option", "not a tensor", "1-D in a Muon group",
                                 "Muon option in an AdamW group"])
def test_refused_group_leaves_the_optimizer_as_it_was(bad: str) -> None:
    model, opt = _frozen_backbone()
    group = {
        "duplicate": {"params": [model.backbone[0].weight, model.head.weight]},  # the second split fails
        "bad option": {"params": list(model.backbone.parameters()), "state_format": "int5"},
        "not a tensor": {"params": [model.backbone[0].weight, 3.0]},
        "1-D in a Muon group": {"params": [model.backbone[0].bias], "use_muon": True},
        "Muon option in an AdamW group": {"params": [model.backbone[0].bias], "use_muon": False, "ns_steps": 7},
    }[bad]
    before = copy.deepcopy(opt.state_dict())
    n = len(opt.param_groups)
    with pytest.raises((ValueError, TypeError)):
        opt.add_param_group(group)
    assert len(opt.param_groups) == n
    assert_same(opt.state_dict(), before)
    _set_grads(model, 0)
    opt.step()  # and it still steps


def test_groups_hold_their_own_optimizers_options() -> None:
    """A Muon group holds the Muon options, an AdamW group AdamW's (as a torch.optim.AdamW group
    holds AdamW's): no Newton-Schulz, momentum, layout or GRASP key in an AdamW group."""
    from qmuon.core.config import ADAMW_GROUP_KEYS, GROUP_KEYS

    model, opt = _frozen_backbone()
    opt.add_param_group({"params": list(model.backbone.parameters())})
    bookkeeping = {"params", "name", "param_names", "use_muon"}
    for g in opt.param_groups:
        keys = set(g) - bookkeeping
        if g["use_muon"]:
            assert set(GROUP_KEYS.values()) <= keys and "betas" not in keys
        else:
            assert keys == set(ADAMW_GROUP_KEYS.values()), g["name"]
            assert not keys & {"ns_steps", "ns_coefficients", "ns_dtype", "grid_block", "momentum", "nesterov", "parts"}


def test_an_adamw_group_saved_with_muon_keys_loads_without_them() -> None:
    """Checkpoints written before AdamW groups held their own options carry every Muon key in
    them (with the defaults); loading drops those keys and the run goes on identically."""
    torch.manual_seed(0)
    model = Net()
    opt = build_optimizer(model, lr=LR, adamw_lr=ADAMW_LR)
    _set_grads(model, 0)
    opt.step()
    sd = opt.state_dict()
    old = copy.deepcopy(sd)
    muon_defaults = {k: v for k, v in opt.defaults.items() if k not in opt._adamw_defaults and k != "use_muon"}
    for g in old["param_groups"]:
        if not g["use_muon"]:
            g.update(copy.deepcopy(muon_defaults))
    fresh = build_optimizer(copy.deepcopy(model), lr=LR, adamw_lr=ADAMW_LR)
    fresh.load_state_dict(old)
    for g in fresh.param_groups:
        if not g["use_muon"]:
            assert "ns_steps" not in g and "grid_block" not in g
    assert_same(fresh.state_dict(), sd)
