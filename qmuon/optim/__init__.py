"""Optimizers built on the Muon core (:mod:`qmuon.core`): :class:`QMuon` and the parameter router."""

from ..core.config import QMuonConfig
from . import routing as _routing
from .qmuon import DEFAULT_NS_COEFFICIENTS, FORMAT_VERSION, NonFiniteGradientError, QMuon, adjusted_lr
from .release import GradientRelease, attach_gradient_release
from .weight_numerics import bf16_stall_report, stall_shares
from .routing import *  # noqa: F401,F403  (RoutingRule, build_optimizer, ...: see optim.routing)

__all__ = ["QMuon", "QMuonConfig", "NonFiniteGradientError", "FORMAT_VERSION", "DEFAULT_NS_COEFFICIENTS", "adjusted_lr",
           "GradientRelease", "attach_gradient_release", "bf16_stall_report", "stall_shares", *_routing.__all__]
