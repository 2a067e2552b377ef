"""The state of :class:`.flat_step.FlatOwnerStep` in a checkpoint: what a rank keeps (its Muon
slices' momentum rows, what it keeps as an owner, its AdamW pieces, its bf16 slices' correction
codes) as plain tensors, and loading it back, validated and converted to this run's formats as
``QMuon.load_state_dict`` does, everything checked before anything changes
(:class:`FlatStateMixin`; the envelope and layout checks are the adapter's,
:mod:`qmuon.integrations.deepspeed.optimizer_state`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..core import apply as weight_apply
from ..core.config import STRUCTURAL_KEYS, check_resume, param_group_view
from ..core.variants import NORMUON_STATE, check_row_moment
from ..quant import adamw as qadamw
from ..quant import state as qstate
from .flat import FlatParam

__all__: list[str] = []


class FlatStateMixin:
    """State dict entries of a flat-layout step (mixed into :class:`.flat_step.FlatOwnerStep`)."""

    def _slice_state_dict(self) -> dict[str, Any]:
        """This rank's state: what it keeps as the owner of Muon matrices (``"muon"``: index -> at
        stage 0 QMuon's state entry, at ZeRO 1-3 NorMuon's second moment), the momentum of the rows its
        Muon slices touch (``"muon_slices"``: index -> QMuon's entry over those rows), the AdamW state
        of the pieces of its slices, the weight-correction codes of its bf16 Muon slices."""
        return {"muon": {i: dict(st) for i, st in self._muon_state.items()},
                "muon_slices": {i: dict(st) for i, st in self._muon_slices.items()},
                "adamw_slices": {i: {"pieces": [list(x) for x in self._pieces[i]], "state": [dict(st) for st in sts]}
                                 for i, sts in self._slice_state.items()},
                "weight_slices": {i: dict(st) for i, st in self._weight_state.items() if st}}

    def _load_muon_state(self, saved: dict[Any, Any], saved_groups: list[dict[str, Any]],
                         slices: bool) -> dict[int, dict[str, Tensor]]:
        """The Muon entries of ``saved`` this rank keeps, validated and converted to this run's formats
        as ``QMuon.load_state_dict`` does; nothing is changed here. ``slices``: the momentum of this
        rank's slices (``"muon_slices"``); else the owners' entries (another owner's are skipped: at
        stage 0 rank 0's file holds all of them)."""
        out: dict[int, dict[str, Tensor]] = {}
        checked: set[int] = set()
        for key, src in saved.items():
            index = int(key)
            info = self._params[index] if 0 <= index < len(self._params) else None
            if info is None or not info.muon:
                raise ValueError(f"the checkpoint holds momentum for parameter {index}, which is not a Muon matrix of "
                                 "this run: the model or the optimizer's parameter groups changed since it was saved")
            seg = info.holders[self._rank]
            if slices and (not self._sliced(index) or seg is None or not seg.length):
                raise ValueError(f"the checkpoint holds momentum of rank {self._rank}'s slice of Muon parameter {index}, "
                                 "of which this run's rank holds none: the partition layout changed")
            if not slices and info.owner != self._rank:
                continue
            cur = param_group_view(self._all_groups[info.group], info.pos)
            sg = saved_groups[info.group] if info.group < len(saved_groups) else {}
            sview = param_group_view(sg, info.pos) if sg else cur
            where = f"Muon parameter {index} (shape {tuple(info.shape)})"
            st = dict(src)
            if NORMUON_STATE in st:
                if cur.get("variant", "muon") != "normuon":
                    del st[NORMUON_STATE]  # resumed as plain Muon: the second moment is unused
                else:
                    check_row_moment(st[NORMUON_STATE], self._plans[index], info.shape[0], where)
            if slices or not self._sliced(index):  # momentum (owners of sliced matrices keep NorMuon's moment only)
                if info.group not in checked and "state_format" in sg:  # QMuon.load_state_dict's one resume check
                    check_resume({**cur, **sview}, cur, where=f"param group {info.group}", allow_format_change=True)
                    checked.add(info.group)
                shape = (info.rows, info.cols)
                if slices:  # the rows the slice touches, full width
                    shape = ((seg.start + seg.length - 1) // info.cols + 1 - seg.start // info.cols, info.cols)
                    where = f"rank {self._rank}'s rows of {where}"
                moment = {NORMUON_STATE: st.pop(NORMUON_STATE)} if NORMUON_STATE in st else {}
                st = {**qstate.convert_state(st, sview, cur, shape, where), **moment}
            elif set(st) - {NORMUON_STATE}:
                raise ValueError(f"the checkpoint holds the whole momentum of {where} on its owner (ZeRO stage 0); this "
                                 "run keeps it per slice: resume with the ZeRO stage that saved it")
            out[index] = {k: (v.detach().to("cpu", copy=True) if k == qstate.STEP else v.to(self._device, copy=True))
                          if isinstance(v, Tensor) else v for k, v in st.items()}
        return out

    def _load_slice_state(self, saved: dict[str, Any], saved_groups: list[dict[str, Any]]) -> None:
        """Load what :meth:`_slice_state_dict` wrote for this rank's layout (checked by the caller),
        converting momentum and AdamW pieces to this run's formats; ``saved_groups``: the saved group
        options. Everything is built and checked before anything changes."""
        muon = self._load_muon_state(saved["muon"], saved_groups, False)
        muon_slices = self._load_muon_state(saved["muon_slices"], saved_groups, True)
        saved_rule = {gi: (saved_groups[gi].get("bf16_update") if gi < len(saved_groups) else None)
                      for gi in range(len(self._all_groups))}

        def rule(info: FlatParam) -> str:  # this run's, validated as single-process QMuon does
            return self._all_groups[info.group].get("bf16_update", "nearest")

        slices = saved["adamw_slices"]
        slice_state: dict[int, list[dict[str, Tensor]]] = {}
        for index, pieces in self._pieces.items():
            info = self._params[index]
            where = f"AdamW parameter {index} (shape {tuple(info.shape)}), rank {self._rank}'s slice"
            family = self._all_groups[info.group]["state_format"]
            mine = slices.get(index)
            if mine is None:
                continue  # no step taken before the save
            if [list(x) for x in mine["pieces"]] != [list(x) for x in pieces]:
                raise ValueError(f"{where}: the checkpoint cuts the slice into pieces {mine['pieces']}, this "
                                 f"run into {[list(x) for x in pieces]}; the partition layout changed")
            slice_state[index] = [
                {k: v.to(device=self._device, copy=True) if isinstance(v, Tensor) and k != "step" else
                 (v.clone() if isinstance(v, Tensor) else v)
                 for k, v in qadamw.convert_adamw_state(src, family, info.shape, (r, w), where).items()}
                for src, (_, r, w) in zip(mine["state"], pieces)]
            data = self._views(info)[0]
            for (off, r, w), st in zip(pieces, slice_state[index]):
                weight_apply.check_loaded_weight_state(data.narrow(0, off, r * w).view(r, w), st, rule(info),
                                                       saved_rule[info.group], f"{where}, piece at {off}")
        if set(slices) - set(self._pieces):
            raise ValueError(f"the checkpoint holds AdamW state for parameters {sorted(set(slices) - set(self._pieces))}, "
                             f"of which rank {self._rank} holds no AdamW slice; the partition layout changed")
        weight_state: dict[int, dict[str, Tensor]] = {}
        for index, st in saved["weight_slices"].items():
            info = self._params[int(index)]
            if not info.muon or info.holders[self._rank] is None:
                raise ValueError(f"the checkpoint holds weight-correction codes for parameter {index}, of which this "
                                 "run's rank holds no Muon slice; the partition layout changed")
            weight_state[info.index] = {k: v.to(device=self._device, copy=True) for k, v in st.items()}
        for info in self._params:
            v = self._views(info) if info.muon else None
            if v is not None:
                weight_apply.check_loaded_weight_state(
                    v[0], weight_state.get(info.index, {}), rule(info), saved_rule[info.group],
                    f"Muon parameter {info.index} (shape {tuple(info.shape)}), rank {self._rank}'s slice")
        # Nothing above changed the optimizer; from here on nothing can fail.
        self._muon_state, self._muon_slices = muon, muon_slices
        self._slice_state, self._weight_state = slice_state, weight_state
        for g, saved_group in zip(self._all_groups, saved_groups):
            if g.get("ns_dtype") == "auto" and saved_group.get("ns_dtype") in ("bf16", "fp32"):
                g["ns_dtype"] = saved_group["ns_dtype"]  # what "auto" chose when the run started (record_auto_choices)
            for k, v in saved_group.items():
                # structural keys stay this run's, as in QMuon.load_state_dict (the state was converted to
                # this run's formats above; a changed bf16_update creates / drops codes at the next step)
                if k not in ("params", "param_names", *STRUCTURAL_KEYS):
                    g[k] = v
