"""``QuantFidelityMonitor``: how far does quantized momentum turn Muon's update, in a live run?

What is measured
----------------
For a Muon parameter at step ``t`` the optimizer computes ``m_t = beta m_{t-1} + (1 - beta) g_t``
from the *stored* (quantized) ``m_{t-1}``, the Nesterov blend ``n_t = lerp(g_t, m_t, beta)`` and the
update ``U = adj_lr * NS(n_t)`` (per part for fused matrices). The fp32-state reference makes the
same computation from an fp32 momentum that saw the same gradients. The monitor logs, per layer,
``cos(U_quantized, U_fp32)``: the metric of :func:`qmuon.optim.fidelity.per_layer_update_cosine`
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

Acting on it (``action="promote"`` / ``"stop"``): see :class:`QuantFidelityMonitor`; thresholds
per format come from :func:`qmuon.quant.guard_threshold` (measured, docs/fidelity.md).

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
import logging
import math
import re
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from qmuon.ops import reference as ref
from qmuon.core import pipeline
from qmuon.core.config import param_group_view
from qmuon.core.plan import MatrixPart, plan_param
from qmuon.optim.qmuon import QMuon
from qmuon.quant import state as qstate
from qmuon.quant.fidelity import cosine
from ._common import is_dtensor, log_to_loggers, muon_params, param_names, qmuon_optimizers

__all__ = ["QuantFidelityMonitor", "UpdateFidelityTracker", "QuantFidelityError"]

log = logging.getLogger(__name__)

#: Default threshold: ``None`` means each layer is judged by its own format's
#: :func:`qmuon.quant.guard_threshold` (int8 0.7, grasp4 0.4, int4 / e0m3 0.2, bf16
#: 0.85), each set clearly below the lowest update cosine measured on healthy layers of that format
#: (figures and source: docs/fidelity.md, "Fidelity guard"). One number cannot serve every format:
#: healthy grasp4 layers read 0.52-0.83 where healthy int8 layers read 0.82-0.997.
DEFAULT_COSINE_THRESHOLD: float | None = None
#: Consecutive checks below the threshold before ``action="promote"`` / ``"stop"`` acts: one low
#: reading (a bad batch) does not move a layer; no healthy layer measured fell below its format's
#: threshold even once (docs/fidelity.md).
DEFAULT_PATIENCE = 2
#: What the monitor does about a layer below its threshold.
ACTIONS = ("log", "promote", "stop")

GradTransform = Callable[[Tensor], Tensor]


class QuantFidelityError(RuntimeError):
    """``QuantFidelityMonitor(action="stop")`` ended the run: quantized momentum turned the
    update of the layers in :attr:`layers` away from the fp32-momentum update."""

    def __init__(self, message: str, layers: list[str]) -> None:
        super().__init__(message)
        self.layers = layers


def _identity(g: Tensor) -> Tensor:
    return g


def _local(t: Tensor) -> Tensor:
    return t.to_local() if is_dtensor(t) else t


def _gather_rows(t_local: Tensor, p: Tensor) -> Tensor:
    """The whole ``rows x n`` tensor of which ``t_local`` holds ``p``'s local rows (collective)."""
    from torch.distributed.tensor import DTensor

    from qmuon.quant.layout import row_placements

    t_local = t_local.contiguous()
    shape = (int(p.shape[0]), *t_local.shape[1:])
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(t_local, p.device_mesh, row_placements(p), run_check=False, shape=shape,
                              stride=stride).full_tensor()


def _world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class UpdateFidelityTracker:
    """Shadow fp32 momentum and per-layer update cosines for one :class:`QMuon` (no Lightning needed).

    Call :meth:`start` to seed the shadow from the optimizer's dequantized state, then
    :meth:`observe` once per step *before* ``optimizer.step()`` (with the gradients in ``.grad``);
    ``observe(measure=True)`` returns ``{name: cosine}``. :meth:`stop` frees the shadow.

    Sharded (FSDP2 ``Shard(0)`` DTensor) parameters: the shadow holds this rank's rows only and
    advances without communication; a measurement gathers the matrix's gradient, NS inputs and
    quantized state (collective: every rank must call :meth:`observe` at the same steps) and one
    rank per matrix (its index modulo the world size) computes the cosine; the other ranks leave
    it out of their result (:class:`QuantFidelityMonitor` all-reduces the cosines so every rank
    sees them all).

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
        #: ``(group index, index in group, param, key, name)`` of every monitored parameter. Groups
        #: are looked up when used: ``load_state_dict`` replaces the group dicts.
        self.entries: list[tuple[int, int, Tensor, int, str]] = []
        for gi, _, i, p, key in muon_params(optimizer):
            name = self.names.get(id(p), f"param{key}")
            if pattern is not None and not pattern.search(name):
                continue
            self.entries.append((gi, i, p, key, name))
        self.shadow_device = torch.device(shadow_device) if shadow_device is not None else None
        self._shadow: dict[int, Tensor] = {}
        self.keep_updates = keep_updates
        self.last_updates: dict[str, tuple[Tensor, Tensor]] = {}

    @property
    def active(self) -> bool:
        return bool(self._shadow)

    @property
    def sharded(self) -> bool:
        return any(is_dtensor(p) for _, _, p, _, _ in self.entries)

    def param_of(self, name: str) -> Tensor | None:
        return next((p for _, _, p, _, n in self.entries if n == name), None)

    def format_of(self, name: str) -> str | None:
        """The state format the named parameter is stepped with now (its promotion, if any)."""
        for gi, i, _, _, n in self.entries:
            if n == name:
                return str(self._view(gi, i)["state_format"])
        return None

    def _view(self, gi: int, i: int) -> dict[str, Any]:
        return param_group_view(self.optimizer.param_groups[gi], i)

    @staticmethod
    def _local_shape(p: Tensor) -> tuple[int, int]:
        rows = int(_local(p).shape[0])
        return rows, math.prod(int(s) for s in p.shape[1:])

    def _stored_momentum(self, view: dict[str, Any], p: Tensor) -> Tensor:
        """This rank's rows of the dequantized stored momentum (every format decodes row shards
        on their own: the layout checks of sharded QMuon guarantee it)."""
        rows, cols = self._local_shape(p)
        st = self.optimizer.state.get(p)
        if not st:
            return torch.zeros((rows, cols), dtype=torch.float32, device=_local(p).device)
        fmt = qstate.get_format(view["state_format"])
        return fmt.dequantize({k: _local(v) for k, v in st.items()}, qstate.format_options(view), cols).float()

    def start(self) -> None:
        """Seed the fp32 shadow of every monitored parameter with its dequantized stored momentum."""
        with torch.no_grad():
            for gi, i, p, key, _ in self.entries:
                m = self._stored_momentum(self._view(gi, i), p)
                self._shadow[key] = m.to(self.shadow_device or _local(p).device, dtype=torch.float32, copy=True)

    def stop(self) -> None:
        self._shadow.clear()

    def restart(self, name: str) -> None:
        """Re-seed one parameter's shadow from its stored momentum (after its format changed, so
        later measurements see the new format's error, not the old one's)."""
        for gi, i, p, key, n in self.entries:
            if n == name and key in self._shadow:
                m = self._stored_momentum(self._view(gi, i), p)
                self._shadow[key] = m.to(self._shadow[key].device, dtype=torch.float32, copy=True)

    def _usable(self, grads: list[Tensor | None]) -> list[bool]:
        """Per entry: a gradient is present and finite. Agreed over ranks (all-reduce MIN) when
        parameters are sharded, so every rank skips or measures the same matrices."""
        ok = [g is not None and bool(torch.isfinite(g).all()) for g in grads]
        rank, world = _world()
        if world > 1 and self.sharded:
            flags = torch.tensor(ok, dtype=torch.int32, device=_local(self.entries[0][2]).device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
            ok = [bool(v) for v in flags.tolist()]
        return ok

    @torch.no_grad()
    def observe(self, *, measure: bool = False, grad_transform: GradTransform = _identity) -> dict[str, float]:
        """Advance the shadow by this step's gradients; with ``measure`` return per-layer cosines.

        ``grad_transform`` maps a gradient to what the optimizer will see (gradient clipping).
        Parameters without a gradient, or with a non-finite one, are skipped, as QMuon skips them.
        """
        if not self._shadow:
            self.start()
        dense = qstate.get_format("fp32")
        rank, world = _world()
        grads = [None if p.grad is None else grad_transform(_local(p.grad.detach())) for _, _, p, _, _ in self.entries]
        usable = self._usable(grads)
        out: dict[str, float] = {}
        for j, ((gi, i, p, key, name), grad, ok) in enumerate(zip(self.entries, grads, usable)):
            if not ok:
                continue
            view = self._view(gi, i)
            rows, cols = self._local_shape(p)
            g = grad.reshape(rows, cols)
            opts = qstate.format_options(view)
            beta, nesterov = float(view["momentum"]), bool(view["nesterov"])
            nb = ref.num_blocks(cols, opts.block_size)
            shadow = self._shadow[key]
            # fp32 path: the optimizer's own fp32-state update op, on the shadow and a copy of g.
            n_ref = g.to(shadow.device, copy=True).contiguous()
            sums_ref = torch.empty((rows, nb), dtype=torch.float32, device=shadow.device)
            dense.update([{qstate.BUFFER: shadow}], [n_ref], [sums_ref], beta=beta, nesterov=nesterov, opts=opts,
                         streams=[-1], offsets=[0], keys=[key], seed=int(view["seed"]))
            if not measure:
                continue
            st = self.optimizer.state.get(p)
            fmt = qstate.get_format(view["state_format"])
            dev = _local(p).device
            if is_dtensor(p):  # whole matrices (collective), then one owner rank computes
                g = _gather_rows(g, p)
                n_ref = _gather_rows(n_ref.to(dev), p)
                sums_ref = _gather_rows(sums_ref.to(dev), p)
                src = {k: v.full_tensor() if is_dtensor(v) else v for k, v in st.items()} if st else None
                if j % world != rank:
                    continue
                rows = int(p.shape[0])
            else:
                src = st if st else None
            # Quantized path: the format update on a copy of the stored state and of g. The
            # rounding mode only changes the *new* stored state, not this step's NS input.
            src = src if src is not None else fmt.init(rows, cols, opts, dev)
            state_copy = {k: src[k].clone() for k in fmt.spec.keys}
            n_q = g.clone().contiguous()
            sums_q = torch.empty((rows, nb), dtype=torch.float32, device=dev)
            fmt.update([state_copy], [n_q], [sums_q], beta=beta, nesterov=nesterov, opts=opts, streams=[-1],
                       offsets=[0], keys=[key], seed=int(view["seed"]))
            u_q = _update(n_q, sums_q, view, shape=tuple(p.shape))
            u_ref = _update(n_ref.to(dev), sums_ref.to(dev), view, carrier="bf16", shape=tuple(p.shape))
            out[name] = cosine(u_q, u_ref)
            if self.keep_updates:
                self.last_updates[name] = (u_q, u_ref)
        return out


def _update(ns_input: Tensor, sums: Tensor, group: dict[str, Any], *, carrier: str | None = None,
            shape: tuple[int, ...] | None = None) -> Tensor:
    """The Muon update direction QMuon applies for one matrix (per part; lr factor 1), fp32,
    computed by the optimizer's own pipeline (:func:`qmuon.core.pipeline.orthogonalize`).

    ``carrier`` overrides the group's ``ns_input`` (the fp32 reference always reads the NS input
    as it is); ``shape``: the parameter's (global) shape, which a bank's plan needs."""
    rows, cols = ns_input.shape
    out = torch.empty((rows, cols), dtype=torch.float32, device=ns_input.device)
    settings = pipeline.ns_settings(group, ns_input.device)
    if carrier is not None:
        settings = dataclasses.replace(settings, carrier=carrier)

    def write(part: MatrixPart, o: Tensor) -> None:
        part.block(out).copy_(o.float() * part.lr_scale)

    plan = plan_param(shape if shape is not None else ns_input, group, 0, "")
    pipeline.orthogonalize(pipeline.local_items(plan, ns_input, sums, group, settings, write))
    return out


class QuantFidelityMonitor(Callback):
    """Every ``every_n_steps`` optimizer steps, measure each Muon layer's update cosine against
    the fp32-momentum update, log it, and act on layers below their threshold.

    Logged to the Trainer's loggers at the measured step: ``fidelity/cos/<param name>`` (unless
    ``log_per_layer=False``), ``fidelity/cos_min``, ``fidelity/cos_mean``; with promotions also
    ``fidelity/promotions`` (the run's total) and ``fidelity/promoted/<param name>`` (1 at the
    step it moved). The values of every measurement are kept in :attr:`history`
    (``[{"step": s, "cos": {name: value}}]``), the promotions in :attr:`promotions`.

    Actions (``action``):

    * ``"log"``: warn (rank 0, once per layer) at the first reading below the threshold.
    * ``"promote"``: a layer below its threshold at ``patience`` consecutive checks moves to the
      next safer format (:func:`qmuon.quant.safer_format`: grasp4 / int4 / e0m3 -> int8
      -> bf16) through :meth:`QMuon.promote_param`, which converts its stored momentum and records
      the override in the optimizer's parameter group (saved in checkpoints, so a resumed run keeps
      it). A layer at the end of the chain is warned about instead.
    * ``"stop"``: the same condition raises :class:`QuantFidelityError` naming the layers.

    Under several processes the cosines are all-reduced before any decision (each matrix is
    measured by one rank when sharded, by every rank otherwise), so every rank promotes or stops
    on the same layers at the same step.

    Args:
        every_n_steps: measure at optimizer steps ``every_n_steps - 1, 2 * every_n_steps - 1, ...``
            (0-based ``trainer.global_step``).
        window: fp32 shadow length in steps before each measurement (1 <= window < every_n_steps);
            ``None`` keeps the shadow for the whole run (exact fp32 trajectory; 4 bytes per
            monitored element for the whole run). See the module docstring for what it measures.
        threshold: ``None`` (default): each layer's format's
            :func:`~qmuon.quant.guard_threshold`; a float: the same cosine for every
            format; a mapping: per format name (formats left out use their default).
        action: ``"log"``, ``"promote"`` or ``"stop"`` (above).
        patience: consecutive checks below the threshold before ``"promote"`` / ``"stop"`` act.
        params: regex on parameter names; only matching Muon parameters are monitored.
        shadow_device: device of the shadow momentum (default: the parameter's).
    """

    def __init__(self, every_n_steps: int = 100, *, window: int | None = 50,
                 threshold: float | Mapping[str, float] | None = DEFAULT_COSINE_THRESHOLD, action: str = "log",
                 patience: int = DEFAULT_PATIENCE, params: str | None = None,
                 shadow_device: torch.device | str | None = None, log_per_layer: bool = True) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 2:
            raise ValueError(f"every_n_steps must be an int >= 2, got {every_n_steps!r}")
        if window is not None and not (isinstance(window, int) and 1 <= window < every_n_steps):
            raise ValueError(
                f"window must be None or an int in [1, every_n_steps) = [1, {every_n_steps}), got {window!r}: the shadow "
                "momentum starts `window` steps before each measurement (window=0 would compare a state with itself)")
        if action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
        if not isinstance(patience, int) or isinstance(patience, bool) or patience < 1:
            raise ValueError(f"patience must be an int >= 1 (consecutive checks below the threshold), got {patience!r}")
        if isinstance(threshold, Mapping):
            for name, v in threshold.items():
                qstate.get_format(name)  # raises naming the known formats
                _check_cosine(v)
            threshold = dict(threshold)
        elif threshold is not None:
            _check_cosine(threshold)
            threshold = float(threshold)
        if params is not None:
            re.compile(params)
        self.every_n_steps = every_n_steps
        self.window = window
        self.threshold = threshold
        self.action = action
        self.patience = patience
        self.params = params
        self.shadow_device = shadow_device
        self.log_per_layer = log_per_layer
        self.history: list[dict[str, Any]] = []
        #: ``[{"step", "param", "from", "to", "cosines"}]``: what ``action="promote"`` did.
        self.promotions: list[dict[str, Any]] = []
        self._trackers: dict[int, UpdateFidelityTracker] = {}
        self._warned: set[str] = set()
        self._below: dict[str, list[float]] = {}

    def threshold_for(self, state_format: str) -> float | None:
        """The cosine below which a layer in ``state_format`` counts as drifting."""
        if isinstance(self.threshold, float):
            return self.threshold
        if isinstance(self.threshold, dict) and state_format in self.threshold:
            return float(self.threshold[state_format])
        return qstate.guard_threshold(state_format)

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
            self._trackers[id(opt)] = UpdateFidelityTracker(
                opt, names=param_names(pl_module, opt), params=self.params, shadow_device=self.shadow_device)

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
        cos = self._agree(trainer, tracker, cos)
        if cos:
            self._report(trainer, step, cos, tracker)

    @staticmethod
    def _agree(trainer: pl.Trainer, tracker: UpdateFidelityTracker, cos: dict[str, float]) -> dict[str, float]:
        """Every rank's cosines, averaged over the ranks that measured each layer (one all-reduce),
        so decisions are identical on every rank."""
        if trainer.world_size <= 1:
            return cos
        names = [e[4] for e in tracker.entries]
        vals = torch.tensor([[cos.get(n, 0.0), 1.0 if n in cos else 0.0] for n in names], dtype=torch.float64,
                            device=trainer.strategy.root_device).reshape(-1, 2)
        vals = trainer.strategy.reduce(vals, reduce_op="sum")
        return {n: float(v / c) for n, (v, c) in zip(names, vals.tolist()) if c > 0}

    def _report(self, trainer: pl.Trainer, step: int, cos: dict[str, float], tracker: UpdateFidelityTracker) -> None:
        values = list(cos.values())
        metrics = {"fidelity/cos_min": min(values), "fidelity/cos_mean": sum(values) / len(values)}
        if self.log_per_layer:
            metrics.update({f"fidelity/cos/{k}": v for k, v in cos.items()})
        self.history.append({"step": step, "cos": dict(cos)})
        due: list[tuple[str, str, float, list[float]]] = []
        for name, v in cos.items():
            fmt = tracker.format_of(name) or "?"
            thr = self.threshold_for(fmt)
            if thr is None or v >= thr:
                self._below.pop(name, None)
                continue
            run = self._below.setdefault(name, [])
            run.append(v)
            if self.action == "log":
                if name not in self._warned:
                    self._warned.add(name)
                    rank_zero_warn(
                        f"QuantFidelityMonitor: at step {step} the Muon update of {name!r} ({fmt} momentum) has "
                        f"cosine {v:.4f} with the fp32-momentum update, below the threshold {thr}. The quantized "
                        "momentum is turning this layer's update; consider state_format='int8' (or 'grasp4' instead "
                        "of int4/e0m3), a smaller block_size, excluding the layer from Muon, or "
                        "QuantFidelityMonitor(action='promote'). (Warned once per layer.)")
            elif len(run) >= self.patience:
                due.append((name, fmt, thr, list(run)))
        if due and self.action == "stop":
            log_to_loggers(trainer, metrics)
            lines = "; ".join(f"{n!r} ({f} momentum, cosines {', '.join(f'{c:.3f}' for c in cs)} < {t})"
                              for n, f, t, cs in due)
            raise QuantFidelityError(
                f"QuantFidelityMonitor(action='stop'): at step {step} the quantized momentum of {len(due)} layer(s) "
                f"turned their Muon update away from the fp32-momentum update for {self.patience} consecutive "
                f"checks: {lines}. Fix: resume with QuantFidelityMonitor(action='promote') (moves such layers to a "
                "safer format), a safer state_format (int8), or leave these layers out of Muon.",
                [n for n, _, _, _ in due])
        for name, fmt, thr, cs in due:
            self._promote(trainer, step, tracker, name, fmt, thr, cs, metrics)
        if self.promotions:
            metrics["fidelity/promotions"] = float(len(self.promotions))
        log_to_loggers(trainer, metrics)

    def _promote(self, trainer: pl.Trainer, step: int, tracker: UpdateFidelityTracker, name: str, fmt: str,
                 thr: float, cosines: list[float], metrics: dict[str, float]) -> None:
        p = tracker.param_of(name)
        assert p is not None
        moved = tracker.optimizer.promote_param(p)
        self._below.pop(name, None)
        cs = ", ".join(f"{c:.3f}" for c in cosines)
        if moved is None:
            if name not in self._warned:
                self._warned.add(name)
                rank_zero_warn(
                    f"QuantFidelityMonitor: {name!r} ({fmt} momentum) stays below the update-cosine threshold {thr} "
                    f"(cosines {cs}) but {fmt} ends the promotion chain; nothing safer to move it to. Consider "
                    "excluding the layer from Muon. (Warned once per layer.)")
            return
        old, new = moved
        tracker.restart(name)  # window=None keeps the shadow: measure the new format from here on
        self.promotions.append({"step": int(step), "param": name, "from": old, "to": new, "cosines": list(cosines)})
        metrics[f"fidelity/promoted/{name}"] = 1.0
        msg = (f"QuantFidelityMonitor: promoted {name!r} from {old} to {new} momentum at step {step}: its update "
               f"cosine against the fp32-momentum update was below {thr} for {len(cosines)} consecutive checks "
               f"({cs}). The override is saved with the optimizer state; a resumed run keeps it.")
        if trainer.is_global_zero:
            log.warning(msg)

    # ------------------------------------------------------------------ callback state
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history, "warned": sorted(self._warned), "promotions": self.promotions,
                "below": {k: list(v) for k, v in self._below.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self._warned = set(state_dict.get("warned", []))
        self.promotions = list(state_dict.get("promotions", []))
        self._below = {k: list(v) for k, v in state_dict.get("below", {}).items()}


def _check_cosine(v: Any) -> None:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not -1.0 <= float(v) <= 1.0:
        raise ValueError(f"threshold is a cosine, it must be in [-1, 1]; got {v!r}")


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
