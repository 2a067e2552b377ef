"""Lightning strategies: ``Trainer(strategy="qmuon_fsdp")`` and its presets.

Importing this package (``import qmuon_lightning`` does) registers every strategy class defined here
in Lightning's ``StrategyRegistry``: Lightning has no entry points for strategies, so a name is
usable as ``Trainer(strategy=...)`` only after this import. Each class registers its names through
Lightning's ``register_strategies(registry)`` class-method convention.
"""

from __future__ import annotations

import importlib
import logging

from lightning.pytorch.strategies import Strategy, StrategyRegistry

from .fsdp import OPTIMIZER_MODES, PRESETS, QMuonFSDPStrategy
from .sharding import ShardPolicy, apply_sharding, select_blocks, select_roots

__all__ = [
    "QMuonFSDPStrategy",
    "OPTIMIZER_MODES",
    "PRESETS",
    "ShardPolicy",
    "apply_sharding",
    "select_blocks",
    "select_roots",
    "register_strategies",
]

log = logging.getLogger(__name__)


def _strategy_classes() -> list[type[Strategy]]:
    classes: list[type[Strategy]] = [QMuonFSDPStrategy]
    # The DeepSpeed strategy lives in its own module, owned and landed separately: registered when present.
    try:
        deepspeed_mod = importlib.import_module(f"{__name__}.deepspeed")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.deepspeed":
            raise
        return classes
    for obj in vars(deepspeed_mod).values():
        if (
            isinstance(obj, type) and issubclass(obj, Strategy) and obj.__module__ == deepspeed_mod.__name__
            and "register_strategies" in vars(obj)
        ):
            classes.append(obj)
    return classes


def register_strategies(registry=StrategyRegistry) -> list[str]:
    """Register this package's strategies in ``registry`` (Lightning's ``StrategyRegistry`` by
    default; already done on import). Returns the names registered."""
    classes = _strategy_classes()
    for cls in classes:
        cls.register_strategies(registry)
    names = sorted(n for n, d in registry.items() if d["strategy"] in classes)
    log.debug("registered Lightning strategies: %s", names)
    return names


register_strategies()
