"""Bad inputs raise clear errors; non-finite gradients are skipped or raise without touching
the state."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from _helpers import assert_same, roundtrip_state_dict
from qmuon import QMuon
from qmuon.optim import FORMAT_VERSION
from qmuon.quant import StateFormatError


def _mat(*shape):
    return nn.Parameter(torch.randn(*shape))


# --------------------------------------------------------------------------- constructor
@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"state_format": "fp8"}, r"unknown state_format 'fp8'; choose one of fp32, bf16, int8, uint8, int4, e0m3, grasp4"),
        ({"state": {"block_size": 100}}, r"block_size must be a multiple of 32.*got 100"),
        ({"state": {"block_size": 0}}, r"block_size must be a multiple of 32.*got 0"),
        ({"state": {"block_size": 8192}}, r"block_size must be a multiple of 32 in \[32, 4096\].*got 8192"),
        ({"state": {"rounding": "floor"}}, r"rounding must be 'nearest' or 'stochastic', got 'floor'"),
        ({"safety": {"nonfinite": "ignore"}}, r"nonfinite must be 'skip' or 'raise', got 'ignore'"),
        ({"update": {"adjust_lr_fn": "sqrt"}}, r"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got 'sqrt'"),
        ({"momentum": 1.0}, r"momentum must be in \[0, 1\), got 1.0"),
        ({"lr": -1.0}, r"lr must be >= 0"),
    ],
)
def test_bad_constructor_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        QMuon([_mat(4, 8)], **kwargs)


def test_unknown_format_is_a_state_format_error():
    with pytest.raises(StateFormatError):
        QMuon([_mat(4, 8)], state_format="int3")


def test_one_dimensional_tensor_in_muon_group_points_to_adamw():
    with pytest.raises(ValueError) as exc:
        QMuon([_mat(4, 8), nn.Parameter(torch.zeros(8))])
    msg = str(exc.value)
    assert "parameter #1 has shape (8,)" in msg
    assert "AdamW" in msg and "'use_muon': False" in msg and "build_optimizer" in msg


def test_one_dimensional_tensor_is_named_when_group_has_names():
    with pytest.raises(ValueError, match=r"parameter 'norm.weight' has shape \(8,\)"):
        QMuon([{"params": [nn.Parameter(torch.zeros(8))], "param_names": ["norm.weight"]}])


def test_parts_must_sum_to_rows():
    with pytest.raises(ValueError, match=r"parts \(8, 8\) sum to 16 rows but parameter #0 has 24 rows"):
        QMuon([{"params": [_mat(24, 8)], "parts": (8, 8)}])
    with pytest.raises(ValueError, match=r"parts must be positive row counts"):
        QMuon([{"params": [_mat(24, 8)], "parts": (24, 0)}])


def test_bad_adamw_group():
    with pytest.raises(ValueError, match=r"AdamW\): betas must be in \[0, 1\)"):
        QMuon([{"params": [_mat(4)], "use_muon": False, "betas": (0.9, 1.0)}])


# --------------------------------------------------------------------------- load_state_dict
def _trained(fmt="int8", block_size=32, shapes=((16, 40), (8, 16)), groups=1, steps=2):
    torch.manual_seed(0)
    ps = [_mat(*s) for s in shapes]
    if groups == 1:
        opt = QMuon(ps, state_format=fmt, state={"block_size": block_size})
    else:
        opt = QMuon([{"params": [p]} for p in ps], state_format=fmt, state={"block_size": block_size})
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape)
        opt.step()
    return ps, opt


def test_load_wrong_block_size_names_both_sizes_and_changes_nothing():
    ps, opt = _trained(block_size=32, groups=2)
    sd = roundtrip_state_dict(opt.state_dict())
    target_ps, target = _trained(block_size=64, groups=2, steps=1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(StateFormatError) as exc:
        target.load_state_dict(sd)
    msg = str(exc.value)
    assert "block_size=32" in msg and "block_size=64" in msg
    assert_same(before["state"], target.state_dict()["state"], "state")
    assert all(g["block_size"] == 64 for g in target.param_groups)


def test_load_wrong_block_size_in_second_group_changes_nothing():
    """Validation of every group happens before any state is replaced."""
    _, opt = _trained(block_size=32, groups=2)
    sd = roundtrip_state_dict(opt.state_dict())
    sd["param_groups"][1]["block_size"] = 64
    sd["state"][1]["momentum_absmax"] = torch.zeros(8, 1)  # consistent with block_size 64
    _, target = _trained(block_size=32, groups=2, steps=1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(StateFormatError, match="block_size=64.*block_size=32"):
        target.load_state_dict(sd)
    assert_same(before["state"], target.state_dict()["state"], "state")


@pytest.mark.parametrize("fmt,key", [("int8", "momentum_codes"), ("fp32", "momentum_buffer")])
def test_load_wrong_shape(fmt, key):
    _, opt = _trained(fmt=fmt, shapes=((16, 40), (8, 16)))
    sd = roundtrip_state_dict(opt.state_dict())
    _, target = _trained(fmt=fmt, shapes=((16, 48), (8, 16)), steps=0)
    with pytest.raises(StateFormatError, match=rf"{key} has shape \(16, 40\) but the parameter is 16x48"):
        target.load_state_dict(sd)


def test_load_wrong_absmax_shape():
    _, opt = _trained()
    sd = roundtrip_state_dict(opt.state_dict())
    sd["state"][0]["momentum_absmax"] = torch.zeros(16, 3)
    _, target = _trained(steps=0)
    with pytest.raises(StateFormatError, match=r"momentum_absmax has shape \(16, 3\), expected \(16, 2\) for block_size=32"):
        target.load_state_dict(sd)


def test_load_wrong_number_of_groups():
    _, opt = _trained(groups=2)
    sd = roundtrip_state_dict(opt.state_dict())
    _, target = _trained(groups=1, steps=0)
    with pytest.raises(ValueError, match="checkpoint has 2 parameter groups but this optimizer has 1"):
        target.load_state_dict(sd)


def test_load_wrong_number_of_params():
    _, opt = _trained(shapes=((16, 40), (8, 16)))
    sd = roundtrip_state_dict(opt.state_dict())
    _, target = _trained(shapes=((16, 40),), steps=0)
    with pytest.raises(ValueError, match="checkpoint has 2 parameters, optimizer has 1"):
        target.load_state_dict(sd)


@pytest.mark.parametrize("dtype", [torch.int16, torch.float32])
def test_load_codes_of_wrong_dtype(dtype):
    _, opt = _trained()
    sd = roundtrip_state_dict(opt.state_dict())
    sd["state"][0]["momentum_codes"] = sd["state"][0]["momentum_codes"].to(dtype)
    _, target = _trained(steps=0)
    with pytest.raises(StateFormatError, match=rf"momentum_codes has dtype {re.escape(str(dtype))}; expected int8 or uint8"):
        target.load_state_dict(sd)


def test_load_absmax_of_wrong_dtype():
    _, opt = _trained()
    sd = roundtrip_state_dict(opt.state_dict())
    sd["state"][0]["momentum_absmax"] = sd["state"][0]["momentum_absmax"].half()
    _, target = _trained(steps=0)
    with pytest.raises(StateFormatError, match="momentum_absmax must be float32, got torch.float16"):
        target.load_state_dict(sd)


def test_load_inconsistent_format_label():
    _, opt = _trained(fmt="uint8")
    sd = roundtrip_state_dict(opt.state_dict())
    sd["param_groups"][0]["state_format"] = "int8"
    _, target = _trained(steps=0)
    with pytest.raises(StateFormatError, match="state_format='int8' but the tensors are uint8"):
        target.load_state_dict(sd)


def test_load_newer_version():
    _, opt = _trained()
    sd = roundtrip_state_dict(opt.state_dict())
    sd["param_groups"][0]["qmuon_version"] = FORMAT_VERSION + 1
    _, target = _trained(steps=0)
    with pytest.raises(ValueError, match=rf"version {FORMAT_VERSION + 1}, newer than this qmuon \({FORMAT_VERSION}\)"):
        target.load_state_dict(sd)


# --------------------------------------------------------------------------- non-finite gradients
def _snapshot(opt, ps):
    return [p.detach().clone() for p in ps], copy.deepcopy(opt.state_dict()["state"])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("fmt", ["int8", "fp32", "int4", "e0m3", "grasp4"])
def test_nonfinite_skip_leaves_param_and_state_unchanged(fmt, bad):
    torch.manual_seed(0)
    a, b, c = _mat(16, 40), _mat(8, 16), _mat(5)
    opt = QMuon([{"params": [a, b]}, {"params": [c], "use_muon": False}], state_format=fmt, state={"block_size": 32})
    for p in (a, b, c):
        p.grad = torch.randn(p.shape)
    opt.step()  # every parameter has state now
    assert opt.nonfinite_skips == 0
    (a0, b0, c0), state0 = _snapshot(opt, (a, b, c))
    ga = torch.randn(a.shape)
    ga[3, 7] = bad
    a.grad, b.grad, c.grad = ga, torch.randn(b.shape), torch.randn(c.shape)
    opt.step()
    assert opt.nonfinite_skips == 1
    assert torch.equal(a, a0)
    state1 = opt.state_dict()["state"]
    for k, v in state0[0].items():  # param a: codes/absmax (or buffer) and step untouched
        assert torch.equal(state1[0][k], v), k
    # the others still update, state included
    assert not torch.equal(b, b0) and not torch.equal(c, c0)
    assert state1[1]["step"].item() == 2.0 and state1[2]["step"].item() == 2.0

    # a non-finite AdamW gradient is skipped the same way
    c1 = c.detach().clone()
    exp_avg = opt.state[c]["exp_avg"].clone()
    for p in (a, b):
        p.grad = torch.randn(p.shape)
    c.grad = torch.full(c.shape, bad)
    opt.step()
    assert opt.nonfinite_skips == 2
    assert torch.equal(c, c1) and torch.equal(opt.state[c]["exp_avg"], exp_avg)
    assert opt.state[c]["step"].item() == 2.0
    assert not torch.equal(a, a0)  # a is fine again and updates


def test_nonfinite_raise_single_group_leaves_everything_unchanged():
    torch.manual_seed(0)
    a, b = _mat(16, 40), _mat(8, 16)
    opt = QMuon([{"params": [a, b], "param_names": ["blocks.0.w", "blocks.1.w"]}], safety={"nonfinite": "raise"}, state={"block_size": 32})
    for p in (a, b):
        p.grad = torch.randn(p.shape)
    opt.step()
    (a0, b0), state0 = _snapshot(opt, (a, b))
    a.grad = torch.randn(a.shape)
    b.grad = torch.randn(b.shape)
    b.grad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"non-finite gradient in 'blocks.1.w'; no parameter or optimizer state was changed"):
        opt.step()
    assert torch.equal(a, a0) and torch.equal(b, b0)
    assert_same(state0, opt.state_dict()["state"], "state")
    assert opt.nonfinite_skips == 0


def test_nonfinite_raise_multi_group_leaves_everything_unchanged():
    """The error says "no parameter or optimizer state was changed", and build_optimizer always makes
    several groups: a NaN in a later group (here a bias in the AdamW group after the Muon group)
    must not leave earlier groups half-stepped."""
    torch.manual_seed(0)
    w, u, bias = _mat(16, 40), _mat(8, 16), _mat(16)
    opt = QMuon([{"params": [w]}, {"params": [u]}, {"params": [bias], "use_muon": False}],
                safety={"nonfinite": "raise"}, state={"block_size": 32})
    for p in (w, u, bias):
        p.grad = torch.randn(p.shape)
    opt.step()
    params0, state0 = _snapshot(opt, (w, u, bias))
    w.grad = torch.randn(w.shape)
    u.grad = torch.randn(u.shape)
    bias.grad = torch.randn(bias.shape)
    bias.grad[3] = float("inf")
    with pytest.raises(FloatingPointError):
        opt.step()
    for p, p0 in zip((w, u, bias), params0):
        assert torch.equal(p, p0)
    assert_same(state0, opt.state_dict()["state"], "state")


# --------------------------------------------------------------------------- 4-bit formats
@pytest.mark.parametrize("fmt", ["int4", "e0m3", "grasp4"])
def test_load_wrong_shape_4bit(fmt):
    _, opt = _trained(fmt=fmt, shapes=((16, 40), (8, 16)))
    sd = roundtrip_state_dict(opt.state_dict())
    _, target = _trained(fmt=fmt, shapes=((16, 48), (8, 16)), steps=0)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(StateFormatError,
                       match=r"momentum_packed has shape \(16, 20\), expected \(16, 24\) for a 16x48 parameter"):
        target.load_state_dict(sd)
    assert_same(before["state"], target.state_dict()["state"], "state")


def test_load_int4_wrong_block_size_names_both_sizes_and_changes_nothing():
    _, opt = _trained(fmt="int4", block_size=32, groups=2)
    sd = roundtrip_state_dict(opt.state_dict())
    _, target = _trained(fmt="int4", block_size=64, groups=2, steps=1)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(StateFormatError, match=r"block_size=32 but this optimizer uses block_size=64"):
        target.load_state_dict(sd)
    assert_same(before["state"], target.state_dict()["state"], "state")


def test_load_int4_absmax_of_wrong_shape():
    _, opt = _trained(fmt="int4")
    sd = roundtrip_state_dict(opt.state_dict())
    sd["state"][0]["momentum_absmax"] = torch.zeros(16, 3)
    _, target = _trained(fmt="int4", steps=0)
    with pytest.raises(StateFormatError, match=r"momentum_absmax has shape \(16, 3\), expected \(16, 2\) for block_size=32"):
        target.load_state_dict(sd)


@pytest.mark.parametrize("key,value,pattern", [
    ("momentum_ue4m3", torch.zeros(16, 4, dtype=torch.uint8), r"momentum_ue4m3 has shape \(16, 4\), expected \(16, 3\)"),
    ("momentum_ue4m3", torch.zeros(16, 3, dtype=torch.float32), r"momentum_ue4m3 must be uint8, got torch.float32"),
    ("momentum_tensor_scale", torch.ones(2), r"momentum_tensor_scale has shape \(2,\), expected \(\)"),
])
def test_load_bad_e0m3_scales(key, value, pattern):
    _, opt = _trained(fmt="e0m3", shapes=((16, 40), (8, 16)))  # 40 columns: 3 UE4M3 blocks of 16 per row
    sd = roundtrip_state_dict(opt.state_dict())
    sd["state"][0][key] = value
    _, target = _trained(fmt="e0m3", steps=0)
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(StateFormatError, match=pattern):
        target.load_state_dict(sd)
    assert_same(before["state"], target.state_dict()["state"], "state")


def test_load_incomplete_4bit_state():
    _, opt = _trained(fmt="e0m3")
    sd = roundtrip_state_dict(opt.state_dict())
    del sd["state"][0]["momentum_tensor_scale"]
    _, target = _trained(fmt="e0m3", steps=0)
    with pytest.raises(StateFormatError, match="lacks momentum_tensor_scale"):
        target.load_state_dict(sd)
    _, opt = _trained(fmt="int4")
    sd = roundtrip_state_dict(opt.state_dict())
    del sd["state"][0]["momentum_absmax"]
    with pytest.raises(StateFormatError, match="momentum_packed present without its scales"):
        target.load_state_dict(sd)


@pytest.mark.parametrize("key,saved,cur", [("grid_block", 16, 32), ("rank", 4, 2)])
def test_load_grasp4_wrong_layout_options(key, saved, cur):
    torch.manual_seed(0)
    ps = [_mat(40, 48), _mat(8, 16)]
    opt = QMuon(ps, state_format="grasp4", state={key: saved})
    for p in ps:
        p.grad = torch.randn(p.shape)
    opt.step()
    sd = roundtrip_state_dict(opt.state_dict())
    target = QMuon([_mat(40, 48), _mat(8, 16)], state_format="grasp4", state={key: cur})
    with pytest.raises(StateFormatError, match=rf"saved with {key}={saved} but this optimizer uses {key}={cur}"):
        target.load_state_dict(sd)


def test_load_grasp4_bad_factor_shape():
    _, opt = _trained(fmt="grasp4")
    sd = roundtrip_state_dict(opt.state_dict())
    sd["state"][0]["grasp_r_codes"] = torch.zeros(40, 2, dtype=torch.int8)
    _, target = _trained(fmt="grasp4", steps=0)
    with pytest.raises(StateFormatError, match=r"grasp_r_codes has shape \(40, 2\), expected \(40, 4\) for rank=4"):
        target.load_state_dict(sd)


def test_a_gradient_whose_norm_overflows_fp32_is_skipped_like_a_nonfinite_one():
    """The non-finite check is one L2 norm per gradient, on the device (no host read). A finite
    gradient whose sum of squares overflows fp32 reads as non-finite and is skipped (docs/fidelity.md:
    the step's own fp32 norms would overflow on it); one just below the overflow is stepped."""
    p, q, r = (torch.nn.Parameter(torch.zeros(8, 32)) for _ in range(3))
    opt = QMuon([p, q, r], state_format="int8")
    p.grad = torch.full((8, 32), 3e38)  # finite; its sum of squares overflows
    q.grad = torch.randn(8, 32)
    q.grad[0, 0] = float("nan")
    r.grad = torch.full((8, 32), 1e18)  # sum of squares 2.6e38 < 3.4e38: finite
    opt.step()
    assert opt.nonfinite_skips == 2
    assert int(opt.state[p]["step"]) == 0 and int(opt.state[q]["step"]) == 0 and int(opt.state[r]["step"]) == 1
    assert torch.equal(p, torch.zeros(8, 32)) and torch.equal(q, torch.zeros(8, 32))
    assert not torch.equal(r, torch.zeros(8, 32))
