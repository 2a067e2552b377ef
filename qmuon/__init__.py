"""qmuon: Muon with 8-bit and 4-bit (int4, e0m3, GRASP) momentum, an 8/4-bit auxiliary AdamW and bf16
weights without an fp32 copy, as a plain ``torch.optim.Optimizer``. Imports torch only.

    import qmuon
    opt = qmuon.build_optimizer(model, lr=0.02, state_format="int8")   # hidden matrices -> Muon, the rest -> AdamW

Layers (imports flow one way, no cycles): ``ops`` (kernels and their pure-PyTorch references) ->
``quant`` (state formats) -> ``core`` (the Muon step: plan, momentum, Newton-Schulz, apply; the
configuration) -> ``optim`` (QMuon, routing, gradient release) / ``distributed`` (sharded step, meshes,
checkpoints) / ``integrations`` (Accelerate, DeepSpeed; each imports its framework only when used).
The Lightning kit (strategies, callbacks, ``qmuon-train``) is the separate package ``qmuon_lightning``.
"""

from importlib.metadata import PackageNotFoundError, version

from .core.config import ConfigError, NewtonSchulz, Routing, Safety, StateOptions, UpdateRule
from .optim import (
    FusedParts,
    GradientRelease,
    NonFiniteGradientError,
    QMuon,
    QMuonConfig,
    RoutingRule,
    attach_gradient_release,
    build_optimizer,
    capture_step,
    compile_step,
    format_routing_table,
    route_parameters,
)
from .integrations import hf_attention as _hf_attention  # noqa: F401  registers QK-clip's Hugging Face adapter

try:
    __version__ = version("qmuon")
except PackageNotFoundError:  # running from a source tree without install
    __version__ = "0.0.0+source"

__all__ = [
    "QMuon", "QMuonConfig", "build_optimizer",
    "NewtonSchulz", "UpdateRule", "StateOptions", "Safety", "Routing", "ConfigError",
    "NonFiniteGradientError", "RoutingRule", "FusedParts", "route_parameters", "format_routing_table",
    "GradientRelease", "attach_gradient_release", "compile_step", "capture_step", "__version__",
]
