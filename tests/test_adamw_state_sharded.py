"""Quantized AdamW moments under FSDP2 (``Shard(0)`` DTensor parameters, 2 gloo processes):

* the state is ``Shard(0)`` DTensors with the global shape (codes and scales in row blocks);
* the sharded step equals the single-process step bit for bit (row-local blocks, same kernel);
* ``torch.distributed.checkpoint`` reshards it 2 -> 1 and 1 -> 2 without requantizing (the codes
  and scales a rank holds after loading are the saved rows, bit for bit);
* with ``rounding="stochastic"`` too: each shard keys the noise of its moments by the global element
  index (``row_offset * cols``), so the sharded codes are the single process's."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from _dist import full_copy, local_copy, run_workers

pytestmark = pytest.mark.slow

VOCAB, DIM = 130, 64  # 8320 elements: quantized; 130 rows split 65 + 65; 64 cols: one block per row
STEPS = 3


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Parameter(torch.randn(VOCAB, DIM, generator=g))  # AdamW, quantized moments
        self.w = nn.Parameter(torch.randn(DIM, DIM, generator=g) / 8)  # Muon
        self.gain = nn.Parameter(torch.ones(DIM))  # AdamW, 1-D: fp32 moments


def _opt(net: _Net, family: str, rounding: str = "nearest"):
    from qmuon import QMuon

    return QMuon([{"params": [net.w]}, {"params": [net.emb, net.gain], "use_muon": False}], lr=0.02, adamw_lr=1e-2, adamw_state_format=family, state={"rounding": rounding, "seed": 7})


def _grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    rows = torch.exp(torch.linspace(-5, 0, VOCAB)).unsqueeze(1)
    return {"emb": torch.randn(VOCAB, DIM, generator=g) * rows, "w": torch.randn(DIM, DIM, generator=g),
            "gain": torch.randn(DIM, generator=g)}


def _set_grads(net: _Net, step: int) -> None:
    from torch.distributed.tensor import DTensor

    for n, g in _grads(step).items():
        p = getattr(net, n)
        p.grad = DTensor.from_local(g.chunk(dist.get_world_size())[dist.get_rank()], p.device_mesh, p.placements,
                                    run_check=False, shape=g.shape, stride=g.stride()) if isinstance(p, DTensor) else g


def _sd(net, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(net, opt)
    return {"model": msd, "optim": osd}


def _load(net, opt, path: str, no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    sd = _sd(net, opt)
    dcp.load(sd, checkpoint_id=path, no_dist=no_dist)
    set_state_dict(net, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def _worker(rank: int, world: int, root: str, family: str, rounding: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    net = _Net()
    fully_shard(net, mesh=mesh)
    opt = _opt(net, family, rounding)
    for s in range(STEPS):
        _set_grads(net, s)
        opt.step()
    st = opt.state[net.emb]
    out = {"dtensor": {k: (type(v).__name__, tuple(v.shape)) for k, v in st.items()},
           "params": {n: local_copy(p) for n, p in net.named_parameters()},
           "state": {k: local_copy(v) for k, v in st.items()}}
    dcp.save(_sd(net, opt), checkpoint_id=os.path.join(root, "w2"))
    # 1 -> 2: the single-process checkpoint written by the test, loaded into fresh shards
    net2 = _Net()
    fully_shard(net2, mesh=mesh)
    opt2 = _opt(net2, family, rounding)
    _load(net2, opt2, os.path.join(root, "w1"))
    out["loaded_state"] = {k: local_copy(v) for k, v in opt2.state[net2.emb].items()}
    out["loaded_types"] = {k: type(v).__name__ for k, v in opt2.state[net2.emb].items()}
    _set_grads(net2, STEPS)
    opt2.step()
    out["continued"] = {n: full_copy(p) for n, p in net2.named_parameters()}
    return out


def _single(family: str, steps: int, rounding: str = "nearest") -> tuple[_Net, object]:
    net = _Net()
    opt = _opt(net, family, rounding)
    for s in range(steps):
        for n, g in _grads(s).items():
            getattr(net, n).grad = g
        opt.step()
    return net, opt


@pytest.mark.parametrize("family,rounding", [("int8", "nearest"), ("int4", "nearest"), ("int8", "stochastic")])
def test_sharded_adamw_state_reshards_without_requantizing(tmp_path, family, rounding):
    import torch.distributed.checkpoint as dcp

    root = str(tmp_path)
    net1, opt1 = _single(family, STEPS, rounding)
    dcp.save(_sd(net1, opt1), checkpoint_id=os.path.join(root, "w1"), no_dist=True)
    two = run_workers(_worker, 2, timeout=300, root=root,
                      family=family, rounding=rounding)
    # the state is Shard(0) DTensors with the global shape (DCP's resharding relies on it)
    kinds = two[0]["dtensor"]
    codes = "exp_avg_q8" if family == "int8" else "exp_avg_q4"
    assert kinds[codes][0] == "DTensor" and kinds[codes][1][0] == VOCAB
    assert kinds["exp_avg_absmax"] == ("DTensor", (VOCAB, 1)) and kinds["step"][0] == "Tensor"
    # the sharded step is the single-process step, bit for bit (row-local blocks)
    st1 = opt1.state[net1.emb]
    for k in st1:
        if k == "step":
            continue
        joined = torch.cat([t["state"][k] for t in two])
        assert torch.equal(joined, st1[k]), k
    assert torch.equal(torch.cat([t["params"]["emb"] for t in two]), net1.emb.detach())
    if rounding == "stochastic":  # the rounding really was stochastic (codes differ from nearest's)
        net_n, opt_n = _single(family, STEPS)
        assert not torch.equal(opt_n.state[net_n.emb][codes], st1[codes])
    # 1 -> 2: each rank holds the saved rows unchanged
    for r, t in enumerate(two):
        for k, v in st1.items():
            want = v if k == "step" else v.chunk(2)[r]
            assert torch.equal(t["loaded_state"][k], want), (r, k)
        assert t["loaded_types"][codes] == "DTensor"
    # ... and continues like the single process (the AdamW parameters; Muon's sharded NS exchanges
    # an int8 carrier, so its bits differ from the single process by design)
    net_c, opt_c = _single(family, STEPS + 1, rounding)
    for n in ("emb", "gain"):
        assert torch.equal(two[0]["continued"][n], getattr(net_c, n).detach()), n
    # 2 -> 1: the two-rank checkpoint loads into one unsharded optimizer, rows unchanged
    net3 = _Net()
    opt3 = _opt(net3, family, rounding)
    _load(net3, opt3, os.path.join(root, "w2"), no_dist=True)
    for k, v in st1.items():
        assert torch.equal(opt3.state[net3.emb][k], v), k
