"""Run a function in N fresh processes joined in a gloo process group (tests of sharded QMuon).

``run_workers(fn, world_size, **kwargs)`` spawns ``world_size`` processes (the ``spawn`` start
method, so no state leaks from the pytest process), initializes ``torch.distributed`` with gloo
through a FileStore in a private temporary directory (no TCP port to guess), sets one intra-op
thread per worker, calls ``fn(rank, world_size, **kwargs)`` and returns every rank's return value
(passed back with ``torch.save``). A worker that raises fails the call with its traceback; a
worker that hangs (a collective nobody answers) is killed after ``timeout`` seconds and the call
raises ``TimeoutError`` instead of blocking the test run. ``fn`` must be importable by the child
(a module-level function of a test module: pytest's ``prepend`` import mode puts tests/ on
``sys.path``, which the spawn start method passes on).
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _entry(fn: Callable[..., Any], rank: int, world_size: int, tmp: str, kwargs: dict[str, Any]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=kwargs.pop("_collective_timeout", 60)),
        )
        out = fn(rank, world_size, **kwargs)
        torch.save(out, os.path.join(tmp, f"result{rank}.pt"))
        from qmuon.distributed import exit_after_distributed_run

        exit_after_distributed_run()  # exits with 0; returns only if fn already shut the group down
    except BaseException:
        with open(os.path.join(tmp, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def run_workers(fn: Callable[..., Any], world_size: int = 2, timeout: float = 150.0, start_method: str = "spawn",
                **kwargs: Any) -> list[Any]:
    """``[fn(rank, world_size, **kwargs) for rank in range(world_size)]``, each in its own process.

    ``start_method="fork"`` skips re-importing torch and qmuon_lightning in every worker (about
    10 s each on a busy machine); use it only from a process that has not started intra-op thread
    pools or CUDA (the test suite runs with one torch thread, see conftest.py).
    """
    tmp = tempfile.mkdtemp(prefix="qmuon_dist_")
    ctx = mp.get_context(start_method)
    kwargs = dict(kwargs, _collective_timeout=max(30, int(timeout) - 10))
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, tmp, dict(kwargs)), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        errors = []
        for r in range(world_size):
            path = os.path.join(tmp, f"error{r}.txt")
            if os.path.exists(path):
                with open(path) as f:
                    errors.append(f"--- rank {r} ---\n{f.read()}")
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        if errors:
            raise RuntimeError("worker failed:\n" + "\n".join(errors))
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout:.0f} s (a collective hung?)")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise RuntimeError(f"ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}")
        return [torch.load(os.path.join(tmp, f"result{r}.pt"), weights_only=False) for r in range(world_size)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- DTensor test utilities
def set_grads(net: "torch.nn.Module", grads: dict[str, torch.Tensor], sharded: bool) -> None:
    """Give every parameter of ``net`` the *full* gradient ``grads[name]`` (``None`` if absent): as
    is for plain parameters; for FSDP2 ``Shard(0)`` parameters, this rank's rows (``torch.chunk``
    split, as FSDP2 shards: ceil(rows / world) rows per rank, trailing ranks possibly empty)."""
    from torch.distributed.tensor import DTensor, Shard

    for n, p in net.named_parameters():
        if n not in grads:
            p.grad = None
            continue
        g = grads[n]
        if sharded:
            mesh = p.device_mesh
            rows, world, rank = g.shape[0], mesh.size(), mesh.get_local_rank()
            chunk = -(-rows // world)
            a = min(rank * chunk, rows)
            b = min(a + chunk, rows)
            p.grad = DTensor.from_local(g[a:b].clone(), mesh, [Shard(0)], run_check=False, shape=g.shape,
                                        stride=g.stride())
        else:
            p.grad = g.clone()


def full_copy(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered if it is a DTensor), detached and cloned."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def local_copy(t: torch.Tensor) -> torch.Tensor:
    """This rank's rows, detached and cloned (tests return shards and join them in the pytest
    process: no gather collectives, which are slow on an oversubscribed machine)."""
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def step_side_by_side(ref: "torch.nn.Module", opt_ref: "torch.optim.Optimizer", net: "torch.nn.Module",
                      opt: "torch.optim.Optimizer", grads_for_step: Callable[["torch.nn.Module", int], dict],
                      steps: int, after_step: Callable[[int], None] | None = None) -> None:
    """``steps`` optimizer steps of a single-process model ``ref`` and its FSDP2-sharded twin ``net``
    on the same full gradients ``grads_for_step(ref, step)`` (``net`` gets this rank's rows)."""
    for s in range(steps):
        grads = grads_for_step(ref, s)
        set_grads(ref, grads, False)
        set_grads(net, grads, True)
        opt_ref.step()
        opt.step()
        if after_step is not None:
            after_step(s)

