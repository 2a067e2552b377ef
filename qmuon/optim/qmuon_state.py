"""``QMuon``'s state as a checkpoint and per parameter: ``state_dict`` / ``load_state_dict`` (with
format conversion from any QMuon format, ``torch.optim.Muon`` and ``torch.optim.AdamW``), the
fidelity guard's per-parameter format promotion, and introspection (``torch_adamw_state``,
``master_weight``, ``state_nbytes``). A mixin of :class:`qmuon.optim.QMuon`, which owns the
step; split out of ``qmuon.py`` along that seam.
"""

from __future__ import annotations

import copy
import numbers
from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from . import bf16_weights as bf16w
from ..core.config import (
    FORMAT_OVERRIDES,
    STRUCTURAL_KEYS,
    check_resume,
    param_group_view,
    validate_format_overrides,
)
from ..core.pipeline import is_dtensor, local
from ..core.plan import plan_param
from ..core.variants import NORMUON_STATE, check_row_moment
from ..quant import adamw as qadamw
from ..quant import state as qstate
from ..quant.layout import localize_loaded_state, shard_state

__all__ = ["FORMAT_VERSION"]

#: Version of the optimizer state layout written by ``state_dict()`` (a newer one is refused on load).
FORMAT_VERSION = 2


class QMuonStateMixin:
    """Checkpoint and per-parameter state methods of :class:`QMuon` (``self`` is the optimizer:
    ``param_groups``, ``state``, ``_plans``, ``_sharded``, ``_layout_fresh``, ``_param_label``)."""

    # ------------------------------------------------------------------ state dict
    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.Optimizer.state_dict`` with ``qmuon_version`` in every group.

        Written out here rather than wrapping ``super().state_dict()`` so the hooks see what the
        caller gets: pre-hooks run first, post-hooks get the finished dict (versions included) and
        may return a replacement, as with any ``torch.optim`` optimizer. The skip flags of the last
        step are read first (:mod:`.nonfinite`), so a skipped parameter's ``step`` is its count of
        updates.
        """
        self._nonfinite.settle(raise_now=False)
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        ids: dict[int, int] = {}  # id(param) -> index, in group order (torch's packing)
        groups = []
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            for p in group["params"]:
                ids.setdefault(id(p), len(ids))
            packed["params"] = [ids[id(p)] for p in group["params"]]
            packed["qmuon_version"] = FORMAT_VERSION
            groups.append(packed)
        state = {(ids[id(k)] if isinstance(k, Tensor) else k): v for k, v in self.state.items()}
        sd: dict[str, Any] = {"state": state, "param_groups": groups}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a QMuon (any format) or ``torch.optim.Muon`` / ``torch.optim.AdamW`` state dict.

        Momentum saved in another format is converted to this optimizer's format (dense <->
        8-bit, int8 <-> uint8), and so are AdamW moments (``torch.optim.AdamW``'s fp32 ``exp_avg`` /
        ``exp_avg_sq`` <-> QMuon's bf16 / int8 / int4); shapes, block sizes and dtypes are validated
        and every new state entry is built first, so a bad checkpoint raises before anything is
        changed (the optimizer keeps its groups and state, bit for bit). A ``step`` saved as a
        Python number (older torch, fused Adam) is read as a 0-d fp32 tensor, as ``torch.optim.Adam``
        does. The skip flags of the last step are read first (they may roll back step counters).

        Hooks run as in ``torch.optim.Optimizer``: load-state-dict pre-hooks get a shallow copy of
        ``state_dict`` (and may return a replacement, which is then loaded), post-hooks run once
        the state is in place. (Written out here instead of calling ``super().load_state_dict``:
        torch would cast every state tensor of a floating-point parameter to the parameter's dtype,
        turning int8 codes, fp32 scales and bf16 momentum into the parameter's dtype.)
        """
        self._nonfinite.settle(raise_now=False)
        state_dict = state_dict.copy()  # shallow, as torch: a pre-hook may edit it in place
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = copy.deepcopy(state_dict["param_groups"])
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"checkpoint has {len(saved_groups)} parameter groups but this optimizer has "
                f"{len(self.param_groups)}; build the optimizer the same way it was built when saved"
            )
        saved_state = state_dict["state"]
        new_groups: list[dict[str, Any]] = []
        placed: dict[Tensor, dict[str, Any]] = {}  # param -> its new state entry, built before anything changes
        loaded_ids: set[Any] = set()
        for gi, (saved, cur) in enumerate(zip(saved_groups, self.param_groups)):
            version = saved.get("qmuon_version", 0)
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"param group {gi} was saved with state format version {version}, newer than this "
                    f"qmuon ({FORMAT_VERSION}); upgrade qmuon to load it"
                )
            if len(saved["params"]) != len(cur["params"]):
                raise ValueError(
                    f"param group {gi}: checkpoint has {len(saved['params'])} parameters, optimizer has "
                    f"{len(cur['params'])}; build the optimizer the same way it was built when saved"
                )
            merged = {k: v for k, v in saved.items() if k != "qmuon_version"}
            if not cur["use_muon"]:  # an AdamW group holds AdamW's options (older checkpoints carry Muon's too)
                for k in self.muon_only_keys():
                    merged.pop(k, None)
            for k in STRUCTURAL_KEYS:
                if k in cur:
                    merged[k] = cur[k]
            if cur.get("ns_dtype") == "auto" and saved.get("ns_dtype") in ("bf16", "fp32"):
                merged["ns_dtype"] = saved["ns_dtype"]  # what "auto" chose when the run started (record_auto_choices)
            for k, v in cur.items():  # options the checkpoint lacks (torch.optim.Muon's, AdamW's) take this run's
                if k != FORMAT_OVERRIDES:
                    merged.setdefault(k, v)
            if cur["use_muon"] and "state_format" in saved:  # a QMuon checkpoint: the one resume check
                check_resume({**cur, **saved}, cur, where=f"param group {gi}", allow_format_change=True)
            if cur["use_muon"]:
                # Per-parameter layout overrides (promotions by the fidelity guard) are part of the
                # saved run: they are kept, and each promoted parameter resumes in its own format.
                merged["params"] = cur["params"]  # for the index check
                validate_format_overrides(merged, f"param group {gi} (checkpoint)")
                overrides = merged.get(FORMAT_OVERRIDES) or {}
                for i, (pid, p) in enumerate(zip(saved["params"], cur["params"])):
                    if pid in saved_state:
                        where = f"param group {gi}, param id {pid}"
                        src, shape = _with_tensor_step(saved_state[pid], where), p.shape
                        saved_view = {**saved, **overrides[i]} if i in overrides else saved
                        cur_view = {**cur, **overrides[i]} if i in overrides else cur
                        if is_dtensor(p):  # sharded: validate and convert this rank's rows only
                            src = localize_loaded_state(src, p, None, None, where)  # None: the saved format
                            shape = tuple(local(p).shape)  # its rows (and a rowwise TP shard's columns)
                        converted = qstate.convert_state(src, saved_view, cur_view, shape, where, sharded=is_dtensor(p))
                        bf16w.check_loaded_weight_state(p, converted, saved, cur, where)
                        if NORMUON_STATE in converted:
                            if cur_view.get("variant", "muon") != "normuon":
                                del converted[NORMUON_STATE]  # resumed as plain Muon: the second moment is unused
                            else:
                                check_row_moment(converted[NORMUON_STATE], plan_param(p, cur_view, 0, ""),
                                                 int(shape[0]), where)
                        new = _placed(converted, local(p).device, getattr(self, "capturable", False))
                        if is_dtensor(p):
                            shard_state(p, new, qstate.get_format(cur_view["state_format"]), qstate.format_options(cur_view))
                        placed[p] = new
                        loaded_ids.add(pid)
            else:
                # AdamW moments in any family (or torch.optim.AdamW's), validated and converted to
                # this group's family on this rank's rows (torch would cast them).
                for pid, p in zip(saved["params"], cur["params"]):
                    if pid in saved_state:
                        where = f"param group {gi}, param id {pid} (AdamW)"
                        src, shape = _with_tensor_step(saved_state[pid], where), tuple(p.shape)
                        if is_dtensor(p):
                            src = localize_loaded_state(src, p, None, None, where)
                            shape = tuple(local(p).shape)
                        converted = qadamw.convert_adamw_state(src, cur["state_format"], p.shape, shape, where)
                        bf16w.check_loaded_weight_state(
                            p, {k: converted[k] for k in qstate.weight_state_keys() if k in converted}, saved, cur, where)
                        new = _placed(converted, local(p).device, getattr(self, "capturable", False))
                        if is_dtensor(p):
                            shard_state(p, new)
                        placed[p] = new
                        loaded_ids.add(pid)
            merged["params"] = cur["params"]
            new_groups.append(merged)
        # Nothing above changed the optimizer; from here on nothing can fail.
        state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
        for k, v in saved_state.items():
            if k not in loaded_ids:  # state of no parameter of a group: kept as it is (torch does the same)
                state[k] = v
        state.update(placed)
        self.state = state
        self.param_groups = new_groups
        self._plans.clear()
        self._sharded = None
        self._index = None
        self._layout_fresh = False
        self._lr_follow_seen = {}  # linked groups (QMuon.add_param_group) take the loaded lrs as they are
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

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
        promotion chain (:func:`qmuon.quant.safer_format`: grasp4 / int4 / e0m3 -> int8
        -> bf16). The stored momentum is converted with :func:`qmuon.quant.convert_state`
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
        self._layout_fresh = False
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

    def torch_adamw_state(self, p: Tensor) -> dict[str, Tensor]:
        """AdamW parameter ``p``'s state as ``torch.optim.AdamW`` keeps it (fp32 ``exp_avg`` /
        ``exp_avg_sq`` with ``p``'s shape, and ``step``), dequantized when stored quantized; a
        sharded parameter gives its local rows."""
        gi, _ = self._locate(p)
        if self.param_groups[gi]["use_muon"]:
            raise ValueError("QMuon.torch_adamw_state: the parameter is in a Muon group")
        st = self.state.get(p)
        if not st:
            raise KeyError("QMuon.torch_adamw_state: the parameter has no state yet (no step taken)")
        return qadamw.to_torch_adamw_state({k: local(v) for k, v in st.items()}, local(p).shape)

    # ------------------------------------------------------------------ introspection
    def master_weight(self, p: Tensor) -> Tensor:
        """The fp32 weight parameter ``p`` stands for (this rank's rows when sharded): the bf16 value
        corrected by its ``weight_ecc`` codes under ``bf16_update="ecc8"``, else ``p`` itself in fp32
        (export a bf16 + ecc8 model at its full precision with this)."""
        gi, _ = self._locate(p)
        fmt = qstate.weight_format(self.param_groups[gi]["bf16_update"])
        st = self.state.get(p, {})
        p_local = local(p).detach()
        if fmt is not None and all(k in st for k in fmt.spec.keys):
            return fmt.master_weight(p_local, {k: local(st[k]) for k in fmt.spec.keys})
        return p_local.float()

    def state_nbytes(self, muon_only: bool = True) -> int:
        """Bytes of optimizer state tensors (Muon parameters only by default)."""
        total = 0
        for group in self.param_groups:
            if muon_only and not group["use_muon"]:
                continue
            for p in group["params"]:
                total += qstate.state_nbytes(self.state.get(p, {}))
        return total


def _with_tensor_step(entry: Any, where: str) -> dict[str, Any]:
    """A loaded state entry with its ``step`` as a 0-d fp32 tensor: a Python number (a
    checkpoint of older torch or of fused Adam) is converted, as ``torch.optim.Adam`` does; anything
    else that is not a one-element real tensor is refused (before anything changes)."""
    if not isinstance(entry, dict):
        raise qstate.StateFormatError(f"{where}: a parameter's state must be a dict of tensors, got {type(entry).__name__}")
    step = entry.get(qstate.STEP)
    if step is None or isinstance(step, Tensor) and step.numel() == 1 and not step.is_complex():
        return entry
    if isinstance(step, numbers.Real) and not isinstance(step, bool):
        return {**entry, qstate.STEP: torch.tensor(float(step), dtype=torch.float32)}
    raise qstate.StateFormatError(f"{where}: step must be a number or a one-element tensor, got {step!r}")


def _placed(entry: dict[str, Any], device: torch.device, capturable: bool = False) -> dict[str, Any]:
    """A converted state entry as the optimizer keeps it: its own copies of the tensors on the
    parameter's device (``step`` on the CPU, or on the parameter's device for a capturable optimizer,
    as ``torch.optim`` places it whatever the checkpoint's device), other values copied."""
    step_device = device if capturable else torch.device("cpu")
    return {k: (v.detach().to(device=step_device, copy=True) if k == qstate.STEP else v.to(device=device, copy=True))
            if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in entry.items()}
