"""``QMuon``: Muon with fp32 / bf16 / 8-bit / 4-bit momentum and an auxiliary AdamW, in one optimizer.

The Muon step itself is :mod:`qmuon.core` (momentum through the group's state format,
same-shape Newton-Schulz batching within a memory budget, apply); this class owns what an
``torch.optim.Optimizer`` owns: per-parameter state, the non-finite gradient policy and AdamW for
the groups with ``use_muon=False``. Adding groups, their names and their learning rates come from
:mod:`.groups`; ``state_dict`` / ``load_state_dict`` (with format conversion), per-parameter
promotion and state introspection from :mod:`.qmuon_state`; each group's update (Muon momentum and
its Newton-Schulz items, AdamW) and a capturable step's device learning rates from
:mod:`.qmuon_updates`; the non-finite skip counters from :mod:`.nonfinite`. This module keeps
construction, copies, and the step itself: which parameters update, in which order, and its closing.

No persistent full-precision momentum exists for the quantized formats and no scratch buffer is
allocated for the NS input: after ``step()`` a Muon parameter's ``.grad`` holds its NS input.
Read or log gradients before ``step()``; docs/limits.md says what this breaks and what it saves.
"""

from __future__ import annotations

import dataclasses

import logging
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer

from .. import ops  # noqa: F401  (registers torch.ops.qmuon)
from ..core import pipeline
from ..core.config import (
    ConfigError,
    FORMAT_OVERRIDES,
    QMuonConfig,
)
from ..core.newton_schulz import MUON_COEFFICIENTS
from ..core.pipeline import NSItem, is_dtensor, local
from ..core.plan import ParamPlan, plan_param
from .groups import QMuonGroupsMixin
from .nonfinite import NonFiniteGradientError, NonFiniteLedger, QMuonNonFiniteMixin, StepSkips
from .qmuon_state import FORMAT_VERSION, QMuonStateMixin
from .qmuon_updates import QMuonUpdatesMixin

__all__ = ["QMuon", "FORMAT_VERSION", "NonFiniteGradientError"]

log = logging.getLogger(__name__)

#: torch.optim.Muon's quintic coefficients (the ``"muon"`` preset of ``ns_coefficients``).
DEFAULT_NS_COEFFICIENTS = MUON_COEFFICIENTS


#: Attributes a copy does not take (caches rebuilt by ``_reset_caches``; torch's hook tables and
#: profiling name are recreated empty by ``Optimizer.__setstate__``).
_NOT_COPIED = ("_plans", "_sharded", "_index", "_layout_fresh", "_batch_sizes", "_lr_follow_seen",
               "_zero_grad_profile_name", "qk_clip")  # QK-clip is a step hook on the model: hooks are not copied

COPY_RELEASE_ERROR = (
    "QMuon: this optimizer has gradient release attached (build_optimizer(..., gradient_release=True)): its hooks "
    "live on the model's parameters and step this optimizer inside backward, so a copy (copy.deepcopy, pickle, "
    "torch.save of the optimizer object) could not step. Save optimizer.state_dict() with the model's state_dict "
    "and load it into an optimizer built the same way (build_optimizer(copied_model, ..., gradient_release=True)); "
    "or detach release first (optimizer.gradient_release.detach()) to copy the optimizer without it"
)


class QMuon(QMuonGroupsMixin, QMuonStateMixin, QMuonUpdatesMixin, QMuonNonFiniteMixin, Optimizer):
    """Muon with quantized momentum; AdamW for parameter groups with ``use_muon=False``.

    The Muon options mean what they mean in :class:`torch.optim.Muon`. With ``state_format="fp32"``,
    ``newton_schulz={"dtype": "bf16", "method": "standard"}`` and the default coefficients the algorithm is
    torch's (momentum, Nesterov blend, bf16 Newton-Schulz, learning-rate adjustment, decoupled
    weight decay). Every option, its default and its accepted values: :class:`~qmuon.QMuonConfig`.

        QMuon(params, lr=0.02, state_format="int8")                           # the common options
        QMuon(params, newton_schulz={"dtype": "fp32"}, safety={"nonfinite": "raise"})   # a section
        QMuon(params, config=QMuonConfig(...), lr=0.01)                       # a config, keywords over it

    Most users call :func:`~qmuon.build_optimizer`, which routes a model's parameters into groups.

    Args:
        params: parameters or parameter groups. A group with ``use_muon=False`` is updated by
            AdamW (keys ``lr``, ``betas``, ``eps``, ``weight_decay``, ``state_format``; unset keys take
            the ``adamw_*`` options). A Muon group may set ``parts=(n0, n1, ...)``: each of its
            parameters is a stack of matrices along dim ``parts_axis`` (0, the default, or 1 for
            the columns of a 2-D weight; for example fused q, k, v) whose parts are normalized and
            orthogonalized separately; and ``orientation="in_out"`` for 2-D weights stored
            ``(in, out)`` (Hugging Face ``Conv1D``): Newton-Schulz and the lr adjustment then use
            the layer's ``(out, in)`` matrix (see :mod:`qmuon.core.plan`). A group with
            ``bank_dims=n`` holds banks: parameters ``(*bank, rows, cols)`` whose leading ``n`` dims
            index matrices (mixture-of-experts experts), each stepped as its own matrix, with
            ``parts`` / ``parts_axis`` / ``orientation`` (and ``parts_interleaved=True`` for
            alternating parts such as gpt-oss's gate / up columns) applying to every member;
            banks need a row-local ``state_format`` (docs/moe.md). A group may set any option by
            its group key (:data:`~qmuon.core.config.GROUP_KEYS`: ``state_format``, ``ns_dtype``, ...).
        lr, weight_decay, momentum, state_format, adamw_lr, adamw_weight_decay, adamw_state_format,
            bf16_update: the top-level options of :class:`~qmuon.QMuonConfig` (``None``: the config's).
        config: a :class:`~qmuon.QMuonConfig` (or a dict of its options); the keywords are laid over it.
        **sections: ``newton_schulz``, ``update``, ``state``, ``safety`` (each a section dataclass or a
            dict of its fields; they merge into the config's field by field). ``routing`` and
            ``gradient_release`` are :func:`~qmuon.build_optimizer`'s (release hooks the model).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor | None = None,
        weight_decay: float | None = None,
        momentum: float | None = None,
        state_format: str | None = None,
        *,
        adamw_lr: float | None = None,
        adamw_weight_decay: float | None = None,
        adamw_state_format: str | None = None,
        bf16_update: str | None = None,
        config: QMuonConfig | dict[str, Any] | None = None,
        **sections: Any,
    ) -> None:
        config = QMuonConfig.from_kwargs(
            config, lr=lr, weight_decay=weight_decay, momentum=momentum, state_format=state_format, adamw_lr=adamw_lr,
            adamw_weight_decay=adamw_weight_decay, adamw_state_format=adamw_state_format, bf16_update=bf16_update,
            **sections)
        #: The options (group defaults; groups may override them by their group keys).
        self.config = config
        self.batch_budget = float(config.newton_schulz.batch_budget)
        #: Carriers of the distributed Newton-Schulz exchange (sharded parameters only).
        self.comm_carrier, self.comm_return = config.newton_schulz.comm_carrier, config.newton_schulz.comm_return
        #: What happens when a loop writes one lr into every group (see :meth:`_check_group_lrs`).
        self.lr_ratios = config.update.lr_ratios
        #: torch.optim's ``capturable`` (``update.capturable``): step counters on the parameters' device, lrs
        #: read from device copies (:meth:`refresh_device_lrs`), so the step can be captured or compiled once.
        self.capturable = bool(config.update.capturable)
        #: ``(group index, device) -> 0-d fp64 lr`` of a capturable step (refreshed outside any graph).
        self._device_lrs: dict[tuple[int, torch.device], Tensor] = {}
        self._device_lrs_fresh = False
        #: Bytes this rank sent to other ranks in the last step (sharded parameters; 0 otherwise).
        self.comm_bytes_last_step = 0
        #: Per-step communication figures for logging (empty until a sharded step ran).
        self.comm_stats: dict[str, float] = {}
        self.max_nonfinite_skips = config.safety.max_nonfinite_skips
        #: The non-finite skips, decided on the device and read one step late (:mod:`.nonfinite`).
        self._nonfinite = NonFiniteLedger(self._key_label, self._max_skips)
        self._adamw_defaults = config.adamw_group_defaults()
        self._reset_caches()
        self._step_comm: list[dict[str, float]] = []
        #: The gradient-release driver stepping this optimizer inside backward, when one is attached
        #: (:func:`qmuon.optim.release.attach_gradient_release`); ``None`` otherwise.
        self.gradient_release: Any = None
        #: How the model was routed (:class:`qmuon.optim.routing.ModelRouting`, set by
        #: ``build_optimizer``): :meth:`add_param_group` routes groups added later by it; ``None``
        #: (a QMuon built from groups) routes them by the default rules, by shape.
        self.router: Any = None
        #: Per param group, the full shapes of a Muon group's tensors when it was added (None for
        #: AdamW groups); see :meth:`check_routed_shapes`.
        self._routed_shapes: list[tuple | None] = []
        self._constructed = False
        if config.gradient_release:
            raise ConfigError(
                "QMuon: gradient_release=True hooks the model's parameters, which a QMuon built from groups does not "
                "know: use qmuon.build_optimizer(model, gradient_release=True), or attach it to this optimizer with "
                "qmuon.attach_gradient_release(opt)")
        if config.qk_clip.tau is not None:
            raise ConfigError(
                "QMuon: qk_clip measures and rescales the model's attention layers, which a QMuon built from groups "
                "does not know: use qmuon.build_optimizer(model, qk_clip={...}), or attach it to this optimizer with "
                "qmuon.optim.qk_clip.attach_qk_clip(opt, model, tau)")
        #: The QK-clip measuring and clipping this model's attention (:mod:`qmuon.optim.qk_clip`), or None.
        self.qk_clip: Any = None
        super().__init__(params, config.muon_group_defaults())
        self._constructed = True

    def _reset_caches(self) -> None:
        """(Re)create the caches keyed by the parameters' identities; rebuilt on the next step."""
        self._plans: dict[int, tuple[tuple, list[ParamPlan]]] = {}
        self._sharded: tuple[tuple, Any] | None = None
        self._index: dict[int, tuple[int, int]] | None = None  # id(param) -> (group, index)
        # The caches keyed by the parameter set (plans, index, sharded driver) are checked against
        # the parameters once per optimizer step, not once per step_params call: under gradient
        # release there is one call per parameter, and re-checking every parameter's identity in
        # each would make a step quadratic in the number of parameters.
        self._layout_fresh = False
        self._batch_sizes = pipeline.BatchSizes(())
        self._lr_follow_seen: dict[str, tuple[float, float]] = {}  # see _follow_lrs

    # ------------------------------------------------------------------ copies and printing
    def __getstate__(self) -> dict[str, Any]:
        """Everything a copy needs to step as this optimizer would (configuration, groups, state,
        counters, routing), for ``copy.deepcopy`` and pickle; ``torch.optim.Optimizer`` keeps only
        ``defaults`` / ``state`` / ``param_groups``, which left a copy that failed on its first
        step. Caches keyed by parameter identities are rebuilt; hooks are not copied (as in torch).
        An optimizer whose updates run outside it (gradient release) refuses."""
        if self.__dict__.get("gradient_release") is not None:
            raise RuntimeError(COPY_RELEASE_ERROR)
        return {k: v for k, v in self.__dict__.items() if k not in _NOT_COPIED and not k.startswith("_optimizer_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        had_differentiable = "differentiable" in state.get("defaults", {})
        super().__setstate__(state)  # torch: empty hook tables, the profiled step
        if "defaults" in state and not had_differentiable:
            self.defaults.pop("differentiable", None)  # torch adds it; a copy keeps the original's groups
        self._reset_caches()
        for k, v in (("gradient_release", None), ("router", None), ("qk_clip", None),
                     ("_constructed", True),
                     ("_routed_shapes", [])):
            self.__dict__.setdefault(k, v)

    def __repr__(self) -> str:
        """torch's listing of the groups, each headed by its name and family (and long
        ``param_names`` shortened)."""
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            family = "Muon" if group.get("use_muon", True) else "AdamW"
            name = f" {group['name']!r}" if "name" in group else ""
            lines.append(f"Parameter Group {i}{name} ({family}, {len(group['params'])} parameters)")
            for key in sorted(group):
                if key == "params":
                    continue
                value = group[key]
                if key == "param_names" and len(value) > 4:
                    value = f"[{', '.join(map(repr, value[:3]))}, ... ({len(value)} names)]"
                lines.append(f"    {key}: {value}")
        lines.append(")")
        return "\n".join(lines)

    def _group_plans(self, gi: int) -> list[ParamPlan]:
        """The plans of group ``gi``'s parameters, recomputed only when the parameters (FSDP2 and
        Accelerate replace them in place), their shapes or the group's layout keys change."""
        group = self.param_groups[gi]
        if self._layout_fresh and gi in self._plans:
            return self._plans[gi][1]
        key0 = sum(len(g["params"]) for g in self.param_groups[:gi])
        sig = (key0, tuple((id(p), tuple(p.shape)) for p in group["params"]), group["parts"], group["parts_axis"],
               group["orientation"], group["adjust_lr_fn"], group.get("parts_interleaved"), group.get("bank_dims"))
        cached = self._plans.get(gi)
        if cached is None or cached[0] != sig:
            self.check_routed_shapes(gi)
            names = group.get("param_names") or [f"param group {gi} parameter #{i}" for i in range(len(group["params"]))]
            plans = [plan_param(p, group, key0 + i, names[i]) for i, p in enumerate(group["params"])]
            self._plans[gi] = cached = (sig, plans)
        return cached[1]

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step: runs ``closure`` (if given), steps every parameter holding a
        gradient (:meth:`step_params`) and closes the step (non-finite bookkeeping, communication
        figures). With gradient release attached (:mod:`qmuon.optim.release`) the
        parameters were stepped inside backward already; ``step()`` then steps only what bypassed
        the release hooks and closes the step the same way."""
        loss = pipeline.call_closure(closure)
        release = self.gradient_release
        if release is not None:
            release.finish_step()
        else:
            self.step_params()
        self._end_step()
        return loss

    @torch.no_grad()
    def step_params(self, params: Iterable[Tensor] | None = None) -> None:
        """Step ``params`` (default: every parameter of the optimizer) that hold a gradient, through
        the one pipeline :meth:`step` uses: non-finite policy, Muon momentum and Newton-Schulz per
        matrix, AdamW for ``use_muon=False`` groups. Parameters are processed in group order
        whatever the order given, so stepping a model in several calls does per parameter exactly
        what one call does.

        Sharded (DTensor) parameters make the call collective: every rank must call it with the
        same parameters (the finite-gradient agreement and the distributed Newton-Schulz exchange
        run over the given parameters only). Step-level bookkeeping (``nonfinite_skipped_steps``,
        ``comm_stats``) is closed by :meth:`step`.
        """
        if not self._layout_fresh:  # once per optimizer step (see __init__)
            # the previous step's skip flags, copied to the host a step ago: roll back the step counters
            # of skipped parameters and enforce max_nonfinite_skips before anything changes
            if not torch.compiler.is_compiling() and not _capturing():  # compile_step and capture_step settle
                self._nonfinite.settle()                                     # outside their graph
            self._index = None
            self._sharded_step()
            if self.capturable:
                self._check_capturable()
            shapes = []
            for gi, group in enumerate(self.param_groups):
                if group["use_muon"]:  # AdamW groups have no matrix plans (nor Muon keys, when loaded from torch's AdamW)
                    if group["params"]:
                        pipeline.record_auto_choices(group, local(group["params"][0]).device)
                    shapes += [(pt.cols, pt.rows) if pt.transposed else (pt.rows, pt.cols)
                               for plan in self._group_plans(gi) for pt in plan.parts]
            # From every Muon matrix (global shapes): each call of the step and every rank batches alike.
            self._batch_sizes = pipeline.BatchSizes.of(shapes, self.batch_budget)
            self._layout_fresh = True
        if not torch.compiler.is_compiling() and not _capturing():  # host bookkeeping: compile_step and
            self._follow_lrs()                                          # capture_step run it before the graph
            self._check_group_lrs()
            if self.capturable and not self._device_lrs_fresh:  # once per step (release calls once per parameter)
                self.refresh_device_lrs()
                self._device_lrs_fresh = True
        keys = self._keys_of(params)
        sharded = self._sharded[1] if self._sharded is not None else None  # None unless a parameter is a DTensor
        if sharded is not None and params is not None and not any(
                is_dtensor(self.param_groups[gi]["params"][i]) for gi, i in keys):
            sharded = None  # only plain parameters: nothing collective
        if sharded is not None:
            sharded.begin()
        # raises before anything changes (nonfinite="raise")
        updatable, skips = self._updatable_params(sharded, keys)
        items: list[NSItem] = []
        for gi, (group, idx) in enumerate(zip(self.param_groups, updatable)):
            if group["use_muon"]:
                self._muon_group_step(gi, idx, items, sharded, skips)
            elif idx:
                self._adamw_step(gi, group, idx, skips)
        # A call for some parameters only (gradient release: one parameter per call) does not pad
        # its batches: padding would multiply its NS work by the step's batch size.
        sizes = self._batch_sizes if params is None else dataclasses.replace(self._batch_sizes, pad=False)
        pipeline.orthogonalize(items, sizes)
        if sharded is not None:
            # distributed Newton-Schulz (collective: every rank, same items)
            self._step_comm.append(sharded.finish(sizes))
        if skips.flags is not None:
            # a capturable step keeps a skipped parameter's counter on the device; others are rolled back
            # when the flags are read
            self._nonfinite.record(skips.keys, skips.flags,
                                   [None if self.capturable else self.state[self.param_groups[gi]["params"][i]].get("step")
                                    for gi, i in skips.keys])

    def _keys_of(self, params: Iterable[Tensor] | None) -> list[tuple[int, int]]:
        """``(group, index)`` of ``params`` in group order (every parameter when None)."""
        if params is None:
            return [(gi, i) for gi, g in enumerate(self.param_groups) for i in range(len(g["params"]))]
        if self._index is None:  # rebuilt once per step (step_params)
            self._index = {id(p): (gi, i) for gi, g in enumerate(self.param_groups) for i, p in enumerate(g["params"])}
        index = self._index
        keys = set()
        for p in params:
            key = index.get(id(p))
            if key is None:
                raise KeyError("QMuon.step_params: a parameter is not in any of the optimizer's parameter groups")
            keys.add(key)
        return sorted(keys)

    def _end_step(self) -> None:
        """Close one optimizer step: count it as skipped when a parameter update was skipped in it,
        and publish the step's communication figures (summed over the calls of the step)."""
        self._layout_fresh = False
        self._device_lrs_fresh = False
        if not torch.compiler.is_compiling():  # a compiled step stages outside its graph (compile_step)
            self._nonfinite.end_step()  # its flags go to the host asynchronously; read by the next step
        if self._step_comm:
            from ..distributed.orthogonalize import merge_comm_stats

            self.comm_stats = merge_comm_stats(self._step_comm)
            self.comm_bytes_last_step = int(self.comm_stats["ns_bytes_sent"] + self.comm_stats["flags_bytes"])
            self._step_comm = []

    def _sharded_step(self) -> Any:
        """The distributed driver when some parameter is a DTensor, else ``None``; built (and its
        layout checks run) once per set of parameters.

        The import is lazy: ``optim`` only reaches into ``qmuon.distributed`` once
        sharded parameters are seen (FSDP2 / Accelerate may replace parameters after construction).
        """
        params = [p for g in self.param_groups for p in g["params"]]
        if not any(is_dtensor(p) for p in params):
            self._sharded = None
            return None
        sig = tuple(id(p) for p in params) + tuple(
            (g["use_muon"], g.get("state_format"), g.get("grid_block"), g.get("rank"), repr(g.get(FORMAT_OVERRIDES)))
            for g in self.param_groups)
        if self._sharded is None or self._sharded[0] != sig:
            from ..distributed.orthogonalize import ShardedStep

            self._sharded = (sig, ShardedStep(self.param_groups, self.comm_carrier, self.comm_return))
        return self._sharded[1]

    def _updatable_params(self, sharded: Any, keys: list[tuple[int, int]]) -> tuple[list[list[int]], StepSkips]:
        """Per group, indices of the parameters ``keys`` that hold a gradient, and their skip flags.

        One fused reduction over the gradients decides, on the device, which are not finite
        (:func:`~qmuon.core.pipeline.finite_mask`); the kernels read those flags and leave a flagged
        parameter and its state untouched, and the host reads them one step late
        (:mod:`.nonfinite`). Two cases read them now instead: a group with ``nonfinite="raise"``
        (it must raise before anything changes), and sharded steps, whose ranks agree on the
        skipped parameters and leave them out."""
        where: list[tuple[int, int]] = []
        grads: list[Tensor] = []
        for gi, i in keys:
            p = self.param_groups[gi]["params"][i]
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("QMuon does not support sparse gradients")
            where.append((gi, i))
            grads.append(local(p.grad))
        out: list[list[int]] = [[] for _ in self.param_groups]
        if not grads:
            return out, StepSkips()
        if sharded is not None:
            finite = pipeline.finite_flags(grads)
            if sharded is not None:  # one all-reduce: every rank skips / updates the same sharded parameters
                where, finite = sharded.agree_on_updates(where, finite, keys)
            self._raise_policy(where, finite)
            for (gi, i), ok in zip(where, finite):
                if ok:
                    out[gi].append(i)
            self._nonfinite.record_read(where, [not ok for ok in finite])
            return out, StepSkips()
        skip = ~pipeline.finite_mask(grads)
        if any(self.param_groups[gi].get("nonfinite", "skip") == "raise" for gi, _ in where):
            self._raise_policy(where, [not s for s in skip.tolist()])  # the debugging policy reads the flags
        for gi, i in where:
            out[gi].append(i)
        return out, StepSkips(where, skip)

    def _raise_policy(self, where: list[tuple[int, int]], finite: list[bool]) -> None:
        """``nonfinite="raise"``: raise before any parameter or state changes when a gradient of such a
        group is not finite."""
        bad = {"raise": [], "skip": []}
        for (gi, i), ok in zip(where, finite):
            if not ok:
                bad[self.param_groups[gi].get("nonfinite", "skip")].append(self._param_label(gi, i))
        if bad["raise"]:
            raise FloatingPointError(
                f"QMuon: non-finite gradient in {', '.join(bad['raise'] + bad['skip'])}; "
                "no parameter or optimizer state was changed. Use nonfinite='skip' to skip such updates, "
                "or check the loss scale / learning rate"
            )

    def _param_label(self, gi: int, i: int) -> str:
        group = self.param_groups[gi]
        names = group.get("param_names")
        return repr(names[i]) if names else f"param group {gi} parameter #{i} (shape {tuple(group['params'][i].shape)})"


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (never initializes CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()
