"""Which parameters Muon updates and which go to the auxiliary AdamW: one readable rule table.

Rules are checked in order and the first match wins. The default table:

====  ===============================================  ===============  ===========================
#     matches                                          goes to          why
====  ===============================================  ===============  ===========================
1     ``ndim < 2``                                      adamw_no_decay   biases, norm gains, sinks
2     name ends in ``bias`` (``gate_up_proj_bias``)     adamw_no_decay   bias banks of experts
3     owning module is ``nn.Embedding`` / ``EmbeddingBag``  adamw        lookup tables, not maps
4     the model's output head, found by role             adamw           output head (any name)
5     name matches ``DEFAULT_HEAD_REGEX``                adamw           embeddings / output head
6     MoE router (class ``*Router``, ``DEFAULT_ROUTER_REGEX``)  adamw    per-expert logits
7     ``ndim >= 2``                                     muon             hidden matrices
====  ===============================================  ===============  ===========================

The output head by role (rule 4, :func:`output_head`): Muon's update has equal singular values,
which suits maps between hidden states but not the map to logits (a classifier's or an LM's output
layer; Muon's authors keep it on AdamW), whatever the layer is called: a ResNet's ``fc`` is a head
although no name rule can say so. Which module produces the output is read from the model, without
running it:

- a model that declares its head, Hugging Face style (``get_output_embeddings()``, on the model or
  on the module the descent below reaches, e.g. a transformers model inside a LightningModule): the
  module it returns (``None``: the model has no head; nothing is guessed);
- otherwise the last registered child that holds parameters, followed down to a leaf (PyTorch
  models register their layers in forward order by convention; an ``nn.Sequential`` *is* that
  order): the leaf is the head if it is an ``nn.Linear`` whose ``out_features`` differ from its
  ``in_features``. The descent stops (no head) at an ``nn.ModuleList`` / ``nn.ModuleDict`` (a stack
  of blocks computes no output of its own: an encoder ending in its layers has no head) and a square
  ``nn.Linear`` is not taken (a hidden-to-hidden map such as a pooler or a residual projection,
  not a map to classes or a vocabulary).

A misread costs little either way (the layer trains with AdamW, or with Muon as before); rule 4 is
an ordinary :class:`RoutingRule` (``role="output_head"``): leave it out of ``rules`` to route by
names only, or put a rule before it. A tied head (one ``Parameter`` shared with the input
embedding) is routed once, as the embedding it is first registered as (rule 3).

Routers go to AdamW, like output heads: a router's rows are the experts' logits, a classifier
over experts. Muon would move every expert's logit at the same rate whatever its gradient (the
orthogonalized update has equal singular values), and the matrix is tiny (``E x hidden``, rank at
most ``E``), so Muon buys nothing there. A rule placed before it (``RoutingRule("muon",
module_class_regex="Router$")``) sends them to Muon instead.

Layer meaning (fused parts, orientation, expert banks) is read by :mod:`.layouts`.
"""

from __future__ import annotations

import copy
import logging
import re
import weakref
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import torch
from torch import nn

from ..core.config import QMuonConfig, check_per_head
from ..core.plan import FusedParts, true_shape
from .heads import HeadRole, attention_heads, head_parts
from .layouts import BankLayout, _hf_banks, _hf_fused, _owners, _read_layout, _unwrapped
from .litgpt_layouts import litgpt_fused_parts
from .qk_clip import attach_qk_clip, find_attention
from .groups import group_name, unique_group_name
from .qmuon import QMuon
from .release import attach_gradient_release

__all__ = [
    "RoutingRule",
    "RouteDecision",
    "DEFAULT_RULES",
    "OUTPUT_HEAD",
    "output_head",
    "route_parameters",
    "FusedParts",
    "format_routing_table",
    "build_optimizer",
    "routed_groups",
    "ModelRouting",
]

log = logging.getLogger(__name__)

Target = Literal["muon", "adamw", "adamw_no_decay"]
_TARGETS = ("muon", "adamw", "adamw_no_decay")

#: Names of embedding tables and output heads in common model code (GPT-2, LLaMA, HF, timm).
DEFAULT_HEAD_REGEX = (
    r"(^|\.)(lm_head|head|output|output_proj|classifier|score|embed\w*|embedding\w*|wte|wpe|"
    r"tok_embeddings|word_embeddings|position_embeddings|decoder\.out)(\.|$)"
)

#: Router weights of mixture-of-experts blocks written as a plain ``nn.Linear`` (transformers 4's
#: ``mlp.gate`` / ``block_sparse_moe.gate``, Qwen2-MoE's ``shared_expert_gate``); transformers 5's
#: routers are matched by class name (``*Router``).
DEFAULT_ROUTER_REGEX = r"(^|\.)((mlp|moe|block_sparse_moe|feed_forward)\.(gate|router)|shared_expert_gate)\.weight$"

#: Role of the parameters of the model's output head (:func:`output_head`), for ``RoutingRule(role=...)``.
OUTPUT_HEAD = "output_head"
_ROLES = (None, OUTPUT_HEAD)


@dataclass(frozen=True)
class RoutingRule:
    """A parameter matches when every given condition holds (unset conditions match anything).

    Args:
        target: ``"muon"``, ``"adamw"`` or ``"adamw_no_decay"`` (AdamW with weight_decay 0).
        min_ndim / max_ndim: bounds on the parameter's number of dims (inclusive), read from its
            full shape (:func:`~qmuon.core.plan.true_shape`: DeepSpeed ZeRO-3 partitioned
            parameters look 1-D and empty).
        module_types: the module that owns the parameter is an instance of one of these.
        name_regex: ``re.search`` on the parameter's qualified name.
        reason: shown in the routing table.
        module_class_regex: ``re.search`` on the owning module's class name (matches model code
            that is not imported, such as transformers' ``Qwen3MoeTopKRouter``).
        any_of: when set, the rule also needs at least one of these name / class conditions:
            ``("name", regex)`` or ``("class", regex)``.
        role: the parameter plays this role in the model: ``"output_head"`` (:data:`OUTPUT_HEAD`),
            a parameter of the module :func:`output_head` finds.
    """

    target: Target
    min_ndim: int | None = None
    max_ndim: int | None = None
    module_types: tuple[type, ...] = ()
    name_regex: str | None = None
    reason: str = ""
    module_class_regex: str | None = None
    any_of: tuple[tuple[str, str], ...] = ()
    role: str | None = None

    def __post_init__(self) -> None:
        if self.target not in _TARGETS:
            raise ValueError(f"RoutingRule target must be one of {_TARGETS}, got {self.target!r}")
        if self.role not in _ROLES:
            raise ValueError(f"RoutingRule role must be one of {_ROLES}, got {self.role!r}")

    def matches(self, name: str, param: torch.Tensor, module: nn.Module, role: str | None = None) -> bool:
        """Whether the rule matches parameter ``name`` of ``module``; ``role``: the parameter's role
        in the model (:data:`OUTPUT_HEAD` or ``None``), for rules that set one."""
        if self.role is not None and role != self.role:
            return False
        if self.min_ndim is not None and len(true_shape(param)) < self.min_ndim:
            return False
        if self.max_ndim is not None and len(true_shape(param)) > self.max_ndim:
            return False
        if self.module_types and not isinstance(module, self.module_types):
            return False
        if self.name_regex is not None and re.search(self.name_regex, name) is None:
            return False
        cls = type(module).__name__
        if self.module_class_regex is not None and re.search(self.module_class_regex, cls) is None:
            return False
        if self.any_of and not any(re.search(rx, name if kind == "name" else cls) for kind, rx in self.any_of):
            return False
        return True


DEFAULT_RULES: tuple[RoutingRule, ...] = (
    RoutingRule("adamw_no_decay", max_ndim=1, reason="1-D: bias or norm gain"),
    RoutingRule("adamw_no_decay", name_regex=r"(^|[._])bias$", reason="bias bank (one bias per expert)"),
    RoutingRule("adamw", module_types=(nn.Embedding, nn.EmbeddingBag), reason="embedding table"),
    RoutingRule("adamw", role=OUTPUT_HEAD, reason="output head (by role)"),
    RoutingRule("adamw", name_regex=DEFAULT_HEAD_REGEX, reason="embedding or output head (by name)"),
    RoutingRule("adamw", max_ndim=2, any_of=(("class", r"(?i)router$"), ("name", DEFAULT_ROUTER_REGEX)),
                reason="MoE router: logits over experts"),
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
    bank_dims: int = 0
    parts_interleaved: bool = False

    @property
    def layout(self) -> tuple[Any, ...]:
        """``(parts, parts_axis, orientation, parts_interleaved, bank_dims)``: the Muon group this
        parameter belongs to."""
        return (self.parts, (self.parts_axis if self.parts else 0), self.orientation,
                bool(self.parts and self.parts_interleaved), self.bank_dims)


def output_head(model: nn.Module) -> nn.Module | None:
    """The module that computes ``model``'s output when it is an output head, else ``None`` (the
    rule and why: the module docstring, "output head by role"). The root is never its own head (a
    model that is one layer is what the caller asked to optimize)."""
    module = _unwrapped(model)
    while True:
        declared = getattr(module, "get_output_embeddings", None)
        if callable(declared):  # the model says which module its head is (Hugging Face convention)
            try:
                head = declared()
            except (NotImplementedError, AttributeError, TypeError):
                return None
            return head if isinstance(head, nn.Module) and head is not model else None
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            return None  # a stack of blocks: its last member is not where the output comes from
        last = None
        for child in module.children():
            if next(child.parameters(), None) is not None:
                last = child
        if last is None:
            break
        module = last
    if module is model or module is _unwrapped(model):
        return None
    if isinstance(module, nn.Linear) and module.out_features != module.in_features:
        return module
    return None


def _rule(rule: RoutingRule | Mapping[str, Any]) -> RoutingRule:
    """A rule, or the dict of its fields a YAML config gives (``{"target": "adamw", "name_regex": ...}``)."""
    if isinstance(rule, RoutingRule):
        return rule
    if isinstance(rule, Mapping):
        fields = dict(rule)
        if "any_of" in fields:
            fields["any_of"] = tuple(tuple(c) for c in fields["any_of"])
        if "module_types" in fields:
            raise ValueError("routing.rules: module_types needs classes; in a config use module_class_regex")
        try:
            return RoutingRule(**fields)
        except TypeError as e:
            raise ValueError(f"routing.rules: {e}; a rule's fields are those of qmuon.RoutingRule") from None
    raise TypeError(f"routing.rules holds RoutingRule objects or dicts of their fields, got {type(rule).__name__}")


class _Router:
    """The per-model facts the rule table reads (owners, automatic layouts, the output head),
    computed once per routing."""

    def __init__(self, model: nn.Module | None, rules: Sequence[RoutingRule] | None, fused_parts: Mapping[str, Any] | None,
                 orientations: Mapping[str, str] | None, banks: Mapping[str, Any] | None, per_head: Any = None) -> None:
        self.rules = DEFAULT_RULES if rules is None else tuple(_rule(r) for r in rules)
        per_head = check_per_head(per_head)
        self.heads: dict[int, HeadRole] = {}
        self.fused_parts = fused_parts or {}
        self.orientations = orientations or {}
        self.banks = banks or {}
        self.owners: dict[int, tuple[str, nn.Module, str]] = {}
        self.auto: dict[Any, Any] = {}
        self.auto_banks: dict[tuple[int, str], BankLayout] = {}
        self.head_ids: set[int] = set()
        if model is not None:
            model = _unwrapped(model)
            self.owners = _owners(model)
            self.auto = {**_hf_fused(model), **litgpt_fused_parts(model)}
            self.auto_banks = _hf_banks(model)
            head = output_head(model)
            self.head_ids = {id(p) for p in head.parameters()} if head is not None else set()
            if per_head is not None:
                self.heads = attention_heads(model, per_head)

    def decide(self, name: str, module: nn.Module, attr: str, p: torch.Tensor) -> RouteDecision:
        role = OUTPUT_HEAD if id(p) in self.head_ids else None
        for rule in self.rules:
            if rule.matches(name, p, module, role):
                d = RouteDecision(name, tuple(true_shape(p)), rule.target, rule.reason, None, p)
                if rule.target == "muon":
                    _read_layout(d, module, attr, p, self.fused_parts, self.orientations, self.auto, self.banks,
                                 self.auto_banks)
                    role = self.heads.get(id(p))
                    if role is not None:
                        _split_heads(d, role)
                return d
        raise ValueError(
            f"no routing rule matched parameter {name!r} (shape {tuple(true_shape(p))}); "
            "end the rule table with a catch-all rule such as RoutingRule('adamw')"
        )


def _split_heads(d: RouteDecision, role: HeadRole) -> None:
    """Make ``d``'s parts its attention head blocks (``routing.per_head``, :mod:`.heads`)."""
    parts, axis = head_parts(d.name, d.shape, d.orientation, role, d.parts, d.parts_axis, d.parts_interleaved,
                             d.bank_dims)
    d.parts, d.parts_axis = parts, axis
    n = len(parts) if parts else 1
    what = (f"{role.num_heads} q + {role.num_kv_heads} k + {role.num_kv_heads} v heads" if role.role == "qkv"
            else f"{n} {role.role} head{'s' if n > 1 else ''}")
    d.reason += f"; per head ({what})"


#: Stands for the owning module of a parameter routed without its model (no module rule matches it).
_NO_MODULE = nn.Module()


def route_parameters(
    model: nn.Module,
    rules: Sequence[RoutingRule] | None = None,
    fused_parts: Mapping[str, Any] | None = None,
    orientations: Mapping[str, str] | None = None,
    banks: Mapping[str, Any] | None = None,
    per_head: Any = None,
) -> list[RouteDecision]:
    """Apply the rule table to every trainable parameter of ``model`` (frozen ones are listed as
    ``"frozen"`` and left out of the optimizer), and read each Muon parameter's layer meaning
    (fused parts, orientation; see the module docstring; ``per_head``: split attention weights
    into their head blocks, :mod:`.heads`).

    Parameters are keyed by identity: a tied weight (an embedding shared with the output head)
    appears once, under its first owner's name and routing."""
    router = _Router(model, rules, fused_parts, orientations, banks, per_head)
    decisions = []
    for _, (name, module, attr) in router.owners.items():
        p = getattr(module, attr)
        if not p.requires_grad:
            decisions.append(RouteDecision(name, tuple(true_shape(p)), "frozen", "requires_grad=False", param=p))
            continue
        decisions.append(router.decide(name, module, attr, p))
    return decisions


class ModelRouting:
    """How :func:`build_optimizer` routed a model, kept on the optimizer (``QMuon.router``) so that
    :meth:`QMuon.add_param_group` routes groups added later (Lightning's ``BaseFinetuning``
    unfreezing a backbone) by the same rules, names and layouts. The model is held weakly (an
    optimizer must not keep a model alive); a copy of the optimizer made with its model in one
    ``copy.deepcopy`` follows the copied model, otherwise (pickle, a copy without the model) the
    routing keeps its rules and loses the model: parameters are then routed by shape and label."""

    def __init__(self, model: nn.Module | None, rules: Sequence[RoutingRule] | None = None,
                 fused_parts: Mapping[str, Any] | None = None, orientations: Mapping[str, str] | None = None,
                 banks: Mapping[str, Any] | None = None, bank_state_format: str | None = None,
                 per_head: Any = None) -> None:
        self._model = weakref.ref(model) if model is not None else None
        self.per_head = per_head
        self.rules = None if rules is None else tuple(rules)
        self.fused_parts = dict(fused_parts or {})
        self.orientations = dict(orientations or {})
        self.banks = dict(banks or {})
        self.bank_state_format = bank_state_format

    @property
    def model(self) -> nn.Module | None:
        return self._model() if self._model is not None else None

    def route(self, params: Sequence[torch.Tensor], labels: Sequence[str]) -> list[RouteDecision]:
        """One decision per parameter of ``params`` (trainable or not; a tied parameter routes as
        its first owner): by the model's names and modules for the model's parameters, by
        ``labels`` (and no module) for others."""
        router = _Router(self.model, self.rules, self.fused_parts, self.orientations, self.banks,
                         getattr(self, "per_head", None))
        out = []
        for p, label in zip(params, labels):
            name, module, attr = router.owners.get(id(p), (label, _NO_MODULE, ""))
            out.append(router.decide(name, module, attr, p))
        return out

    def split(self, params: Sequence[torch.Tensor], labels: Sequence[str], names: Sequence[str] | None = None,
              taken: Sequence[str] = ()) -> list[dict[str, Any]]:
        """``params`` as :func:`routed_groups` (names unique among ``taken``): routed by
        :meth:`route` (``labels`` for parameters the model does not own), listed under ``names``
        when given, else under the model's names and ``labels``."""
        decisions = self.route(params, labels)
        for d, name in zip(decisions, names or ()):
            d.name = name
        groups = routed_groups(decisions, bank_state_format=self.bank_state_format, taken=taken)
        for d in decisions:
            d.param = None
        return groups

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_model": None}  # a weak reference does not pickle

    def __deepcopy__(self, memo: dict[int, Any]) -> "ModelRouting":
        new = copy.copy(self)
        new.__dict__.update(copy.deepcopy(self.__getstate__(), memo))
        model = self.model
        copied = memo.get(id(model)) if model is not None else None
        new._model = weakref.ref(copied) if isinstance(copied, nn.Module) else None
        return new


def format_routing_table(decisions: Sequence[RouteDecision]) -> str:
    """The routing table: parameter, shape, optimizer (with fused parts and their stored dim),
    layout of Muon matrices (``out_in`` / ``in_out``) and the rule that matched."""
    rows = [("parameter", "shape", "optimizer", "layout", "rule")]
    for d in decisions:
        target = d.target
        if d.bank_dims:
            target += f" bank={'x'.join(map(str, d.shape[:d.bank_dims]))}"
        if d.parts:
            target += (f" parts={_parts_text(d.parts)}" + (f" dim={d.parts_axis}" if d.parts_axis else "")
                       + (" interleaved" if d.parts_interleaved else ""))
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


def _parts_text(parts: Sequence[int]) -> str:
    """``[64, 32, 32]``; many equal parts (head blocks) as ``[16]*12``."""
    if len(parts) > 4 and len(set(parts)) == 1:
        return f"[{parts[0]}]*{len(parts)}"
    return str(list(parts))


def _device_of(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    if p is None:
        return torch.device("cpu")
    return p.to_local().device if hasattr(p, "to_local") else p.device


def describe_auto_choices(config: QMuonConfig, decisions: Sequence[RouteDecision], device: torch.device) -> str:
    """One line: what the automatic Newton-Schulz options choose for these matrices on ``device``
    (the dtype, how many matrices take the Gram iteration). The first step records the choice in
    each group (:func:`qmuon.core.pipeline.record_auto_choices`), so a resume keeps it."""
    from ..core.gram_newton_schulz import pick_ns_method
    from ..core.newton_schulz import resolve_ns_dtype, resolve_schedule

    ns = config.newton_schulz
    dtype = resolve_ns_dtype(ns.dtype, device)
    schedule = resolve_schedule(ns.coefficients, ns.steps)
    shapes = [(d.shape[-2], d.shape[-1]) for d in decisions if d.target == "muon" and d.parts is None]
    gram = sum(pick_ns_method(ns.method, r, c, device.type, dtype, schedule) == "gram" for r, c in shapes)
    name = str(dtype).replace("torch.", "")
    return (f"Newton-Schulz on {device.type}: dtype {ns.dtype!r} -> {name}, method {ns.method!r} -> gram for {gram} "
            f"of {len(shapes)} unfused matrices (recorded in the state at the first step)")


def routed_groups(decisions: Sequence[RouteDecision], *, adamw_weight_decay: float | None = None,
                  bank_state_format: str | None = None, taken: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Parameter groups for routed parameters: one Muon group for plain ``(out, in)`` matrices, one
    Muon group per other layout (in order of appearance), one AdamW group and one AdamW group
    without weight decay; each with ``params``, ``param_names`` and a ``name`` unique among
    ``taken`` and each other (:func:`~qmuon.optim.qmuon.group_name`: ``muon``, ``muon_<layout>``,
    ``adamw``, ``adamw_no_decay``; what ``LearningRateMonitor`` logs). ``adamw_weight_decay``:
    the decayed AdamW group's ``weight_decay`` (unset: the optimizer's default)."""
    plain_layout = (None, 0, "out_in", False, 0)
    names = list(taken)
    groups: list[dict[str, Any]] = []

    def add(group: dict[str, Any], sel: list[RouteDecision], base: str | None = None) -> None:
        group["name"] = unique_group_name(base or group_name(group), names)
        names.append(group["name"])
        groups.append({"params": [d.param for d in sel], "param_names": [d.name for d in sel], **group})

    muon = [d for d in decisions if d.target == "muon" and d.layout == plain_layout]
    if muon:
        add({}, muon)
    by_layout: dict[tuple[Any, ...], list[RouteDecision]] = {}
    for d in decisions:
        if d.target == "muon" and d.layout != plain_layout:
            by_layout.setdefault(d.layout, []).append(d)
    for (parts, axis, orientation, interleaved, bank_dims), sel in by_layout.items():
        group = {"parts": parts, "parts_axis": axis, "orientation": orientation, "parts_interleaved": interleaved,
                 "bank_dims": bank_dims}
        if bank_dims and bank_state_format is not None:
            group["state_format"] = bank_state_format
        add(group, sel)
    for target in ("adamw", "adamw_no_decay"):
        sel = [d for d in decisions if d.target == target]
        if sel:
            group = {"use_muon": False}
            if target == "adamw_no_decay":
                group["weight_decay"] = 0.0
            elif adamw_weight_decay is not None:
                group["weight_decay"] = adamw_weight_decay
            add(group, sel, target)
    return groups


#: What :meth:`QMuon.add_param_group` routes by in an optimizer built from groups (no
#: ``router``): the default rules, by shape and label (set here: this module builds on QMuon's).
QMuon.default_router = ModelRouting(None)


def build_optimizer(
    model: nn.Module,
    config: QMuonConfig | Mapping[str, Any] | None = None,
    *,
    lr: float | None = None,
    weight_decay: float | None = None,
    momentum: float | None = None,
    state_format: str | None = None,
    adamw_lr: float | None = None,
    adamw_weight_decay: float | None = None,
    adamw_state_format: str | None = None,
    bf16_update: str | None = None,
    gradient_release: bool | None = None,
    verbose: bool = False,
    **sections: Any,
) -> QMuon:
    """Route ``model``'s parameters with the rule table and build one :class:`QMuon`.

        opt = qmuon.build_optimizer(model)                                   # int8 Muon + int8 AdamW
        opt = qmuon.build_optimizer(model, lr=0.02, state_format="grasp4", gradient_release=True)
        opt = qmuon.build_optimizer(model, newton_schulz={"dtype": "fp32"}, routing={"fused_parts": {...}})

    The options are :class:`~qmuon.QMuonConfig`'s: the common ones as keywords (``None``: the
    config's), the sections (``newton_schulz``, ``update``, ``state``, ``safety``, ``routing``) as
    keywords holding a section or a dict of its fields, and ``config`` for a whole configuration
    (the keywords are laid over it). A misspelled option raises :class:`~qmuon.core.config.ConfigError`
    naming the closest valid one.

    Groups, each with ``param_names`` and a ``name`` (``muon``, ``muon_<layout>``, ``adamw``,
    ``adamw_no_decay``: :func:`routed_groups`; Lightning's ``LearningRateMonitor`` logs ``lr-QMuon/muon``,
    ...): one Muon group for plain ``(out, in)`` matrices, one Muon group per distinct layout (``parts``,
    ``parts_axis``, ``orientation``, ``parts_interleaved``, ``bank_dims``; see :func:`route_parameters`;
    ``routing.bank_state_format`` sets the momentum format of the bank groups, which need a row-local
    one), one AdamW group and one AdamW group without weight decay. The routing table is logged on rank 0
    (the ``qmuon`` logger at INFO: ``logging.basicConfig(level=logging.INFO)`` shows it) and printed
    there too when ``verbose``; nothing is printed by default. It is also kept as
    ``optimizer.routing``, and the routing itself as ``optimizer.router`` (:class:`ModelRouting`), so
    groups added later (``optimizer.add_param_group``) are routed by the same rules.

    ``gradient_release=True`` steps each parameter inside backward as soon as its gradient is
    complete and frees the gradient (:mod:`qmuon.optim.release`; ``optimizer.step()`` and
    ``zero_grad()`` keep working).

    ``qk_clip={"tau": 100}`` measures every attention head's largest logit in the forward pass and
    rescales the W_q / W_k rows of the heads over ``tau`` after each step (MuonClip;
    :mod:`qmuon.optim.qk_clip`, ``optimizer.qk_clip``), and caps the queries of a forward whose
    logits exceed ``tau`` (``forward_cap``, on by default); a model whose attention it cannot
    measure is refused here.
    """
    cfg = QMuonConfig.from_kwargs(
        config, lr=lr, weight_decay=weight_decay, momentum=momentum, state_format=state_format, adamw_lr=adamw_lr,
        adamw_weight_decay=adamw_weight_decay, adamw_state_format=adamw_state_format, bf16_update=bf16_update,
        gradient_release=gradient_release, **sections)
    # QK-clip needs attention it can measure: refused here, before anything changes.
    qk_layers = find_attention(model) if cfg.qk_clip.tau is not None else None
    routing = cfg.routing
    rules, fused_parts, orientations, banks = routing.rules, routing.fused_parts, routing.orientations, routing.banks
    bank_state_format = routing.bank_state_format
    decisions = route_parameters(model, rules, fused_parts, orientations, banks, routing.per_head)
    plain_layout = (None, 0, "out_in", False, 0)
    muon = [d for d in decisions if d.target == "muon" and d.layout == plain_layout]
    groups = routed_groups([d for d in decisions if d.target != "frozen"], adamw_weight_decay=cfg.adamw_weight_decay,
                           bank_state_format=bank_state_format)
    by_layout = {d.layout for d in decisions if d.target == "muon" and d.layout != plain_layout}
    if not groups:
        raise ValueError("the model has no trainable parameters")
    if not muon and not by_layout:
        log.warning("build_optimizer: no parameter was routed to Muon; QMuon will run AdamW only")
    # Release hooks the model's parameters: attached below, by the one place that knows the model.
    opt = QMuon(groups, config=cfg.replace(gradient_release=False, safety={"release_clip_norm": None},
                                           qk_clip={"tau": None}))
    opt.config = cfg
    for d in decisions:
        d.param = None
    opt.routing = decisions  # type: ignore[attr-defined]
    opt.router = ModelRouting(model, rules, fused_parts, orientations, banks, bank_state_format, routing.per_head)
    if cfg.gradient_release:
        attach_gradient_release(opt, clip_norm=cfg.safety.release_clip_norm)
    if qk_layers is not None:  # a step post-hook: after release's hooks and optimizer.step()
        attach_qk_clip(opt, model, cfg.qk_clip.tau, qk_layers, forward_cap=cfg.qk_clip.forward_cap)
    table = format_routing_table(decisions) + "\n" + describe_auto_choices(cfg, decisions, _device_of(model))
    if _is_rank_zero():
        log.info("QMuon parameter routing:\n%s", table)
        if verbose:
            print(f"QMuon parameter routing:\n{table}")
    return opt


def _is_rank_zero() -> bool:
    dist = torch.distributed
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
