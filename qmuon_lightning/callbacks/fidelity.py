"""``QuantFidelityMonitor``: how far does quantized momentum turn Muon's update, in a live run?

What is measured
----------------
For a Muon parameter at step ``t`` the optimizer computes ``m_t = beta m_{t-1} + (1 - beta) g_t``
from the *stored* (quantized) ``m_{t-1}``, the Nesterov blend ``n_t = lerp(g_t, m_t, beta)`` and the
update ``U = adj_lr * NS(n_t)`` (per part for fused matrices). The fp32-state reference makes the
same computation from an fp32 momentum that saw the same gradients. The monitor logs, per layer,
``cos(U_quantized, U_fp32)``: the metric of :func:`qmuon_lightning.optim.fidelity.per_layer_update_cosine`
(which runs two optimizers on synthetic gradients), taken here on the run's own gradients.

Why a shadow momentum is needed: the new momentum ``m_t`` enters step ``t``'s update before it is
requantized, so comparing the two paths from the same dequantized ``m_{t-1}`` gives exactly 1 (up
to bf16 Newton-Schulz noise). The quantization error lives in ``m_{t-1}``: it is the sum of the
rounding errors ``e_s`` of the previous steps, each decayed by ``beta^(t-s)``. The monitor therefore
keeps an fp32 *shadow* momentum over a window of ``window`` steps before each measurement, started
from the dequantized state: at the measurement step the shadow differs from the stored state by
exactly the errors of the window's steps, ``sum_{s=t-window}^{t-1} beta^(t-1-s) e_s``. With
independent errors the window captures ``1 - beta^(2 window)`` of the error variance of an
unbounded history (0.994 for ``beta=0.95, window=50``); ``window=None`` keeps the shadow from the
first step on, which is the exact fp32 trajectory (what ``per_layer_update_cosine`` measures).

Cost: 4 bytes per monitored Muon element during a window (freed after each measurement; on
``shadow_device`` if given, e.g. ``"cpu"``), one fp32 lerp per element per window step, and at a
measurement two Newton-Schulz runs per matrix, one matrix at a time. Limit which layers are
monitored with ``params`` (a regex on parameter names).

Training is not disturbed: the monitor reads ``.grad`` and the optimizer state and writes only
its own copies; it draws no random numbers (stochastic rounding is counter-based and does not
affect step ``t``'s update; GRASP's first power-iteration start has its own seeded generator).
Lightning clips gradients right *after* ``on_before_optimizer_step``; the monitor applies the
Trainer's ``gradient_clip_val`` / ``gradient_clip_algorithm`` to its copies so it sees what the
optimizer sees (a custom ``configure_gradient_clipping`` is not replicated).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from ..ops import reference as ref
from ..core import pipeline
from ..core.plan import MatrixPart, plan_param
from ..optim.qmuon import QMuon
from ..quant import state as qstate
from ..quant.fidelity import cosine
from ._common import is_dtensor, log_to_loggers, muon_params, param_names, qmuon_optimizers

__all__ = ["QuantFidelityMonitor", "UpdateFidelityTracker", "DEFAULT_COSINE_THRESHOLD"]

#: Default warning threshold, set from measurements rather than taken from the seed notes' gate.
#: The seed notes' cosine gate (``omega_pack_e0m3.md``: per-token cosine 0.98 "points in nearly the
#: same direction"; its consumer gate measured 0.978-0.982) is for a quantized GEMM's output. On
#: the Muon update it would flag healthy int8 layers: on byte-level DecoderLMs (d_model 64 and 128,
#: 2 layers, 120-300 steps, window 50-60; table in docs/callbacks.md) int8 layers measured
#: 0.82-0.997 (mean 0.955-0.971; int8's validation-loss gap to fp32 state is -0.11% in
#: benchmarks/results/fidelity.md), grasp4 layers 0.52-0.83, e0m3 0.32-0.76, int4 0.35-0.66.
#: 0.8 sits below every int8 layer measured and above most 4-bit layers. Pass ``threshold=0.98``
#: for the seed notes' gate.
DEFAULT_COSINE_THRESHOLD = 0.8

GradTransform = Callable[[Tensor], Tensor]


def _identity(g: Tensor) -> Tensor:
    return g


class UpdateFidelityTracker:
    """Shadow fp32 momentum and per-layer update cosines for one :class:`QMuon` (no Lightning needed).

    Call :meth:`start` to seed the shadow from the optimizer's dequantized state, then
    :meth:`observe` once per step *before* ``optimizer.step()`` (with the gradients in ``.grad``);
    ``observe(measure=True)`` returns ``{name: cosine}``. :meth:`stop` frees the shadow.

    Args:
        optimizer: the optimizer to watch; only its Muon groups are measured.
        names: ``id(param) -> name`` (default: group ``param_names`` or ``group{g}.param{i}``).
        params: regex; only Muon parameters whose name matches (``re.search``) are monitored.
        shadow_device: where the fp32 shadow lives (default: each parameter's device).
        keep_updates: keep the last measurement's update directions in :attr:`last_updates`
            (``{name: (quantized, fp32)}``, fp32 tensors; for inspection and tests).
    """

    def __init__(self, optimizer: QMuon, *, names: Mapping[int, str] | None = None, params: str | None = None,
                 shadow_device: torch.device | str | None = None, keep_updates: bool = False) -> None:
        if not isinstance(optimizer, QMuon):
            raise TypeError(f"UpdateFidelityTracker needs a qmuon_lightning.QMuon, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        self.names = dict(names) if names is not None else param_names(None, optimizer)
        pattern = re.compile(params) if params is not None else None
        self.entries: list[tuple[dict[str, Any], Tensor, int, str]] = []
        for _, group, _, p, key in muon_params(optimizer):
            name = self.names.get(id(p), f"param{key}")
            if pattern is not None and not pattern.search(name):
                continue
            if is_dtensor(p):
                raise NotImplementedError(
                    f"UpdateFidelityTracker: parameter {name!r} is a DTensor (sharded). The update cosine needs whole "
                    "matrices (Newton-Schulz); run the monitor in a single-device or DDP run, or limit it with params=")
            self.entries.append((group, p, key, name))
        self.shadow_device = torch.device(shadow_device) if shadow_device is not None else None
        self._shadow: dict[int, Tensor] = {}
        self.keep_updates = keep_updates
        self.last_updates: dict[str, tuple[Tensor, Tensor]] = {}

    @property
    def active(self) -> bool:
        return bool(self._shadow)

    @property
    def shadow_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._shadow.values())

    @staticmethod
    def _shape(p: Tensor) -> tuple[int, int]:
        rows = p.shape[0]
        return rows, p.numel() // rows

    def _stored_momentum(self, group: dict[str, Any], p: Tensor) -> Tensor:
        rows, cols = self._shape(p)
        st = self.optimizer.state.get(p)
        if not st:
            return torch.zeros((rows, cols), dtype=torch.float32, device=p.device)
        fmt = qstate.get_format(group["state_format"])
        return fmt.dequantize(st, qstate.format_options(group), cols).float()

    def start(self) -> None:
        """Seed the fp32 shadow of every monitored parameter with its dequantized stored momentum."""
        with torch.no_grad():
            for group, p, key, _ in self.entries:
                m = self._stored_momentum(group, p)
                self._shadow[key] = m.to(self.shadow_device or p.device, dtype=torch.float32, copy=True)

    def stop(self) -> None:
        self._shadow.clear()

    @torch.no_grad()
    def observe(self, *, measure: bool = False, grad_transform: GradTransform = _identity) -> dict[str, float]:
        """Advance the shadow by this step's gradients; with ``measure`` return per-layer cosines.

        ``grad_transform`` maps a gradient to what the optimizer will see (gradient clipping).
        Parameters without a gradient, or with a non-finite one, are skipped, as QMuon skips them.
        """
        if not self._shadow:
            self.start()
        dense = qstate.get_format("fp32")
        out: dict[str, float] = {}
        for group, p, key, name in self.entries:
            if p.grad is None:
                continue
            rows, cols = self._shape(p)
            g = grad_transform(p.grad.detach()).reshape(rows, cols)
            if not bool(torch.isfinite(g).all()):
                continue
            opts = qstate.format_options(group)
            beta, nesterov = float(group["momentum"]), bool(group["nesterov"])
            nb = ref.num_blocks(cols, opts.block_size)
            shadow = self._shadow[key]
            # fp32 path: the optimizer's own fp32-state update op, on the shadow and a copy of g.
            n_ref = g.to(shadow.device, copy=True).contiguous()
            sums_ref = torch.empty((rows, nb), dtype=torch.float32, device=shadow.device)
            dense.update([{qstate.BUFFER: shadow}], [n_ref], [sums_ref], beta=beta, nesterov=nesterov, opts=opts,
                         streams=[-1], offsets=[0], keys=[key], seed=int(group["seed"]))
            if not measure:
                continue
            # Quantized path: the group's format update on a copy of the stored state and of g. The
            # rounding mode only changes the *new* stored state, not this step's NS input.
            fmt = qstate.get_format(group["state_format"])
            st = self.optimizer.state.get(p)
            src = st if st else fmt.init(rows, cols, opts, p.device)
            state_copy = {k: src[k].clone() for k in fmt.spec.keys}
            n_q = g.clone().contiguous()
            sums_q = torch.empty((rows, nb), dtype=torch.float32, device=p.device)
            fmt.update([state_copy], [n_q], [sums_q], beta=beta, nesterov=nesterov, opts=opts, streams=[-1],
                       offsets=[0], keys=[key], seed=int(group["seed"]))
            u_q = _update(n_q, sums_q, group)
            u_ref = _update(n_ref.to(p.device), sums_ref.to(p.device), group, carrier="bf16")
            out[name] = cosine(u_q, u_ref)
            if self.keep_updates:
                self.last_updates[name] = (u_q, u_ref)
        return out


def _update(ns_input: Tensor, sums: Tensor, group: dict[str, Any], *, carrier: str | None = None) -> Tensor:
    """The Muon update direction QMuon applies for one matrix (per part; lr factor 1), fp32,
    computed by the optimizer's own pipeline (:func:`qmuon_lightning.core.pipeline.orthogonalize`).

    ``carrier`` overrides the group's ``ns_input`` (the fp32 reference always reads the NS input
    as it is)."""
    rows, cols = ns_input.shape
    out = torch.empty((rows, cols), dtype=torch.float32, device=ns_input.device)
    settings = pipeline.ns_settings(group, ns_input.device)
    if carrier is not None:
        settings = dataclasses.replace(settings, carrier=carrier)

    def write(part: MatrixPart, o: Tensor) -> None:
        part.block(out).copy_(o.float() * part.lr_scale)

    plan = plan_param(ns_input, group, 0, "")
    pipeline.orthogonalize(pipeline.local_items(plan, ns_input, sums, group, settings, write))
    return out


class QuantFidelityMonitor(Callback):
    """Every ``every_n_steps`` optimizer steps, log each Muon layer's update cosine against the
    fp32-momentum update and warn (rank 0, once per layer) when one falls below ``threshold``.

    Logged to the Trainer's loggers at the measured step: ``fidelity/cos/<param name>`` (unless
    ``log_per_layer=False``), ``fidelity/cos_min``, ``fidelity/cos_mean``. The values of every
    measurement are also kept in :attr:`history` (``[{"step": s, "cos": {name: value}}]``).

    Args:
        every_n_steps: measure at optimizer steps ``every_n_steps - 1, 2 * every_n_steps - 1, ...``
            (0-based ``trainer.global_step``).
        window: fp32 shadow length in steps before each measurement (1 <= window < every_n_steps);
            ``None`` keeps the shadow for the whole run (exact fp32 trajectory; 4 bytes per
            monitored element for the whole run). See the module docstring for what it measures.
        threshold: warn below this cosine (default :data:`DEFAULT_COSINE_THRESHOLD`).
        params: regex on parameter names; only matching Muon parameters are monitored.
        shadow_device: device of the shadow momentum (default: the parameter's).
    """

    def __init__(self, every_n_steps: int = 100, *, window: int | None = 50,
                 threshold: float = DEFAULT_COSINE_THRESHOLD, params: str | None = None,
                 shadow_device: torch.device | str | None = None, log_per_layer: bool = True) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 2:
            raise ValueError(f"every_n_steps must be an int >= 2, got {every_n_steps!r}")
        if window is not None and not (isinstance(window, int) and 1 <= window < every_n_steps):
            raise ValueError(
                f"window must be None or an int in [1, every_n_steps) = [1, {every_n_steps}), got {window!r}: the shadow "
                "momentum starts `window` steps before each measurement (window=0 would compare a state with itself)")
        if not -1.0 <= threshold <= 1.0:
            raise ValueError(f"threshold is a cosine, it must be in [-1, 1]; got {threshold}")
        if params is not None:
            re.compile(params)
        self.every_n_steps = every_n_steps
        self.window = window
        self.threshold = float(threshold)
        self.params = params
        self.shadow_device = shadow_device
        self.log_per_layer = log_per_layer
        self.history: list[dict[str, Any]] = []
        self._trackers: dict[int, UpdateFidelityTracker] = {}
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ schedule (O(1))
    def steps_to_measurement(self, step: int) -> int:
        """Optimizer steps from ``step`` to the next measurement (0: ``step`` is measured)."""
        return (self.every_n_steps - 1 - step) % self.every_n_steps

    def _in_window(self, step: int) -> bool:
        return self.window is None or self.steps_to_measurement(step) <= self.window

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trackers.clear()
        found = qmuon_optimizers(trainer)
        if not found:
            rank_zero_warn("QuantFidelityMonitor: no qmuon_lightning.QMuon among trainer.optimizers; nothing to monitor")
        for _, opt in found:
            try:
                self._trackers[id(opt)] = UpdateFidelityTracker(
                    opt, names=param_names(pl_module, opt), params=self.params, shadow_device=self.shadow_device)
            except NotImplementedError as e:
                rank_zero_warn(f"QuantFidelityMonitor disabled for this optimizer: {e}")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for t in self._trackers.values():
            t.stop()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        tracker = self._trackers.get(id(optimizer))
        if tracker is None:
            return
        step = trainer.global_step
        if not self._in_window(step):
            return
        measure = self.steps_to_measurement(step) == 0
        cos = tracker.observe(measure=measure, grad_transform=_clip_transform(trainer, optimizer))
        if not measure:
            return
        if self.window is not None:
            tracker.stop()
        if cos:
            self._report(trainer, step, cos, optimizer)

    def _report(self, trainer: pl.Trainer, step: int, cos: dict[str, float], optimizer: QMuon) -> None:
        values = list(cos.values())
        metrics = {"fidelity/cos_min": min(values), "fidelity/cos_mean": sum(values) / len(values)}
        if self.log_per_layer:
            metrics.update({f"fidelity/cos/{k}": v for k, v in cos.items()})
        log_to_loggers(trainer, metrics)
        self.history.append({"step": step, "cos": dict(cos)})
        formats = {id(p): g["state_format"] for g in optimizer.param_groups for p in g["params"]}
        tracker = self._trackers[id(optimizer)]
        fmt_of = {name: formats.get(id(p), "?") for _, p, _, name in tracker.entries}
        for name, v in cos.items():
            if v < self.threshold and name not in self._warned:
                self._warned.add(name)
                rank_zero_warn(
                    f"QuantFidelityMonitor: at step {step} the Muon update of {name!r} ({fmt_of.get(name)} momentum) has "
                    f"cosine {v:.4f} with the fp32-momentum update, below the threshold {self.threshold}. The quantized "
                    "momentum is turning this layer's update; consider state_format='int8' (or 'grasp4' instead of "
                    "int4/e0m3), a smaller block_size, or excluding the layer from Muon. (Warned once per layer.)")

    # ------------------------------------------------------------------ callback state
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "warned": sorted(self._warned)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self._warned = set(state_dict.get("warned", []))


def _clip_transform(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> GradTransform:
    """What Lightning's built-in gradient clipping will do to each gradient of ``optimizer``."""
    clip = trainer.gradient_clip_val
    if not clip:
        return _identity
    algo = str(getattr(trainer, "gradient_clip_algorithm", None) or "norm").lower()
    if algo.endswith("value"):
        c = float(clip)
        return lambda g: g.clamp(-c, c)
    grads = [p.grad for grp in optimizer.param_groups for p in grp["params"] if p.grad is not None]
    if not grads:
        return _identity
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    # torch.nn.utils.clip_grad_norm_: coef = max_norm / (total + 1e-6), clamped to 1.
    coef = min(1.0, float(clip) / (float(total) + 1e-6))
    if coef >= 1.0 or math.isnan(coef):
        return _identity
    return lambda g: g * coef
