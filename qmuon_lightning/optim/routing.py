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

Layer meaning (Muon parameters only):

- *Fused matrices* (several layers stored in one parameter) are declared with ``fused_parts``
  (``{name_regex: spec}``), by a module attribute ``qmuon_fused_parts = {"weight": spec}``, or found
  automatically for ``nn.MultiheadAttention.in_proj_weight`` (q, k, v along dim 0) and GPT-2's
  ``c_attn`` (q, k, v along dim 1). ``spec``: ``(n0, n1, ...)`` (parts along dim 0),
  ``{"sizes": [n0, ...], "axis": 1}``, a :class:`~qmuon_lightning.core.plan.FusedParts`, or
  ``None`` in ``fused_parts`` (not fused: turns the automatic detection off for that name).
- *Orientation*: a 2-D weight stored ``(in, out)`` is declared with ``orientations``
  (``{name_regex: "in_out"}``) or a module attribute ``qmuon_orientation = {"weight": "in_out"}``;
  Hugging Face ``Conv1D`` (matched by class name, transformers is never imported) is ``(in, out)``
  by itself. Newton-Schulz and the lr adjustment then use the layer's ``(out, in)`` matrix.

Declarations are looked up in that order (argument, module attribute, automatic) and the first
one found wins, for parts and for orientation separately.
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
from ..core.plan import ORIENTATIONS, FusedParts
from .qmuon import QMuon
from .release import attach_gradient_release

__all__ = [
    "RoutingRule",
    "RouteDecision",
    "DEFAULT_RULES",
    "DEFAULT_HEAD_REGEX",
    "route_parameters",
    "FusedParts",
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
    """Where one parameter goes; for Muon parameters also what its layer means: ``parts`` (sizes
    of fused layers, or None) along stored dim ``parts_axis``, and ``orientation``
    (``"out_in"`` or ``"in_out"``)."""

    name: str
    shape: tuple[int, ...]
    target: str
    reason: str
    parts: tuple[int, ...] | None = None
    param: torch.Tensor | None = field(default=None, repr=False)
    parts_axis: int = 0
    orientation: str = "out_in"

    @property
    def layout(self) -> tuple[tuple[int, ...] | None, int, str]:
        """``(parts, parts_axis, orientation)``: the Muon group this parameter belongs to."""
        return self.parts, (self.parts_axis if self.parts else 0), self.orientation


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


#: Class name of Hugging Face transformers' ``Conv1D`` (``transformers.pytorch_utils``): a linear
#: layer stored ``(in, out)`` (``y = x @ W + b``), used by GPT-2 and its relatives.
HF_CONV1D = "Conv1D"


def _is_hf_conv1d(module: nn.Module, attr: str, p: torch.Tensor) -> bool:
    """An HF ``Conv1D`` weight, by class name (no transformers import) and by its ``nf`` (out
    features) matching the weight's columns."""
    if type(module).__name__ != HF_CONV1D or attr != "weight" or p.ndim != 2:
        return False
    nf = getattr(module, "nf", None)
    return nf is None or int(nf) == int(p.shape[1])


def _hf_fused(model: nn.Module) -> dict[int, FusedParts]:
    """id(Conv1D module) -> its fused parts, for GPT-2 style attention: a ``Conv1D`` child named
    ``c_attn`` of a module with ``split_size`` (``GPT2Attention``) packs q, k, v (k, v under
    cross-attention) as column blocks of ``split_size`` each."""
    out: dict[int, FusedParts] = {}
    for parent in model.modules():
        child = getattr(parent, "c_attn", None)
        split = getattr(parent, "split_size", None)
        if child is None or not isinstance(split, int) or split <= 0 or type(child).__name__ != HF_CONV1D:
            continue
        w = getattr(child, "weight", None)
        if isinstance(w, torch.Tensor) and w.ndim == 2 and w.shape[1] % split == 0 and w.shape[1] > split:
            out[id(child)] = FusedParts((split,) * (w.shape[1] // split), axis=1)
    return out


def _declared_parts(name: str, module: nn.Module, attr: str, fused_parts: Mapping[str, Any],
                    auto: Mapping[int, FusedParts]) -> FusedParts | None:
    for pattern, spec in fused_parts.items():
        if re.search(pattern, name):  # None: declared unfused (turns automatic detection off)
            return None if spec is None else _parse_parts(spec, f"fused_parts[{pattern!r}] (matched {name!r})")
    declared = getattr(module, "qmuon_fused_parts", None)
    if isinstance(declared, Mapping) and attr in declared:
        return _parse_parts(declared[attr], f"{type(module).__name__}.qmuon_fused_parts[{attr!r}] of {name!r}")
    if isinstance(module, nn.MultiheadAttention) and attr == "in_proj_weight":
        e = module.embed_dim
        return FusedParts((e, e, e), 0)
    if attr == "weight" and id(module) in auto:
        return auto[id(module)]
    return None


def _parse_parts(spec: Any, where: str) -> FusedParts:
    try:
        return FusedParts.parse(spec)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _declared_orientation(name: str, module: nn.Module, attr: str, p: torch.Tensor,
                          orientations: Mapping[str, str]) -> str:
    found: tuple[str, str] | None = None
    for pattern, value in orientations.items():
        if re.search(pattern, name):
            found = (value, f"orientations[{pattern!r}] (matched {name!r})")
            break
    if found is None:
        declared = getattr(module, "qmuon_orientation", None)
        if isinstance(declared, Mapping) and attr in declared:
            found = (declared[attr], f"{type(module).__name__}.qmuon_orientation[{attr!r}] of {name!r}")
    if found is None:
        return "in_out" if _is_hf_conv1d(module, attr, p) else "out_in"
    value, where = found
    if value not in ORIENTATIONS:
        raise ValueError(f"{where}: orientation must be one of {ORIENTATIONS} ('out_in': stored (out, in) like "
                         f"nn.Linear; 'in_out': stored (in, out) like transformers' Conv1D), got {value!r}")
    if value != "out_in" and p.ndim != 2:
        raise ValueError(f"{where}: orientation {value!r} applies to 2-D weights; {name!r} has shape {tuple(p.shape)}")
    return value


def route_parameters(
    model: nn.Module,
    rules: Sequence[RoutingRule] | None = None,
    fused_parts: Mapping[str, Any] | None = None,
    orientations: Mapping[str, str] | None = None,
) -> list[RouteDecision]:
    """Apply the rule table to every trainable parameter of ``model`` (frozen ones are listed as
    ``"frozen"`` and left out of the optimizer), and read each Muon parameter's layer meaning
    (fused parts, orientation; see the module docstring).

    Parameters are keyed by identity: a tied weight (an embedding shared with the output head)
    appears once, under its first owner's name and routing."""
    rules = DEFAULT_RULES if rules is None else tuple(rules)
    fused_parts = fused_parts or {}
    orientations = orientations or {}
    model = _unwrapped(model)
    auto = _hf_fused(model)
    decisions = []
    for _, (name, module, attr) in _owners(model).items():
        p = getattr(module, attr)
        if not p.requires_grad:
            decisions.append(RouteDecision(name, tuple(p.shape), "frozen", "requires_grad=False", param=p))
            continue
        for rule in rules:
            if rule.matches(name, p, module):
                d = RouteDecision(name, tuple(p.shape), rule.target, rule.reason, None, p)
                if rule.target == "muon":
                    _read_layout(d, module, attr, p, fused_parts, orientations, auto)
                decisions.append(d)
                break
        else:
            raise ValueError(
                f"no routing rule matched parameter {name!r} (shape {tuple(p.shape)}); "
                "end the rule table with a catch-all rule such as RoutingRule('adamw')"
            )
    return decisions


def _read_layout(d: RouteDecision, module: nn.Module, attr: str, p: torch.Tensor, fused_parts: Mapping[str, Any],
                 orientations: Mapping[str, str], auto: Mapping[int, FusedParts]) -> None:
    """Fill ``d``'s parts and orientation, checked against the parameter's shape."""
    d.orientation = _declared_orientation(d.name, module, attr, p, orientations)
    parts = _declared_parts(d.name, module, attr, fused_parts, auto)
    if parts is None:
        return
    if parts.axis == 1 and p.ndim != 2:
        raise ValueError(f"fused parts of {d.name!r} along axis 1 need a 2-D weight, got shape {tuple(p.shape)}")
    if sum(parts.sizes) != p.shape[parts.axis]:
        raise ValueError(f"fused parts of {d.name!r}: sizes {list(parts.sizes)} sum to {sum(parts.sizes)}, but dim "
                         f"{parts.axis} of its shape {tuple(p.shape)} is {p.shape[parts.axis]}; fix the sizes or the axis")
    d.parts, d.parts_axis = parts.sizes, parts.axis


def format_routing_table(decisions: Sequence[RouteDecision]) -> str:
    """The routing table: parameter, shape, optimizer (with fused parts and their stored dim),
    layout of Muon matrices (``out_in`` / ``in_out``) and the rule that matched."""
    rows = [("parameter", "shape", "optimizer", "layout", "rule")]
    for d in decisions:
        target = d.target
        if d.parts:
            target += f" parts={list(d.parts)}" + (f" dim={d.parts_axis}" if d.parts_axis else "")
        layout = d.orientation if d.target == "muon" else ""
        rows.append((d.name, "x".join(map(str, d.shape)) or "scalar", target, layout, d.reason))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
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
    fused_parts: Mapping[str, Any] | None = None,
    orientations: Mapping[str, str] | None = None,
    verbose: bool = True,
    batch_budget: float = DEFAULT_BATCH_BUDGET,
    gradient_release: bool = False,
    release_clip_norm: float | None = None,
    **qmuon_kwargs: Any,
) -> QMuon:
    """Route ``model``'s parameters with the rule table and build one :class:`QMuon`.

    Groups: one Muon group for plain ``(out, in)`` matrices, one Muon group per distinct layout
    (``parts``, ``parts_axis``, ``orientation``; see :func:`route_parameters`), one AdamW group,
    one AdamW group without weight decay. Every group carries ``param_names``. The routing table is logged (``logging`` at INFO) and printed on rank 0 when
    ``verbose``; it is also kept as ``optimizer.routing``.

    The optimizer's arguments are those of :class:`~qmuon_lightning.core.config.QMuonConfig`
    (one set of defaults, shared with ``QMuon``): pass a ``config``, keyword arguments
    (``lr=0.02, state_format="grasp4", ...``), or both (keywords override the config's fields).
    An unknown keyword raises ``TypeError`` listing the accepted ones.

    ``gradient_release=True`` steps each parameter inside backward as soon as its gradient is
    complete and frees the gradient (:mod:`qmuon_lightning.optim.release`; ``optimizer.step()``
    and ``zero_grad()`` keep working). ``release_clip_norm``: per-parameter L2 clipping of the AdamW
    group's gradients under release (global-norm clipping cannot combine with it).
    """
    if not isinstance(gradient_release, bool):
        raise TypeError(f"build_optimizer: gradient_release must be True or False, got {gradient_release!r}")
    if release_clip_norm is not None and not gradient_release:
        raise ValueError("build_optimizer: release_clip_norm applies with gradient_release=True only; without release "
                         "clip the global norm as usual (torch.nn.utils.clip_grad_norm_, Trainer(gradient_clip_val=...))")
    cfg = config or DEFAULT_CONFIG
    if qmuon_kwargs:
        unknown = sorted(set(qmuon_kwargs) - set(QMuonConfig.field_names()))
        if unknown:
            raise TypeError(f"build_optimizer: unknown argument(s) {unknown}; accepted: routing (rules, fused_parts, "
                            f"orientations, verbose, batch_budget, config), gradient_release, release_clip_norm "
                            f"and QMuon's: "
                            f"{', '.join(QMuonConfig.field_names())}")
        cfg = cfg.replace(**qmuon_kwargs)
    decisions = route_parameters(model, rules, fused_parts, orientations)
    plain_layout = (None, 0, "out_in")
    muon = [d for d in decisions if d.target == "muon" and d.layout == plain_layout]
    groups: list[dict[str, Any]] = []
    if muon:
        groups.append({"params": [d.param for d in muon], "param_names": [d.name for d in muon]})
    by_layout: dict[tuple[Any, ...], list[RouteDecision]] = {}
    for d in decisions:
        if d.target == "muon" and d.layout != plain_layout:
            by_layout.setdefault(d.layout, []).append(d)
    for (parts, axis, orientation), sel in by_layout.items():
        groups.append({"params": [d.param for d in sel], "param_names": [d.name for d in sel], "parts": parts,
                       "parts_axis": axis, "orientation": orientation})
    for target, wd in (("adamw", cfg.adamw_weight_decay), ("adamw_no_decay", 0.0)):
        sel = [d for d in decisions if d.target == target]
        if sel:
            groups.append({
                "params": [d.param for d in sel], "param_names": [d.name for d in sel],
                "use_muon": False, "weight_decay": wd,
            })
    if not groups:
        raise ValueError("the model has no trainable parameters")
    if not muon and not by_layout:
        log.warning("build_optimizer: no parameter was routed to Muon; QMuon will run AdamW only")
    opt = QMuon.from_config(groups, cfg, batch_budget=batch_budget)
    for d in decisions:
        d.param = None
    opt.routing = decisions  # type: ignore[attr-defined]
    if gradient_release:
        attach_gradient_release(opt, clip_norm=release_clip_norm)
    table = format_routing_table(decisions)
    log.info("QMuon parameter routing:\n%s", table)
    if verbose and _is_rank_zero():
        print(f"QMuon parameter routing:\n{table}")
    return opt


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
