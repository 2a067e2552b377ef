"""Which parameters Muon updates and which go to the auxiliary AdamW: one readable rule table.

Rules are checked in order and the first match wins. The default table:

====  ===============================================  ===============  ===========================
#     matches                                          goes to          why
====  ===============================================  ===============  ===========================
1     ``ndim < 2``                                      adamw_no_decay   biases and norm gains
2     owning module is ``nn.Embedding`` / ``EmbeddingBag``  adamw        lookup tables, not maps
3     name matches ``DEFAULT_HEAD_REGEX``                adamw           embeddings / output head
4     ``ndim >= 2``                                     muon             hidden matrices
====  ===============================================  ===============  ===========================

Fused matrices (several logical matrices stacked along dim 0) are declared with ``fused_parts``
(``{name_regex: (n0, n1, ...)}``), by a module attribute ``qmuon_fused_parts = {"weight": (...)}``,
or found automatically for ``nn.MultiheadAttention.in_proj_weight`` (q, k, v of equal size).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import torch
from torch import nn

from ..core.config import DEFAULT_CONFIG, QMuonConfig
from ..core.pipeline import DEFAULT_BATCH_BUDGET
from .qmuon import QMuon

__all__ = [
    "RoutingRule",
    "RouteDecision",
    "DEFAULT_RULES",
    "DEFAULT_HEAD_REGEX",
    "route_parameters",
    "format_routing_table",
    "build_optimizer",
]

log = logging.getLogger(__name__)

Target = Literal["muon", "adamw", "adamw_no_decay"]
_TARGETS = ("muon", "adamw", "adamw_no_decay")

#: Names of embedding tables and output heads in common model code (GPT-2, LLaMA, HF, timm).
DEFAULT_HEAD_REGEX = (
    r"(^|\.)(lm_head|head|output|output_proj|classifier|score|embed\w*|embedding\w*|wte|wpe|"
    r"tok_embeddings|word_embeddings|position_embeddings|decoder\.out)(\.|$)"
)


@dataclass(frozen=True)
class RoutingRule:
    """A parameter matches when every given condition holds (unset conditions match anything).

    Args:
        target: ``"muon"``, ``"adamw"`` or ``"adamw_no_decay"`` (AdamW with weight_decay 0).
        min_ndim / max_ndim: bounds on ``param.ndim`` (inclusive).
        module_types: the module that owns the parameter is an instance of one of these.
        name_regex: ``re.search`` on the parameter's qualified name.
        reason: shown in the routing table.
    """

    target: Target
    min_ndim: int | None = None
    max_ndim: int | None = None
    module_types: tuple[type, ...] = ()
    name_regex: str | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.target not in _TARGETS:
            raise ValueError(f"RoutingRule target must be one of {_TARGETS}, got {self.target!r}")

    def matches(self, name: str, param: torch.Tensor, module: nn.Module) -> bool:
        if self.min_ndim is not None and param.ndim < self.min_ndim:
            return False
        if self.max_ndim is not None and param.ndim > self.max_ndim:
            return False
        if self.module_types and not isinstance(module, self.module_types):
            return False
        if self.name_regex is not None and re.search(self.name_regex, name) is None:
            return False
        return True


DEFAULT_RULES: tuple[RoutingRule, ...] = (
    RoutingRule("adamw_no_decay", max_ndim=1, reason="1-D: bias or norm gain"),
    RoutingRule("adamw", module_types=(nn.Embedding, nn.EmbeddingBag), reason="embedding table"),
    RoutingRule("adamw", name_regex=DEFAULT_HEAD_REGEX, reason="embedding or output head (by name)"),
    RoutingRule("muon", min_ndim=2, reason="hidden matrix"),
)


@dataclass
class RouteDecision:
    name: str
    shape: tuple[int, ...]
    target: str
    reason: str
    parts: tuple[int, ...] | None = None
    param: torch.Tensor | None = field(default=None, repr=False)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The user's model inside Lightning Fabric's ``_FabricModule`` (matched by class name: this
    layer does not import Lightning), so routing names are the model's own (no ``_forward_module.``
    prefix), as in the state dicts ``fabric.save`` writes."""
    while type(model).__name__ == "_FabricModule" and isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def _owners(model: nn.Module) -> dict[int, tuple[str, nn.Module, str]]:
    """id(param) -> (qualified name, owning module, attribute name); first owner wins for tied weights."""
    out: dict[int, tuple[str, nn.Module, str]] = {}
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) not in out:
                out[id(p)] = (f"{mod_name}.{pname}" if mod_name else pname, mod, pname)
    return out


def _declared_parts(
    name: str, module: nn.Module, attr: str, fused_parts: Mapping[str, Sequence[int]]
) -> tuple[int, ...] | None:
    for pattern, parts in fused_parts.items():
        if re.search(pattern, name):
            return tuple(int(n) for n in parts)
    declared = getattr(module, "qmuon_fused_parts", None)
    if isinstance(declared, Mapping) and attr in declared:
        return tuple(int(n) for n in declared[attr])
    if isinstance(module, nn.MultiheadAttention) and attr == "in_proj_weight":
        e = module.embed_dim
        return (e, e, e)
    return None


def route_parameters(
    model: nn.Module,
    rules: Sequence[RoutingRule] | None = None,
    fused_parts: Mapping[str, Sequence[int]] | None = None,
) -> list[RouteDecision]:
    """Apply the rule table to every trainable parameter of ``model`` (frozen ones are listed as
    ``"frozen"`` and left out of the optimizer)."""
    rules = DEFAULT_RULES if rules is None else tuple(rules)
    fused_parts = fused_parts or {}
    decisions = []
    for _, (name, module, attr) in _owners(_unwrapped(model)).items():
        p = getattr(module, attr)
        if not p.requires_grad:
            decisions.append(RouteDecision(name, tuple(p.shape), "frozen", "requires_grad=False", param=p))
            continue
        for rule in rules:
            if rule.matches(name, p, module):
                parts = _declared_parts(name, module, attr, fused_parts) if rule.target == "muon" else None
                decisions.append(RouteDecision(name, tuple(p.shape), rule.target, rule.reason, parts, p))
                break
        else:
            raise ValueError(
                f"no routing rule matched parameter {name!r} (shape {tuple(p.shape)}); "
                "end the rule table with a catch-all rule such as RoutingRule('adamw')"
            )
    return decisions


def format_routing_table(decisions: Sequence[RouteDecision]) -> str:
    rows = [("parameter", "shape", "optimizer", "rule")]
    for d in decisions:
        target = d.target + (f" parts={list(d.parts)}" if d.parts else "")
        rows.append((d.name, "x".join(map(str, d.shape)) or "scalar", target, d.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    counts: dict[str, int] = {}
    for d in decisions:
        counts[d.target] = counts.get(d.target, 0) + (int(torch.Size(d.shape).numel()))
    lines.append("parameters per optimizer: " + ", ".join(f"{k}={v:,}" for k, v in counts.items()))
    return "\n".join(lines)


def build_optimizer(
    model: nn.Module,
    *,
    config: QMuonConfig | None = None,
    rules: Sequence[RoutingRule] | None = None,
    fused_parts: Mapping[str, Sequence[int]] | None = None,
    verbose: bool = True,
    batch_budget: float = DEFAULT_BATCH_BUDGET,
    **qmuon_kwargs: Any,
) -> QMuon:
    """Route ``model``'s parameters with the rule table and build one :class:`QMuon`.

    Groups: one Muon group for plain matrices, one Muon group per distinct fused layout (its
    ``parts``), one AdamW group, one AdamW group without weight decay. Every group carries
    ``param_names``. The routing table is logged (``logging`` at INFO) and printed on rank 0 when
    ``verbose``; it is also kept as ``optimizer.routing``.

    The optimizer's arguments are those of :class:`~qmuon_lightning.core.config.QMuonConfig`
    (one set of defaults, shared with ``QMuon``): pass a ``config``, keyword arguments
    (``lr=0.02, state_format="grasp4", ...``), or both (keywords override the config's fields).
    An unknown keyword raises ``TypeError`` listing the accepted ones.
    """
    cfg = config or DEFAULT_CONFIG
    if qmuon_kwargs:
        unknown = sorted(set(qmuon_kwargs) - set(QMuonConfig.field_names()))
        if unknown:
            raise TypeError(f"build_optimizer: unknown argument(s) {unknown}; accepted: routing (rules, fused_parts, "
                            f"verbose, batch_budget, config) and QMuon's: {', '.join(QMuonConfig.field_names())}")
        cfg = cfg.replace(**qmuon_kwargs)
    decisions = route_parameters(model, rules, fused_parts)
    muon = [d for d in decisions if d.target == "muon" and d.parts is None]
    fused = [d for d in decisions if d.target == "muon" and d.parts is not None]
    groups: list[dict[str, Any]] = []
    if muon:
        groups.append({"params": [d.param for d in muon], "param_names": [d.name for d in muon]})
    by_parts: dict[tuple[int, ...], list[RouteDecision]] = {}
    for d in fused:
        by_parts.setdefault(d.parts, []).append(d)  # type: ignore[arg-type]
    for parts, sel in by_parts.items():
        groups.append({"params": [d.param for d in sel], "param_names": [d.name for d in sel], "parts": parts})
    for target, wd in (("adamw", cfg.adamw_weight_decay), ("adamw_no_decay", 0.0)):
        sel = [d for d in decisions if d.target == target]
        if sel:
            groups.append({
                "params": [d.param for d in sel], "param_names": [d.name for d in sel],
                "use_muon": False, "weight_decay": wd,
            })
    if not groups:
        raise ValueError("the model has no trainable parameters")
    if not muon and not fused:
        log.warning("build_optimizer: no parameter was routed to Muon; QMuon will run AdamW only")
    opt = QMuon.from_config(groups, cfg, batch_budget=batch_budget)
    for d in decisions:
        d.param = None
    opt.routing = decisions  # type: ignore[attr-defined]
    table = format_routing_table(decisions)
    log.info("QMuon parameter routing:\n%s", table)
    if verbose and _is_rank_zero():
        print(f"QMuon parameter routing:\n{table}")
    return opt


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
