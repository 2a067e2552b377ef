"""qmuon_lightning: Muon with 8-bit and 4-bit (int4, e0m3, GRASP) momentum for Lightning, FSDP2,
Accelerate and DeepSpeed users.

Layers (imports flow one way, no cycles): ``ops`` (kernels and their pure-PyTorch references) ->
``quant`` (state formats) -> ``core`` (the Muon step: plan, momentum, Newton-Schulz, apply; the
config) -> ``optim`` (QMuon, routing) / ``distributed`` / ``integrations`` -> ``strategies`` /
``callbacks`` -> ``cli``.
"""

from importlib.metadata import PackageNotFoundError, version

from .optim import (
    FusedParts,
    GraspMuon,
    NonFiniteGradientError,
    QMuon,
    QMuonConfig,
    RoutingRule,
    build_optimizer,
    route_parameters,
)

# Registers Trainer(strategy="qmuon_fsdp"), L.Fabric(strategy="qmuon_fsdp") and their presets in Lightning's
# strategy registries (Lightning has no entry points for strategies). Without Lightning installed the
# optimizers still import.
try:
    from .strategies import QMuonFabricStrategy, QMuonFSDPStrategy
except ModuleNotFoundError as _e:  # pragma: no cover - lightning is a declared dependency
    if not (_e.name or "").startswith("lightning"):
        raise

try:
    __version__ = version("qmuon-lightning")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+source"

__all__ = [
    "QMuon", "QMuonConfig", "GraspMuon", "NonFiniteGradientError", "RoutingRule", "FusedParts", "build_optimizer",
    "route_parameters", "QMuonFSDPStrategy", "QMuonFabricStrategy", "__version__",
]
