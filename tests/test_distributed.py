"""Sharded QMuon (FSDP2 ``Shard(0)`` DTensor parameters) over 2 gloo processes on CPU.

One spawn per scenario group (:mod:`_dist`); each worker returns plain tensors and the
assertions run in the pytest process. Scenarios:

* ``_worker_direct``: the optimizer alone, fed the *same* full gradients as a single-process
  QMuon on every rank (so differences come from the optimizer only): uneven shards (rows 3, 5, 1
  on 2 ranks; cols 40 and 300, not multiples of the 256 block), fused parts cut by a shard
  boundary, a frozen and an unused parameter, an AdamW group, stochastic rounding, and every
  carrier.
* ``_worker_train``: real FSDP2 (``fully_shard``) forward / backward on different data per rank vs
  an unsharded model on the concatenated batch; DCP save / load; resume bit-exact.
* resharded resume 2 -> 1 and 1 -> 2 ranks through DCP, and the consolidated full state dict.
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from torch import nn

from _dist import full_copy, local_copy, run_workers, set_grads, step_side_by_side
from _helpers import assert_same

# ns_bf16: the sharded runs are compared bit for bit with single-process QMuon through bf16 carriers, which are
# lossless only against bf16 Newton-Schulz.
pytestmark = pytest.mark.ns_bf16


STEPS = 4


class _Net(nn.Module):
    """Parameters with awkward shapes for 2 ranks (no forward needed by the direct scenario)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        def w(*shape):
            return nn.Parameter(torch.randn(*shape, generator=g) / math.sqrt(shape[-1]))
        self.a = w(3, 40)  # 2 + 1 rows
        self.b = w(5, 300)  # 3 + 2 rows, cols 300 = 256 + 44 (partial block)
        self.c = w(1, 40)  # 1 + 0 rows: rank 1 owns nothing
        self.qkv = w(8, 40)  # parts (3, 3, 2): rank 0 rows [0, 4) cut part 1
        self.m1 = w(16, 24)
        self.m2 = w(16, 24)  # same shape as m1: batched NS
        self.conv = w(6, 2, 2, 3)  # 4-D: rows 6, cols 12
        self.frozen = w(4, 40)
        self.frozen.requires_grad_(False)
        self.unused = w(6, 40)  # requires grad, never gets one
        self.emb = nn.Embedding(10, 40)  # AdamW
        with torch.no_grad():
            self.emb.weight.copy_(torch.randn(10, 40, generator=g))
        self.gain = nn.Parameter(torch.ones(40))  # AdamW, 1-D


MUON = ("a", "b", "c", "m1", "m2", "conv", "frozen", "unused")


def _groups(net: nn.Module) -> list[dict]:
    return [
        {"params": [getattr(net, n) for n in MUON], "param_names": list(MUON)},
        {"params": [net.qkv], "parts": (3, 3, 2), "param_names": ["qkv"]},
        {"params": [net.emb.weight, net.gain], "use_muon": False, "param_names": ["emb.weight", "gain"]},
    ]


def _grads(net: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for n, p in net.named_parameters():
        if n in ("frozen", "unused"):
            continue
        out[n] = torch.randn(p.shape, generator=g) * 1e-2
    return out


def _shard(net: nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(net, mesh=mesh)


def _merge_shards(per_rank: list):
    """Concatenate rank-local results along dim 0 (dicts recursively; 0-d tensors from rank 0)."""
    first = per_rank[0]
    if isinstance(first, dict):
        return {k: _merge_shards([r[k] for r in per_rank]) for k in first}
    if isinstance(first, torch.Tensor) and first.ndim >= 1:
        return torch.cat(per_rank)
    return first


def _worker_direct(rank: int, world: int, configs: list[dict]) -> dict:
    import qmuon
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    results = {}
    for cfg in configs:
        name = cfg.pop("name")
        ref = _Net()
        net = _Net()
        _shard(net, mesh)
        kw = dict(lr=0.02, weight_decay=0.1, adamw_lr=1e-2, **cfg)
        comm = {k: kw.pop(k) for k in ("comm_carrier", "comm_return") if k in kw}
        opt_ref = qmuon.QMuon(_groups(ref), **kw)
        opt = qmuon.QMuon(_groups(net), **kw, **comm)
        stats = []
        step_side_by_side(ref, opt_ref, net, opt, _grads, STEPS, after_step=lambda s: stats.append(
            dict(opt.comm_stats, comm_bytes_last_step=opt.comm_bytes_last_step)))
        res = {"params": {n: local_copy(p) for n, p in net.named_parameters()},
               "ref_params": {n: p.detach().clone() for n, p in ref.named_parameters()},
               "stats": stats}
        st = {}
        for n in ("a", "b", "c", "qkv"):
            p = getattr(net, n)
            st[n] = {k: local_copy(v) for k, v in opt.state[p].items()}
            st["ref_" + n] = {k: v.clone() for k, v in opt_ref.state[getattr(ref, n)].items()}
        res["state"] = st
        res["dtensor_state"] = all(type(v).__name__ == "DTensor" for k, v in opt.state[net.b].items() if k != "step")
        res["local_rows_c"] = net.c.to_local().shape[0]
        res["has_unused_state"] = net.unused in opt.state
        results[name] = res
    return results


# ---------------------------------------------------------------------------------------------
# Real FSDP2 training with DCP checkpoints
# ---------------------------------------------------------------------------------------------
TRAIN_STEPS = 2  # before the checkpoint
CONT_STEPS = 2  # after it
BATCH = 4


def _lm():
    from qmuon_lightning.models.decoder_lm import DecoderLM

    torch.manual_seed(0)
    return DecoderLM(vocab_size=32, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=48, max_seq_len=16)


def _batch(step: int, rank: int = 0, world: int = 1):
    g = torch.Generator().manual_seed(77 + step)
    tok = torch.randint(0, 32, (BATCH, 17), generator=g)
    per = BATCH // world
    tok = tok[rank * per: (rank + 1) * per]
    return tok[:, :-1], tok[:, 1:]


#: The training scenario runs NorMuon with cautious weight decay, so DCP save / resume / reshard
#: covers the second moment ("normuon_v", Shard(0) rows like the momentum); the direct scenario
#: covers plain Muon.
VARIANT_KW = {"update": {"variant": "normuon", "cautious_weight_decay": True}}


def _opt(model, **kw):
    import qmuon

    return qmuon.build_optimizer(model, lr=0.02, adamw_lr=1e-2, verbose=False, **{**VARIANT_KW, **kw})


def _sharded_lm(mesh):
    from torch.distributed.fsdp import fully_shard

    m = _lm()
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _train_steps(model, opt, steps, rank, world, grads_out=None):
    for s in steps:
        x, y = _batch(s, rank, world)
        model.loss(x, y).backward()
        if grads_out is not None and not grads_out:
            grads_out.update({n: full_copy(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)


def _dcp_save(model, opt, path, no_dist: bool = False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=no_dist)


def _dcp_load(model, opt, path, no_dist: bool = False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=path, no_dist=no_dist)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _full_params(model):
    return {n: full_copy(p).detach().clone() for n, p in model.named_parameters()}


def _worker_train(rank: int, world: int, root: str, load_from: str | None, comm: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from qmuon.distributed import full_state_dict

    mesh = init_device_mesh("cpu", (world,))
    out: dict = {}
    model = _sharded_lm(mesh)
    opt = _opt(model, **comm)
    grads: dict = {}
    _train_steps(model, opt, range(TRAIN_STEPS), rank, world, grads)
    out["grads0"] = grads
    path = os.path.join(root, f"w{world}")
    _dcp_save(model, opt, path)
    out["saved_state"] = full_state_dict(opt)
    out["saved_params"] = _full_params(model)
    out["state_nbytes"] = opt.state_nbytes()  # this rank's shard only
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    full_opts = StateDictOptions(full_state_dict=True)
    # torch's own consolidation; a deep copy because the 0-d `step` tensors in it are the live ones
    full_msd, full_osd = copy.deepcopy(get_state_dict(model, opt, options=full_opts))
    out["torch_full_state"] = copy.deepcopy(full_osd["state"])  # loading below aliases AdamW's `step` tensors
    out["state_is_dtensor"] = all(
        type(v).__name__ == "DTensor" for st in opt.state.values() for k, v in st.items() if k != "step")
    _train_steps(model, opt, range(TRAIN_STEPS, TRAIN_STEPS + CONT_STEPS), rank, world)
    out["cont_params"] = _full_params(model)
    out["stats"] = dict(opt.comm_stats)
    # resume from our own checkpoint at the same world size
    model = _sharded_lm(mesh)
    opt = _opt(model, **comm)
    init = _full_params(model)
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    get_optimizer_state_dict(model, opt)  # DCP's fake step (zero grads, lr = 0) on the empty state
    out["fake_step_max_change"] = max((init[n] - q).abs().max().item() for n, q in _full_params(model).items())
    out["fake_step_state_steps"] = sorted({float(st["step"]) for st in opt.state.values()})
    _dcp_load(model, opt, path)
    _train_steps(model, opt, range(TRAIN_STEPS, TRAIN_STEPS + CONT_STEPS), rank, world)
    out["resume_params"] = _full_params(model)
    # resume from torch's full (consolidated) state dicts: set_state_dict distributes them
    model = _sharded_lm(mesh)
    opt = _opt(model, **comm)
    set_state_dict(model, opt, model_state_dict=full_msd, optim_state_dict=full_osd, options=full_opts)
    _train_steps(model, opt, range(TRAIN_STEPS, TRAIN_STEPS + CONT_STEPS), rank, world)
    out["resume_full_params"] = _full_params(model)
    # resume from our consolidated state dict (qmuon.distributed.load_full_state_dict)
    from qmuon.distributed import load_full_state_dict

    model = _sharded_lm(mesh)
    opt = _opt(model, **comm)
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, copy.deepcopy(full_msd), options=full_opts)
    load_full_state_dict(opt, copy.deepcopy(out["saved_state"]))
    _train_steps(model, opt, range(TRAIN_STEPS, TRAIN_STEPS + CONT_STEPS), rank, world)
    out["resume_consolidated_params"] = _full_params(model)
    if load_from is not None:  # resharded resume
        model = _sharded_lm(mesh)
        opt = _opt(model, **comm)
        _dcp_load(model, opt, load_from)
        out["loaded_state"] = full_state_dict(opt)
        _train_steps(model, opt, range(TRAIN_STEPS, TRAIN_STEPS + CONT_STEPS), rank, world)
        out["other_params"] = _full_params(model)
    return out


def _worker_unsupported(mesh) -> str:
    """A DTensor layout sharded QMuon does not handle (Replicate, not FSDP2's Shard(0)); every state
    format is supported sharded (grasp4 / e0m3: tests/test_distributed_4bit.py)."""
    import qmuon
    from torch.distributed.tensor import Replicate, distribute_tensor

    w = nn.Parameter(distribute_tensor(torch.randn(8, 40), mesh, [Replicate()]))
    opt = qmuon.QMuon([{"params": [w]}])
    w.grad = distribute_tensor(torch.randn(8, 40), mesh, [Replicate()])
    try:
        opt.step()
    except NotImplementedError as e:
        return str(e)
    return "no error"


def _worker_collective_skips(mesh, rank: int) -> dict:
    """A NaN in rank 1's rows only, a gradient on rank 0 only, and nonfinite='raise': every rank
    must take the same decision (or the next collective would hang)."""
    import qmuon

    net = _Net()
    _shard(net, mesh)
    opt = qmuon.QMuon(_groups(net), lr=0.02)
    before = {n: local_copy(p) for n, p in net.named_parameters()}
    grads = _grads(net, 0)
    grads["b"][4, 7] = float("nan")  # row 4 lives on rank 1
    set_grads(net, grads, True)
    if rank == 1:
        net.a.grad = None  # rank 0 has a gradient for `a`, rank 1 does not: it counts as zeros
    opt.step()
    after = {n: local_copy(p) for n, p in net.named_parameters()}
    out = {"skips": opt.nonfinite_skips, "b_unchanged": torch.equal(before["b"], after["b"]),
           "a_changed": not torch.equal(before["a"], after["a"]), "b_state": net.b in opt.state}
    opt_raise = qmuon.QMuon(_groups(net), lr=0.02, safety={"nonfinite": "raise"})
    set_grads(net, grads, True)
    try:
        opt_raise.step()
        out["raised"] = ""
    except FloatingPointError as e:
        out["raised"] = str(e)
    out["unchanged_after_raise"] = all(torch.equal(after[n], local_copy(p)) for n, p in net.named_parameters())
    return out


def _worker_two(rank: int, world: int, root: str, configs: list[dict], comm: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    return {"direct": _worker_direct(rank, world, configs),
            "skips": _worker_collective_skips(mesh, rank),
            "unsupported": _worker_unsupported(mesh),
            "train": _worker_train(rank, world, root, os.path.join(root, "plain"), comm)}


# ---------------------------------------------------------------------------------------------
# The pytest side: one 2-rank spawn, single-process references in this process
# ---------------------------------------------------------------------------------------------
DIRECT_CONFIGS = [
    {"name": "bf16", "newton_schulz": {"comm_carrier": "bf16", "comm_return": "bf16"}},  # int8 state
    {"name": "int8", "state": {"rounding": "stochastic"}},  # the default carriers (int8 both ways)
    {"name": "int4", "state_format": "int4", "newton_schulz": {"comm_carrier": "bf16", "comm_return": "bf16"}},
    {"name": "mxfp8", "state_format": "fp32", "newton_schulz": {"comm_carrier": "mxfp8", "comm_return": "bf16"}},
    # fp32 Newton-Schulz (what ns_dtype="auto" picks without native bf16 matmul) with fp32 carriers,
    # and the per-iteration Polar Express schedule: every NS option is honoured by the sharded step.
    {"name": "fp32ns", "newton_schulz": {"dtype": "fp32", "comm_carrier": "fp32", "comm_return": "fp32"}},
    {"name": "polar", "newton_schulz": {"coefficients": "polar_express", "steps": 6, "comm_carrier": "bf16", "comm_return": "bf16"}},
    # NorMuon (second moment rows ride with the NS rows) and cautious weight decay (mask from the
    # returned rows): the same bits as single-process.
    {"name": "normuon", "update": {"variant": "normuon", "cautious_weight_decay": True}, "newton_schulz": {"comm_carrier": "bf16", "comm_return": "bf16"}},
]
TRAIN_COMM = {"newton_schulz": {"comm_carrier": "bf16", "comm_return": "bf16"}}


def _plain_run(root: str) -> dict:
    """Unsharded single-process QMuon on the whole batch: the reference of the FSDP run, and the
    1-rank side of the resharding tests (its DCP checkpoint is loaded by 2 ranks)."""
    model = _lm()
    opt = _opt(model)
    grads: dict = {}
    _train_steps(model, opt, range(TRAIN_STEPS), 0, 1, grads)
    _dcp_save(model, opt, os.path.join(root, "plain"), no_dist=True)
    out = {"grads0": grads, "saved_params": _full_params(model), "state_nbytes": opt.state_nbytes(),
           "saved_state": {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()}}
    _train_steps(model, opt, range(TRAIN_STEPS, TRAIN_STEPS + CONT_STEPS), 0, 1)
    out["cont_params"] = _full_params(model)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    plain = _plain_run(root)
    # run_workers forks where it can (the workers inherit torch, lightning and the compiled kernels);
    # the timeout turns a hang into a failure.
    two = run_workers(_worker_two, 2, timeout=300, root=root,
                      configs=[dict(c) for c in DIRECT_CONFIGS], comm=TRAIN_COMM)
    for name in two[0]["direct"]:  # shards -> full tensors (the unsharded references are full already)
        res = [t["direct"][name] for t in two]
        params = _merge_shards([r["params"] for r in res])
        state = {n: (_merge_shards([r["state"][n] for r in res]) if not n.startswith("ref_") else res[0]["state"][n])
                 for n in res[0]["state"]}
        for r in res:
            r["params"], r["state"] = params, state
    return {"root": root, "plain": plain, "two": two}


def _maxdiff(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


def _displacement_rel(after: dict, after_ref: dict, before: dict) -> dict[str, float]:
    """Per parameter ``||(p - p0) - (p_ref - p0)|| / ||p_ref - p0||``: the relative error of what
    the optimizer did."""
    out = {}
    for n in after:
        d_ref = after_ref[n] - before[n]
        if d_ref.norm() > 0:
            out[n] = ((after[n] - after_ref[n]).norm() / d_ref.norm()).item()
    return out


def test_carrier_names_match_qmuon():
    from qmuon.core.config import COMM_CARRIERS, COMM_RETURNS
    from qmuon.distributed.carrier import CARRIERS, RETURN_CARRIERS
    from qmuon.optim import qmuon

    assert COMM_CARRIERS == ("auto", *CARRIERS) and COMM_RETURNS == RETURN_CARRIERS
    with pytest.raises(ValueError, match="comm_carrier"):
        qmuon.QMuon([nn.Parameter(torch.zeros(2, 2))], newton_schulz={"comm_carrier": "fp4"})


@pytest.mark.parametrize("name", ["bf16", "fp32", "int8", "mxfp8"])
def test_carrier_is_row_local(name):
    """Encoding row pieces separately decodes to exactly the encoding of the whole matrix (so the
    result does not depend on the sharding), and the int8 error is within half a code step."""
    from qmuon.distributed.carrier import get_carrier

    c = get_carrier(name)
    x = torch.randn(7, 300, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 0, 7)[:, None]
    whole = c.roundtrip(x)
    pieces = torch.cat([c.roundtrip(x[:3]), c.roundtrip(x[3:3]), c.roundtrip(x[3:])])
    assert torch.equal(whole, pieces)
    if name == "bf16":
        assert torch.equal(whole, x.to(torch.bfloat16))
    if name == "int8":
        from _helpers import blocked_absmax, expand_blocks

        step = expand_blocks(blocked_absmax(x, 256), 256, 300) / 127.0
        assert ((whole - x).abs() <= 0.5 * step * (1 + 1e-5)).all()  # nearest rounding: half a step
    assert c.nbytes(7, 300) < 2 * 7 * 300 or name in ("bf16", "fp32")


def test_plan_owners_balances_and_is_deterministic():
    from qmuon.distributed.plan import ShardItem, plan_owners
    from qmuon.quant.layout import RowLayout, chunk_ranges

    items = []
    for rows in (64, 64, 64, 64, 3, 1):
        lay = RowLayout(rows, 64, chunk_ranges(rows, 2), 0)
        e = torch.empty(0)
        items.append(ShardItem(lay, 0, rows, e, e, e, 1, 0.1, 1e-7, None, "int8"))
    owners = plan_owners(items, 2)
    assert owners == plan_owners(items, 2)
    assert sorted(owners[:4]) == [0, 0, 1, 1]  # the four big matrices split evenly
    assert chunk_ranges(3, 2) == ((0, 2), (2, 3)) and chunk_ranges(1, 2) == ((0, 1), (1, 1))


@pytest.mark.slow
def test_sharded_equals_single_process_bit_exact_with_bf16_carrier(runs):
    """Fed the same gradients, sharded QMuon with carriers in the NS dtype both ways gives the
    bits of single-process QMuon: the NS input is rounded to the NS dtype as the local path does,
    the block sums are summed in the same order, and the NS output is added to the parameter rows.
    Covers int8 and int4 state, bf16 and fp32 Newton-Schulz, uneven shards, an empty shard, fused
    parts, a 4-D weight, AdamW."""
    for r in (0, 1):
        for name in ("bf16", "int4", "fp32ns", "polar", "normuon"):
            res = runs["two"][r]["direct"][name]
            assert _maxdiff(res["params"], res["ref_params"]) == 0.0, name
            for n in ("a", "b", "c", "qkv"):
                st, ref = res["state"][n], res["state"]["ref_" + n]
                assert all(torch.equal(st[k], ref[k]) for k in ref), (name, n)


@pytest.mark.slow
def test_uneven_empty_frozen_unused(runs):
    r0, r1 = (runs["two"][r]["direct"]["bf16"] for r in (0, 1))
    assert r0["local_rows_c"] == 1 and r1["local_rows_c"] == 0  # 1 row on 2 ranks: rank 1 holds none
    assert r0["dtensor_state"] and not r0["has_unused_state"]
    init = {n: p.detach() for n, p in _Net().named_parameters()}
    assert torch.equal(r0["params"]["frozen"], init["frozen"]) and torch.equal(r0["params"]["unused"], init["unused"])
    assert not torch.equal(r0["params"]["c"], init["c"])


@pytest.mark.slow
def test_stochastic_rounding_noise_equals_unsharded(runs):
    """Momentum does not depend on the carrier, so with stochastic rounding the sharded codes and
    scales equal the unsharded ones bit for bit only if each shard drew the unsharded noise."""
    for r in (0, 1):
        res = runs["two"][r]["direct"]["int8"]
        for n in ("a", "b", "c", "qkv"):
            st, ref = res["state"][n], res["state"]["ref_" + n]
            assert all(torch.equal(st[k], ref[k]) for k in ref), n


@pytest.mark.slow
@pytest.mark.parametrize("name, bound", [("int8", 0.04), ("mxfp8", 2 * 2**-4)])
def test_compact_carriers_close_to_single_process(runs, name, bound):
    """Relative error of the parameter displacement after 4 steps vs single-process QMuon.
    int8: nearest rounding to absmax/127 steps has RMS error absmax / (127 sqrt(12)), i.e. ~0.9% of
    the RMS for rows whose max is <= 4x their RMS (NS outputs and these gradients), on each trip.
    MXFP8 E4M3: within 2^-4 relative per element. Newton-Schulz does not shrink input errors along
    small singular directions, so the bounds allow 2x that (int8: 2 trips x 0.9% x 2 ~ 0.04;
    mxfp8: 2 x 2^-4). Measured: int8 ~0.02, mxfp8 ~0.05 (benchmarks/bench_comm.py prints cosines)."""
    res = runs["two"][0]["direct"][name]
    init = {n: p.detach() for n, p in _Net().named_parameters()}
    rel = _displacement_rel(res["params"], res["ref_params"], init)
    muon = {n: v for n, v in rel.items() if n in ("a", "b", "c", "qkv", "m1", "m2", "conv")}
    assert max(muon.values()) < bound, muon
    assert max(v for n, v in rel.items() if n not in muon) == 0.0  # AdamW is not affected


@pytest.mark.slow
def test_comm_bytes_reported(runs):
    for r in (0, 1):
        st = runs["two"][r]["direct"]["int8"]["stats"][-1]
        bf = runs["two"][r]["direct"]["bf16"]["stats"][-1]
        assert st["comm_bytes_last_step"] == st["ns_bytes_sent"] + st["flags_bytes"] > 0
        # both ways, every element: int8 = 2 * (1 + 4/256) + block sums (4 / block_size, here cols <= 300)
        assert st["exchange_bytes_per_param"] < 3.0 < bf["exchange_bytes_per_param"]
        assert st["ns_bytes_total"] < 0.6 * bf["ns_bytes_total"]
    assert runs["two"][0]["direct"]["int8"]["stats"][-1]["ns_bytes_total"] == \
        runs["two"][1]["direct"]["int8"]["stats"][-1]["ns_bytes_total"]


@pytest.mark.slow
def test_nonfinite_and_missing_grads_decided_collectively(runs):
    for r in (0, 1):
        sk = runs["two"][r]["skips"]
        assert sk["skips"] == 1 and sk["b_unchanged"] and not sk["b_state"], sk  # both ranks skipped b
        assert sk["a_changed"]
        assert "param group 0" in sk["raised"] or "'b'" in sk["raised"], sk["raised"]
        assert sk["unchanged_after_raise"]


@pytest.mark.slow
def test_unsupported_format_raises(runs):
    msg = runs["two"][0]["unsupported"]
    assert "Replicate()" in msg and "Shard(0)" in msg and "1-D mesh" in msg and "HSDP" in msg, msg


@pytest.mark.slow
def test_fsdp_gradients_match_unsharded(runs):
    """FSDP2 averages the per-rank gradients (gloo, torch 2.13): equal to the whole-batch gradient
    up to fp32 summation order (relative 1e-5 allows ~100 ulp-level roundings per sum)."""
    ref = runs["plain"]["grads0"]
    for n, g in runs["two"][0]["train"]["grads0"].items():
        assert ((g - ref[n]).norm() / ref[n].norm()).item() < 1e-5, n


@pytest.mark.slow
def test_fsdp_training_close_to_unsharded(runs):
    """Real FSDP2 training vs single-process QMuon on the whole batch. The gradients differ in
    the last bits (summation order), which flips some bf16 roundings of the NS input (relative
    2^-8 each); NS of these small, ill-conditioned early gradients amplifies that. Measured
    relative displacement error <= ~0.1 after 2 steps; the bound 0.25 is what that admits."""
    t = runs["two"][0]["train"]
    init = _full_params(_lm())
    rel = _displacement_rel(t["saved_params"], runs["plain"]["saved_params"], init)
    assert max(rel.values()) < 0.25, rel
    assert t["state_is_dtensor"]


@pytest.mark.slow
def test_dcp_resume_bit_exact_same_world_size(runs):
    t = runs["two"][0]["train"]
    assert _maxdiff(t["resume_params"], t["cont_params"]) == 0.0
    assert _maxdiff(t["resume_full_params"], t["cont_params"]) == 0.0  # via full_state_dict=True
    assert _maxdiff(t["resume_consolidated_params"], t["cont_params"]) == 0.0  # load_full_state_dict
    # DCP's _init_optim_state fake step (zero grads, lr 0) leaves the parameters alone
    assert t["fake_step_max_change"] == 0.0


@pytest.mark.slow
def test_reshard_1_to_2(runs):
    """Single-process checkpoint (plain tensors) -> 2 ranks through DCP: every state tensor
    arrives unchanged (rows reshard exactly: codes and scales are per row), and training goes on."""
    t = runs["two"][0]["train"]
    assert any("normuon_v" in st for st in runs["plain"]["saved_state"].values())
    assert_same(t["loaded_state"]["state"], runs["plain"]["saved_state"], "state")
    init = runs["plain"]["saved_params"]
    rel = _displacement_rel(t["other_params"], runs["plain"]["cont_params"], init)
    assert max(rel.values()) < 0.25, rel  # same origin as test_fsdp_training_close_to_unsharded


def _plain_from(load) -> tuple[dict, dict]:
    model = _lm()
    opt = _opt(model)
    load(model, opt)
    state = {k: {kk: vv.clone() for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()}
    _train_steps(model, opt, range(TRAIN_STEPS, TRAIN_STEPS + CONT_STEPS), 0, 1)
    return state, _full_params(model)


@pytest.mark.slow
def test_reshard_2_to_1_and_consolidated(runs):
    """2-rank DCP checkpoint -> one process (plain model, plain QMuon) through DCP, and the
    consolidated full state dict -> plain ``load_state_dict``: both give the sharded run's state
    bit for bit, and then the same training."""
    t = runs["two"][0]["train"]
    path = os.path.join(runs["root"], "w2")
    state_dcp, params_dcp = _plain_from(lambda m, o: _dcp_load(m, o, path, no_dist=True))
    full = t["saved_state"]
    assert_same(state_dcp, full["state"], "state (DCP load)")

    def load_full(m, o):
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(t["saved_params"][n])
        # a deep copy: torch's load_state_dict keeps (aliases) AdamW state tensors of the right dtype
        o.load_state_dict(copy.deepcopy(full))

    state_full, params_full = _plain_from(load_full)
    # torch's full_state_dict=True gathers the same tensors (keyed by parameter name)
    names = [n for g in full["param_groups"] for n in g["param_names"]]
    torch_full = t["torch_full_state"]
    for pid, st in full["state"].items():
        assert all(torch.equal(torch_full[names[pid]][k], v) for k, v in st.items()), names[pid]
    assert_same(state_full, full["state"], "state (consolidated load)")
    assert _maxdiff(params_dcp, params_full) == 0.0
    rel = _displacement_rel(params_dcp, t["cont_params"], t["saved_params"])
    assert max(rel.values()) < 0.25, rel  # same origin as test_fsdp_training_close_to_unsharded


@pytest.mark.slow
def test_state_nbytes_counts_local_shards(runs):
    """``QMuon.state_nbytes()`` reports what this rank holds: the ranks' figures add up to the
    unsharded optimizer's (row-sharded codes and per-row-block scales split exactly; the 0-d
    ``step`` tensors are replicated, 4 bytes per Muon parameter per rank)."""
    per_rank = [t["train"]["state_nbytes"] for t in runs["two"]]
    plain = runs["plain"]["state_nbytes"]
    assert all(0 < n < plain for n in per_rank)
    # one 0-d step tensor per stepped Muon parameter (AdamW state is not counted by state_nbytes())
    n_steps = sum(1 for st in runs["plain"]["saved_state"].values() if "exp_avg" not in st)
    assert sum(per_rank) == plain + 4 * n_steps * (len(per_rank) - 1)
