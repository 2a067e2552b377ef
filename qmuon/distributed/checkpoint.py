"""Consolidated (full, unsharded) optimizer checkpoints for sharded QMuon.

Sharded checkpoints need nothing from this module: QMuon keeps the state of a ``Shard(0)``
parameter as ``Shard(0)`` DTensors with the global shape, so
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` / ``set_optimizer_state_dict``
and ``torch.distributed.checkpoint.save`` / ``load`` (what Lightning's ``ModelParallelStrategy``
calls) save every rank's rows and reshard them on load.

A *consolidated* checkpoint is one plain ``QMuon.state_dict()`` (integer parameter ids, plain
tensors, loadable with ``torch.load(weights_only=True)``) holding the full tensors, so that a
single-process ``QMuon`` built the same way loads it with ``load_state_dict``, and a sharded QMuon
on any number of ranks loads it with :func:`load_full_state_dict`. (``get_optimizer_state_dict(...,
options=StateDictOptions(full_state_dict=True))`` also gathers our state, but keys it by parameter
name.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..quant.layout import localize_loaded_state, shard_state
from ..quant.state import StateFormatError, detect_state_format, format_options, get_format

__all__ = ["full_state_dict", "load_full_state_dict"]


def full_state_dict(opt: torch.optim.Optimizer, *, to_cpu: bool = True) -> dict[str, Any]:
    """``opt.state_dict()`` with every DTensor gathered into a full plain tensor.

    Collective: every rank of the parameters' mesh must call it (all get the full dict).
    """
    sd = opt.state_dict()
    state = {}
    for pid in sorted(sd["state"]):
        entry = {}
        for k, v in sd["state"][pid].items():
            if isinstance(v, DTensor):
                v = v.full_tensor()
            if isinstance(v, Tensor) and to_cpu:
                v = v.detach().cpu().clone()
            entry[k] = v
        state[pid] = entry
    return {"state": state, "param_groups": sd["param_groups"]}


def load_full_state_dict(opt: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Load a consolidated (full) state dict into an optimizer whose parameters may be sharded.

    Each rank keeps its own rows: full tensors of sharded parameters are sliced and wrapped as
    ``Shard(0)`` DTensors before ``opt.load_state_dict`` (QMuon converts momentum formats on its
    own rows). No communication.
    """
    state = dict(state_dict["state"])
    for saved, cur in zip(state_dict["param_groups"], opt.param_groups):
        for pid, p in zip(saved["params"], cur["params"]):
            if pid not in state or not isinstance(p, DTensor):
                continue
            src = state[pid]
            fmt = None  # AdamW state, or a broken one QMuon.load_state_dict reports: every tensor splits by rows
            if cur.get("use_muon", False):
                try:
                    fmt = get_format(detect_state_format(src))  # the format the state was saved in
                except StateFormatError:
                    pass
            opts = format_options({**cur, **saved})
            entry = localize_loaded_state(src, p, fmt, opts, where=f"param id {pid}")
            for k, v in entry.items():  # the full tensors' slices (0-d tensors stay where they are)
                if isinstance(v, Tensor) and not isinstance(v, DTensor) and v.ndim >= 1:
                    entry[k] = v.to(p.device)
            shard_state(p, entry, fmt, opts)
            state[pid] = entry
    opt.load_state_dict({"state": state, "param_groups": state_dict["param_groups"]})
