"""Checkpoints: bit-exact resume in every format, and migration between formats and from
torch.optim.Muon."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from _helpers import QMAX, blocked_absmax, expand_blocks, momentum_fp32, roundtrip_state_dict
from qmuon import QMuon, build_optimizer
from qmuon.optim import FORMAT_VERSION

FP32_U = 2.0**-24


def _model():
    torch.manual_seed(0)
    # no dropout: the forward pass is a pure function of the weights and the batch
    return nn.Sequential(nn.Linear(12, 40), nn.Tanh(), nn.Linear(40, 40), nn.Tanh(), nn.Linear(40, 6))


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 12, generator=g), torch.randn(16, 6, generator=g)


def _train(model, opt, steps):
    for s in steps:
        x, y = _batch(s)
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _build(model, fmt, rounding):
    # block_size 32 on 40 columns: two blocks per row, the second partial
    return build_optimizer(model, lr=0.02, state_format=fmt, state={"rounding": rounding, "block_size": 32, "seed": 11}, adamw_lr=1e-3, verbose=False)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt", ["fp32", "bf16", "int8", "uint8", "int4", "e0m3", "grasp4"])
def test_resume_is_bit_exact(fmt, rounding):
    k, n = 3, 7
    model = _model()
    opt = _build(model, fmt, rounding)
    _train(model, opt, range(k))

    ckpt = roundtrip_state_dict(opt.state_dict())
    resumed_model = copy.deepcopy(model)
    resumed = _build(resumed_model, fmt, rounding)
    resumed.load_state_dict(ckpt)

    _train(model, opt, range(k, n))  # the uninterrupted run
    _train(resumed_model, resumed, range(k, n))

    for (name, a), (_, b) in zip(model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(a, b), name
    sa, sb = opt.state_dict(), resumed.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for pid in sa["state"]:
        for key, v in sa["state"][pid].items():
            assert torch.equal(v, sb["state"][pid][key]), (pid, key)
            assert v.dtype == sb["state"][pid][key].dtype
    # the state really is in the requested format (not silently cast by load_state_dict)
    p = resumed_model[2].weight
    expected = {
        "fp32": {"momentum_buffer": torch.float32},
        "bf16": {"momentum_buffer": torch.bfloat16},
        "int8": {"momentum_codes": torch.int8, "momentum_absmax": torch.float32},
        "uint8": {"momentum_codes": torch.uint8, "momentum_absmax": torch.float32},
        "int4": {"momentum_packed": torch.uint8, "momentum_absmax": torch.float32},
        "e0m3": {"momentum_packed": torch.uint8, "momentum_ue4m3": torch.uint8, "momentum_tensor_scale": torch.float32},
        "grasp4": {"grasp_p_codes": torch.int8, "grasp_p_absmax": torch.bfloat16, "grasp_r_codes": torch.int8,
                   "grasp_r_absmax": torch.bfloat16, "momentum_packed": torch.uint8, "grid_row_max": torch.uint8,
                   "grid_col_max": torch.uint8, "grid_scale": torch.float32},
    }[fmt]
    assert {k: v.dtype for k, v in resumed.state[p].items() if k != "step"} == expected
    assert resumed.state[p]["step"].item() == n


def test_resume_without_loading_differs():
    """Sanity check of the test above: a fresh optimizer (no loaded state) does not reproduce the
    uninterrupted run, so bit-equality there is evidence that the state was restored."""
    model = _model()
    opt = _build(model, "int8", "stochastic")
    _train(model, opt, range(3))
    other_model = copy.deepcopy(model)
    other = _build(other_model, "int8", "stochastic")
    _train(model, opt, range(3, 5))
    _train(other_model, other, range(3, 5))
    assert not torch.equal(model[2].weight, other_model[2].weight)


def test_state_dict_is_plain_tensors_and_versioned():
    model = _model()
    opt = _build(model, "int8", "nearest")
    _train(model, opt, range(2))
    sd = roundtrip_state_dict(opt.state_dict())  # weights_only=True load must succeed
    assert all(g["qmuon_version"] == FORMAT_VERSION for g in sd["param_groups"])
    muon_states = [s for s in sd["state"].values() if "momentum_codes" in s]
    assert muon_states and all(set(s) == {"step", "momentum_codes", "momentum_absmax"} for s in muon_states)


# --------------------------------------------------------------------------- migration
def _torch_muon_run(shapes, steps=5):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(7)
    ps = [nn.Parameter(0.02 * torch.randn(s)) for s in shapes]
    opt = torch.optim.Muon(ps, lr=0.02, weight_decay=0.1)
    for _ in range(steps):
        for p in ps:
            p.grad = 1e-3 * torch.randn(p.shape, generator=gen)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("fmt", ["int8", "uint8"])
def test_migrate_torch_muon_to_8bit(fmt):
    shapes = [(24, 80), (16, 16)]  # 80 = 32 + 32 + 16: a partial block per row
    ps, torch_opt = _torch_muon_run(shapes)
    sd = roundtrip_state_dict(torch_opt.state_dict())
    ps2 = [nn.Parameter(p.detach().clone()) for p in ps]
    opt = QMuon(ps2, state_format=fmt, state={"block_size": 32})
    opt.load_state_dict(sd)
    for p, q in zip(ps, ps2):
        buf = torch_opt.state[p]["momentum_buffer"]
        st = opt.state[q]
        assert st["momentum_codes"].dtype == getattr(torch, fmt)
        assert torch.equal(st["momentum_absmax"], blocked_absmax(buf, 32))
        m = momentum_fp32(opt, q)
        amax = expand_blocks(st["momentum_absmax"], 32, buf.shape[1]).double()
        # nearest-rounding requantization: half a step, absmax/127/2 (+ 6u*absmax fp32 slack, see
        # test_quantize_roundtrip_error_is_half_a_step)
        assert bool(((m.double() - buf.double()).abs() <= amax / QMAX / 2 + 6 * FP32_U * amax).all())
        assert st["step"].item() == 0.0  # torch.optim.Muon keeps no step; it starts at 0
    # the converted optimizer keeps training
    for q in ps2:
        q.grad = torch.randn(q.shape) * 1e-3
    before = [q.detach().clone() for q in ps2]
    opt.step()
    assert all(not torch.equal(q.detach(), b) for q, b in zip(ps2, before))


def test_migrate_8bit_to_fp32_and_between_8bit_formats():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(8)
    ps = [nn.Parameter(torch.randn(24, 80)), nn.Parameter(torch.randn(10, 33))]
    opt = QMuon(ps, state_format="int8", state={"block_size": 32})
    for _ in range(4):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    sd = roundtrip_state_dict(opt.state_dict())

    dense = QMuon([nn.Parameter(p.detach().clone()) for p in ps], state_format="fp32")
    dense.load_state_dict(sd)
    as_u8 = QMuon([nn.Parameter(p.detach().clone()) for p in ps], state_format="uint8", state={"block_size": 32})
    as_u8.load_state_dict(sd)
    for p, q, r in zip(ps, dense.param_groups[0]["params"], as_u8.param_groups[0]["params"]):
        codes, absmax = opt.state[p]["momentum_codes"], opt.state[p]["momentum_absmax"]
        dq = torch.ops.qmuon.dequantize_rows(codes, absmax, 32)
        # int8 -> fp32 is exact dequantization
        buf = dense.state[q]["momentum_buffer"]
        assert buf.dtype == torch.float32 and buf.is_contiguous()
        assert torch.equal(buf, dq)
        assert dense.state[q]["step"].item() == 4.0
        # int8 -> uint8: requantizing a dequantized tensor gives back the same codes; the new scale
        # max|c * fl(a/127)| = fl(127 * fl(a/127)) may differ from a by two fp32 roundings (2u)
        u8 = as_u8.state[r]
        assert u8["momentum_codes"].dtype == torch.uint8
        assert torch.equal(u8["momentum_codes"].int() - 128, codes.int())
        assert torch.allclose(u8["momentum_absmax"], absmax, rtol=4 * FP32_U, atol=0)
    # and the structural keys are the constructed optimizer's, not the checkpoint's
    assert dense.param_groups[0]["state_format"] == "fp32"


# --------------------------------------------------------------------------- 4-bit migration
@pytest.mark.parametrize("fmt", ["int4", "e0m3", "grasp4"])
def test_migrate_torch_muon_to_4bit_and_back(fmt):
    from qmuon.ops import reference_4bit as ref4

    shapes = [(24, 80), (16, 17)]  # 17 columns: an odd count (half-filled last byte)
    ps, torch_opt = _torch_muon_run(shapes)
    sd = roundtrip_state_dict(torch_opt.state_dict())
    ps2 = [nn.Parameter(p.detach().clone()) for p in ps]
    opt = QMuon(ps2, state_format=fmt, state={"block_size": 32, "grid_block": 16})
    opt.load_state_dict(sd)
    for p, q in zip(ps, ps2):
        buf = torch_opt.state[p]["momentum_buffer"].double()
        st = opt.state[q]
        m = momentum_fp32(opt, q).double()
        err = (m - buf).abs()
        if fmt == "int4":
            amax = expand_blocks(st["momentum_absmax"], 32, buf.shape[1]).double()
            assert torch.equal(st["momentum_absmax"], blocked_absmax(buf.float(), 32))
            assert bool((err <= amax / 7 / 2 + 8 * FP32_U * amax).all())
        elif fmt == "e0m3":
            step = expand_blocks(ref4.ue4m3_decode(st["momentum_ue4m3"]).double(), 16, buf.shape[1])
            step = step * st["momentum_tensor_scale"].double()
            assert bool((err <= step / 2 + 32 * FP32_U * step).all())
        else:
            assert (m - buf).norm() / buf.norm() < 0.2
        assert st["step"].item() == 0.0
    # back to fp32: exact dequantization of the 4-bit state
    sd4 = roundtrip_state_dict(opt.state_dict())
    dense = QMuon([nn.Parameter(p.detach().clone()) for p in ps], state_format="fp32", state={"block_size": 32, "grid_block": 16})
    dense.load_state_dict(sd4)
    for q, r in zip(ps2, dense.param_groups[0]["params"]):
        assert torch.equal(dense.state[r]["momentum_buffer"], momentum_fp32(opt, q))
    # and the converted optimizer keeps training
    for q in ps2:
        q.grad = torch.randn(q.shape) * 1e-3
    before = [q.detach().clone() for q in ps2]
    opt.step()
    assert all(not torch.equal(q.detach(), b) for q, b in zip(ps2, before))


@pytest.mark.parametrize("src,dst", [("int8", "int4"), ("int4", "e0m3"), ("e0m3", "grasp4"), ("grasp4", "int8")])
def test_migrate_between_quantized_formats(src, dst):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(8)
    ps = [nn.Parameter(torch.randn(24, 80)), nn.Parameter(torch.randn(10, 33))]
    opt = QMuon(ps, state_format=src, state={"block_size": 32, "grid_block": 16})
    for _ in range(3):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    sd = roundtrip_state_dict(opt.state_dict())
    other = QMuon([nn.Parameter(p.detach().clone()) for p in ps], state_format=dst, state={"block_size": 32, "grid_block": 16})
    other.load_state_dict(sd)
    for p, q in zip(ps, other.param_groups[0]["params"]):
        a, b = momentum_fp32(opt, p), momentum_fp32(other, q)
        assert (a - b).norm() / a.norm() < 0.25
        assert other.state[q]["step"].item() == 3.0
    assert other.param_groups[0]["state_format"] == dst


def test_migrate_int4_to_int8_with_each_formats_default_block_size():
    """Different kinds of blockwise state convert even when their (default) block sizes differ."""
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(8, 256))]
    opt = QMuon(ps, state_format="int4")  # block 128
    ps[0].grad = torch.randn(8, 256)
    opt.step()
    other = QMuon([nn.Parameter(ps[0].detach().clone())], state_format="int8")  # block 256
    other.load_state_dict(roundtrip_state_dict(opt.state_dict()))
    q = other.param_groups[0]["params"][0]
    assert other.param_groups[0]["block_size"] == 256
    assert (momentum_fp32(other, q) - momentum_fp32(opt, ps[0])).abs().max() <= momentum_fp32(opt, ps[0]).abs().max() / 127
