"""qmuon_lightning: Muon with 8-bit (and, later, 4-bit) momentum for Lightning, FSDP2,
Accelerate and DeepSpeed users.

Layers (imports flow one way): ``ops`` (kernels and their pure-PyTorch references) ->
``quant`` (state formats) -> ``optim`` (QMuon, routing) -> ``strategies`` / ``callbacks``.
"""

from importlib.metadata import PackageNotFoundError, version

from .optim import QMuon, RoutingRule, build_optimizer, route_parameters

try:
    __version__ = version("qmuon-lightning")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+source"

__all__ = ["QMuon", "RoutingRule", "build_optimizer", "route_parameters", "__version__"]
