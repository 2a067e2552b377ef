"""The strategies' optimizer settings: ``optimizer_kwargs`` checked when a strategy is constructed,
the mesh sizes, and the QMuon that replaces the user's optimizer after sharding. Shared by the
Trainer strategy (:mod:`.fsdp`) and the Fabric strategy (:mod:`.fabric`)."""

from __future__ import annotations

from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

import torch
from torch.optim import Optimizer

from qmuon.core.config import ConfigError, QMuonConfig
from qmuon.optim.qmuon import QMuon
from qmuon.optim.release import attach_gradient_release, release_of
from qmuon.optim.routing import build_optimizer
from qmuon.quant import state as qstate
from . import optimizer_swap as swap

__all__: list[str] = []



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
