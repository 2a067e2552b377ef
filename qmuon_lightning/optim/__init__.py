"""Optimizers built on the quantized state formats: :class:`QMuon` and the parameter router."""

from .newton_schulz import newton_schulz_folded, newton_schulz_reference
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
    "GraspMuon",
    "FORMAT_VERSION",
    "DEFAULT_NS_COEFFICIENTS",
    "adjusted_lr",
    "newton_schulz_folded",
    "newton_schulz_reference",
    "RoutingRule",
    "RouteDecision",
    "DEFAULT_RULES",
    "DEFAULT_HEAD_REGEX",
    "route_parameters",
    "format_routing_table",
    "build_optimizer",
]
