"""What the Trainer strategy (the kit's ``qmuon_lightning.strategies.QMuonFSDPStrategy``) and the
Fabric strategy (:class:`~qmuon.integrations.fabric.QMuonFabricStrategy`) share on top of their
different Lightning bases: the registered names and their presets, the optimizer modes, the
constructor checks and the mesh sizes resolved before the base class builds the device mesh."""

from __future__ import annotations

from typing import Any, Literal, Optional

from .options import resolve_mesh_sizes, validate_optimizer_kwargs
from .sharding import ShardPolicy, resolve_policy

__all__ = ["OPTIMIZER_MODES", "OptimizerMode", "PRESETS", "QMuonStrategyMixin"]

OptimizerMode = Literal["qmuon", "keep"]
OPTIMIZER_MODES: tuple[str, ...] = ("qmuon", "keep")

#: Registered names -> constructor arguments (``Trainer(strategy=name)``).
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "qmuon_fsdp": ("FSDP2 with QMuon (int8 momentum) replacing the configured optimizer", {}),
    "qmuon_fsdp_int8_stochastic": (
        "FSDP2 with QMuon, int8 momentum with stochastic rounding",
        {"optimizer": "qmuon", "optimizer_kwargs": {"state_format": "int8", "state": {"rounding": "stochastic"}}},
    ),
    "qmuon_fsdp_grasp4": (
        "FSDP2 with QMuon, GRASP 4-bit momentum",
        {"optimizer": "qmuon", "optimizer_kwargs": {"state_format": "grasp4"}},
    ),
    "qmuon_fsdp_keep": ("FSDP2 with automatic sharding; the configured optimizer is kept", {"optimizer": "keep"}),
}


class QMuonStrategyMixin:
    """What the Trainer and Fabric strategies share on top of their (different) Lightning bases:
    registration of ``"qmuon_fsdp"`` and its presets, the optimizer settings, and the mesh sizes
    resolved before the base class builds the device mesh."""

    _optimizer_mode: str
    _optimizer_kwargs: dict[str, Any]
    _data_parallel_size: Any
    _tensor_parallel_size: Any

    @staticmethod
    def _check_init_args(optimizer: str, data_parallel_size: Any, tensor_parallel_size: Any) -> None:
        """Refuse bad constructor arguments before the Lightning base class sees them."""
        if optimizer not in OPTIMIZER_MODES:
            raise ValueError(f"optimizer={optimizer!r} is not one of {OPTIMIZER_MODES}")
        for name, size in (("data_parallel_size", data_parallel_size), ("tensor_parallel_size", tensor_parallel_size)):
            if size != "auto" and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
                raise ValueError(f"{name} must be 'auto' or a positive int, got {size!r}")

    def _init_qmuon_settings(self, optimizer: str, optimizer_kwargs: Optional[dict[str, Any]],
                             shard_policy: ShardPolicy, reshard_after_forward: bool) -> None:
        self._optimizer_mode = optimizer
        self._optimizer_kwargs = validate_optimizer_kwargs(optimizer, optimizer_kwargs or {})
        self._shard_policy: ShardPolicy = shard_policy
        resolve_policy(shard_policy)  # raises on a bad policy now, before any process starts
        self._reshard_after_forward = bool(reshard_after_forward)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"qmuon_fsdp"`` and its presets (:data:`PRESETS`) in a Lightning strategy registry."""
        for name, (description, init_params) in PRESETS.items():
            strategy_registry.register(name, cls, description=description, override=True, **init_params)

    @property
    def optimizer_mode(self) -> str:
        return self._optimizer_mode

    @property
    def optimizer_kwargs(self) -> dict[str, Any]:
        return dict(self._optimizer_kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size, self._tensor_parallel_size = resolve_mesh_sizes(
            self._data_parallel_size, self._tensor_parallel_size,
            self.num_nodes * self.num_processes)  # type: ignore[attr-defined]
        super().setup_environment()  # type: ignore[misc]
