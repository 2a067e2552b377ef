"""Checkpoints of :class:`~.optimizer.WholeMatrixZeroOptimizer`: what each rank's optimizer file
holds (the quantized momentum of the Muon matrices it owns, the AdamW state of its slices, the
weight-correction codes of its bf16 slices, the layout they belong to) and how it is loaded back,
validated against this run's layout (:class:`ZeroStateMixin`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist
from torch import Tensor

__all__: list[str] = []

#: Version of the layout written by :meth:`WholeMatrixZeroOptimizer.state_dict` (the momentum of the rows
#: of each Muon slice under ``"muon_slices"``, what owners keep under ``"muon"``; AdamW moments of flat
#: slices, per piece, under ``"adamw_slices"``; the weight-correction state of bf16 Muon slices under
#: ``"weight_slices"``); only this version loads.
STATE_VERSION = 5
_KEY = "qmuon_deepspeed"
#: The wrapper's modes, as the ZeRO stages users know them (error messages).
MODE_NAMES = {"direct": "ZeRO stage 0", "partitioned": "ZeRO stage 1/2", "zero3": "ZeRO stage 3", None: "no engine"}


class ZeroStateMixin:
    """``state_dict`` / ``load_state_dict`` of :class:`~.optimizer.WholeMatrixZeroOptimizer`: the
    envelope (version, ZeRO stage, process count, layout) and its checks; the state itself is the
    flat step's (:meth:`qmuon.distributed.flat_step.FlatOwnerStep._slice_state_dict`)."""

    def _layout(self) -> list[Any]:
        return [[p.index, p.owner if p.muon else -1, p.numel,
                 None if p.holders[self._rank] is None else dataclasses.astuple(p.holders[self._rank])]
                for p in self._params]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the quantized momentum of its Muon slices' rows (stage 0: of the Muon
        matrices it owns) and the AdamW state of its slices, as plain tensors, plus the layout they
        belong to.

        At ZeRO stage 0 with several processes DeepSpeed saves only rank 0's optimizer state, so this
        gathers every owner's momentum to rank 0 and is a collective there (``engine.save_checkpoint``
        calls it on every rank).
        """
        if self._mode is None:
            self._require_attached()
        state = self._slice_state_dict()
        if self._mode == "direct" and self._world > 1:
            mine = {k: {n: t.cpu() if isinstance(t, Tensor) else t for n, t in v.items()} for k, v in state["muon"].items()}
            gathered: list[Any] = [None] * self._world if self._rank == 0 else None  # type: ignore[assignment]
            dst = 0 if self._group is None else dist.get_global_rank(self._group, 0)
            dist.gather_object(mine, gathered, dst=dst, group=self._group)
            if self._rank == 0:
                for part in gathered:
                    state["muon"].update(part)
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
                **state,
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
                             "load it with the qmuon version that saved it")
        if ours["mode"] != self._mode or ours["world_size"] != self._world:
            raise ValueError(
                f"the checkpoint was saved with {ours['world_size']} process(es) at {MODE_NAMES[ours['mode']]}; this "
                f"run has {self._world} at {MODE_NAMES[self._mode]}. Resume with the same number of processes and "
                "ZeRO stage (QMuon's momentum is stored per rank, cut as this layout cuts the matrices)"
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
        self._load_slice_state(ours, state_dict.get("param_groups") or [])
