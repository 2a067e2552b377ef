"""The strategies' checkpoint metadata and state loading, shared by the Trainer strategy
(:mod:`.fsdp`) and the Fabric strategy (:mod:`.fabric`): the ``"qmuon_fsdp"`` metadata entry, its
compatibility check, the fidelity guard's per-parameter formats, and loading model and optimizer
state from a sharded (``torch.distributed.checkpoint``) or a consolidated checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch.optim import Optimizer

from qmuon.core.config import FORMAT_OVERRIDES, ResumeMismatch, check_resume, describe_layout, state_layout
from qmuon.distributed import safe_load
from qmuon.optim.qmuon import QMuon

__all__: list[str] = []

#: The checkpoint metadata entry written on save and checked on load.
CKPT_KEY = "qmuon_fsdp"


def _fqn_keyed(osd: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
    """A consolidated optimizer state dict keyed by parameter names (Lightning saves it keyed by
    parameter index, ``FSDP.rekey_optim_state_dict(..., PARAM_ID)``)."""
    if not osd["state"] or not all(isinstance(k, int) for k in osd["state"]):
        return osd
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import OptimStateKeyType

    return FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, module)


def _clean_name(name: str) -> str:
    """A parameter's name as ``torch.distributed.checkpoint`` keys it: without the wrappers'
    segments (``torch.compile``'s ``_orig_mod``, activation checkpointing's
    ``_checkpoint_wrapped_module``), so state saved with or without them matches."""
    for seg in ("_orig_mod", "_checkpoint_wrapped_module"):
        name = name.replace(f".{seg}", "").replace(f"{seg}.", "")
    return name


def _drop_state_except(module: torch.nn.Module, optimizer: Optimizer, keep: set[str]) -> None:
    """Delete optimizer state of parameters whose name is not in ``keep``."""
    names = {id(p): _clean_name(n) for n, p in module.named_parameters()}
    for p in list(optimizer.state):
        if names.get(id(p)) not in keep:
            del optimizer.state[p]



def _param_names(module: Optional[torch.nn.Module]) -> dict[int, str]:
    if module is None:
        return {}
    return {id(p): _clean_name(n) for n, p in module.named_parameters()}


def format_overrides(module: Optional[torch.nn.Module], optimizers: Sequence[Optimizer]) -> list[dict[str, dict[str, Any]]]:
    """Per optimizer, ``{parameter name: layout}`` of the parameters stepped in another format than
    their group's (promoted by the fidelity guard); names make them portable across world sizes."""
    names = _param_names(module)
    out = []
    for opt in optimizers:
        found: dict[str, dict[str, Any]] = {}
        for g in opt.param_groups:
            for i, layout in (g.get(FORMAT_OVERRIDES) or {}).items():
                found[names.get(id(g["params"][i]), f"#{i}")] = dict(layout)
        out.append(found)
    return out


def apply_format_overrides(module: Optional[torch.nn.Module], optimizers: Sequence[Optimizer],
                           saved: Optional[Mapping[str, Any]], owner: str) -> None:
    """Give the optimizers the per-parameter formats the checkpoint was saved with, before its state
    is loaded: torch's loaders read saved tensors into the current state's layout, so a promoted
    parameter must already be in its promoted format."""
    if not saved or module is None:
        return
    by_name = {_clean_name(n): p for n, p in module.named_parameters()}
    for opt, overrides in zip(optimizers, saved.get("format_overrides") or []):
        if not overrides:
            continue
        if not isinstance(opt, QMuon):
            raise ValueError("the checkpoint holds per-parameter state formats (fidelity-guard promotions) but this "
                             f"run's optimizer is {type(opt).__name__}; resume with QMuon")
        for name, layout in overrides.items():
            if name not in by_name:
                raise ValueError(f"the checkpoint promoted parameter {name!r} to {layout}, but this model has no "
                                 "parameter of that name; resume with the model it was saved with")
            current = opt.param_layout(by_name[name])
            # every layout key: a (dp, tp) layout fits int8 blocks to narrow rowwise shards by block_size alone
            if any(current.get(k) != v for k, v in layout.items()):
                opt.promote_param(by_name[name], dict(layout))
                rank_zero_info(f"{owner}: {name!r} resumes with {describe_layout(layout)} momentum, its layout when "
                               "the checkpoint was saved (a fidelity-guard promotion, or blocks fitted to tensor-"
                               "parallel shards)")


def checkpoint_info(optimizer_mode: str, optimizers: Sequence[Optimizer], world_size: int,
                    module: Optional[torch.nn.Module] = None) -> dict[str, Any]:
    """The checkpoint metadata entry: optimizer types, Muon state layouts, world size and the
    per-parameter formats the fidelity guard promoted (names from ``module``)."""
    muon_groups = [g for opt in optimizers for g in opt.param_groups
                   if g.get("use_muon", False) and "state_format" in g]
    return {
        "optimizer": optimizer_mode,
        "optimizer_types": [type(opt).__name__ for opt in optimizers],
        "state_formats": sorted({str(g["state_format"]) for g in muon_groups}),
        "muon_layouts": [state_layout(g) for g in muon_groups],
        "world_size": world_size,
        "format_overrides": format_overrides(module, optimizers),
    }


def check_compatible(saved: Optional[Mapping[str, Any]], now: Mapping[str, Any], path: Any) -> None:
    """Refuse to load optimizer state saved with another optimizer or Muon state layout
    (``saved`` / ``now``: :func:`checkpoint_info` entries) before anything is loaded."""
    if not saved:
        return
    missing = sorted(set(now) - set(saved))
    if missing:
        raise ValueError(f"{path}: its {CKPT_KEY!r} metadata lacks {missing}; it was not written by this version of "
                         "qmuon_lightning and cannot be resumed")
    if saved["optimizer_types"] != now["optimizer_types"]:
        raise ValueError(
            f"{path} holds optimizer state of {saved['optimizer_types']} (saved with optimizer="
            f"{saved['optimizer']!r}) but this run trains with {now['optimizer_types']} (optimizer="
            f"{now['optimizer']!r}); resume with the same optimizer setting"
        )
    # torch's loaders place saved tensors into the current optimizer's state layout (same keys,
    # dtypes and sharding), so a checkpoint loads into the layout it was saved with only.
    saved_layouts, now_layouts = saved["muon_layouts"], now["muon_layouts"]
    hint = ("(To change format, load the checkpoint without this strategy and use QMuon.load_state_dict, "
            "which converts between formats.)")
    if len(saved_layouts) != len(now_layouts):
        raise ValueError(f"{path} holds {len(saved_layouts)} Muon parameter groups but this run has "
                         f"{len(now_layouts)}; build the optimizer with the same routing. {hint}")
    for i, (a, b) in enumerate(zip(saved_layouts, now_layouts)):
        if a == b:
            continue
        try:
            check_resume(a, b, where=f"{path}, Muon group {i}", allow_format_change=False)
        except ResumeMismatch:
            raise ValueError(
                f"{path} holds Muon momentum saved with {describe_layout(a)} (Muon group {i}) but this run uses "
                f"{describe_layout(b)}; resume with optimizer_kwargs={dict(a)!r}. {hint}") from None


def load_file(path: Any, weights_only: Optional[bool] = None, **kwargs: Any) -> Any:
    """``torch.load`` of a checkpoint file the strategies read, always with ``weights_only=True``: a
    file that safe loading refuses raises :class:`qmuon.distributed.safe_load.UnsafeCheckpointError`
    saying why, and ``weights_only=False`` (Lightning's argument) is refused before anything is read,
    since unpickling an untrusted file runs its code."""
    if weights_only is False:
        raise ValueError(
            f"{path}: the QMuon strategies load checkpoints with weights_only=True only (unpickling with "
            "weights_only=False runs whatever code the file holds). Drop weights_only=False; if the file holds "
            "types of your own, register them with torch.serialization.add_safe_globals([...])")
    return safe_load.load(path, **kwargs)


def saved_dcp_keys(path: Any) -> Any:
    """The state-dict keys of the ``torch.distributed.checkpoint`` directory ``path`` (its metadata,
    read by :func:`qmuon.distributed.safe_load.read_dcp_metadata`)."""
    return safe_load.read_dcp_metadata(path).state_dict_metadata


def load_sharded_state(
    module: torch.nn.Module, path: Path, model_key: str, optimizers: Mapping[str, Optimizer], *, strict: bool,
    missing_optimizer: str,
) -> None:
    """Load the model (saved under ``model_key``) and each optimizer (under its key) from the
    ``torch.distributed.checkpoint`` directory ``path``, resharding to the current mesh.

    Optimizer state is restored for exactly the parameters that had state when saved. Parameters
    that never received a gradient (unused in forward) have no state; torch's loader would otherwise
    require it (strict) or keep the zero state its initializing dry-run ``step()`` created.
    ``missing_optimizer`` (formatted with ``path`` and ``key``) is the error when an optimizer's
    state is not in the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict,
    )

    saved_keys = set(saved_dcp_keys(path))
    for key in optimizers:  # checked before anything is loaded
        if not any(k.startswith(f"{key}.") for k in saved_keys):
            raise KeyError(missing_optimizer.format(path=path, key=key))
    model_state = {model_key: get_model_state_dict(module)}
    dcp.load(model_state, storage_reader=safe_load.dcp_reader(path), planner=safe_load.dcp_planner())
    module.load_state_dict(model_state[model_key], strict=strict)
    for key, opt in optimizers.items():
        osd = get_optimizer_state_dict(module, opt)  # a dry-run step creates every state tensor
        saved = {fqn for fqn in osd["state"] if any(k.startswith(f"{key}.state.{fqn}.") for k in saved_keys)}
        osd["state"] = {fqn: v for fqn, v in osd["state"].items() if fqn in saved}
        dcp.load({key: osd}, storage_reader=safe_load.dcp_reader(path), planner=safe_load.dcp_planner())
        set_optimizer_state_dict(module, opt, optim_state_dict=osd,
                                 options=StateDictOptions(cpu_offload=True, strict=False))
        _drop_state_except(module, opt, saved)


def load_full_state(
    module: torch.nn.Module, model_state: Mapping[str, Any], optimizer_states: Sequence[tuple[Optimizer, Any]], *,
    strict: bool,
) -> None:
    """Load a consolidated (single file) model state dict and optimizer state dicts (keyed by
    parameter name or, as Lightning's Trainer saves them, by index) into the sharded ``module`` and
    its optimizers; each rank keeps its own rows. Optimizer state is restored for exactly the
    parameters that had state when saved (see :func:`load_sharded_state`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(module, dict(model_state), options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True, strict=strict))
    for opt, osd in optimizer_states:
        osd = _fqn_keyed(osd, module)
        saved = set(osd["state"])
        set_optimizer_state_dict(module, opt, optim_state_dict=osd, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=False))
        _drop_state_except(module, opt, saved)
