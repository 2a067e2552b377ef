"""``OptimizerStepProfiler``: ``torch.profiler`` on the optimizer update only, on scheduled steps.

Whole-program profiling of a Lightning run buries the optimizer step under forward and backward
(and the prototype's profiler schedule never lined up with it). This callback opens a profiler
in ``on_before_optimizer_step`` (which Lightning calls inside ``optimizer.step`` after the closure
ran forward and backward) and closes it from an optimizer step post-hook, so a window holds the
update and nothing else: Lightning's gradient clipping (which runs right after the hook), and the
optimizer's own ``step``.

For each profiled step it writes, under ``dirpath`` (default ``<trainer.log_dir>/optimizer_profiles``;
``-rank<r>`` is appended to file names when the world size is above 1):

* ``optimizer_step_<step>.trace.json``: Chrome trace (open in ``chrome://tracing`` or Perfetto);
* ``optimizer_step_<step>.txt``: ``key_averages()`` table sorted by self CPU time (self device
  time on CUDA); QMuon's kernels appear as ``qmuon::<op>`` rows;
* one line in ``optimizer_steps.jsonl`` with the step time and memory figures;

and logs ``optimizer_step_ms`` (and ``optimizer_step_peak_alloc_mb``) to the Trainer's loggers.
The step time is wall time between opening and closing the window with the profiler recording
(CUDA synchronized at both ends), so it includes the profiler's per-op overhead. Peak memory is
the largest ``Total Allocated`` of the profiler's memory events during the window minus the
allocator's total before the window's first allocation, per device (CPU: the allocations torch
tracks; CUDA: the caching allocator).

Inactive steps cost O(1): one schedule test in ``on_before_optimizer_step``; no profiler object is
built and no optimizer hook is registered outside scheduled steps (the post-hook is registered
when a window opens and removed when it closes).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from ._common import log_to_loggers

__all__ = ["OptimizerStepProfiler"]


def peak_allocated_from_trace(trace_path: str) -> dict[str, int]:
    """``{device: peak bytes allocated during the trace, above the level before it}`` from the
    ``[memory]`` events of a Chrome trace written with ``profile_memory=True`` (device ``"cpu"``,
    ``"cuda:<i>"``; absent when the window allocated nothing on it)."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f).get("traceEvents", [])
    base: dict[str, int] = {}
    peak: dict[str, int] = {}
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e.get("ts", 0)):
        a = e.get("args", {})
        if "Total Allocated" not in a:
            continue
        dev = "cpu" if int(a.get("Device Type", 0)) == 0 else f"cuda:{int(a.get('Device Id', 0))}"
        total = int(a["Total Allocated"])
        if dev not in base:
            base[dev] = total - int(a.get("Bytes", 0))  # level before this first event
        peak[dev] = max(peak.get(dev, total), total)
    return {d: max(0, peak[d] - base[d]) for d in peak}


class OptimizerStepProfiler(Callback):
    """Profile ``optimizer.step`` (only) on scheduled steps with ``torch.profiler``.

    Schedule: either ``steps`` (explicit 0-based ``trainer.global_step`` values, e.g.
    ``steps=(10, 11, 12)``), or windows of ``active`` consecutive steps starting at ``start``,
    repeated every ``every`` steps ``repeat`` times (``repeat=0``: for the whole run).

    Args:
        steps: explicit steps to profile (overrides ``start``/``active``/``every``/``repeat``).
        start, active, every, repeat: the periodic schedule (``every >= active``; needed when
            ``repeat != 1``).
        dirpath: output folder (default ``<trainer.log_dir>/optimizer_profiles``).
        row_limit: rows of the key-averages table.
        record_shapes, with_stack: passed to ``torch.profiler.profile`` (off by default: cost).
        profile_memory: record allocations (needed for the peak-memory figure).
    """

    def __init__(self, steps: Iterable[int] | None = None, *, start: int = 10, active: int = 3,
                 every: int | None = None, repeat: int = 1, dirpath: str | os.PathLike | None = None,
                 row_limit: int = 30, record_shapes: bool = False, profile_memory: bool = True,
                 with_stack: bool = False) -> None:
        if steps is not None:
            st = frozenset(int(s) for s in steps)
            if not st or min(st) < 0:
                raise ValueError(f"steps must be non-empty non-negative optimizer step indices, got {steps!r}")
            self._steps: frozenset[int] | None = st
        else:
            self._steps = None
            if start < 0 or active < 1 or repeat < 0:
                raise ValueError(f"need start >= 0, active >= 1 and repeat >= 0; got start={start}, active={active}, "
                                 f"repeat={repeat}")
            if repeat != 1 and every is None:
                raise ValueError(f"repeat={repeat} needs every= (the period between window starts, >= active={active})")
            if every is not None and every < active:
                raise ValueError(f"every={every} must be >= active={active} (windows would overlap)")
        self.start, self.active, self.every, self.repeat = int(start), int(active), every, int(repeat)
        self.dirpath = os.fspath(dirpath) if dirpath is not None else None
        self.row_limit = row_limit
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        #: one dict per profiled step (also written to ``optimizer_steps.jsonl``)
        self.records: list[dict[str, Any]] = []
        self._prof: Any = None
        self._handle: Any = None
        self._open_info: dict[str, Any] = {}
        self._suffix = ""
        self._trainer: pl.Trainer | None = None

    # ------------------------------------------------------------------ schedule (O(1))
    def is_scheduled(self, step: int) -> bool:
        """Whether optimizer step ``step`` (0-based ``trainer.global_step``) is profiled."""
        if self._steps is not None:
            return step in self._steps
        d = step - self.start
        if d < 0:
            return False
        k, j = divmod(d, self.every) if self.every else (0, d)
        return j < self.active and (self.repeat == 0 or k < self.repeat)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.dirpath is None:
            log_dir = trainer.log_dir  # collective: every rank calls setup
            self.dirpath = os.path.join(log_dir or trainer.default_root_dir, "optimizer_profiles")
        self._suffix = f"-rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        self._trainer = trainer

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        if self._prof is not None or not self.is_scheduled(trainer.global_step):
            return
        self._open(trainer, optimizer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._prof is not None:  # the step did not run (e.g. skipped by a GradScaler on inf)
            step = self._open_info.get("step")
            self._discard()
            rank_zero_warn(f"OptimizerStepProfiler: the optimizer step at global step {step} did not run after "
                           "on_before_optimizer_step (skipped by the precision plugin?); nothing was written for it")

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._prof is not None:
            self._discard()

    # ------------------------------------------------------------------ window
    def _device(self, optimizer: torch.optim.Optimizer) -> torch.device:
        for g in optimizer.param_groups:
            for p in g["params"]:
                return p.device
        return torch.device("cpu")

    def _open(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> None:
        device = self._device(optimizer)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(activities=activities, record_shapes=self.record_shapes,
                                      profile_memory=self.profile_memory, with_stack=self.with_stack)
        self._handle = optimizer.register_step_post_hook(self._on_step_end)
        self._open_info = {"step": trainer.global_step, "device": device, "optimizer": type(optimizer).__name__}
        prof.start()
        self._prof = prof
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._open_info["t0"] = time.perf_counter()

    def _on_step_end(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self._prof is None:
            return
        device = self._open_info["device"]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - self._open_info["t0"]) * 1e3
        prof = self._prof
        prof.stop()
        self._remove_hook()
        self._prof = None
        self._write(prof, ms)

    def _discard(self) -> None:
        prof, self._prof = self._prof, None
        self._remove_hook()
        try:
            prof.stop()
        except RuntimeError:  # pragma: no cover - profiler already stopped
            pass

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _write(self, prof: Any, ms: float) -> None:
        info = self._open_info
        step, device = info["step"], info["device"]
        assert self.dirpath is not None
        os.makedirs(self.dirpath, exist_ok=True)
        stem = os.path.join(self.dirpath, f"optimizer_step_{step:06d}{self._suffix}")
        trace = stem + ".trace.json"
        prof.export_chrome_trace(trace)
        on_cuda = device.type == "cuda"
        sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
        averages = prof.key_averages()
        qmuon_ops = sorted({e.key for e in averages if e.key.startswith("qmuon::")})
        peaks = peak_allocated_from_trace(trace) if self.profile_memory else {}
        dev_key = "cpu" if not on_cuda else f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"
        record: dict[str, Any] = {
            "step": step, "optimizer": info["optimizer"], "device": str(device), "optimizer_step_ms": ms,
            "peak_alloc_bytes": peaks, "qmuon_ops": qmuon_ops, "trace": trace, "table": stem + ".txt",
        }
        header = [
            f"optimizer.step profile: global step {step}, {info['optimizer']} on {device}",
            f"step time {ms:.3f} ms (wall, profiler recording; CUDA synchronized at both ends)",
        ]
        if self.profile_memory:
            header.append("peak allocated during the step, above the level before it (profiler memory events): "
                          + (", ".join(f"{d} {b / 2**20:.3f} MiB" for d, b in sorted(peaks.items())) or "none"))
        header.append(f"qmuon ops: {', '.join(qmuon_ops) or 'none'}")
        with open(stem + ".txt", "w", encoding="utf-8") as f:
            f.write("\n".join(header) + "\n\n")
            f.write(averages.table(sort_by=sort_by, row_limit=self.row_limit))
            f.write("\n")
        with open(os.path.join(self.dirpath, f"optimizer_steps{self._suffix}.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        self.records.append(record)
        metrics = {"optimizer_step_ms": ms}
        if dev_key in peaks:
            metrics["optimizer_step_peak_alloc_mb"] = peaks[dev_key] / 2**20
        if self._trainer is not None:
            log_to_loggers(self._trainer, metrics)
