"""Checkpoints of :class:`~.optimizer.WholeMatrixZeroOptimizer`: what each rank's optimizer file
holds (the quantized momentum of the Muon matrices it owns, the AdamW state of its slices, the
weight-correction codes of its bf16 slices, the layout they belong to) and how it is loaded back,
validated against this run's layout (:class:`ZeroStateMixin`)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...core import apply as weight_apply
from ...core.config import STRUCTURAL_KEYS
from ...quant import adamw as qadamw
from ...quant import state as qstate
from ...distributed.flat import FlatParam

__all__: list[str] = []

#: Version of the layout written by :meth:`WholeMatrixZeroOptimizer.state_dict` (AdamW moments of flat
#: slices, per piece, under ``"adamw_slices"``; the weight-correction state of bf16 Muon slices under
#: ``"weight_slices"``); only this version loads.
STATE_VERSION = 3
_KEY = "qmuon_deepspeed"
#: The wrapper's modes, as the ZeRO stages users know them (error messages).
MODE_NAMES = {"direct": "ZeRO stage 0", "partitioned": "ZeRO stage 1/2", "zero3": "ZeRO stage 3", None: "no engine"}


class ZeroStateMixin:
    """``state_dict`` / ``load_state_dict`` of :class:`~.optimizer.WholeMatrixZeroOptimizer` (its
    attributes: ``_params``, ``_all_groups``, ``_inner``, ``_proxies``, ``_pieces``,
    ``_slice_state``, ``_weight_state``, ``_mode``, ``_world``, ``_rank``, ``_group``, ``_device``)."""

    def _layout(self) -> list[Any]:
        return [[p.index, p.owner if p.muon else -1, p.numel,
                 None if p.holders[self._rank] is None else dataclasses.astuple(p.holders[self._rank])]
                for p in self._params]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the quantized momentum of the Muon matrices it owns and the AdamW state of
        its slices, as plain tensors, plus the layout they belong to.

        At ZeRO stage 0 with several processes DeepSpeed saves only rank 0's optimizer state, so this
        gathers every owner's momentum to rank 0 and is a collective there (``engine.save_checkpoint``
        calls it on every rank).
        """
        if self._mode is None:
            self._require_attached()
        inner = self._inner.state_dict()
        if self._mode == "direct" and self._world > 1:
            muon_idx = {p.index for p in self._params if p.muon}
            mine = {k: {n: t.cpu() if isinstance(t, Tensor) else t for n, t in v.items()}
                    for k, v in inner["state"].items() if k in muon_idx}
            gathered: list[Any] = [None] * self._world if self._rank == 0 else None  # type: ignore[assignment]
            dst = 0 if self._group is None else dist.get_global_rank(self._group, 0)
            dist.gather_object(mine, gathered, dst=dst, group=self._group)
            if self._rank == 0:
                for part in gathered:
                    inner["state"].update(part)
        groups = [{k: v for k, v in g.items() if k != "params"} | {"params": []} for g in self._all_groups]
        return {
            "state": {},
            "param_groups": groups,
            _KEY: {
                "version": STATE_VERSION,
                "mode": self._mode,
                "world_size": self._world,
                "rank": self._rank,
                "layout": self._layout() if self._mode in ("partitioned", "zero3") else None,
                "owners": self.owners,
                "inner": inner,
                "adamw_slices": {i: {"pieces": [list(x) for x in self._pieces[i]],
                                     "state": [dict(st) for st in sts]}
                                 for i, sts in self._slice_state.items()},
                "weight_slices": {i: dict(st) for i, st in self._weight_state.items() if st},
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` wrote for this rank (same process count and ZeRO stage)."""
        if self._mode is None:
            self._require_attached()
        if state_dict is None:
            raise ValueError(
                "the checkpoint holds no optimizer state for this engine: it was saved at another ZeRO stage "
                "(stage 0 keeps it in mp_rank_00_model_states.pt, stages 1-3 in per-rank zero_pp_rank_* files). "
                "Resume with the same number of processes and ZeRO stage, or load with load_optimizer_states=False"
            )
        ours = state_dict.get(_KEY)
        if ours is None:
            raise ValueError(
                "this optimizer state was not written by qmuon's DeepSpeed integration (no "
                f"'{_KEY}' entry); a plain QMuon state dict loads with QMuon.load_state_dict before wrapping"
            )
        if ours["version"] != STATE_VERSION:
            raise ValueError(f"checkpoint layout version {ours['version']} is not this qmuon's ({STATE_VERSION}); "
                             "load it with the qmuon-lightning version that saved it")
        if ours["mode"] != self._mode or ours["world_size"] != self._world:
            raise ValueError(
                f"the checkpoint was saved with {ours['world_size']} process(es) at {MODE_NAMES[ours['mode']]}; this "
                f"run has {self._world} at {MODE_NAMES[self._mode]}. Resume with the same number of processes and "
                "ZeRO stage (QMuon's momentum is stored per owner rank)"
            )
        if list(ours["owners"]) != self.owners:
            raise ValueError("the checkpoint's matrix-to-rank assignment differs from this run's: the model or the "
                             "optimizer's parameter groups changed since it was saved")
        if self._mode in ("partitioned", "zero3"):
            if ours["rank"] != self._rank:
                raise ValueError(f"rank {self._rank} was given rank {ours['rank']}'s optimizer state")
            if [list(x) if not isinstance(x, list) else x for x in ours["layout"]] != \
                    [list(x) for x in self._layout()]:
                raise ValueError("the checkpoint's ZeRO partition layout differs from this run's (different "
                                 "parameters, bucket alignment or process count)")
        inner = copy.copy(ours["inner"])
        state = dict(inner["state"])
        muon_idx = {p.index: p for p in self._params if p.muon}
        for k in list(state):
            if k in muon_idx and muon_idx[k].owner != self._rank:
                del state[k]  # another rank's matrix (stage 0: rank 0's file holds all of them)
        saved_groups = state_dict.get("param_groups") or []
        saved_rule = {gi: (saved_groups[gi].get("bf16_update") if gi < len(saved_groups) else None)
                      for gi in range(len(self._all_groups))}
        slices = ours["adamw_slices"]
        self._slice_state = {}
        for index, pieces in self._pieces.items():
            info = self._params[index]
            where = f"AdamW parameter {index} (shape {tuple(info.shape)}), rank {self._rank}'s slice"
            family = self._all_groups[info.group]["state_format"]
            saved = slices.get(index)
            if saved is not None:
                if [list(x) for x in saved["pieces"]] != [list(x) for x in pieces]:
                    raise ValueError(f"{where}: the checkpoint cuts the slice into pieces {saved['pieces']}, this "
                                     f"run into {[list(x) for x in pieces]}; the partition layout changed")
                srcs = saved["state"]
            else:
                continue  # no step taken before the save
            self._slice_state[index] = [
                {k: v.to(device=self._device, copy=True) if isinstance(v, Tensor) and k != "step" else
                 (v.clone() if isinstance(v, Tensor) else v)
                 for k, v in qadamw.convert_adamw_state(src, family, info.shape, (r, w), where).items()}
                for src, (_, r, w) in zip(srcs, pieces)]
            data = self._views(info)[0]
            for (off, r, w), st in zip(pieces, self._slice_state[index]):
                self._check_weight_state(data.narrow(0, off, r * w).view(r, w), st, info, saved_rule[info.group],
                                         f"{where}, piece at {off}")
        self._weight_state = {}
        for index, st in ours["weight_slices"].items():
            info = self._params[int(index)]
            if not info.muon or info.holders[self._rank] is None:
                raise ValueError(f"the checkpoint holds weight-correction codes for parameter {index}, of which this "
                                 "run's rank holds no Muon slice; the partition layout changed")
            self._weight_state[info.index] = {k: v.to(device=self._device, copy=True) for k, v in st.items()}
        for info in self._params:
            v = self._views(info) if info.muon else None
            if v is not None:
                self._check_weight_state(v[0], self._weight_state.get(info.index, {}), info, saved_rule[info.group],
                                         f"Muon parameter {info.index} (shape {tuple(info.shape)}), rank "
                                         f"{self._rank}'s slice")
        inner["state"] = state
        # AdamW proxies must look like the saved slices while loading (torch casts state to them).
        for info, proxy in zip(self._params, self._proxies):
            if not info.muon and info.index not in self._pieces:
                v = self._views(info)
                proxy.data = v[0] if v is not None else torch.zeros(0, device=self._device)
        self._inner.load_state_dict(inner)
        for info, proxy in zip(self._params, self._proxies):
            if not info.muon:
                proxy.data = torch.zeros(0, device=self._device)
        for g, saved in zip(self._all_groups, state_dict.get("param_groups", [])):
            for k, v in saved.items():
                # structural keys stay this run's, as in QMuon.load_state_dict (the state was converted to
                # this run's formats above; a changed bf16_update creates / drops codes at the next step)
                if k not in ("params", "param_names", *STRUCTURAL_KEYS):
                    g[k] = v

    def _check_weight_state(self, data: Tensor, st: dict[str, Any], info: FlatParam, saved_rule: str | None,
                            where: str) -> None:
        """Validate the loaded weight-correction codes of one bf16 slice (or piece) ``data``, as
        single-process QMuon does (:func:`qmuon.optim.bf16_weights.check_loaded_weight_state`):
        saved and resumed with the same ``bf16_update``, what the rule needs must be there, int8 and
        shaped like the slice (a missing ``weight_ecc`` is an incomplete checkpoint); after a rule
        change, codes are created (zero) or dropped at the next step."""
        rule = self._all_groups[info.group].get("bf16_update", "nearest")
        present = any(k in st for k in qstate.weight_state_keys())
        if saved_rule == rule or (present and weight_apply.weight_state_keys(data, rule)):
            weight_apply.check_weight_state(data, st, rule, where)

