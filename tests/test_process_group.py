"""``shut_down_process_group`` and ``exit_after_distributed_run``: the end of a multi-process run."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from qmuon.distributed import shut_down_process_group

from _dist import free_port, run_workers, start, subprocess_env


def test_no_group_is_a_no_op():
    assert not dist.is_initialized()
    assert shut_down_process_group() is False


def _worker(rank: int, world: int) -> dict:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    destroyed = shut_down_process_group()
    return {"sum": t.item(), "destroyed": destroyed, "initialized_after": dist.is_initialized()}


@pytest.mark.slow
def test_two_processes_wait_then_destroy():
    results = run_workers(_worker, world_size=2, start_method="fork")
    for r in results:
        assert r == {"sum": 3.0, "destroyed": True, "initialized_after": False}


_EXIT_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from qmuon.distributed import exit_after_distributed_run
exit_after_distributed_run()  # no group yet: returns
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"rank {dist.get_rank()} sum {t.item():.0f}", flush=True)
sys.stdout.write("buffered, flushed by the helper\\n")
exit_after_distributed_run()
print("not reached", flush=True)
sys.exit(3)
"""


@pytest.mark.slow
def test_exit_after_distributed_run_exits_zero_without_finalization(tmp_path):
    """Two gloo ranks: each prints, calls the helper, and leaves with status 0 right there (the
    code after it does not run; what was written to stdout before it is not lost)."""
    import subprocess
    import sys

    port = free_port()
    script = tmp_path / "exit_script.py"
    script.write_text(_EXIT_SCRIPT)
    procs = [start([sys.executable, str(script)], stdout=subprocess.PIPE, cwd=tmp_path, what=f"rank {rank}",
                   env=subprocess_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for rank in range(2)]
    for rank, p in enumerate(procs):
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        assert f"rank {rank} sum 2" in out and "buffered, flushed by the helper" in out, out
        assert "not reached" not in out, out


def _never_called(rank: int, world: int) -> None:
    raise AssertionError("no process should have started")


def test_a_launch_from_a_test_not_marked_slow_fails_before_starting():
    """The launchers refuse to start processes for a test without the ``slow`` marker, so that
    ``pytest -m "not slow"`` cannot grow multi-process tests unnoticed."""
    import _dist

    assert _dist.running_test_is_slow is False  # conftest.py set it for this (unmarked) test
    with pytest.raises(pytest.fail.Exception, match=r"mark the test @pytest.mark.slow"):
        _dist.run_workers(_never_called, 2)
    with pytest.raises(pytest.fail.Exception, match=r"mark the test @pytest.mark.slow"):
        _dist.run_launcher(["true"], timeout=5)
