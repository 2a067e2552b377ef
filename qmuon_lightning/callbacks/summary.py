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
  for the other parameters: 8 bytes per element); the Muon part also per Muon parameter.
* **model TFLOP/s and MFU**: :func:`~qmuon_lightning.callbacks.telemetry.model_flops_per_token`
  (``6 N + 12 L d_attn T``) x tokens/s / devices, against the device's dense bf16 peak
  (:data:`~qmuon_lightning.callbacks.telemetry.PEAK_BF16_TFLOPS`, or ``peak_tflops``); MFU is
  "n/a" on CPU and on devices without a known peak.
* **peak memory**: CUDA max allocated / reserved since ``fit`` started, or the process' peak RSS
  on CPU; the largest over ranks.
* **grad norm**: L2 norm of all gradients in ``on_before_optimizer_step`` (after AMP unscaling,
  before clipping; the full norm across FSDP2 shards), and the optimizer step's share of the
  training-batch time.
* **promotions**: Muon parameters stepped in a safer momentum format than their group's (moved by
  ``QuantFidelityMonitor(action="promote")``, in this run or before a resume: read from the
  optimizer's parameter groups, with the step from the monitor when it made the move).
* **non-finite skips**: parameter updates QMuon skipped for a NaN/Inf gradient, the steps that
  had any, and the longest run of consecutive skips of one parameter (this run's counts).

Every training batch it also logs (``pl_module.log``, so the CSV / TensorBoard loggers get them
every ``log_every_n_steps``): ``perf/tokens_per_s``, ``perf/model_tflops`` (per device),
``perf/mfu_percent`` (known peaks only), ``perf/optimizer_step_share``, ``memory/peak_allocated_gib``
and ``memory/peak_reserved_gib`` (CUDA) or ``memory/peak_rss_gib`` (CPU), and ``grad_norm``.
With QK-clip on (``qk_clip={"tau": ...}``, :mod:`qmuon.optim.qk_clip`) it writes, every
``log_every_n_steps`` optimizer steps (the only steps that read the device for it), each attention
layer's largest logit of the last step, ``qk_clip/max_logit/<layer>``, and the heads clipped in the
last step and since the start, ``qk_clip/heads_clipped`` and ``qk_clip/heads_clipped_total``.

Use it in YAML as ``class_path: qmuon_lightning.callbacks.summary.TrainSummary``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Any

import torch
from torch import Tensor

import lightning as L
from lightning.pytorch.utilities import rank_zero_only

from qmuon.optim.qmuon import QMuon
from qmuon.optim.routing import route_parameters
from ._common import log_to_loggers
from .telemetry import model_flops_per_token, peak_bf16_flops, peak_memory, total_grad_norm

__all__ = ["TrainSummary"]


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


def _flops_row(s: dict[str, Any]) -> str:
    if s.get("flops_per_token") is None:
        return "n/a (the model's layer count and width are unknown)"
    return (f"{s['model_tflops_per_device']:.4g} TFLOP/s per device ({s['flops_per_token'] / 1e6:,.1f} MFLOP/token = "
            f"6 N + 12 L d_attn T at T={s['flops_seq_len']}, {s['devices']} device(s))")


def _mfu_row(s: dict[str, Any]) -> str:
    if s.get("mfu") is None:
        return f"n/a ({s.get('device')}: no dense bf16 peak known; set summary.peak_tflops)"
    source = "summary.peak_tflops" if s.get("peak_tflops_given") else "dense bf16"
    return f"{100 * s['mfu']:.3g}% of {s['peak_tflops']:,.4g} TFLOP/s {source} ({s['device']})"


def _memory_row(s: dict[str, Any]) -> str:
    if s.get("peak_memory_kind") == "cuda":
        return (f"{_fmt_bytes(s['peak_memory_allocated_bytes'])} allocated, {_fmt_bytes(s['peak_memory_reserved_bytes'])} "
                "reserved (CUDA max since fit started, largest rank)")
    return f"{_fmt_bytes(s['peak_memory_rss_bytes'])} RSS (process peak, largest rank)"


def _grad_norm_row(s: dict[str, Any]) -> str:
    if not s.get("grad_norm_steps"):
        return "not measured (no gradients in param.grad, e.g. DeepSpeed ZeRO)"
    return (f"{s['grad_norm_final']:.4g} final, {s['grad_norm_mean']:.4g} mean, {s['grad_norm_max']:.4g} max over "
            f"{s['grad_norm_steps']} steps (before clipping)")


class TrainSummary(L.Callback):
    """Measures a ``fit`` run and prints (rank 0) and saves a summary table.

    Args:
        filename: stem of ``<log_dir>/<filename>.json`` / ``.md`` written at the end of ``fit``
            (``None``: print only).
        peak_tflops: the device's peak in TFLOP/s for MFU; ``None``: the dense bf16 table
            (GB10, H100, H200), MFU "n/a" elsewhere.
        log_metrics: log the per-batch metrics listed in the module docstring to the loggers.
        log_grad_norm: compute the gradient norm every optimizer step (a reduction over all
            gradients, plus an all-reduce under FSDP).
    """

    def __init__(self, filename: str | None = "summary", peak_tflops: float | None = None, log_metrics: bool = True,
                 log_grad_norm: bool = True) -> None:
        if peak_tflops is not None and peak_tflops <= 0:
            raise ValueError(f"summary.peak_tflops must be positive, got {peak_tflops}")
        self.filename = filename
        self.peak_tflops = peak_tflops
        self.log_metrics = log_metrics
        self.log_grad_norm = log_grad_norm
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
        self.grad_norms: list[float] = []
        self._step_in_batch: float | None = None
        self._flops_per_token: int | None = None
        self._flops_seq_len = 0
        self._devices = 1
        self._device = torch.device("cpu")
        self._device_name, self._peak_flops = "cpu", None

    # ------------------------------------------------------------------ timing
    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._reset()
        self._device = trainer.strategy.root_device
        self._cuda = self._device.type == "cuda"
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
        self._device_name, self._peak_flops = peak_bf16_flops(self._device)
        if self.peak_tflops is not None:
            self._peak_flops = self.peak_tflops * 1e12
        self._devices = max(1, trainer.world_size)
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
        # Lightning calls this after backward and AMP unscaling, before gradient clipping. The
        # norm is computed before the step timer starts, so it does not count as optimizer time.
        if self.log_grad_norm:
            norm = total_grad_norm(p for g in optimizer.param_groups for p in g["params"])
            if norm is not None:
                self.grad_norms.append(norm)
                if self.log_metrics:
                    pl_module.log("grad_norm", norm, on_step=True, on_epoch=False)
        self._sync()
        self._t_step = time.perf_counter()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._t_step:
            self._sync()
            self.step_times.append(time.perf_counter() - self._t_step)
            self._step_in_batch = (self._step_in_batch or 0.0) + self.step_times[-1]
            self._t_step = 0.0

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sync()
        seconds = time.perf_counter() - self._t_batch
        self.train_seconds += seconds
        self.batches += 1
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        tokens = int(x.numel()) * self._replicas
        self.tokens += tokens
        if self._flops_per_token is None or self._flops_seq_len != x.shape[-1]:
            self._flops_seq_len = int(x.shape[-1])
            self._flops_per_token = model_flops_per_token(pl_module, self._flops_seq_len)
        if self.log_metrics and seconds > 0:
            metrics = {"perf/tokens_per_s": tokens / seconds}
            if self._flops_per_token is not None:
                flops = self._flops_per_token * tokens / seconds / self._devices
                metrics["perf/model_tflops"] = flops / 1e12
                if self._peak_flops:
                    metrics["perf/mfu_percent"] = 100.0 * flops / self._peak_flops
            if self._step_in_batch is not None:
                metrics["perf/optimizer_step_share"] = self._step_in_batch / seconds
            for k, v in peak_memory(self._device).items():
                metrics[f"memory/peak_{k}_gib"] = v / 2**30
            pl_module.log_dict(metrics, on_step=True, on_epoch=False)
            self._log_qk_clip(trainer)
        self._step_in_batch = None

    def _log_qk_clip(self, trainer: L.Trainer) -> None:
        """QK-clip's per-layer max logit and clipped heads, read from the device at log intervals only."""
        every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 1))
        if not trainer.is_global_zero or trainer.global_step % every:
            return
        for opt in trainer.optimizers:
            qk = getattr(opt, "qk_clip", None) or getattr(getattr(opt, "optimizer", None), "qk_clip", None)
            if qk is not None:
                log_to_loggers(trainer, qk.metrics())

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
        mem = peak_memory(self._device)
        peaks = torch.tensor(list(mem.values()), dtype=torch.float64, device=trainer.strategy.root_device)
        if trainer.world_size > 1:
            peaks = trainer.strategy.reduce(peaks, reduce_op="max")
        mem = {k: int(v) for k, v in zip(mem, peaks.tolist())}
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
        tokens_per_s = self.tokens / self.train_seconds if self.train_seconds > 0 else float("nan")
        model_flops = (self._flops_per_token * tokens_per_s / self._devices
                       if self._flops_per_token is not None else float("nan"))
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
            "tokens_per_s": tokens_per_s,
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
            # the mean also carries preemptions: on a busy machine the OpenMP threads of a step
            # can wait whole scheduler time slices for each other (10-50x single steps)
            "optimizer_step_ms_median": 1e3 * statistics.median(steps_timed) if steps_timed else float("nan"),
            "optimizer_steps_timed": len(steps_timed),
            "torch_threads": torch.get_num_threads(),
            "optimizer_step_share": sum(self.step_times) / self.train_seconds if self.train_seconds > 0 else float("nan"),
            "muon_state_bytes_per_param": muon_b / muon_n if muon_n else float("nan"),
            "flops_per_token": self._flops_per_token,
            "flops_seq_len": self._flops_seq_len,
            "devices": self._devices,
            "model_tflops_per_device": model_flops / 1e12,
            "device": self._device_name,
            "peak_tflops": self._peak_flops / 1e12 if self._peak_flops else None,
            "mfu": model_flops / self._peak_flops if self._peak_flops else None,
            "peak_tflops_given": self.peak_tflops is not None,
            "peak_memory_kind": "cuda" if self._cuda else "rss",
            **{f"peak_memory_{k}_bytes": v for k, v in mem.items()},
            "grad_norm_final": self.grad_norms[-1] if self.grad_norms else None,
            "grad_norm_mean": sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else None,
            "grad_norm_max": max(self.grad_norms) if self.grad_norms else None,
            "grad_norm_steps": len(self.grad_norms),
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
            ("optimizer step", f"{s['optimizer_step_ms_mean']:.2f} ms mean"
                               + (f", {s['optimizer_step_ms_median']:.2f} ms median" if "optimizer_step_ms_median" in s else "")
                               + f" over {s['optimizer_steps_timed']} steps "
                               f"(first step {s['optimizer_step_ms_first']:.1f} ms"
                               + (f"; {s['torch_threads']} torch threads" if "torch_threads" in s else "") + "); "
                               f"{100 * s['optimizer_step_share']:.1f}% of training-batch time"),
            ("Muon state", f"{s['muon_state_bytes_per_param']:.3f} B per Muon parameter"),
            ("model FLOPs", _flops_row(s)),
            ("MFU", _mfu_row(s)),
            ("peak memory", _memory_row(s)),
            ("grad norm", _grad_norm_row(s)),
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
