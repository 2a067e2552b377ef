"""``shut_down_process_group``: an orderly end of a multi-process run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from qmuon_lightning.distributed import shut_down_process_group

from _dist import run_workers


def test_no_group_is_a_no_op():
    assert not dist.is_initialized()
    assert shut_down_process_group() is False


def _worker(rank: int, world: int) -> dict:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    destroyed = shut_down_process_group()
    return {"sum": t.item(), "destroyed": destroyed, "initialized_after": dist.is_initialized()}


def test_two_processes_wait_then_destroy():
    results = run_workers(_worker, world_size=2, start_method="fork")
    for r in results:
        assert r == {"sum": 3.0, "destroyed": True, "initialized_after": False}
