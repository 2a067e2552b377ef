"""Sharded grasp4 and e0m3 momentum (FSDP2 ``Shard(0)``) over 2 gloo processes vs single-process QMuon.

One fork per module (:mod:`_dist`). The workers feed the sharded optimizer and a single-process
reference the *same* full gradients, so differences come from the optimizer only: the per-rank
GEMM of ``M_a^T P_a`` summed by an all-reduce instead of one ``M^T P`` (fp32 rounding of ``R``,
which can flip an 8-bit code of ``R`` and then the residual codes that depend on it).
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn

from _dist import full_copy, local_copy, run_workers, set_grads, step_side_by_side

# ns_bf16: sharded 4-bit runs are compared with single-process QMuon through bf16 carriers, which are lossless
# only against bf16 Newton-Schulz (and the tolerances are set for it).
pytestmark = pytest.mark.ns_bf16


STEPS = 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def w(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g) / math.sqrt(shape[-1]))
        self.a = w(127, 48)  # 64 + 63 rows: uneven, last tile of rank 1 has 31 rows
        self.b = w(64, 72)  # 32 + 32 rows, cols 72 (partial column tile)
        self.conv = w(128, 4, 3)  # 3-D: cols 12
        self.emb = nn.Embedding(10, 48)  # AdamW


def _groups(net, **kw):
    return [{"params": [net.a, net.b, net.conv], "param_names": ["a", "b", "conv"], **kw},
            {"params": [net.emb.weight], "use_muon": False, "param_names": ["emb.weight"]}]


def _grads(net, step):
    g = torch.Generator().manual_seed(500 + step)
    # low rank + noise, so the rank-4 factors carry most of the momentum
    out = {}
    for n, p in net.named_parameters():
        rows, cols = p.shape[0], p[0].numel()
        low = torch.randn(rows, 2, generator=g) @ torch.randn(2, cols, generator=g)
        out[n] = ((low + 0.3 * torch.randn(rows, cols, generator=g)) * 1e-2).view(p.shape)
    return out


def _sharded(mesh, state_format="grasp4", **kw):
    import qmuon
    from torch.distributed.fsdp import fully_shard

    net = _Net()
    fully_shard(net, mesh=mesh)
    return net, qmuon.QMuon(_groups(net), lr=0.02, weight_decay=0.1, state_format=state_format, newton_schulz={"comm_carrier": "bf16", "comm_return": "bf16"}, **kw)


def _dcp(model, opt, path, load):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    if not load:
        dcp.save(sd, checkpoint_id=path)
        return
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _worker(rank: int, world: int, root: str) -> dict:
    import qmuon
    from qmuon.distributed import full_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from qmuon.ops import _extension, _kernels

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {"compiled_cpu": bool(_extension.status().cpu)}
    served_before = _kernels.served.copy()
    # --- sharded vs single process, same gradients
    ref = _Net()
    opt_ref = qmuon.QMuon(_groups(ref), lr=0.02, weight_decay=0.1, state_format="grasp4")
    net, opt = _sharded(mesh)
    step_side_by_side(ref, opt_ref, net, opt, _grads, STEPS)
    out["params"] = {n: full_copy(p) for n, p in net.named_parameters()}
    out["ref_params"] = {n: p.detach().clone() for n, p in ref.named_parameters()}
    out["state"] = {n: {k: full_copy(v) for k, v in opt.state[getattr(net, n)].items()} for n in ("a", "b", "conv")}
    out["ref_state"] = {n: {k: v.clone() for k, v in opt_ref.state[getattr(ref, n)].items()} for n in ("a", "b", "conv")}
    out["local_r"] = local_copy(opt.state[net.a]["grasp_r_codes"])
    out["grid_scale"] = opt.state[net.a]["grid_scale"].clone()
    out["placements"] = {k: str(getattr(v, "placements", None)) for k, v in opt.state[net.a].items()}
    # --- DCP checkpoint after STEPS steps, continue 2 steps; a fresh optimizer loads it and continues
    path = os.path.join(root, "w2")
    _dcp(net, opt, path, load=False)
    out["saved_full"] = full_state_dict(opt)
    out["saved_params"] = {n: full_copy(p) for n, p in net.named_parameters()}
    for s in range(STEPS, STEPS + 2):
        set_grads(net, _grads(ref, s), True)
        opt.step()
    out["cont_params"] = {n: full_copy(p) for n, p in net.named_parameters()}
    net2, opt2 = _sharded(mesh)
    _dcp(net2, opt2, path, load=True)
    out["loaded_full"] = full_state_dict(opt2)
    for s in range(STEPS, STEPS + 2):
        set_grads(net2, _grads(ref, s), True)
        opt2.step()
    out["resume_params"] = {n: full_copy(p) for n, p in net2.named_parameters()}
    # --- shards that do not start on a tile boundary: 96 rows -> 48 + 48, grid_block 32
    bad = nn.Linear(40, 96, bias=False)
    from torch.distributed.fsdp import fully_shard

    fully_shard(bad, mesh=mesh)
    opt_bad = qmuon.QMuon([{"params": [bad.weight], "param_names": ["w"]}], state_format="grasp4")
    before = local_copy(bad.weight)
    bad.weight.grad = torch.ones_like(bad.weight)
    try:
        opt_bad.step()
        out["unaligned"] = "no error"
    except ValueError as e:
        out["unaligned"] = str(e)
    out["unaligned_unchanged"] = torch.equal(before, local_copy(bad.weight)) and not opt_bad.state
    # --- the consolidated grasp4 state loads onto 2 ranks (plain full tensors sliced per rank)
    from qmuon.distributed import load_full_state_dict

    net3, opt3 = _sharded(mesh)
    with torch.no_grad():
        for n, p in net3.named_parameters():
            p.to_local().copy_(_rows(out["saved_params"][n], p))
    load_full_state_dict(opt3, copy.deepcopy(out["saved_full"]))  # torch's AdamW load aliases state tensors
    out["consolidated_loaded"] = full_state_dict(opt3)
    for s in range(STEPS, STEPS + 2):
        set_grads(net3, _grads(ref, s), True)
        opt3.step()
    out["consolidated_params"] = {n: full_copy(p) for n, p in net3.named_parameters()}
    # --- e0m3: nearest and stochastic rounding, sharded vs single process
    for rounding in ("nearest", "stochastic"):
        ref_e = _Net()
        opt_re = qmuon.QMuon(_groups(ref_e), lr=0.02, weight_decay=0.1, state_format="e0m3", state={"rounding": rounding})
        net_e, opt_e = _sharded(mesh, state_format="e0m3", state={"rounding": rounding})
        step_side_by_side(ref_e, opt_re, net_e, opt_e, _grads, STEPS)
        out["e0m3_" + rounding] = {
            "params": {n: full_copy(p) for n, p in net_e.named_parameters()},
            "ref_params": {n: p.detach().clone() for n, p in ref_e.named_parameters()},
            "state": {n: {k: full_copy(v) for k, v in opt_e.state[getattr(net_e, n)].items()} for n in ("a", "b", "conv")},
            "ref_state": {n: {k: v.clone() for k, v in opt_re.state[getattr(ref_e, n)].items()}
                          for n in ("a", "b", "conv")},
        }
    out["served"] = dict(_kernels.served - served_before)
    return out


def _rows(full, p):
    """This rank's rows of ``full`` for the Shard(0) DTensor ``p``."""
    mesh = p.device_mesh
    chunk = -(-full.shape[0] // mesh.size())
    a = min(mesh.get_local_rank() * chunk, full.shape[0])
    return full[a: a + chunk]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("grasp_dcp"))
    two = run_workers(_worker, 2, timeout=240, root=root)
    return {"root": root, "two": two}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()


@pytest.mark.slow
def test_state_layout_and_replication(runs):
    r0, r1 = runs["two"]
    pl = r0["placements"]
    assert "Replicate" in pl["grasp_r_codes"] and "Replicate" in pl["grasp_r_absmax"]
    assert "Shard(dim=0)" in pl["grasp_p_codes"] and "Shard(dim=0)" in pl["grid_col_max"]
    assert pl["grid_scale"] == "None" and pl["step"] == "None"  # 0-d, identical on every rank
    # the replicated factor and the per-matrix scale are the same on both ranks (collective results)
    assert torch.equal(r0["local_r"], r1["local_r"])
    assert torch.equal(r0["grid_scale"], r1["grid_scale"])
    st = r0["state"]["a"]
    assert st["grid_col_max"].shape == (4, 48) and st["momentum_packed"].shape == (127, 24)


@pytest.mark.slow
def test_sharded_grasp4_matches_single_process(runs):
    """The sharded state decodes to the single-process momentum and the parameters follow it.

    Origin of the bounds: the only difference is fp32 summation order in ``R`` (relative ~1e-7),
    which flips an int8 code of ``R`` (step ``absmax / 127``, ~0.8 % of the column max) only where a
    value sits within rounding of a code boundary, and with it a few 4-bit residual codes. Such a
    flip is absorbed by the residual (encoded against the *stored* factors), so the decoded momentum
    moves by at most a residual quantization step there. We bound the decoded momentum by 1 % and
    the parameter displacement by 1 % relative, and require at least 99 % identical residual codes.
    """
    from qmuon.quant import state as qstate
    from qmuon.quant.state import FormatOptions

    r = runs["two"][0]
    fmt = qstate.get_format("grasp4")
    opts = FormatOptions(block_size=256, rank=4, grid_block=32)
    for n in ("a", "b", "conv"):
        st, ref = r["state"][n], r["ref_state"][n]
        assert st.keys() == ref.keys()
        for k in st:
            assert st[k].shape == ref[k].shape and st[k].dtype == ref[k].dtype, (n, k)
        m, m_ref = fmt.dequantize(st, opts), fmt.dequantize(ref, opts)
        rel = _rel(m, m_ref)
        same = (st["momentum_packed"] == ref["momentum_packed"]).float().mean().item()
        print(f"{n}: momentum rel diff {rel:.2e}, identical residual bytes {same:.4f}")
        assert rel < 1e-2, (n, rel)
        assert same > 0.99, (n, same)
    init = {n: p.detach().clone() for n, p in _Net().named_parameters()}
    for n in ("a", "b", "conv"):
        d, d_ref = r["params"][n] - init[n], r["ref_params"][n] - init[n]
        rel = _rel(d, d_ref)
        print(f"{n}: displacement rel diff {rel:.2e}")
        assert rel < 1e-2, (n, rel)


@pytest.mark.slow
def test_dcp_resume_bit_exact_same_world_size(runs):
    r = runs["two"][0]
    for pid, st in r["saved_full"]["state"].items():
        for k, v in st.items():
            assert torch.equal(r["loaded_full"]["state"][pid][k], v), (pid, k)
    for n, v in r["cont_params"].items():
        assert torch.equal(r["resume_params"][n], v), n


@pytest.mark.slow
def test_reshard_2_to_1(runs):
    """The 2-rank DCP checkpoint loads into a single-process grasp4 QMuon with the same state bits
    (the global layout of every tensor is the unsharded one)."""
    import qmuon
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    r = runs["two"][0]
    net = _Net()
    opt = qmuon.QMuon(_groups(net), lr=0.02, weight_decay=0.1, state_format="grasp4")
    msd, osd = get_state_dict(net, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=os.path.join(runs["root"], "w2"), no_dist=True)
    set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    got = opt.state_dict()["state"]
    for pid, st in r["saved_full"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got[pid][k], v), (pid, k)
    for n, p in net.named_parameters():
        assert torch.equal(p.detach(), r["saved_params"][n]), n


@pytest.mark.slow
def test_unaligned_shards_raise_clear_error(runs):
    r = runs["two"][0]
    msg = r["unaligned"]
    assert "grid_block=32" in msg and "(96, 40)" in msg and "multiple of grid_block" in msg, msg
    assert r["unaligned_unchanged"]


@pytest.mark.slow
def test_consolidated_load_onto_two_ranks(runs):
    """``load_full_state_dict`` slices the plain full grasp4 tensors per rank (rows, row tiles, R
    whole): the state round-trips bit for bit and training continues exactly as uninterrupted."""
    r = runs["two"][0]
    for pid, st in r["saved_full"]["state"].items():
        for k, v in st.items():
            assert torch.equal(r["consolidated_loaded"]["state"][pid][k], v), (pid, k)
    for n, v in r["cont_params"].items():
        assert torch.equal(r["consolidated_params"][n], v), n


@pytest.mark.slow
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_sharded_e0m3_equals_single_process(runs, rounding):
    """e0m3's only non-row-local piece is the tensor scale ``amax / (7 * 448)``; a MAX all-reduce of
    the local amax is the global amax exactly (max is order-free), and stochastic-rounding noise is
    keyed by the global element index: state and parameters equal single-process QMuon bit for bit."""
    r = runs["two"][0]["e0m3_" + rounding]
    for n in ("a", "b", "conv"):
        for k, v in r["ref_state"][n].items():
            assert torch.equal(r["state"][n][k], v), (n, k)
    for n in ("a", "b", "conv"):  # (the AdamW embedding is initialized from the global RNG, differently)
        assert torch.equal(r["params"][n], r["ref_params"][n]), n


@pytest.mark.slow
def test_sharded_updates_run_the_compiled_kernels(runs):
    """The sharded e0m3 / grasp4 updates go through ``torch.ops.qmuon``'s row-shard ops, served by the
    compiled CPU kernels when the extension is loaded (the same kernels as the single-process update)."""
    r = runs["two"][0]
    ops = ("e0m3_momentum_amax_multi", "e0m3_momentum_update_with_scale_multi_", "grid_quantize4_with_scale")
    used = {op: r["served"].get((op, "compiled"), 0) + r["served"].get((op, "reference"), 0) for op in ops}
    assert all(n > 0 for n in used.values()), r["served"]
    if not r["compiled_cpu"]:
        pytest.skip("the compiled CPU extension is not loaded here (reference backend)")
    for op in ops:
        assert r["served"].get((op, "reference"), 0) == 0 and r["served"][(op, "compiled")] > 0, (op, r["served"])
