"""Optimizers built on the Muon core (:mod:`qmuon_lightning.core`): :class:`QMuon` and the parameter router."""

from ..core.config import QMuonConfig
from .qmuon import DEFAULT_NS_COEFFICIENTS, FORMAT_VERSION, GraspMuon, QMuon, adjusted_lr
from .routing import (
    DEFAULT_HEAD_REGEX,
    DEFAULT_RULES,
    RouteDecision,
    RoutingRule,
    build_optimizer,
    format_routing_table,
    route_parameters,
)

__all__ = [
    "QMuon",
    "QMuonConfig",
    "GraspMuon",
    "FORMAT_VERSION",
    "DEFAULT_NS_COEFFICIENTS",
    "adjusted_lr",
    "RoutingRule",
    "RouteDecision",
    "DEFAULT_RULES",
    "DEFAULT_HEAD_REGEX",
    "route_parameters",
    "format_routing_table",
    "build_optimizer",
]
