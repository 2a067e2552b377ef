"""``TrainSummary``: the table ``qmuon-train`` prints at the end of ``fit``.

What it measures and how:

* **val loss**: ``val_loss`` from ``trainer.callback_metrics`` after every validation run (first
  and last are reported, with the step they were measured at).
* **tokens/s**: tokens of the training batches (input ``numel`` x data-parallel replicas) divided
  by the wall time spent inside training batches (``on_train_batch_start`` -> ``on_train_batch_end``:
  forward, backward, optimizer step; validation and checkpointing excluded).
* **mean optimizer step time**: from ``on_before_optimizer_step`` (Lightning calls it inside
  ``optimizer.step`` after the closure ran forward and backward) to the optimizer's step post-hook,
  i.e. the update alone. The first step is reported apart (it allocates state and may build kernels).
  On CUDA both ends synchronize the device.
* **optimizer state bytes**: every tensor in ``optimizer.state`` (local shards under FSDP,
  summed over ranks), split into the Muon part (groups with ``use_muon``) and the rest, against
  the same model's state under fp32 Muon (``torch.optim.Muon``: 4 bytes per Muon element; AdamW
  for the other parameters: 8 bytes per element).
* **promotions**: Muon parameters stepped in a safer momentum format than their group's (moved by
  ``QuantFidelityMonitor(action="promote")``, in this run or before a resume: read from the
  optimizer's parameter groups, with the step from the monitor when it made the move).
* **non-finite skips**: parameter updates QMuon skipped for a NaN/Inf gradient, the steps that
  had any, and the longest run of consecutive skips of one parameter (this run's counts).

Use it in YAML as ``class_path: qmuon_lightning.callbacks.summary.TrainSummary``.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import torch
from torch import Tensor

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from ..optim.qmuon import QMuon
from ..optim.routing import route_parameters

__all__ = ["TrainSummary", "optimizer_state_bytes"]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """``(muon_bytes, other_bytes)`` of this rank's optimizer state tensors.

    A parameter counts as Muon when its group has ``use_muon`` true (QMuon, MuonWithAdamW).
    """
    muon = other = 0
    for group in optimizer.param_groups:
        is_muon = bool(group.get("use_muon", False))
        for p in group["params"]:
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, Tensor):
                    t = _local(v)
                    n = t.numel() * t.element_size()
                    if is_muon:
                        muon += n
                    else:
                        other += n
    return muon, other


def _guard_figures(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
    """Promotions and non-finite-gradient counts of the run's QMuon optimizers (empty without QMuon)."""
    qms = [o for o in trainer.optimizers if isinstance(o, QMuon)]
    if not qms:
        return {}
    names = {id(p): n for n, p in pl_module.named_parameters()}
    steps: dict[str, int] = {}
    for cb in trainer.callbacks:
        for rec in getattr(cb, "promotions", None) or []:
            if isinstance(rec, dict) and "param" in rec:
                steps[rec["param"]] = int(rec["step"])  # the last move of each parameter
    promotions = [{**pr, "step": steps.get(pr["param"])} for o in qms for pr in o.promotions(names)]
    return {
        "promotions": promotions,
        "nonfinite_skips": sum(o.nonfinite_skips for o in qms),
        "nonfinite_skipped_steps": max(o.nonfinite_skipped_steps for o in qms),
        "nonfinite_max_consecutive": max(o.nonfinite_max_consecutive for o in qms),
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


class TrainSummary(L.Callback):
    """Measures a ``fit`` run and prints (rank 0) and saves a summary table.

    Args:
        filename: stem of ``<log_dir>/<filename>.json`` / ``.md`` written at the end of ``fit``
            (``None``: print only).
    """

    def __init__(self, filename: str | None = "summary") -> None:
        self.filename = filename
        self.summary: dict[str, Any] = {}
        self._reset()

    def _reset(self) -> None:
        self.train_seconds = 0.0
        self.tokens = 0
        self.batches = 0
        self.step_times: list[float] = []
        self.val_history: list[tuple[int, float]] = []
        self._t_batch = self._t_step = 0.0
        self._hooked: set[int] = set()
        self._handles: list[Any] = []
        self._cuda = False
        self._start_step = 0
        self._t_fit = time.perf_counter()

    # ------------------------------------------------------------------ timing
    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        self._cuda = trainer.strategy.root_device.type == "cuda"
        self._replicas = max(1, trainer.world_size)
        mesh = getattr(pl_module, "_device_mesh", None)
        if mesh is not None and mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names:
            self._replicas = mesh["data_parallel"].size()
        self._t_fit = time.perf_counter()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start_step = int(trainer.global_step)  # a resumed run's loops are restored by now
        for opt in trainer.optimizers:
            if id(opt) not in self._hooked:
                self._hooked.add(id(opt))
                self._handles.append(opt.register_step_post_hook(self._after_step))

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._sync()
        self._t_batch = time.perf_counter()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self._sync()
        self._t_step = time.perf_counter()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._t_step:
            self._sync()
            self.step_times.append(time.perf_counter() - self._t_step)
            self._t_step = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sync()
        self.train_seconds += time.perf_counter() - self._t_batch
        self.batches += 1
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        self.tokens += int(x.numel()) * self._replicas

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        v = trainer.callback_metrics.get("val_loss")
        if v is not None and not trainer.sanity_checking:
            self.val_history.append((int(trainer.global_step), float(v)))

    # ------------------------------------------------------------------ report
    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        opt = trainer.optimizers[0] if trainer.optimizers else None
        muon_b = other_b = 0
        if opt is not None:
            muon_b, other_b = optimizer_state_bytes(opt)
        sums = torch.tensor([muon_b, other_b], dtype=torch.float64, device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            sums = trainer.strategy.reduce(sums, reduce_op="sum")
        muon_b, other_b = (int(v) for v in sums.tolist())
        model = getattr(pl_module, "model", None) or pl_module
        muon_n = other_n = 0
        for d in route_parameters(model):
            n = int(torch.Size(d.shape).numel())
            if d.target == "muon":
                muon_n += n
            elif d.target != "frozen":
                other_n += n
        fp32_ref = 4 * muon_n + 8 * other_n
        spec = getattr(pl_module, "optimizer_spec", None)
        steps_timed = self.step_times[1:] if len(self.step_times) > 1 else self.step_times
        s: dict[str, Any] = {
            "optimizer": getattr(spec, "name", type(opt).__name__ if opt is not None else "none"),
            "state_format": getattr(spec, "resolved_state_format", None),
            "steps": int(trainer.global_step),
            "steps_this_run": int(trainer.global_step) - self._start_step,
            "parameters": muon_n + other_n,
            "muon_parameters": muon_n,
            "tokens": self.tokens,
            "train_seconds": self.train_seconds,
            "fit_seconds": time.perf_counter() - self._t_fit,
            "tokens_per_s": self.tokens / self.train_seconds if self.train_seconds > 0 else float("nan"),
            "val_first": self.val_history[0] if self.val_history else None,
            "val_final": self.val_history[-1] if self.val_history else None,
            "state_bytes": muon_b + other_b,
            "state_bytes_muon": muon_b,
            "state_bytes_other": other_b,
            "fp32_muon_reference_bytes": fp32_ref,
            "state_vs_fp32_muon": (muon_b + other_b) / fp32_ref if fp32_ref else float("nan"),
            "muon_state_vs_fp32": muon_b / (4 * muon_n) if muon_n and muon_b else float("nan"),
            "optimizer_step_ms_first": 1e3 * self.step_times[0] if self.step_times else float("nan"),
            "optimizer_step_ms_mean": 1e3 * sum(steps_timed) / len(steps_timed) if steps_timed else float("nan"),
            "optimizer_steps_timed": len(steps_timed),
            **_guard_figures(trainer, pl_module),
        }
        self.summary = s
        self._report(s, trainer.log_dir)  # log_dir broadcasts: every rank must ask

    @staticmethod
    def table(s: dict[str, Any]) -> str:
        """The summary as an aligned two-column text table."""
        def val(v: Any) -> str:
            return f"{v[1]:.4f} (step {v[0]})" if v else "not measured (no validation ran)"
        fmt = f" / {s['state_format']} momentum" if s.get("state_format") else ""
        rows = [
            ("optimizer", f"{s['optimizer']}{fmt}"),
            ("steps", f"{s['steps']} ({s['steps_this_run']} in this run)"),
            ("parameters", f"{s['parameters']:,} ({s['muon_parameters']:,} in Muon matrices)"),
            ("val loss, first", val(s["val_first"])),
            ("val loss, final", val(s["val_final"])),
            ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s ({s['tokens']:,} tokens in {s['train_seconds']:.1f} s of training batches)"),
            ("optimizer state", f"{_fmt_bytes(s['state_bytes'])} (Muon {_fmt_bytes(s['state_bytes_muon'])}, other {_fmt_bytes(s['state_bytes_other'])})"),
            ("fp32 Muon state", f"{_fmt_bytes(s['fp32_muon_reference_bytes'])} (4 B/Muon element + 8 B/AdamW element)"),
            ("state / fp32 Muon", f"{s['state_vs_fp32_muon']:.3f} (Muon momentum alone: {s['muon_state_vs_fp32']:.3f})"),
            ("optimizer step", f"{s['optimizer_step_ms_mean']:.2f} ms mean over {s['optimizer_steps_timed']} steps "
                               f"(first step {s['optimizer_step_ms_first']:.1f} ms)"),
            ("wall time", f"{s['fit_seconds']:.1f} s in fit"),
        ]
        if "nonfinite_skips" in s:
            rows.append(("non-finite skips", f"{s['nonfinite_skips']} parameter updates in {s['nonfinite_skipped_steps']} "
                                             f"steps (longest run of one parameter: {s['nonfinite_max_consecutive']})"))
        promos = s.get("promotions") or []
        for i, pr in enumerate(promos):
            when = f" at step {pr['step']}" if pr.get("step") is not None else " (before a resume)"
            rows.append(("promotions" if i == 0 else "", f"{pr['param']}: {pr['group_format']} -> {pr['state_format']}{when}"))
        if "promotions" in s and not promos:
            rows.append(("promotions", "none"))
        w = max(len(k) for k, _ in rows)
        line = "-" * (w + 2 + max(len(v) for _, v in rows))
        return "\n".join(["qmuon-train summary", line, *(f"{k.ljust(w)}  {v}" for k, v in rows), line])

    @rank_zero_only
    def _report(self, s: dict[str, Any], log_dir: str | None) -> None:
        text = self.table(s)
        print(text, flush=True)
        if self.filename and log_dir:
            os.makedirs(log_dir, exist_ok=True)
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in s.items()}
            with open(os.path.join(log_dir, f"{self.filename}.json"), "w") as f:
                json.dump(clean, f, indent=2)
            with open(os.path.join(log_dir, f"{self.filename}.md"), "w") as f:
                f.write("```\n" + text + "\n```\n")
