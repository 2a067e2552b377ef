"""Helpers shared by the callbacks: finding QMuon optimizers, naming parameters, logging."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Mapping

from torch import Tensor, nn

from qmuon.optim.qmuon import QMuon

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

__all__: list[str] = []


def qmuon_optimizers(trainer: "pl.Trainer") -> list[tuple[int, QMuon]]:
    """``(index in trainer.optimizers, optimizer)`` for every :class:`QMuon` the trainer runs."""
    return [(i, opt) for i, opt in enumerate(trainer.optimizers) if isinstance(opt, QMuon)]


def param_names(module: nn.Module | None, optimizer: QMuon) -> dict[int, str]:
    """``id(param) -> name``: the module's parameter names, else the group's ``param_names``
    (set by :func:`~qmuon_lightning.build_optimizer`), else ``"group{g}.param{i}"``."""
    names: dict[int, str] = {}
    if module is not None:
        for name, p in module.named_parameters(remove_duplicate=True):
            names.setdefault(id(p), name)
    for gi, group in enumerate(optimizer.param_groups):
        given = group.get("param_names")
        for i, p in enumerate(group["params"]):
            if id(p) not in names:
                names[id(p)] = given[i] if given else f"group{gi}.param{i}"
    return names


def muon_params(optimizer: QMuon) -> Iterator[tuple[int, dict, int, Tensor, int]]:
    """``(group index, group, index in group, param, key)`` for every Muon parameter, where
    ``key`` is the parameter's running index over all groups, as :meth:`QMuon.step` numbers it
    (it seeds GRASP's first power-iteration start and the stochastic-rounding streams)."""
    key = 0
    for gi, group in enumerate(optimizer.param_groups):
        if group["use_muon"]:
            for i, p in enumerate(group["params"]):
                yield gi, group, i, p, key + i
        key += len(group["params"])


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (sharded or replicated)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def logger_step(trainer: "pl.Trainer") -> int:
    """The step Lightning's own logging uses (``LearningRateMonitor`` logs at the same value)."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    return int(getattr(loop, "_batches_that_stepped", trainer.global_step))


def log_to_loggers(trainer: "pl.Trainer", metrics: Mapping[str, float]) -> None:
    """Write ``metrics`` to every logger of the trainer now (rank 0; loggers are rank-zero only).

    These callbacks measure on a few scheduled steps; going through ``LightningModule.log`` would
    drop those values unless the step happens to be a multiple of ``log_every_n_steps``.
    """
    if not metrics or not trainer.is_global_zero:
        return
    step = logger_step(trainer)
    for lg in trainer.loggers:
        lg.log_metrics(dict(metrics), step=step)
