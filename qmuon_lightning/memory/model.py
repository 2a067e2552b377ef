"""The accounting model: per :class:`Setup`, the bytes of weights, gradients, optimizer state and
step temporaries of one training step of a routed model (see the package docstring)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from qmuon.core.config import ConfigError, QMuonConfig
from qmuon.core.newton_schulz import resolve_ns_dtype
from qmuon.optim.routing import RouteDecision, route_parameters
from qmuon.quant import adamw as qadamw
from qmuon.quant import state as qstate
from .paths import (
    _itemsize,
    _uses_foreach,
    adamw_chunked_step_bytes,
    adamw_phase_bytes,
    ns_phase_bytes,
    qmuon_muon_phase_bytes,
    torch_muon_phase_bytes,
)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: 0-d fp32 ``step`` tensor kept per parameter by torch.optim.AdamW and by QMuon's groups.


STEP_BYTES = 4


@dataclass(frozen=True)
class Setup:
    """One optimizer configuration.

    Args:
        label: the row name in tables.
        optimizer: ``"adamw"`` (``torch.optim.AdamW`` on every parameter), ``"torch_muon"``
            (``torch.optim.Muon`` on the Muon-routed matrices + ``torch.optim.AdamW`` on the rest),
            ``"qmuon"`` (:func:`~qmuon_lightning.build_optimizer`).
        options: QMuon options (:class:`~qmuon.QMuonConfig`'s, e.g. ``state_format``,
            ``adamw_state_format``, ``bf16_update``, ``gradient_release``).
        weights: ``"fp32"`` or ``"bf16"`` (``model.to(torch.bfloat16)``; gradients follow).
    """

    label: str
    optimizer: str = "qmuon"
    options: Mapping[str, Any] = field(default_factory=dict)
    weights: str = "fp32"

    @property
    def weight_dtype(self) -> torch.dtype:
        return _DTYPES[self.weights]

    @property
    def gradient_release(self) -> bool:
        return self.optimizer == "qmuon" and self.config().gradient_release

    def missing(self) -> list[str]:
        """What is wrong with the setup (empty: it can be built and estimated)."""
        if self.optimizer not in ("adamw", "torch_muon", "qmuon"):
            return [f"optimizer {self.optimizer!r}"]
        if self.weights not in _DTYPES:
            return [f"weights {self.weights!r}"]
        if self.optimizer != "qmuon":
            return []
        try:
            self.config()
        except ConfigError as e:
            return [str(e)]
        return []

    def config(self) -> QMuonConfig:
        return QMuonConfig.from_kwargs(self.options)


#: The configurations ``qmuon-estimate`` and the memory benchmark compare (issue 19). Setups whose
#: options this installation does not have yet are reported as unavailable, not guessed.


STANDARD_SETUPS: tuple[Setup, ...] = (
    Setup("AdamW", "adamw"),
    Setup("torch.Muon + AdamW", "torch_muon"),
    Setup("QMuon int8", "qmuon", {"state_format": "int8", "adamw_state_format": "fp32"}),
    Setup("QMuon grasp4", "qmuon", {"state_format": "grasp4", "adamw_state_format": "fp32"}),
    Setup("int8 + int8 AdamW", "qmuon", {"state_format": "int8", "adamw_state_format": "int8"}),
    Setup("int8 + int8 AdamW + release", "qmuon",
          {"state_format": "int8", "adamw_state_format": "int8", "gradient_release": True}),
    Setup("grasp4 + int4 AdamW + release", "qmuon",
          {"state_format": "grasp4", "adamw_state_format": "int4", "gradient_release": True}),
    Setup("int8 + int8 AdamW + bf16 stochastic", "qmuon",
          {"state_format": "int8", "adamw_state_format": "int8", "bf16_update": "stochastic"}, "bf16"),
    Setup("int8 + int8 AdamW + bf16 ecc8", "qmuon",
          {"state_format": "int8", "adamw_state_format": "int8", "bf16_update": "ecc8"}, "bf16"),
    Setup("int8 + int8 AdamW + stochastic + release", "qmuon",
          {"state_format": "int8", "adamw_state_format": "int8", "bf16_update": "stochastic",
           "gradient_release": True}, "bf16"),
    Setup("grasp4 + int4 AdamW + stochastic + release", "qmuon",
          {"state_format": "grasp4", "adamw_state_format": "int4", "bf16_update": "stochastic",
           "gradient_release": True}, "bf16"),
)


@dataclass(frozen=True)
class ParamInfo:
    """One trainable parameter as the optimizer sees it."""

    name: str
    shape: tuple[int, ...]
    target: str  # "muon", "adamw", "adamw_no_decay" (routing), "frozen"
    parts: tuple[int, ...] | None = None
    parts_axis: int = 0
    orientation: str = "out_in"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        return int(self.shape[0]) if self.shape else 1

    @property
    def cols(self) -> int:
        return math.prod(self.shape[1:]) if self.shape else 1

    def matrices(self) -> list[tuple[int, int, bool]]:
        """The ``(rows, cols, transposed)`` blocks Newton-Schulz runs on (fused parts split)."""
        rows, cols = self.rows, self.cols
        sizes = self.parts or ((rows,) if self.parts_axis == 0 else (cols,))
        t = self.orientation == "in_out"
        if self.parts_axis == 0:
            return [(n, cols, t) for n in sizes]
        return [(rows, n, t) for n in sizes]


@dataclass(frozen=True)
class Inventory:
    params: tuple[ParamInfo, ...]
    buffer_numels: tuple[tuple[int, torch.dtype], ...]  # (numel, dtype) of each floating / other buffer

    @property
    def n_params(self) -> int:
        return sum(p.numel for p in self.params if p.target != "frozen")

    @property
    def n_muon(self) -> int:
        return sum(p.numel for p in self.params if p.target == "muon")

    def of(self, *targets: str) -> list[ParamInfo]:
        return [p for p in self.params if p.target in targets]


def parameter_inventory(model: nn.Module, rules: Any = None, fused_parts: Mapping[str, Any] | None = None,
                        orientations: Mapping[str, str] | None = None) -> Inventory:
    """The routed parameters of ``model`` (any device; build it on ``meta`` to allocate nothing)
    and its buffers, in model order (the order the optimizers step them)."""
    decisions: list[RouteDecision] = route_parameters(model, rules, fused_parts, orientations)
    params = tuple(ParamInfo(d.name, tuple(int(s) for s in d.shape), d.target, d.parts, d.parts_axis, d.orientation)
                   for d in decisions)
    bufs = tuple((b.numel(), b.dtype) for b in model.buffers())
    return Inventory(params, bufs)


@dataclass
class MemoryEstimate:
    """Bytes of one training step of one :class:`Setup` (activations aside)."""

    setup: Setup
    n_params: int
    n_muon: int
    weights: int = 0
    buffers: int = 0
    grads: int = 0
    state: int = 0
    temporaries: int = 0
    #: which phase of the step holds the peak, and the temporaries of every phase
    peak_phase: str = ""
    phases: dict[str, int] = field(default_factory=dict)
    #: state split: {"muon momentum": .., "adamw moments": .., "weight correction": .., "step": ..}
    state_parts: dict[str, int] = field(default_factory=dict)
    available: bool = True
    missing: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """The step's peak: weights + buffers + grads + state + temporaries."""
        return self.weights + self.buffers + self.grads + self.state + self.temporaries

    @property
    def bytes_per_param(self) -> float:
        return self.total / max(1, self.n_params)

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.setup.label, "available": self.available, "missing": self.missing,
                "n_params": self.n_params, "n_muon": self.n_muon, "weights": self.weights, "buffers": self.buffers,
                "grads": self.grads, "state": self.state, "temporaries": self.temporaries, "total": self.total,
                "bytes_per_param": self.bytes_per_param, "peak_phase": self.peak_phase, "phases": dict(self.phases),
                "state_parts": dict(self.state_parts)}


def _weight_state_nbytes(p: ParamInfo, dtype: torch.dtype, bf16_update: str | None) -> int:
    """Bytes of the weight-correction state ``bf16_update`` keeps for a parameter stored in ``dtype``
    (``core.apply.weight_state_init`` on a meta tensor: the rule's own tensors)."""
    if dtype == torch.float32 or bf16_update is None:
        return 0
    return _weight_state_nbytes_of(p.shape, dtype, bf16_update)


@functools.lru_cache(maxsize=4096)
def _weight_state_nbytes_of(shape: tuple[int, ...], dtype: torch.dtype, bf16_update: str) -> int:
    from qmuon.core import apply as core_apply

    st = core_apply.weight_state_init(torch.empty(shape, dtype=dtype, device="meta"), bf16_update)
    return sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))


def _normuon_state_nbytes(p: ParamInfo) -> int:
    """NorMuon's per-output-row second moment of one Muon parameter (``variant="normuon"``): fp32,
    one value per output row of each of its matrices (:func:`qmuon.core.variants.row_moment_nbytes`)."""
    from qmuon.core.variants import row_moment_nbytes

    return row_moment_nbytes(p.shape, p.parts, p.parts_axis, p.orientation)


def _adamw_state_nbytes(p: ParamInfo, dtype: torch.dtype, family: str | None) -> int:
    """AdamW state of one parameter: ``torch.optim.AdamW``'s ``exp_avg`` and ``exp_avg_sq``
    (``zeros_like(param)``) and its 0-d ``step`` (``family=None``); or QMuon's AdamW state in moment
    family ``family`` (``adamw_state_format``): the tensors
    :func:`qmuon.quant.adamw.init_adamw_state` creates, on the meta device."""
    if family is None:
        return 2 * p.numel * _itemsize(dtype) + STEP_BYTES
    return _quantized_adamw_nbytes(family, tuple(p.shape))


@functools.lru_cache(maxsize=4096)
def _quantized_adamw_nbytes(family: str, shape: tuple[int, ...]) -> int:
    st = qadamw.init_adamw_state(family, shape, shape, torch.device("meta"))
    return sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))


#: :func:`adamw_chunked_step_bytes` once per shape: a budget search asks for the same shapes thousands of times.
_chunked_step_bytes = functools.lru_cache(maxsize=4096)(adamw_chunked_step_bytes)


def _per_layout(fn: Callable[[ParamInfo], Any]) -> Callable[[ParamInfo], Any]:
    """``fn`` of a parameter computed once per shape and layout (``fn`` must read nothing else): a
    deep model repeats each layer's parameters, thousands of times in :func:`largest_within`."""
    cache: dict[tuple, Any] = {}

    def of(p: ParamInfo) -> Any:
        key = (p.shape, p.parts, p.parts_axis, p.orientation)
        if key not in cache:
            cache[key] = fn(p)
        return cache[key]

    return of


def _adamw_groups(inv: Inventory, optimizer: str) -> list[list[ParamInfo]]:
    """The AdamW parameter groups in step order: ``torch.optim.AdamW`` on everything (matrices
    with decay, then 1-D without, as benchmarks/_common.py builds it), or the routed AdamW groups."""
    live = [p for p in inv.params if p.target != "frozen"]
    if optimizer == "adamw":
        return [[p for p in live if len(p.shape) >= 2], [p for p in live if len(p.shape) < 2]]
    return [inv.of("adamw"), inv.of("adamw_no_decay")]


def _muon_groups(inv: Inventory) -> list[list[ParamInfo]]:
    """build_optimizer's Muon groups: plain ``(out, in)`` matrices, then one per layout."""
    plain = [p for p in inv.of("muon") if not p.parts and p.orientation == "out_in"]
    by_layout: dict[tuple, list[ParamInfo]] = {}
    for p in inv.of("muon"):
        if p.parts or p.orientation != "out_in":
            by_layout.setdefault((p.parts, p.parts_axis, p.orientation), []).append(p)
    return [g for g in [plain, *by_layout.values()] if g]


def estimate(model_or_inventory: nn.Module | Inventory, setup: Setup, *, device: str = "cuda") -> MemoryEstimate:
    """Bytes of one training step of ``setup`` on the model (see the module docstring).

    ``device``: where the step runs; it decides torch's AdamW path (foreach on CUDA, per tensor on
    CPU) and QMuon's NS dtype and batch cap (``ns_dtype="auto"``: bf16 on CUDA, per CPU otherwise).
    """
    inv = model_or_inventory if isinstance(model_or_inventory, Inventory) else parameter_inventory(model_or_inventory)
    est = MemoryEstimate(setup, inv.n_params, inv.n_muon)
    missing = setup.missing()
    if missing:
        est.available, est.missing = False, missing
        return est
    wdtype = setup.weight_dtype
    wb = _itemsize(wdtype)
    live = [p for p in inv.params if p.target != "frozen"]
    est.weights = sum(p.numel * wb for p in inv.params)
    est.buffers = sum(n * (wb if dt.is_floating_point else _itemsize(dt)) for n, dt in inv.buffer_numels)
    foreach = _uses_foreach(device)
    phases: dict[str, int] = {}
    parts = {"muon momentum": 0, "normuon second moment": 0, "adamw moments": 0, "weight correction": 0}
    per_param_step: dict[str, int] = {}  # gradient release: each parameter's own step transient

    if setup.optimizer == "adamw":
        groups = _adamw_groups(inv, "adamw")
        parts["adamw moments"] = sum(_adamw_state_nbytes(p, wdtype, None) for p in live)
        phases["adamw"] = adamw_phase_bytes([[p.numel for p in g] for g in groups], wb, foreach=foreach)
    elif setup.optimizer == "torch_muon":
        muon = inv.of("muon")
        parts["muon momentum"] = sum(p.numel * wb for p in muon)  # momentum_buffer = zeros_like(grad), no step
        parts["adamw moments"] = sum(_adamw_state_nbytes(p, wdtype, None) for p in live if p.target != "muon")
        phases["torch.Muon"] = torch_muon_phase_bytes([(p.rows, p.cols) for p in muon], wb)
        phases["adamw"] = adamw_phase_bytes([[p.numel for p in g] for g in _adamw_groups(inv, "torch_muon")], wb,
                                            foreach=foreach)
    else:
        cfg = setup.config()
        opts_dict = cfg.muon_group_defaults()
        fmt = qstate.get_format(cfg.state_format)
        opts = qstate.format_options(opts_dict)
        # QMuon's AdamW groups: the moment family of adamw_state_format through the per-tensor step,
        # or (installations without it) torch's functional AdamW with torch's state
        adamw_fmt = cfg.adamw_state_format
        bf16_update = cfg.bf16_update
        muon, adamw = inv.of("muon"), inv.of("adamw", "adamw_no_decay")
        momentum = _per_layout(lambda p: fmt.nbytes(p.rows, p.cols, opts) + STEP_BYTES)
        parts["muon momentum"] = sum(momentum(p) for p in muon)
        if cfg.update.variant == "normuon":
            parts["normuon second moment"] = sum(map(_per_layout(_normuon_state_nbytes), muon))
        adamw_state = _per_layout(lambda p: _adamw_state_nbytes(p, wdtype, adamw_fmt))
        parts["adamw moments"] = sum(adamw_state(p) for p in adamw)
        weight_state = _per_layout(lambda p: _weight_state_nbytes(p, wdtype, bf16_update))
        parts["weight correction"] = sum(weight_state(p) for p in live)
        ns_dtype = resolve_ns_dtype(cfg.newton_schulz.dtype, torch.device(device))
        nsb = _itemsize(ns_dtype)
        matrices = [m for ms in map(_per_layout(ParamInfo.matrices), muon) for m in ms]
        phases["muon momentum"] = qmuon_muon_phase_bytes(_muon_groups(inv), lambda: opts, fmt, wb)
        phases["adamw"] = _qmuon_adamw_phase(inv, wb, wdtype, adamw_fmt, foreach)
        phases["newton-schulz"] = ns_phase_bytes(matrices, nsb, wb, device=device)
        if setup.gradient_release:
            def muon_step(p: ParamInfo) -> int:
                ws = fmt.update_workspace_nbytes(p.rows, p.cols, opts, wb) + p.rows * math.ceil(p.cols / opts.block_size) * 4
                return max(ws, ns_phase_bytes(p.matrices(), nsb, wb, device=device))

            muon_step_of = _per_layout(muon_step)
            adamw_step_of = _per_layout(lambda p: _qmuon_adamw_phase_one(p, wb, wdtype, adamw_fmt, foreach))
            for p in muon:
                per_param_step[p.name] = muon_step_of(p)
            for p in adamw:
                per_param_step[p.name] = adamw_step_of(p)

    est.state_parts = {k: v for k, v in parts.items() if v}
    est.state = sum(parts.values())
    est.phases = phases
    if setup.gradient_release:
        # weights + state + (one gradient + its own step's transient), the largest such pair
        best = max(live, key=lambda p: p.numel * wb + per_param_step.get(p.name, 0))
        est.grads = best.numel * wb
        est.temporaries = per_param_step.get(best.name, 0)
        est.peak_phase = f"backward hook of {best.name}"
    else:
        est.grads = sum(p.numel * wb for p in live)
        est.peak_phase, est.temporaries = max(phases.items(), key=lambda kv: kv[1]) if phases else ("", 0)
    return est


def _qmuon_adamw_phase(inv: Inventory, wb: int, wdtype: torch.dtype, family: str | None, foreach: bool) -> int:
    """QMuon's AdamW groups: one parameter at a time (:func:`adamw_chunked_step_bytes`), or, in an
    installation without :mod:`qmuon.core.adamw`, torch's functional AdamW
    (:func:`adamw_phase_bytes`)."""
    groups = _adamw_groups(inv, "qmuon")
    if family is None:
        return adamw_phase_bytes([[p.numel for p in g] for g in groups], wb, foreach=foreach)
    return max((_chunked_step_bytes(p.shape, family, wdtype) for g in groups for p in g), default=0)


def _qmuon_adamw_phase_one(p: ParamInfo, wb: int, wdtype: torch.dtype, family: str | None, foreach: bool) -> int:
    """The AdamW step of one parameter on its own (gradient release)."""
    if family is None:
        return adamw_phase_bytes([[p.numel]], wb, foreach=foreach)
    return _chunked_step_bytes(p.shape, family, wdtype)


def estimate_all(model_or_inventory: nn.Module | Inventory, setups: Sequence[Setup] = STANDARD_SETUPS, *,
                 device: str = "cuda") -> list[MemoryEstimate]:
    inv = model_or_inventory if isinstance(model_or_inventory, Inventory) else parameter_inventory(model_or_inventory)
    return [estimate(inv, s, device=device) for s in setups]


def largest_within(inventory_at: Callable[[int], Inventory | nn.Module], setup: Setup, budget: int, *,
                   start: int = 1, limit: int = 1 << 16, device: str = "cuda") -> tuple[int, MemoryEstimate | None]:
    """The largest size ``k`` in ``[start, limit]`` (``inventory_at(k)``: the inventory, or a
    meta-device model, of size ``k``, e.g. ``k`` layers; :func:`depth_inventories` makes one without
    building deep models) whose step fits ``budget`` bytes, and its estimate; ``(0, None)`` when even
    ``start`` does not fit.

    The step grows with ``k``, so the answer is the ``k`` that fits whose ``k + 1`` does not. An
    estimate costs time linear in ``k`` (thousands of layers for a small model under a large
    budget), so the sizes probed are few: the total is nearly affine in ``k`` (each layer adds the
    same bytes), so each round probes the size the known totals predict and the one after it (a
    right prediction ends the search), extrapolating from the two largest fitting sizes until a
    size that does not fit is known; a round that does not halve the bracket is followed by a
    bisection (doubling while no size above is known), so a total far from affine still costs
    no more than a doubling search and bisection."""

    def probe(k: int) -> MemoryEstimate:
        return estimate(inventory_at(k), setup, device=device)

    def fits(e: MemoryEstimate) -> bool:
        return e.available and e.total <= budget

    first = probe(start)
    if not fits(first):
        return 0, None
    lo, lo_e = start, first
    below: tuple[int, int] | None = None  # (size, total) of the fitting size before lo: the slope
    hi, hi_total = limit + 1, None  # the smallest size known not to fit (limit + 1: none known)
    safe = True  # the next round bisects (or doubles)
    while hi - lo > 1:
        if safe:
            ks = [(lo + hi) // 2 if hi_total is not None or hi <= 2 * lo else 2 * lo]
        else:
            if hi_total is not None:
                a = lo + (budget - lo_e.total) * (hi - lo) // (hi_total - lo_e.total)
            elif below is not None and lo_e.total > below[1]:
                a = lo + (budget - lo_e.total) * (lo - below[0]) // (lo_e.total - below[1])
            else:
                a = hi - 1  # the total does not grow: the largest size left
            a = min(max(a, lo), hi - 1)
            ks = [k for k in (a, a + 1) if lo < k < hi]
        width = hi - lo
        for k in ks:
            e = probe(k)
            if fits(e):
                below, lo, lo_e = (lo, lo_e.total), k, e
            else:
                hi, hi_total = k, (e.total if e.available else None)
                break
        safe = not safe and (hi - lo) * 2 > width
    return lo, lo_e


def _layer_key(p: ParamInfo) -> tuple:
    """A parameter's identity up to its layer index (digits in the name dropped)."""
    return ("".join(c for c in p.name.split("#")[0] if not c.isdigit()), p.shape, p.target, p.parts, p.parts_axis, p.orientation)


def depth_inventories(build: Callable[[int], nn.Module], base: int = 1) -> Callable[[int], Inventory]:
    """``k -> Inventory`` of the model ``build(k)`` (``k`` repeated layers), from two small builds:
    the models at ``base`` and ``base + 1`` layers share everything but one layer's parameters,
    which the inventory at ``k`` repeats ``k - base`` times in place (model order kept, so the
    step's per-tensor temporaries see the same neighbours). A model of thousands of layers is never
    built; ``tests/test_memory_estimate.py`` checks the result against a real build."""
    a = parameter_inventory(build(base))
    b = parameter_inventory(build(base + 1))
    extra = len(b.params) - len(a.params)
    p = 0
    while p < len(a.params) and _layer_key(a.params[p]) == _layer_key(b.params[p]):
        p += 1
    layer = b.params[p: p + extra]
    if extra <= 0 or [_layer_key(x) for x in b.params[p + extra:]] != [_layer_key(x) for x in a.params[p:]]:
        raise ValueError("the model does not grow by one repeated layer per step of its depth argument; "
                         "estimate each depth by building it")
    buf_extra = list(b.buffer_numels[len(a.buffer_numels):]) if len(b.buffer_numels) >= len(a.buffer_numels) else []

    reps: list[ParamInfo] = []  # the repeated layers' parameters, renamed, grown as deeper sizes are asked

    def at(k: int) -> Inventory:
        if k < base:
            return parameter_inventory(build(k))
        for i in range(len(reps) // len(layer), k - base):
            reps.extend(dataclasses.replace(x, name=f"{x.name}#{i}") for x in layer)
        return Inventory(a.params[:p] + tuple(reps[:(k - base) * len(layer)]) + a.params[p:],
                         a.buffer_numels + tuple(buf_extra) * (k - base))

    return at


def with_options(setup: Setup, **changes: Any) -> Setup:
    return dataclasses.replace(setup, **changes)


#: ``torch.optim.AdamW`` / ``torch.optim.Muon`` settings of the compared baselines (build_optimizer's
#: AdamW defaults; weight decay 0.1 on matrices, 0 on 1-D tensors).
