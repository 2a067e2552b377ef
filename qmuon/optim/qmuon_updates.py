"""QMuon's per-group updates: a Muon group's momentum through its state format and the Newton-Schulz
items it queues (for a plain parameter or a sharded one; NorMuon's row moment), AdamW for
the ``use_muon=False`` groups, and the device copies of the learning rates that a capturable step reads
(``update.capturable``). A mixin of :class:`~qmuon.QMuon`, whose ``step_params`` decides which parameters
update and calls these group by group; split out of ``qmuon.py`` along that seam.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from . import bf16_weights as bf16w
from ..core import adamw as core_adamw
from ..core import pipeline
from ..core.config import ConfigError, FORMAT_OVERRIDES, param_group_view
from ..core.pipeline import NSItem, is_dtensor, local
from ..core.plan import ParamPlan
from ..core.variants import NORMUON_STATE, RowMoment, part_row_moment, row_moment_shape
from ..quant import state as qstate
from ..quant.layout import global_row_offset, shard_state
from .nonfinite import StepSkips

__all__: list[str] = []


class QMuonUpdatesMixin:
    """The per-group update methods of :class:`~qmuon.QMuon` (``self`` is the optimizer: ``param_groups``,
    ``state``, ``capturable``, ``_group_plans``, ``_sharded``)."""

    # ------------------------------------------------------------------ per-group updates
    def _muon_group_step(self, gi: int, idx: list[int], items: list[NSItem], sharded: Any, skips: StepSkips) -> None:
        """Step group ``gi``'s parameters ``idx``: those without a layout override together, each
        promoted one (:meth:`promote_param`) with its own view of the group."""
        group = self.param_groups[gi]
        overrides = group.get(FORMAT_OVERRIDES) or {}
        self._muon_subset_step(gi, group, [i for i in idx if i not in overrides], items, sharded, skips)
        for i in idx:
            if i in overrides:
                self._muon_subset_step(gi, param_group_view(group, i), [i], items, sharded, skips)

    def _muon_subset_step(self, gi: int, group: dict[str, Any], idx: list[int], items: list[NSItem],
                          sharded: Any, skips: StepSkips) -> None:
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
                st.update(qstate.init_momentum_state(fmt.name, local(p.grad).shape[0], math.prod(local(p.grad).shape[1:]),
                                                     opts=opts, device=local(p.grad).device))
                if is_dtensor(p):
                    sharded.init_state(p, st, group)  # Shard(0) DTensors with the global shape (for DCP)
            if self.capturable:
                _step_to(st, local(p).device)
            bf16w.sync_param_weight_state(p, st, group)
            states.append({k: local(v) for k, v in st.items()} if is_dtensor(p) else st)
            offsets.append(sharded.row_offset(p) if is_dtensor(p) else 0)
        grads = [local(p.grad) for p in params]
        inputs = pipeline.momentum_inputs(group, grads, states, plans, offsets)
        flags = [skips.of((gi, i)) for i in idx]
        if self.capturable:  # the counter of a skipped parameter stays, decided on the device
            for st, flag in zip(states, flags):
                if flag is not None:
                    st["step"].sub_(flag.reshape(()).to(st["step"].dtype))
        if skips.flags is not None:
            inputs.skips = flags  # type: ignore[assignment]
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
        wd = float(group["weight_decay"])
        lr: float | Tensor = self._device_lr(gi, local(params[0]).device) if self.capturable else float(group["lr"])
        decay, cautious = 1.0 - lr * wd, bool(group.get("cautious_weight_decay", False))
        normuon = group.get("variant", "muon") == "normuon"
        settings_on: dict[torch.device, pipeline.NSSettings] = {}
        for p, plan, g2, grad, sums, st, row0, skip in zip(params, plans, inputs.grads2d, grads, block_sums, states,
                                                           offsets, flags):
            if not grad.is_contiguous():  # g2 was a copy (pipeline.momentum_inputs): write it back
                grad.copy_(g2.view(grad.shape))  # keep the contract: .grad holds the NS input
            p_local = local(p)
            settings = settings_on.get(g2.device) or settings_on.setdefault(g2.device, pipeline.ns_settings(group, g2.device))
            write = bf16w.weight_write(p_local, st, group, plan.key, row0 * plan.cols, device_step=self.capturable)
            v = self._row_moment_state(p, plan, st, sharded) if normuon else None
            if is_dtensor(p):
                sharded.add(p, plan, p_local, g2, sums, group, settings, write, v)  # whole-matrix NS across ranks
                continue
            apply = pipeline.apply_to(p, lr, decay=decay, cautious=cautious, skip=skip, **write.rounding)
            moments = None
            if v is not None:
                b2 = float(group["normuon_beta2"])
                moments = [RowMoment(part_row_moment(v, plan, part), b2, skip=skip) for part in plan.parts]
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

    def _adamw_step(self, gi: int, group: dict[str, Any], idx: list[int], skips: StepSkips) -> None:
        """AdamW for parameters ``idx`` of group ``gi``: one parameter at a time, in bounded row blocks
        (:func:`qmuon.core.adamw.adamw_param_step`; no whole-group temporaries). A sharded
        (``Shard(0)`` DTensor) parameter steps its own rows; its state is kept as ``Shard(0)``
        DTensors with the global shape (DCP saves and reshards it)."""
        key0 = sum(len(g["params"]) for g in self.param_groups[:gi])
        rule = group.get("bf16_update", "nearest")
        for i in idx:
            p = group["params"][i]
            p_local = local(p)
            st = self.state[p]
            if not st:
                st.update(core_adamw.init_state(group["state_format"], p.shape, p_local, rule))
                if is_dtensor(p):
                    shard_state(p, st)  # no momentum format: every tensor splits by rows
            if self.capturable:
                _step_to(st, p_local.device)
            bf16w.sync_param_weight_state(p, st, group)  # a rule changed on resume: codes created / dropped
            states = {k: local(v) for k, v in st.items()} if is_dtensor(p) else st
            core_adamw.adamw_param_step(p_local, local(p.grad), states, group, global_shape=p.shape, key=key0 + i,
                                        row_offset=global_row_offset(p), skip=skips.of((gi, i)),
                                        device_lr=self._device_lr(gi, p_local.device) if self.capturable else None)
            if states is not st:
                st["step"] = states["step"]

    # ------------------------------------------------------------------ capturable
    def refresh_device_lrs(self) -> None:
        """Write every group's current lr into its device copy (``update.capturable``): host-to-device
        writes, no read. The eager step does it itself; :func:`qmuon.compile_step` and
        :func:`qmuon.capture_step` do it before running their graph, which reads the copies."""
        for gi, group in enumerate(self.param_groups):
            lr = group["lr"]
            for dev in {local(p).device for p in group["params"]}:
                t = self._device_lrs.get((gi, dev))
                if t is None:
                    t = self._device_lrs[(gi, dev)] = torch.zeros((), dtype=torch.float64, device=dev)
                if isinstance(lr, Tensor):
                    t.copy_(lr.detach())  # a tensor lr (e.g. on the device already): copied, not read
                else:
                    t.fill_(float(lr))

    def _device_lr(self, gi: int, device: torch.device) -> Tensor:
        t = self._device_lrs.get((gi, device))
        if t is None:
            raise RuntimeError(
                f"QMuon (capturable): param group {gi} has no lr on {device} yet; call optimizer.refresh_device_lrs() "
                "after add_param_group, before a captured or compiled step")
        return t

    def _check_capturable(self) -> None:
        """What a capturable step cannot host, refused by name before anything changes."""
        if self._sharded is not None:
            raise ConfigError(
                "QMuon: update.capturable=True with sharded (DTensor) parameters: their step exchanges matrices between "
                "ranks with collectives decided on the host. Use capturable=False for FSDP2 / HSDP / TP")
        for gi, group in enumerate(self.param_groups):
            if group.get("rounding", "nearest") != "nearest":
                raise ConfigError(
                    f"QMuon: update.capturable=True, but param group {gi} rounds its quantized state stochastically "
                    f"(rounding={group['rounding']!r}): the noise stream comes from the step count in host arguments, "
                    "which a captured graph would freeze. Set rounding='nearest' for that group")


def _step_to(st: dict[str, Any], device: torch.device) -> None:
    """A capturable step's counter lives on the parameter's device (torch.optim's convention): one
    host-to-device copy the first time (a new state, or one loaded from a non-capturable checkpoint)."""
    step = st.get("step")
    if isinstance(step, Tensor) and step.device != device:
        st["step"] = step.to(device)
