"""The strategies' optimizer settings: ``optimizer_kwargs`` checked when a strategy is constructed,
the mesh sizes, and the QMuon that replaces the user's optimizer after sharding. Shared by the
Trainer strategy (:mod:`.fsdp`) and the Fabric strategy (:mod:`.fabric`)."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.optim import Optimizer

from qmuon.core.config import ConfigError, QMuonConfig
from qmuon.optim.qmuon import QMuon
from qmuon.optim.release import attach_gradient_release, release_of
from qmuon.optim.routing import build_optimizer
from qmuon.quant import state as qstate
from . import optimizer_swap as swap

__all__ = ["ActivationCheckpointingPolicy", "activation_checkpointing_kwargs", "setup_activation_checkpointing"]

#: ``QMuonFSDPStrategy(activation_checkpointing_policy=...)``: as Lightning's ``FSDPStrategy`` takes it
#: (a set of module classes, or an FSDP auto-wrap policy callable ``(module, recurse, nonwrapped_numel)
#: -> bool``), plus class names for YAML: ``"pkg.mod.Block"`` is imported, a bare ``"Block"`` matches
#: the name of the module's class or of a base class.
ActivationCheckpointingPolicy = Union[set, Sequence[Union[str, type]], Callable[..., bool]]


def validate_optimizer_kwargs(mode: str, kwargs: Any) -> dict[str, Any]:
    """Check ``optimizer_kwargs`` (a :class:`~qmuon.QMuonConfig` or a dict of its options) now, with
    the optimizer's own checks, so a typo or a bad value fails when the strategy is constructed, not
    after the processes have started. Returns the options as given (a dict): the keys the user set,
    which win over what the swap reads from the user's AdamW."""
    if isinstance(kwargs, QMuonConfig):
        kwargs = kwargs.to_dict()
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"optimizer_kwargs must be a QMuonConfig or a dict of its options, got {type(kwargs).__name__}")
    kwargs = dict(kwargs)
    if mode == "keep":
        if kwargs:
            raise ValueError(
                f"optimizer='keep' trains with the optimizer configure_optimizers returns; optimizer_kwargs "
                f"{sorted(kwargs)} would be ignored. Drop them or use optimizer='qmuon'"
            )
        return kwargs
    try:
        QMuonConfig.from_kwargs(kwargs)
    except ConfigError as e:
        raise ConfigError(f"optimizer_kwargs: {e}") from None
    return kwargs


def ensure_release(optimizer: QMuon, optimizer_kwargs: Mapping[str, Any]) -> None:
    """Attach gradient release to a QMuon the strategy keeps (built by the user) when
    ``optimizer_kwargs`` asks for it and it has none yet."""
    config = QMuonConfig.from_kwargs(optimizer_kwargs)
    if config.gradient_release and release_of(optimizer) is None:
        attach_gradient_release(optimizer, clip_norm=config.safety.release_clip_norm)


def check_sharded_formats(opt: QMuon) -> None:
    """Fail at setup, not at the first step, when a Muon group's state format cannot be sharded
    (the registry lists the formats that support ``Shard(0)`` parameters)."""
    from torch.distributed.tensor import DTensor

    bad = sorted({
        str(g["state_format"]) for g in opt.param_groups
        if g["use_muon"] and g["state_format"] not in qstate.SUPPORTED_SHARDED_FORMATS
        and any(isinstance(p, DTensor) for p in g["params"])
    })
    if bad:
        raise ValueError(
            f"QMuon state_format {', '.join(map(repr, bad))} cannot be used on FSDP2-sharded parameters: its state "
            f"cannot be split with the weight rows. Use optimizer_kwargs={{'state_format': ...}} "
            f"with one of {', '.join(qstate.SUPPORTED_SHARDED_FORMATS)}"
        )


def resolve_mesh_sizes(
    data_parallel_size: Union[Literal["auto"], int], tensor_parallel_size: Union[Literal["auto"], int], world_size: int,
) -> tuple[int, int]:
    """The device-mesh shape ``(data parallel, tensor parallel)``. ``tensor_parallel_size="auto"``
    means 1 here (Lightning's "all devices of a node" only makes sense with a tensor-parallel
    ``configure_model`` / ``parallelize_fn``); ``data_parallel_size="auto"`` spans the rest."""
    tp = 1 if tensor_parallel_size == "auto" else tensor_parallel_size
    if data_parallel_size != "auto":
        return data_parallel_size, tp
    if world_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the world size {world_size}")
    return world_size // tp, tp


def build_replacement(
    module: torch.nn.Module, user: Optional[Optimizer], optimizer_kwargs: Mapping[str, Any], warn: Callable[[str], None],
) -> QMuon:
    """The QMuon that replaces ``user`` (a ``torch.optim.AdamW`` / ``Adam``, or None): built by
    :func:`build_optimizer` on the sharded ``module`` with ``optimizer_kwargs``, the user's AdamW
    settings filling the ``adamw_*`` arguments that ``optimizer_kwargs`` leaves unset. ``warn``
    receives the settings that cannot carry over."""
    settings: dict[str, Any] = {}
    if user is not None:
        swap.check_coverage(module, user)
        settings, notes = swap.adamw_settings(user)
        for note in notes:
            warn(note)
    config = QMuonConfig.from_kwargs(settings, **optimizer_kwargs)  # explicit optimizer_kwargs win, field by field
    if config.routing.bank_state_format is None and not qstate.get_format(config.state_format).row_local:
        # A format with per-matrix statistics (grasp4's low-rank factor) would mix the experts of a
        # MoE bank; the banks of a replacement keep int8 momentum (no-op for models without banks).
        config = config.replace(routing={"bank_state_format": "int8"})
    new = build_optimizer(module, config, verbose=False)
    check_sharded_formats(new)
    return new


def no_muon_warning(owner: str, decisions: Sequence[Any]) -> Optional[str]:
    """The warning to show when routing sent no parameter to Muon (None otherwise)."""
    if any(d.target == "muon" for d in decisions):
        return None
    return (
        f"{owner}: no parameter was routed to Muon, so QMuon runs AdamW only. Muon takes "
        "2-D hidden weights; the rule table sends embeddings, the output head (by name) and 1-D tensors "
        "to AdamW. Check the routing table, pass optimizer_kwargs={'routing': {'rules': [...]}}, or use optimizer='keep'"
    )


def _checkpoint_class(entry: Any) -> Union[type, str]:
    if isinstance(entry, type):
        if not issubclass(entry, nn.Module):
            raise TypeError(f"activation_checkpointing_policy entry {entry!r} is not an nn.Module subclass")
        return entry
    if isinstance(entry, str) and "." in entry:
        module_name, _, attr = entry.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"activation_checkpointing_policy entry {entry!r}: cannot import it ({e}); give an "
                             "importable 'package.module.Class', a bare class name or the class itself") from None
        return _checkpoint_class(obj)
    if isinstance(entry, str) and entry:
        return entry
    raise TypeError(f"activation_checkpointing_policy entries must be nn.Module classes or class names, got {entry!r}")


def activation_checkpointing_kwargs(policy: Optional[ActivationCheckpointingPolicy]) -> dict[str, Any]:
    """The keyword arguments of ``torch.distributed``'s ``apply_activation_checkpointing`` for
    ``policy`` (checked now, in the strategy's constructor): Lightning's own translation
    (``lightning.fabric.strategies.fsdp._activation_checkpointing_kwargs``) for a set of classes or a
    callable; class names (YAML) are imported, or matched by the name of the module's class or a base class when bare."""
    from lightning.fabric.strategies.fsdp import _activation_checkpointing_kwargs

    if policy is None:
        return {}
    if callable(policy) and not isinstance(policy, type):
        return _activation_checkpointing_kwargs(None, policy)
    entries = [policy] if isinstance(policy, (type, str)) else policy
    if not isinstance(entries, (set, frozenset, Sequence)) or not entries:
        raise TypeError("activation_checkpointing_policy must be a non-empty set / list of nn.Module classes or "
                        f"class names, or an FSDP auto-wrap policy callable; got {policy!r}")
    resolved = [_checkpoint_class(e) for e in entries]
    classes = {c for c in resolved if isinstance(c, type)}
    names = frozenset(c for c in resolved if isinstance(c, str))
    if not names:
        return _activation_checkpointing_kwargs(None, classes)
    cls_tuple = tuple(classes)

    def check_fn(module: nn.Module) -> bool:
        # by the class and its bases: fully_shard swaps a Block's class for a subclass "FSDPBlock"
        return isinstance(module, cls_tuple) or any(c.__name__ in names for c in type(module).__mro__)

    return {"check_fn": check_fn}


def setup_activation_checkpointing(module: nn.Module, kwargs: Mapping[str, Any], owner: str) -> list[str]:
    """Wrap the modules ``kwargs`` selects in ``torch.distributed``'s non-reentrant
    ``checkpoint_wrapper`` (Lightning's ``_setup_activation_checkpointing``); returns their names.
    Refuses a model that checkpoints its blocks itself (``DecoderLM(activation_checkpointing=True)``):
    each block would be recomputed twice."""
    from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if not kwargs:
        return []
    own = [n or type(module).__name__ for n, m in module.named_modules() if getattr(m, "activation_checkpointing", False) is True]
    if own:
        raise ValueError(
            f"{owner}(activation_checkpointing_policy=...) and the model's own activation checkpointing "
            f"({', '.join(own)}) would recompute each block twice. Use one: drop the policy, or build the "
            "model with activation_checkpointing=False"
        )
    _setup_activation_checkpointing(module, dict(kwargs))
    wrapped = [n for n, m in module.named_modules() if isinstance(m, CheckpointWrapper)]
    if not wrapped:
        raise ValueError(f"{owner}: activation_checkpointing_policy selected no module of "
                         f"{type(module).__name__}; check the class names")
    return wrapped
