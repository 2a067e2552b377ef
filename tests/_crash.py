"""Kill ``qmuon-train`` runs with SIGKILL and restart them with the same command.

Shared by tests/test_resume.py (a few kills per world size) and benchmarks/kill_resume.py (the
20-kill run). A run is a tiny decoder LM checkpointing every step (``ModelCheckpoint`` top-1 plus
``last``) with ``ckpt_path: auto`` in its config, so the restart command is the start command.
``second=`` adds a user's own ``ModelCheckpoint`` in another folder: ``"periodic"`` (``ck/``,
top-1 plus ``last`` at another frequency) or ``"best"`` (``best/``, the 2 best by ``val_loss``).
``world_size=2`` trains under ``qmuon_fsdp`` on 2 CPU processes (gloo); Lightning starts the second
process, and a kill takes the whole process group, as a lost node would.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from _dist import kill, start, subprocess_env

CONFIG = """
seed_everything: 0
ckpt_path: auto
trainer:
  accelerator: cpu
  devices: {world}
  {strategy}
  max_steps: {max_steps}
  max_epochs: -1
{precision}  val_check_interval: 5
  check_val_every_n_epoch: null
  num_sanity_val_steps: 0
  log_every_n_steps: 1
  enable_progress_bar: false
  enable_model_summary: false
  default_root_dir: {root}
  logger:
    - class_path: lightning.pytorch.loggers.CSVLogger
      init_args:
        save_dir: {root}
        name: csv
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {root}/checkpoints
        save_last: true
        every_n_train_steps: {every}
{second}model:
  d_model: 32
  n_layers: 1
  n_heads: 2
  optimizer:
    name: qmuon
    state_format: int8
    state:
      rounding: stochastic
    warmup_steps: 2
{optimizer}data:
  seq_len: 16
  batch_size: 2
  max_bytes: 600000
  val_windows: 4
  train_samples: {train_samples}
"""


#: The second ``ModelCheckpoint`` of a run (``second=``): each in its own folder.
SECOND = {
    "periodic": """    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {root}/ck
        save_last: true
        every_n_train_steps: {every}
""",
    "best": """    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        dirpath: {root}/best
        monitor: val_loss
        mode: min
        save_top_k: 2
        filename: "best-{{step}}-{{val_loss:.4f}}"
""",
}
#: Checkpoint folders a run may have (``checkpoints`` always; the second callback's).
FOLDERS = ("checkpoints", "ck", "best")


def write_config(root: Path, world_size: int, max_steps: int, batches_per_epoch: int = 7, every: int = 1,
                 second: str | None = None, second_every: int = 2, precision: str | None = None,
                 optimizer: dict[str, Any] | None = None) -> Path:
    """A tiny run under ``root``; an epoch is ``batches_per_epoch`` steps, so a run crosses epoch
    boundaries and restarts land before, on and after them. The first ``ModelCheckpoint`` saves
    every ``every`` steps; ``second`` (a key of :data:`SECOND`) adds another, every ``second_every``
    steps for ``"periodic"``, after each validation (every 5 steps) for ``"best"``."""
    root.mkdir(parents=True, exist_ok=True)
    strategy = "strategy: qmuon_fsdp" if world_size > 1 else ""
    extra = "" if second is None else SECOND[second].format(root=root, every=second_every)
    prec = "" if precision is None else f"  precision: {precision}\n"
    opt = "".join(f"    {k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in (optimizer or {}).items())
    path = root / "run.yaml"
    path.write_text(CONFIG.format(world=world_size, strategy=strategy, max_steps=max_steps, root=root, every=every,
                                  second=extra, train_samples=batches_per_epoch * 2 * world_size, precision=prec,
                                  optimizer=opt))
    return path


def command(config: Path) -> list[str]:
    return [sys.executable, "-m", "qmuon_lightning.cli", "fit", "--config", str(config)]


def env() -> dict[str, str]:
    # warnings stay on: the restarts' reports (incomplete / untracked checkpoints) are warnings
    return subprocess_env(PYTHONFAULTHANDLER="1")


def run(config: Path, timeout: float = 600) -> str:
    """Run the configured training to its end; its output (stdout and stderr together)."""
    proc = start(command(config), stdout=subprocess.PIPE, env=env(), what="qmuon-train fit")
    try:
        log, _ = proc.communicate(timeout=timeout)
    finally:
        kill(proc)
    if proc.returncode != 0:
        raise AssertionError(f"run failed ({proc.returncode}):\n{log[-8000:]}")
    return log


@contextmanager
def running(config: Path, timeout: float = 600) -> Iterator[Callable[[], str]]:
    """The configured training started in the background, e.g. the uninterrupted reference run
    beside the killed ones (each start spends ~10 s importing Lightning on one core; on the 2-core CI
    machine the other core idles meanwhile). Yields ``finish()``: waits for the run's end and returns
    its output, as :func:`run` does; a run still going when the block exits is killed."""
    log_path = config.parent / "background.log"
    with open(log_path, "w") as out:
        proc = start(command(config), stdout=out, env=env(), what="qmuon-train fit")
        deadline = time.monotonic() + timeout

        def finish() -> str:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill(proc)
                raise AssertionError(f"run still going after {timeout} s:\n{log_path.read_text()[-8000:]}") from None
            log = log_path.read_text()
            if proc.returncode != 0:
                raise AssertionError(f"run failed ({proc.returncode}):\n{log[-8000:]}")
            return log

        try:
            yield finish
        finally:
            kill(proc)


def saved_steps(root: Path) -> int:
    """Highest step of a published checkpoint in the run's checkpoint folders (by name; hidden
    staging directories of a save in progress do not count), -1 if none."""
    best = -1
    for p in (q for folder in FOLDERS for q in (root / folder).glob("*step=*")):
        if p.name.startswith("."):
            continue
        try:
            best = max(best, int(p.name.split("step=")[1].split(".")[0].split("-")[0]))
        except ValueError:
            pass
    return best


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def run_and_kill(config: Path, root: Path, after_step: int, rng: random.Random, timeout: float = 600,
                 max_delay: float = 0.5, only_rank1: bool = False) -> tuple[str, str]:
    """Start the run, wait until a checkpoint of step ``after_step`` or later exists, wait a random
    0-``max_delay`` s more (the kill lands mid-step or mid-save) and SIGKILL its whole process
    group. Returns how the run ended (``killed``, or ``finished`` when it completed first) and its
    output (kept in a file: a pipe nobody reads would block the run once full).

    ``only_rank1``: SIGKILL only the second rank (the process Lightning started for it, a child of
    the first), as a lost node; the outcome is then ``rank 1 lost, rank 0 exited after X s`` once
    the first rank has ended on its own (it must, within 120 s), or ``rank 0 hung``."""
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"start{len(list(logs.iterdir()))}.log"
    with open(log_path, "w") as out:
        proc = start(command(config), stdout=out, env=env(), what="qmuon-train fit")
        deadline = time.monotonic() + timeout
        outcome = "killed"
        try:
            while saved_steps(root) < after_step:
                if proc.poll() is not None:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no checkpoint of step {after_step} after {timeout} s; see {log_path}")
                time.sleep(0.02)
            else:
                time.sleep(rng.uniform(0.0, max_delay))
            if proc.poll() is not None:
                if proc.returncode != 0:
                    raise AssertionError(f"run failed ({proc.returncode}) before the kill:\n{log_path.read_text()[-5000:]}")
                outcome = "finished"
            elif only_rank1:
                ranks = _children(proc.pid)
                if not ranks:
                    raise AssertionError("no child process to kill: is this a 2-process run?")
                for pid in ranks:
                    os.kill(pid, signal.SIGKILL)
                t0 = time.monotonic()
                try:
                    proc.wait(120)
                    outcome = f"rank 1 lost, rank 0 exited after {time.monotonic() - t0:.1f} s"
                except subprocess.TimeoutExpired:
                    outcome = "rank 0 hung"
            else:
                kill(proc)
        finally:
            kill(proc)
    return outcome, log_path.read_text()


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A Lightning checkpoint of either layout as one dict of full tensors (no process group), a
    sharded directory in the single-file layout (``"state_dict"``, ``"optimizer_states"``) as
    ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` writes it."""
    if path.is_dir():
        from lightning.fabric.utilities.load import _load_distributed_checkpoint
        from lightning.pytorch.utilities.consolidate_checkpoint import _format_checkpoint

        blob = _load_distributed_checkpoint(path)
        blob.update(torch.load(path / "meta.pt", weights_only=False))
        return _format_checkpoint(blob) if "model" in blob else blob
    return torch.load(path, map_location="cpu", weights_only=False)


def tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested dict / list, by its path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(tensors(v, f"{prefix}[{i}]"))
    return out


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if x.is_floating_point():  # bitwise: NaN payloads and the sign of zero count
        x, y = x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)
    return bool(torch.equal(x, y))


def state_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """Names of weight and optimizer tensors that are not bit-identical between two checkpoints."""
    ta = tensors({k: a[k] for k in a if k == "state_dict" or k.startswith("optimizer")})
    tb = tensors({k: b[k] for k in b if k == "state_dict" or k.startswith("optimizer")})
    diff = sorted(set(ta) ^ set(tb))
    for k in sorted(set(ta) & set(tb)):
        if not _same_bits(ta[k], tb[k]):
            diff.append(k)
    return diff


def checkpoint_names(root: Path) -> list[str]:
    """The visible checkpoint names of every folder (``folder/name`` for the second callback's)."""
    names = sorted(p.name for p in (root / "checkpoints").iterdir() if not p.name.startswith("."))
    for folder in FOLDERS[1:]:
        if (root / folder).is_dir():
            names += sorted(f"{folder}/{p.name}" for p in (root / folder).iterdir() if not p.name.startswith("."))
    return names


def hidden_leftovers(root: Path) -> list[str]:
    """Hidden entries (staging / replaced directories) left in any checkpoint folder."""
    return sorted(f"{folder}/{p.name}" for folder in FOLDERS if (root / folder).is_dir()
                  for p in (root / folder).iterdir() if p.name.startswith("."))


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def run_under_torchrun(config: Path, root: Path, kills: int, rng: random.Random, nproc: int = 2,
                       timeout: float = 1200, max_delay: float = 0.3) -> tuple[int, list[str], str]:
    """``torchrun --standalone --nproc_per_node N --max-restarts K -m qmuon_lightning.cli fit``:
    each time a new checkpoint appears, SIGKILL one worker (a random one) and let torchrun restart
    all of them with the same command, ``kills`` times. Returns torchrun's exit code, a line per
    kill and the output."""
    logs = root / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           "--max-restarts", str(kills), "-m", "qmuon_lightning.cli", "fit", "--config", str(config)]
    events: list[str] = []
    with open(log_path, "w") as out:
        proc = start(cmd, stdout=out, env=env(), what="torchrun qmuon-train fit")
        deadline = time.monotonic() + timeout
        try:
            for k in range(kills):
                target = saved_steps(root) + 1
                while saved_steps(root) < target and proc.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.02)
                time.sleep(rng.uniform(0.0, max_delay))
                workers = [p for p in _descendants(proc.pid) if "qmuon_lightning.cli" in _cmdline(p)]
                if proc.poll() is not None or not workers:
                    events.append(f"kill {k + 1}: no worker to kill (run ended)")
                    break
                victim = rng.choice(workers)
                os.kill(victim, signal.SIGKILL)
                events.append(f"kill {k + 1}: SIGKILL to one of {len(workers)} workers after checkpoint step "
                              f"{saved_steps(root)}")
                t0 = time.monotonic()  # wait for torchrun to replace the workers before the next kill
                while proc.poll() is None and victim in _descendants(proc.pid) and time.monotonic() - t0 < 120:
                    time.sleep(0.05)
            proc.wait(max(1.0, deadline - time.monotonic()))
        finally:
            kill(proc)
    return proc.returncode, events, log_path.read_text()
