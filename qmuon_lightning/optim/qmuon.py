"""``QMuon``: Muon with fp32 / bf16 / 8-bit / 4-bit momentum and an auxiliary AdamW, in one optimizer.

The Muon step itself is :mod:`qmuon_lightning.core` (momentum through the group's state format,
same-shape Newton-Schulz batching within a memory budget, apply); this class owns what an
``torch.optim.Optimizer`` owns: parameter groups and their validation (:mod:`.core.config`),
per-parameter state, the non-finite gradient policy, ``state_dict`` / ``load_state_dict`` (with
format conversion) and AdamW for the groups with ``use_muon=False``.

No persistent full-precision momentum exists for the quantized formats and no scratch buffer is
allocated for the NS input: after ``step()`` a Muon parameter's ``.grad`` holds its NS input.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.adam import adam as _functional_adam

from .. import ops  # noqa: F401  (registers torch.ops.qmuon)
from ..core import pipeline
from ..core.config import (
    DEFAULT_CONFIG as _D,
    FORMAT_OVERRIDES,
    STRUCTURAL_KEYS,
    QMuonConfig,
    check_resume,
    param_group_view,
    validate_adamw_group,
    validate_format_overrides,
    validate_muon_group,
)
from ..core.newton_schulz import MUON_COEFFICIENTS
from ..core.pipeline import NSItem, is_dtensor, local
from ..core.plan import MatrixPart, ParamPlan, adjusted_lr, plan_param
from ..core.variants import NORMUON_STATE, RowMoment, check_row_moment, part_row_moment, row_moment_shape
from ..quant import state as qstate
from ..quant.layout import localize_loaded_state, shard_state

__all__ = ["QMuon", "GraspMuon", "FORMAT_VERSION", "DEFAULT_NS_COEFFICIENTS", "adjusted_lr", "UpdateSink",
           "NonFiniteGradientError"]

log = logging.getLogger(__name__)

#: Version of the optimizer state layout written by ``state_dict()``.
FORMAT_VERSION = 1
#: torch.optim.Muon's quintic coefficients (the ``"muon"`` preset of ``ns_coefficients``).
DEFAULT_NS_COEFFICIENTS = MUON_COEFFICIENTS

#: What a parameter-group mismatch on load may come from since build_optimizer groups Muon matrices
#: by layer layout, and how to load such a checkpoint.
LAYOUT_HINT = (
    "Since build_optimizer reads layer layouts, Hugging Face Conv1D weights (GPT-2) get their own groups "
    "(orientation 'in_out', c_attn split into q, k, v); a checkpoint saved before that loads into "
    r"build_optimizer(model, orientations={r'\.c_\w+\.weight$': 'out_in'}, fused_parts={r'c_attn\.weight$': None})"
)

#: ``QMuon.update_sink(param, part, out)``: receives a Muon update instead of it being applied.
UpdateSink = Callable[[Tensor, MatrixPart, Tensor], None]


class NonFiniteGradientError(FloatingPointError):
    """Parameters whose gradient stayed non-finite for more optimizer steps in a row than
    ``max_nonfinite_skips`` allows (their updates were skipped each time)."""

    def __init__(self, message: str, params: list[str], streak: int) -> None:
        super().__init__(message)
        #: Names (or group / index labels) of the parameters over the limit.
        self.params = params
        #: Their number of skipped steps in a row, this one included.
        self.streak = streak


class QMuon(Optimizer):
    """Muon with quantized momentum; AdamW for parameter groups with ``use_muon=False``.

    The Muon arguments mean what they mean in :class:`torch.optim.Muon`; with
    ``state_format="fp32"``, ``ns_dtype="bf16"`` and ``ns_coefficients="muon"`` the algorithm is
    torch's (momentum, Nesterov blend, bf16 Newton-Schulz, learning-rate adjustment, decoupled
    weight decay). Every argument, its default and its accepted values: :class:`~qmuon_lightning.core.config.QMuonConfig`
    (``QMuon.from_config(params, config)`` takes one directly).

    Args:
        params: parameters or parameter groups. A group with ``use_muon=False`` is updated by
            AdamW (keys ``lr``, ``betas``, ``eps``, ``weight_decay``; unset keys take the
            ``adamw_*`` defaults). A Muon group may set ``parts=(n0, n1, ...)``: each of its
            parameters is a stack of matrices along dim ``parts_axis`` (0, the default, or 1 for
            the columns of a 2-D weight; for example fused q, k, v) whose parts are normalized and
            orthogonalized separately; and ``orientation="in_out"`` for 2-D weights stored
            ``(in, out)`` (Hugging Face ``Conv1D``): Newton-Schulz and the lr adjustment then use
            the layer's ``(out, in)`` matrix (see :mod:`qmuon_lightning.core.plan`). Any QMuon
            argument below can be set per group too (``state_format``, ``ns_dtype``, ...).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: Muon.
        ns_dtype: Newton-Schulz precision: ``"auto"``, ``"bf16"``, ``"fp32"``.
        state_format, block_size, rank, grid_block, rounding, seed: momentum storage.
        nonfinite: ``"skip"`` leaves a parameter and its state untouched for a step whose gradient
            holds NaN/Inf (counted in :attr:`nonfinite_skips`); ``"raise"`` raises instead.
        max_nonfinite_skips: ``None`` (unlimited) or the most steps in a row one parameter's update
            may be skipped; one more raises :class:`NonFiniteGradientError` naming the parameters
            before anything changes. A finite update resets a parameter's count.
        ns_input: ``"bf16"`` or ``"mxfp8"`` (NS reads the decoded MXFP8 carrier of ``G / ||G||``).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: defaults for AdamW groups.
        comm_carrier, comm_return: sharded (FSDP2 ``Shard(0)``) parameters only: how the
            distributed Newton-Schulz moves rows to the rank that orthogonalizes a matrix and back;
            see :mod:`qmuon_lightning.distributed`. Bytes per step: :attr:`comm_stats`.
        variant: ``"muon"`` or ``"normuon"`` (per-output-row second moment of the orthogonalized
            update, state key ``"normuon_v"``: :mod:`qmuon_lightning.core.variants`);
            normuon_beta2: its EMA factor.
        cautious_weight_decay: decay only where the update and the weight agree in sign (Muon and
            AdamW groups).
        ns_method: ``"standard"``, ``"gram"`` or ``"auto"`` (Gram Newton-Schulz for elongated
            matrices: :mod:`qmuon_lightning.core.gram_newton_schulz`).
        batch_budget: Newton-Schulz batches hold at most this many times the largest matrix's
            elements (1.0: the step's transient memory is the largest matrix's own NS working set).
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = _D.lr,
        weight_decay: float = _D.weight_decay,
        momentum: float = _D.momentum,
        nesterov: bool = _D.nesterov,
        ns_coefficients: Any = _D.ns_coefficients,
        eps: float = _D.eps,
        ns_steps: int = _D.ns_steps,
        adjust_lr_fn: str | None = _D.adjust_lr_fn,
        *,
        ns_dtype: str = _D.ns_dtype,
        state_format: str = _D.state_format,
        block_size: int | None = _D.block_size,
        rank: int = _D.rank,
        grid_block: int = _D.grid_block,
        rounding: str = _D.rounding,
        seed: int = _D.seed,
        nonfinite: str = _D.nonfinite,
        ns_input: str = _D.ns_input,
        max_nonfinite_skips: int | None = _D.max_nonfinite_skips,
        adamw_lr: float = _D.adamw_lr,
        adamw_betas: tuple[float, float] = _D.adamw_betas,
        adamw_eps: float = _D.adamw_eps,
        adamw_weight_decay: float = _D.adamw_weight_decay,
        comm_carrier: str = _D.comm_carrier,
        comm_return: str = _D.comm_return,
        variant: str = _D.variant,
        normuon_beta2: float = _D.normuon_beta2,
        cautious_weight_decay: bool = _D.cautious_weight_decay,
        ns_method: str = _D.ns_method,
        batch_budget: float = pipeline.DEFAULT_BATCH_BUDGET,
    ) -> None:
        args = locals()
        config = QMuonConfig(**{k: args[k] for k in QMuonConfig.field_names()}).validate()
        if not (isinstance(batch_budget, (int, float)) and batch_budget > 0):
            raise ValueError(f"QMuon: batch_budget must be > 0 (a multiple of the largest matrix), got {batch_budget!r}")
        #: The constructor arguments (group defaults; groups may override them).
        self.config = config
        self.batch_budget = float(batch_budget)
        #: Carriers of the distributed Newton-Schulz exchange (sharded parameters only).
        self.comm_carrier, self.comm_return = config.comm_carrier, config.comm_return
        #: Bytes this rank sent to other ranks in the last step (sharded parameters; 0 otherwise).
        self.comm_bytes_last_step = 0
        #: Per-step communication figures for logging (empty until a sharded step ran).
        self.comm_stats: dict[str, float] = {}
        #: Parameter updates skipped because their gradient was not finite (``nonfinite="skip"``).
        self.nonfinite_skips = 0
        #: Optimizer steps in which at least one parameter update was skipped (non-finite gradient).
        self.nonfinite_skipped_steps = 0
        #: The longest run of consecutive skipped steps of any one parameter so far.
        self.nonfinite_max_consecutive = 0
        self.max_nonfinite_skips = config.max_nonfinite_skips
        self._nonfinite_streak: dict[tuple[int, int], int] = {}
        #: When set, Muon updates of plain (non-sharded) parameters are handed to it instead of
        #: being applied (weight decay is still applied): a driver that applies them elsewhere (the
        #: DeepSpeed integration sends them to the ranks holding the parameter's slices).
        self.update_sink: UpdateSink | None = None
        self._adamw_defaults = config.adamw_group_defaults()
        self._plans: dict[int, tuple[tuple, list[ParamPlan]]] = {}
        self._sharded: tuple[tuple, Any] | None = None
        super().__init__(params, config.muon_group_defaults())

    @classmethod
    def from_config(cls, params: Iterable[Tensor] | Iterable[dict[str, Any]], config: QMuonConfig,
                    **kwargs: Any) -> "QMuon":
        """``QMuon(params, **config)``; ``kwargs`` are the non-config arguments (``batch_budget``)."""
        return cls(params, **{**config.__dict__, **kwargs})

    # ------------------------------------------------------------------ groups and validation
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not param_group.get("use_muon", True):
            for k, v in self._adamw_defaults.items():
                param_group.setdefault(k, v)
            param_group.setdefault("use_muon", False)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"QMuon param group {len(self.param_groups) - 1}"
        if group["use_muon"]:
            validate_muon_group(group, where)
            self._validate_muon_params(group, where)
        else:
            validate_adamw_group(group, where)
        self._plans.clear()
        self._sharded = None

    @staticmethod
    def _validate_muon_params(group: dict[str, Any], where: str) -> None:
        names = group.get("param_names")
        parts = group["parts"]
        for i, p in enumerate(group["params"]):
            label = f"parameter {names[i]!r}" if names else f"parameter #{i}"
            if p.ndim < 2:
                raise ValueError(
                    f"{where}: {label} has shape {tuple(p.shape)}: Muon orthogonalizes matrices. Put 1-D tensors "
                    "(biases, norm gains) in an AdamW group ({'params': [...], 'use_muon': False}) or build "
                    "the optimizer with qmuon_lightning.build_optimizer(model), which routes them for you"
                )
            if torch.is_complex(p):
                raise ValueError(f"{where}: {label} is complex; QMuon supports real parameters only")
            axis, orientation = group["parts_axis"], group["orientation"]
            if (axis == 1 or orientation != "out_in") and p.ndim != 2:
                raise ValueError(
                    f"{where}: {label} has shape {tuple(p.shape)}; orientation={orientation!r} and parts_axis={axis} "
                    "apply to 2-D weights only. Put it in a group with the defaults (orientation='out_in', parts_axis=0)")
            if parts is not None and sum(parts) != p.shape[axis]:
                unit = "rows" if axis == 0 else "columns (parts_axis=1)"
                raise ValueError(f"{where}: parts {parts} sum to {sum(parts)} {unit} but {label} has {p.shape[axis]} {unit}")

    def _group_plans(self, gi: int) -> list[ParamPlan]:
        """The plans of group ``gi``'s parameters, recomputed only when the parameters (FSDP2 and
        Accelerate replace them in place), their shapes or the group's layout keys change."""
        group = self.param_groups[gi]
        key0 = sum(len(g["params"]) for g in self.param_groups[:gi])
        sig = (key0, tuple((id(p), tuple(p.shape)) for p in group["params"]), group["parts"], group["parts_axis"],
               group["orientation"], group["adjust_lr_fn"])
        cached = self._plans.get(gi)
        if cached is None or cached[0] != sig:
            names = group.get("param_names") or [f"param group {gi} parameter #{i}" for i in range(len(group["params"]))]
            plans = [plan_param(p, group, key0 + i, names[i]) for i, p in enumerate(group["params"])]
            self._plans[gi] = cached = (sig, plans)
        return cached[1]

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = pipeline.call_closure(closure)
        sharded = self._sharded_step()  # None unless a parameter is a DTensor (FSDP2)
        if sharded is not None:
            sharded.begin()
        updatable = self._updatable_params(sharded)  # raises before anything changes (nonfinite="raise")
        items: list[NSItem] = []
        for gi, (group, idx) in enumerate(zip(self.param_groups, updatable)):
            if group["use_muon"]:
                self._muon_group_step(gi, idx, items, sharded)
            else:
                self._adamw_step(group, idx)
        pipeline.orthogonalize(items, self.batch_budget)
        if sharded is not None:
            # distributed Newton-Schulz (collective: every rank, same items)
            self.comm_stats = sharded.finish(self.batch_budget)
            self.comm_bytes_last_step = int(self.comm_stats["ns_bytes_sent"] + self.comm_stats["flags_bytes"])
        return loss

    def _sharded_step(self) -> Any:
        """The distributed driver when some parameter is a DTensor, else ``None``; built (and its
        layout checks run) once per set of parameters.

        The import is lazy: ``optim`` only reaches into ``qmuon_lightning.distributed`` once
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

    def _updatable_params(self, sharded: Any = None) -> list[list[int]]:
        """Per group, indices of parameters with a finite gradient (one fused reduction over every
        gradient and one host sync). With ``nonfinite="raise"`` in any group that holds a bad
        gradient, raises before any parameter or state of any group changes."""
        where: list[tuple[int, int]] = []
        grads: list[Tensor] = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("QMuon does not support sparse gradients")
                where.append((gi, i))
                grads.append(local(p.grad))
        out: list[list[int]] = [[] for _ in self.param_groups]
        finite = pipeline.finite_flags(grads)
        if sharded is not None:  # one all-reduce: every rank skips / updates the same sharded parameters
            where, finite = sharded.agree_on_updates(where, finite)
        bad_by_policy: dict[str, list[str]] = defaultdict(list)
        streaks = self._nonfinite_streak
        over: list[str] = []
        for (gi, i), ok in zip(where, finite):
            if ok:
                out[gi].append(i)
                streaks.pop((gi, i), None)  # a finite update ends the parameter's run of skips
                continue
            group = self.param_groups[gi]
            label = self._param_label(gi, i)
            policy = group.get("nonfinite", "skip")
            bad_by_policy[policy].append(label)
            if policy == "skip":
                streaks[(gi, i)] = n = streaks.get((gi, i), 0) + 1
                self.nonfinite_max_consecutive = max(self.nonfinite_max_consecutive, n)
                if self.max_nonfinite_skips is not None and n > self.max_nonfinite_skips:
                    over.append(label)
        if bad_by_policy.get("raise"):
            raise FloatingPointError(
                f"QMuon: non-finite gradient in {', '.join(bad_by_policy['raise'] + bad_by_policy['skip'])}; "
                "no parameter or optimizer state was changed. Use nonfinite='skip' to skip such updates, "
                "or check the loss scale / learning rate"
            )
        if over:
            n = max(streaks.values())
            raise NonFiniteGradientError(
                f"QMuon: the gradient of {', '.join(over)} was non-finite (NaN/Inf) for {n} optimizer steps in a row, "
                f"more than max_nonfinite_skips={self.max_nonfinite_skips}; training stops here (this step changed no "
                "parameter or optimizer state). Fix: lower the learning rate, enable or tighten gradient clipping, "
                "check the loss scale (fp16) and the data of the last steps for NaN/Inf; raise max_nonfinite_skips "
                "(or set it to None) only if such runs recover", over, n)
        if bad_by_policy.get("skip"):
            self.nonfinite_skips += len(bad_by_policy["skip"])
            self.nonfinite_skipped_steps += 1
            log.warning("QMuon: skipped update of %s (non-finite gradient)", ", ".join(bad_by_policy["skip"]))
        return out

    def _param_label(self, gi: int, i: int) -> str:
        group = self.param_groups[gi]
        names = group.get("param_names")
        return repr(names[i]) if names else f"param group {gi} parameter #{i} (shape {tuple(group['params'][i].shape)})"

    def _muon_group_step(self, gi: int, idx: list[int], items: list[NSItem], sharded: Any) -> None:
        """Step group ``gi``'s parameters ``idx``: those without a layout override together, each
        promoted one (:meth:`promote_param`) with its own view of the group."""
        group = self.param_groups[gi]
        overrides = group.get(FORMAT_OVERRIDES) or {}
        self._muon_subset_step(gi, group, [i for i in idx if i not in overrides], items, sharded)
        for i in idx:
            if i in overrides:
                self._muon_subset_step(gi, param_group_view(group, i), [i], items, sharded)

    def _muon_subset_step(self, gi: int, group: dict[str, Any], idx: list[int], items: list[NSItem],
                          sharded: Any) -> None:
        if not idx:
            return
        plans_all = self._group_plans(gi)
        params = [group["params"][i] for i in idx]
        plans = [plans_all[i] for i in idx]
        fmt = qstate.get_format(group["state_format"])
        opts = qstate.format_options(group)
        states, offsets = [], []
        for p in params:
            st = self.state[p]
            if not st:
                st.update(qstate.init_momentum_state(fmt.name, local(p.grad).shape[0], math.prod(p.shape[1:]),
                                                     opts=opts, device=local(p.grad).device))
                if is_dtensor(p):
                    sharded.init_state(p, st, group)  # Shard(0) DTensors with the global shape (for DCP)
            states.append({k: local(v) for k, v in st.items()} if is_dtensor(p) else st)
            offsets.append(sharded.row_offset(p) if is_dtensor(p) else 0)
        grads = [local(p.grad) for p in params]
        inputs = pipeline.momentum_inputs(group, grads, states, plans, offsets)
        is_dt = [is_dtensor(p) for p in params]
        block_sums: list[Tensor | None] = [None] * len(params)
        for want in (False, True):
            sel = [j for j, d in enumerate(is_dt) if d == want]
            if not sel:
                continue
            sub = inputs.subset(sel)
            sums = pipeline.update_momentum(
                group, sub, sharded_params=[params[j] for j in sel] if want else None,
                process_group=sharded.process_group if want else None)
            for j, s in zip(sel, sums):
                block_sums[j] = s
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        decay, cautious = 1.0 - lr * wd, bool(group.get("cautious_weight_decay", False))
        normuon = group.get("variant", "muon") == "normuon"
        settings_on: dict[torch.device, pipeline.NSSettings] = {}
        for p, plan, g2, grad, sums, st in zip(params, plans, inputs.grads2d, grads, block_sums, states):
            if g2.data_ptr() != grad.data_ptr():
                grad.copy_(g2.view(grad.shape))  # keep the contract: .grad holds the NS input
            p_local = local(p)
            settings = settings_on.get(g2.device) or settings_on.setdefault(g2.device, pipeline.ns_settings(group, g2.device))
            v = self._row_moment_state(p, plan, st, sharded) if normuon else None
            if is_dtensor(p):
                sharded.add(p, plan, p_local, g2, sums, group, settings, v)  # whole-matrix NS across ranks
                continue
            if self.update_sink is not None:
                # The driver behind the sink applies the update (and its own weight decay).
                pipeline.decay_rows_(p_local, p_local, decay, False)
                apply = self._sink_for(p)
            else:
                apply = pipeline.apply_to(p, lr, decay, cautious)
            moments = None
            if v is not None:
                b2 = float(group["normuon_beta2"])
                moments = [RowMoment(part_row_moment(v, plan, part), b2) for part in plan.parts]
            items.extend(pipeline.local_items(plan, g2, sums, group, settings, apply, moments))

    def _row_moment_state(self, p: Tensor, plan: ParamPlan, st_local: dict[str, Tensor], sharded: Any) -> Tensor:
        """NorMuon's second moment of ``p`` (its local rows when sharded), created as zeros on the
        first NorMuon step (also when a plain-Muon checkpoint is resumed as NorMuon)."""
        v = st_local.get(NORMUON_STATE)
        if v is None:
            rows, k = row_moment_shape(plan)
            if is_dtensor(p):
                rows = local(p).shape[0]
            v = torch.zeros((rows, k), dtype=torch.float32, device=local(p).device)
            st_local[NORMUON_STATE] = v
            st = self.state[p]
            if is_dtensor(p):
                sub = {NORMUON_STATE: v}
                sharded.init_state(p, sub)  # Shard(0) like the momentum rows (DCP reshards it)
                st[NORMUON_STATE] = sub[NORMUON_STATE]
            else:
                st[NORMUON_STATE] = v
        return v

    def _sink_for(self, p: Tensor) -> Callable[[MatrixPart, Tensor], None]:
        sink = self.update_sink
        assert sink is not None
        return lambda part, out: sink(p, part, out)

    def _adamw_step(self, group: dict[str, Any], idx: list[int]) -> None:
        params = [group["params"][i] for i in idx]
        grads = [p.grad for p in params]
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            st = self.state[p]
            if not st:
                # Same state layout as torch.optim.AdamW, so checkpoints interoperate.
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not params:
            return
        b1, b2 = group["betas"]
        lr, wd = float(group["lr"]), float(group["weight_decay"])
        # CAUTIOUS-WD HOOK (AdamW): the step runs without decay, then the weights as they were
        # before it are decayed where they agree in sign with the step's update.
        cautious = bool(group.get("cautious_weight_decay", False)) and wd != 0.0
        before = [p.detach().clone() for p in params] if cautious else None
        _functional_adam(
            params, grads, exp_avgs, exp_avg_sqs, [], steps,
            foreach=None, capturable=False, differentiable=False, fused=None,
            grad_scale=None, found_inf=None, has_complex=False, decoupled_weight_decay=True,
            amsgrad=False, beta1=b1, beta2=b2, lr=lr, weight_decay=0.0 if cautious else wd,
            eps=group["eps"], maximize=False,
        )
        if before is not None:
            for p, w in zip(params, before):
                # p_new = w - lr u (no decay yet); decay term lr wd w where w * u >= 0, u = (w - p_new) / lr
                p.sub_(torch.where(w * (w - p) >= 0, w, 0.0), alpha=lr * wd)

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        for g in sd["param_groups"]:
            g["qmuon_version"] = FORMAT_VERSION
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a QMuon (any format) or ``torch.optim.Muon`` / ``torch.optim.AdamW`` state dict.

        Momentum saved in another format is converted to this optimizer's format (dense <->
        8-bit, int8 <-> uint8); shapes, block sizes and dtypes are validated first, so a bad
        checkpoint raises before anything is changed.
        """
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"checkpoint has {len(saved_groups)} parameter groups but this optimizer has "
                f"{len(self.param_groups)}; build the optimizer the same way it was built when saved. {LAYOUT_HINT}"
            )
        saved_state = state_dict["state"]
        # Muon state is converted and placed here, not by torch: torch casts every state tensor of a
        # floating-point parameter to the parameter's dtype, which would turn int8 codes, fp32 scales
        # and bf16 momentum into the parameter's dtype.
        new_groups, new_state = [], dict(saved_state)
        muon_state: list[tuple[Tensor, dict[str, Any], dict[str, Any]]] = []
        for gi, (saved, cur) in enumerate(zip(saved_groups, self.param_groups)):
            version = saved.get("qmuon_version", 0)
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"param group {gi} was saved with state format version {version}, newer than this "
                    f"qmuon_lightning ({FORMAT_VERSION}); upgrade qmuon_lightning to load it"
                )
            if len(saved["params"]) != len(cur["params"]):
                raise ValueError(
                    f"param group {gi}: checkpoint has {len(saved['params'])} parameters, optimizer has "
                    f"{len(cur['params'])}; build the optimizer the same way it was built when saved. {LAYOUT_HINT}"
                )
            merged = {k: v for k, v in saved.items() if k != "qmuon_version"}
            for k in STRUCTURAL_KEYS:
                merged[k] = cur[k]
            for k, v in cur.items():  # options added after the checkpoint was written take today's value
                if k != FORMAT_OVERRIDES:
                    merged.setdefault(k, v)
            if cur["use_muon"] and "state_format" in saved:  # a QMuon checkpoint: the one resume check
                check_resume({**cur, **saved}, cur, where=f"param group {gi}", allow_format_change=True)
            if cur["use_muon"]:
                # Per-parameter layout overrides (promotions by the fidelity guard) are part of the
                # saved run: they are kept, and each promoted parameter resumes in its own format.
                merged["params"] = cur["params"]  # for the index check; the saved ids go back below
                validate_format_overrides(merged, f"param group {gi} (checkpoint)")
                merged["params"] = saved["params"]
                overrides = merged.get(FORMAT_OVERRIDES) or {}
                for i, (pid, p) in enumerate(zip(saved["params"], cur["params"])):
                    if pid in saved_state:
                        where = f"param group {gi}, param id {pid}"
                        src, shape = saved_state[pid], p.shape
                        saved_view = {**saved, **overrides[i]} if i in overrides else saved
                        cur_view = {**cur, **overrides[i]} if i in overrides else cur
                        if is_dtensor(p):  # sharded: validate and convert this rank's rows only
                            src = localize_loaded_state(src, p, None, None, where)  # None: the saved format
                            shape = (local(p).shape[0], *p.shape[1:])
                        converted = qstate.convert_state(src, saved_view, cur_view, shape, where, sharded=is_dtensor(p))
                        if NORMUON_STATE in converted:
                            if cur_view.get("variant", "muon") != "normuon":
                                del converted[NORMUON_STATE]  # resumed as plain Muon: the second moment is unused
                            else:
                                check_row_moment(converted[NORMUON_STATE], plan_param(p, cur_view, 0, ""),
                                                 int(shape[0]), where)
                        muon_state.append((p, converted, cur_view))
                        del new_state[pid]
            new_groups.append(merged)
        super().load_state_dict({"state": new_state, "param_groups": new_groups})
        self._plans.clear()
        self._sharded = None
        for p, st, cur in muon_state:
            new = {k: v.to(device=p.device, copy=True) if k != "step" else v.clone() for k, v in st.items()}
            if is_dtensor(p):
                shard_state(p, new, qstate.get_format(cur["state_format"]), qstate.format_options(cur))
            self.state[p] = new

    # ------------------------------------------------------------------ per-parameter formats
    def _locate(self, p: Tensor) -> tuple[int, int]:
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return gi, i
        raise KeyError("QMuon: this parameter is not in any of the optimizer's parameter groups")

    def param_layout(self, p: Tensor) -> dict[str, Any]:
        """The state layout parameter ``p`` is stepped with (its group's, or its override's)."""
        gi, i = self._locate(p)
        return param_group_view(self.param_groups[gi], i)

    def promote_param(self, p: Tensor, layout: dict[str, Any] | None = None) -> tuple[str, str] | None:
        """Move Muon parameter ``p``'s momentum to a safer format: ``layout`` (layout keys such as
        ``{"state_format": "int8", "block_size": 256}``) or, by default, the next format of the
        promotion chain (:func:`qmuon_lightning.quant.safer_format`: grasp4 / int4 / e0m3 -> int8
        -> bf16). The stored momentum is converted with :func:`qmuon_lightning.quant.convert_state`
        (dequantize, re-encode); a sharded parameter converts its own rows, with no communication,
        so every rank must promote the same parameters. The override is saved with the parameter
        group (``state_dict`` / DCP), so a resumed run keeps it.

        Returns ``(old format, new format)``, or ``None`` when the format ends the chain.
        """
        gi, i = self._locate(p)
        group = self.param_groups[gi]
        if not group["use_muon"]:
            raise ValueError("QMuon.promote_param: the parameter is in an AdamW group; only Muon momentum has formats")
        old = param_group_view(group, i)
        target = dict(layout) if layout is not None else qstate.promoted_layout(old)
        if target is None:
            return None
        new = {**old, **target}
        label = self._param_label(gi, i)
        overrides = dict(group.get(FORMAT_OVERRIDES) or {})
        overrides[i] = target
        checked = {**group, FORMAT_OVERRIDES: overrides}
        validate_format_overrides(checked, f"QMuon.promote_param({label})")  # raises before anything changes
        st = self.state.get(p)
        if st:
            shape = (local(p).shape[0], *p.shape[1:]) if is_dtensor(p) else tuple(p.shape)
            src = {k: local(v) if is_dtensor(v) else v for k, v in st.items()}
            converted = qstate.convert_state(src, old, new, shape, f"QMuon.promote_param({label})", sharded=is_dtensor(p))
            dev = local(p).device
            converted = {k: v.to(dev) if k != "step" else v for k, v in converted.items()}
            if is_dtensor(p):
                shard_state(p, converted, qstate.get_format(new["state_format"]), qstate.format_options(new))
            self.state[p] = converted
        group[FORMAT_OVERRIDES] = checked[FORMAT_OVERRIDES]
        self._sharded = None
        return str(old["state_format"]), str(new["state_format"])

    def promotions(self, names: dict[int, str] | None = None) -> list[dict[str, Any]]:
        """Every parameter stepped in another format than its group's:
        ``[{"param": name, "group_format": ..., "state_format": ...}]`` (names from ``names``,
        ``id(param) -> name``, else the group's ``param_names``)."""
        out = []
        for gi, group in enumerate(self.param_groups):
            for i, layout in sorted((group.get(FORMAT_OVERRIDES) or {}).items()):
                p = group["params"][i]
                name = (names or {}).get(id(p)) or self._param_label(gi, i).strip("'")
                out.append({"param": name, "group_format": str(group["state_format"]),
                            "state_format": str(layout["state_format"])})
        return out

    # ------------------------------------------------------------------ introspection
    def state_nbytes(self, muon_only: bool = True) -> int:
        """Bytes of optimizer state tensors (Muon parameters only by default)."""
        total = 0
        for group in self.param_groups:
            if muon_only and not group["use_muon"]:
                continue
            for p in group["params"]:
                total += qstate.state_nbytes(self.state.get(p, {}))
        return total


class GraspMuon(QMuon):
    """:class:`QMuon` with GRASP 4-bit momentum (``state_format="grasp4"``) by default.

    The momentum is stored as an 8-bit rank-``rank`` factor ``P R^T`` tracked by one warm-started
    power iteration per step plus a 4-bit residual with ``grid_block x grid_block`` grid
    quantization (:mod:`qmuon_lightning.quant.grasp`): <= 0.578 bytes per element on GPT-small shapes.
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], lr: float = _D.lr, *args: Any,
                 state_format: str = "grasp4", rank: int = _D.rank, grid_block: int = _D.grid_block,
                 **kwargs: Any) -> None:
        super().__init__(params, lr, *args, state_format=state_format, rank=rank, grid_block=grid_block, **kwargs)
