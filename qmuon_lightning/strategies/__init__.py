"""Lightning strategies: ``Trainer(strategy="qmuon_fsdp")``, ``L.Fabric(strategy="qmuon_fsdp")`` and presets.

Importing this package (``import qmuon_lightning`` does) registers every Trainer strategy class
defined here in Lightning's ``StrategyRegistry`` and the Fabric strategy
(:class:`~qmuon.integrations.fabric.QMuonFabricStrategy`, which lives in the library so that
``qmuon-litgpt`` needs no kit) under the same names in Fabric's ``STRATEGY_REGISTRY``:
Lightning has no entry points for strategies, so a name is usable as ``strategy=...`` only after
this import. Each class registers its names through Lightning's ``register_strategies(registry)``
class-method convention.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
from lightning.pytorch.strategies import Strategy, StrategyRegistry

from qmuon.integrations.fabric import QMuonFabricStrategy, ShardPolicy

from .fsdp import QMuonFSDPStrategy

__all__ = [
    "QMuonFSDPStrategy",
    "QMuonFabricStrategy",
    "ShardPolicy",
    "register_strategies",
    "register_fabric_strategies",
]

log = logging.getLogger(__name__)


def _optional_strategy_module(name: str) -> Any:
    """Import ``strategies.<name>`` if that module exists (modules owned and landed separately)."""
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        return None


_deepspeed = _optional_strategy_module("deepspeed")
if _deepspeed is not None:
    QMuonDeepSpeedStrategy = _deepspeed.QMuonDeepSpeedStrategy
    __all__.append("QMuonDeepSpeedStrategy")


def _strategy_classes() -> list[type[Strategy]]:
    classes: list[type[Strategy]] = [QMuonFSDPStrategy]
    if _deepspeed is not None:
        classes += [
            obj for obj in vars(_deepspeed).values()
            if isinstance(obj, type) and issubclass(obj, Strategy) and obj.__module__ == _deepspeed.__name__
            and "register_strategies" in vars(obj)
        ]
    return classes


def register_strategies(registry: Any = StrategyRegistry) -> list[str]:
    """Register this package's strategies in ``registry`` (Lightning's ``StrategyRegistry`` by
    default; already done on import). Returns the names registered."""
    classes = _strategy_classes()
    for cls in classes:
        cls.register_strategies(registry)
    names = sorted(n for n, d in registry.items() if d["strategy"] in classes)
    log.debug("registered Lightning strategies: %s", names)
    return names


def register_fabric_strategies(registry: Any = FABRIC_STRATEGY_REGISTRY) -> list[str]:
    """Register the Fabric strategy in ``registry`` (Fabric's ``STRATEGY_REGISTRY`` by default;
    already done on import) under the Trainer registry's names. Returns the names registered."""
    QMuonFabricStrategy.register_strategies(registry)
    names = sorted(n for n, d in registry.items() if d["strategy"] is QMuonFabricStrategy)
    log.debug("registered Fabric strategies: %s", names)
    return names


register_strategies()
register_fabric_strategies()
