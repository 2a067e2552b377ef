"""The one way tests start processes, and the DTensor utilities of the sharded tests.

Three shapes of launch, one module:

- :func:`run_workers` runs a test module's function in N fresh processes joined in a gloo group
  (FileStore in a private directory, no TCP port to guess) and returns every rank's return value;
- :func:`run_launcher` runs a command (torchrun, a test module as a script that starts a Lightning /
  Fabric / DeepSpeed run, ``qmuon-train``) in its own session and returns its output;
- :func:`start` starts such a command and hands back the ``Popen``, for tests that kill it mid-run
  (tests/_crash.py).

Each bounds the run (a hung collective fails the test instead of blocking the suite) and kills the
whole process group on the way out. Starting several processes costs a test 10-60 s on the 2-core CI
machine, so each launch checks that the running test is marked ``@pytest.mark.slow``: ``pytest -m
"not slow"`` stays the fast loop (conftest.py tells this module which test runs).
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

#: The repository root (tests/..).
REPO = Path(__file__).resolve().parents[1]

#: Variables a launcher (torchrun, Lightning, the deepspeed launcher) sets for its children; a child
#: launcher started from a test must not inherit them from an outer one.
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")

#: Set by conftest.py before each test: whether it is marked ``slow`` (None outside pytest, e.g.
#: when a benchmark imports this module).
running_test_is_slow: bool | None = None


def require_slow_marker(what: str) -> None:
    """Fail the running test if it starts several processes without ``@pytest.mark.slow``."""
    if running_test_is_slow is False:
        import pytest

        pytest.fail(f"{what} starts other processes: mark the test @pytest.mark.slow (or its module with "
                    f"pytestmark = pytest.mark.slow) so that `pytest -m \"not slow\"` stays fast", pytrace=False)


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1 (for a launcher's ``--master_port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a launched test worker: this one without launcher variables, the
    repository first on ``PYTHONPATH``, one OpenMP thread (see conftest.py), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def torchrun_cmd(nproc: int | str, script: str | Path, *args: str) -> list[str]:
    """``python -m torch.distributed.run`` starting ``nproc`` local processes of ``script`` with
    ``args``, rendezvous on 127.0.0.1 at a free port (run it with :func:`run_launcher`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port()), str(script), *map(str, args)]


def start(cmd: list[str], *, stdout: Any, env: dict[str, str] | None = None, cwd: str | Path | None = None,
          what: str = "") -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (so that :func:`kill` takes its workers with it), with
    ``env`` (default :func:`subprocess_env`) and ``cwd`` (default the repository root); output,
    stderr included, goes to ``stdout`` (a file or ``subprocess.PIPE``)."""
    require_slow_marker(what or " ".join(map(str, cmd[:4])))
    return subprocess.Popen(cmd, cwd=str(cwd or REPO), env=env if env is not None else subprocess_env(),
                            stdout=stdout, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def kill(proc: subprocess.Popen, wait: float = 30) -> None:
    """SIGKILL ``proc``'s whole session (launcher and workers) if it still runs, and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(wait)


def run_launcher(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 what: str = "") -> str:
    """Run ``cmd`` (see :func:`start`) and return stdout + stderr together.

    Fails the test, with the log's tail, when it exits non-zero or runs past ``timeout`` seconds
    (then the whole session, launcher and workers, is killed, so no rank lingers)."""
    import pytest

    what = what or " ".join(map(str, cmd[:4]))
    proc = start(cmd, stdout=subprocess.PIPE, env=env, cwd=cwd, what=what)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill(proc)
        log, _ = proc.communicate()
        pytest.fail(f"{what}: still running after {timeout:.0f} s; log tail:\n{log[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what}: exit status {proc.returncode}; log tail:\n{log[-8000:]}")
    return log


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


def _default_start_method() -> str:
    """``fork`` where it is safe, which skips re-importing torch and the package in every worker
    (about 10 s each on a busy machine): no intra-op thread pool started (the suite runs with one
    torch thread, conftest.py), no process group in this process. ``spawn`` otherwise."""
    import torch.distributed as dist

    forkable = (torch.get_num_threads() == 1 and not (dist.is_available() and dist.is_initialized())
                and "fork" in mp.get_all_start_methods())
    return "fork" if forkable else "spawn"


def run_workers(fn: Callable[..., Any], world_size: int = 2, timeout: float = 150.0, start_method: str | None = None,
                **kwargs: Any) -> list[Any]:
    """``[fn(rank, world_size, **kwargs) for rank in range(world_size)]``, each in its own process.

    ``fn`` must be importable by the child (a module-level function of a test module: pytest's
    ``prepend`` import mode puts tests/ on ``sys.path``, which the spawn start method passes on). A
    worker that raises fails the call with its traceback; a worker that hangs (a collective nobody
    answers) is killed after ``timeout`` seconds and the call raises ``TimeoutError``.
    ``start_method`` defaults to ``fork`` where that is safe, else ``spawn``.
    """
    require_slow_marker(f"run_workers({getattr(fn, '__name__', fn)}, {world_size})")
    tmp = tempfile.mkdtemp(prefix="qmuon_dist_")
    ctx = mp.get_context(start_method or _default_start_method())
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

