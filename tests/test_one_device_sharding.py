"""FSDP2 on one device (``qmuon_fsdp`` with ``devices=1``): the parameters are 1-rank ``Shard(0)``
DTensors and the sharded step runs, but nothing is sent, so its carriers must be lossless: the
run equals plain single-process QMuon bit for bit, with the default (int8) carriers configured.
With a second rank the same configuration rounds through int8 (tests/test_distributed.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _dist import run_workers

pytestmark = pytest.mark.slow  # a spawned process

STEPS = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 48)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48)) for _ in range(2))
        self.head = nn.Linear(48, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _run(model: nn.Module, ns_dtype: str, sharded: bool) -> dict[str, torch.Tensor]:
    import qmuon

    opt = qmuon.build_optimizer(model, state_format="int8", verbose=False,
                                newton_schulz={"dtype": ns_dtype})  # default carriers: int8 both ways
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randint(0, 32, (4, 16), generator=g)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for name, p in model.named_parameters():
        out[name] = (p.full_tensor() if sharded else p).detach().clone()
    return out


def _worker(rank: int, world: int, ns_dtype: str) -> dict:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    plain = Net()
    torch.manual_seed(0)
    shard = Net()
    for b in shard.blocks:
        fully_shard(b)
    fully_shard(shard)
    assert all(isinstance(p, DTensor) for p in shard.parameters())
    return {"plain": _run(plain, ns_dtype, False), "sharded": _run(shard, ns_dtype, True)}


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_one_device_fsdp_is_plain_qmuon(ns_dtype: str) -> None:
    (res,) = run_workers(_worker, 1, ns_dtype=ns_dtype)
    differ = [n for n, t in res["plain"].items() if not torch.equal(t, res["sharded"][n])]
    assert not differ, f"one-device FSDP2 differs from plain QMuon in {differ}"
