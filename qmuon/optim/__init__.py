"""Optimizers built on the Muon core (:mod:`qmuon.core`): :class:`QMuon` and the parameter router."""

from ..core.config import QMuonConfig
from . import routing as _routing
from .qmuon import FORMAT_VERSION, NonFiniteGradientError, QMuon
from .compiled import capture_step, compile_step
from .release import GradientRelease, attach_gradient_release
from .weight_numerics import bf16_stall_report
from .routing import *  # noqa: F401,F403  (RoutingRule, build_optimizer, ...: see optim.routing)

__all__ = ["QMuon", "QMuonConfig", "NonFiniteGradientError", "FORMAT_VERSION", "GradientRelease", "compile_step", "capture_step",
           "attach_gradient_release", "bf16_stall_report", *_routing.__all__]
