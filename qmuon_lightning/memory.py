"""Will it fit? The bytes of one training step, per optimizer configuration, from a model's shapes.

One accounting model, used by ``qmuon-estimate``, ``benchmarks/bench_train_memory.py`` and the
tests that hold it to PyTorch's ``MemTracker``. It reads a model built on the meta device (no
memory is allocated), routes it with :func:`~qmuon_lightning.optim.routing.route_parameters` (the
split :func:`~qmuon_lightning.build_optimizer` makes), and counts, per :class:`Setup`:

* **weights**: every parameter in the setup's weight dtype, plus the model's buffers;
* **grads**: one gradient per trainable parameter in its dtype; with gradient release only the
  largest single gradient is in flight (each is stepped and freed inside backward);
* **optimizer state**: what the optimizer keeps between steps, from the formats themselves:
  Muon momentum from the quant registry (:meth:`StateFormat.nbytes
  <qmuon_lightning.quant.formats.base.StateFormat.nbytes>`, the format's own tensors on the meta
  device), the bf16 weight-correction state from
  :func:`qmuon_lightning.core.apply.weight_state_init`, AdamW moments as ``torch.optim.AdamW``
  stores them (``zeros_like(param)`` twice) or in the group's AdamW state format, and each
  optimizer's 0-d ``step`` tensors;
* **step temporaries**: the largest transient working set of ``optimizer.step()``, from a model of
  what each step path allocates (:func:`adamw_phase_bytes`, :func:`torch_muon_phase_bytes`,
  :func:`qmuon_muon_phase_bytes`, :func:`ns_phase_bytes`; the formulas are in their docstrings).

The step's phases run one after the other (QMuon: Muon momentum per group, AdamW groups, then the
Newton-Schulz batches; torch.optim.Muon then torch.optim.AdamW), so the step's peak is
``weights + grads + state + max(phase temporaries)``; with gradient release it is
``weights + state + max over parameters (its gradient + its own step's temporaries)``.
Activations are not part of it: they are freed before ``optimizer.step()`` and, with release, the
estimate holds for a tiny batch (add your activations; ``models.lm_module.memory_budget`` has an
estimate for DecoderLM).

What is counted is what PyTorch's ``MemTracker`` sees: tensor storages created through the
dispatcher. Scratch a compiled kernel allocates internally, the CUDA context and the caching
allocator's slack are not part of it (leave ~1-3 GiB of a budget for them on a GPU).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .core import pipeline
from .core.config import QMuonConfig
from .core.newton_schulz import resolve_ns_dtype
from .optim.routing import RouteDecision, route_parameters
from .quant import state as qstate

__all__ = [
    "Setup",
    "MemoryEstimate",
    "ParamInfo",
    "STANDARD_SETUPS",
    "parameter_inventory",
    "estimate",
    "estimate_all",
    "largest_within",
    "depth_inventories",
    "adamw_phase_bytes",
    "torch_muon_phase_bytes",
    "qmuon_muon_phase_bytes",
    "ns_phase_bytes",
    "parse_bytes",
    "format_bytes",
    "format_table",
]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: 0-d fp32 ``step`` tensor kept per parameter by torch.optim.AdamW and by QMuon's groups.
STEP_BYTES = 4


# ------------------------------------------------------------------------------------------ setups
@dataclass(frozen=True)
class Setup:
    """One optimizer configuration.

    Args:
        label: the row name in tables.
        optimizer: ``"adamw"`` (``torch.optim.AdamW`` on every parameter), ``"torch_muon"``
            (``torch.optim.Muon`` on the Muon-routed matrices + ``torch.optim.AdamW`` on the rest),
            ``"qmuon"`` (:func:`~qmuon_lightning.build_optimizer`).
        options: QMuon arguments (:class:`~qmuon_lightning.QMuonConfig` fields, e.g.
            ``state_format``, ``adamw_state_format``, ``bf16_update``) and ``gradient_release``.
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
        return bool(self.options.get("gradient_release", False))

    @property
    def qmuon_options(self) -> dict[str, Any]:
        """The options that are QMuonConfig fields (``gradient_release`` is build_optimizer's)."""
        return {k: v for k, v in self.options.items() if k != "gradient_release"}

    def missing(self) -> list[str]:
        """What this installation lacks to build the setup (empty: it can be built and estimated)."""
        if self.optimizer not in ("adamw", "torch_muon", "qmuon"):
            return [f"optimizer {self.optimizer!r}"]
        if self.weights not in _DTYPES:
            return [f"weights {self.weights!r}"]
        if self.optimizer != "qmuon":
            return []
        fields = set(QMuonConfig.field_names())
        out = [f"QMuon option {k!r}" for k in self.qmuon_options if k not in fields]
        if self.gradient_release and not _release_supported():
            out.append("build_optimizer(gradient_release=True)")
        if not out:
            try:
                QMuonConfig.from_kwargs(**self.qmuon_options)
            except (TypeError, ValueError) as e:
                out.append(str(e))
        return out

    def config(self) -> QMuonConfig:
        return QMuonConfig.from_kwargs(**self.qmuon_options)


def _release_supported() -> bool:
    import inspect

    from .optim import routing

    return "gradient_release" in inspect.signature(routing.build_optimizer).parameters or (
        "gradient_release" in QMuonConfig.field_names())


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


# ------------------------------------------------------------------------------------ inventory
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


# ------------------------------------------------------------------------------------ results
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


# ------------------------------------------------------------------------------------ step paths
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _uses_foreach(device: str) -> bool:
    """Whether ``torch.optim.AdamW`` (``foreach=None``) takes its foreach path on ``device``:
    torch defaults to foreach where its foreach kernels are supported (CUDA, XPU, ...), and to
    the per-tensor loop elsewhere (CPU)."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return torch.device(device).type in _get_foreach_kernels_supported_devices()


def adamw_phase_bytes(groups: Sequence[Sequence[int]], elem_bytes: int, *, foreach: bool) -> int:
    """Largest transient of ``torch.optim.AdamW`` (``foreach=None``, ``capturable=False``), whose
    functional form QMuon's AdamW groups call too. ``groups``: element counts per parameter
    group, in step order; ``elem_bytes``: bytes per element of the parameters (state follows them).

    * foreach (CUDA): ``torch._foreach_sqrt(exp_avg_sqs)`` materializes ``sqrt(v)`` of the whole
      group at once, then divides and adds in place: one copy of the group (per device and dtype).
    * per tensor (CPU): ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` holds
      ``sqrt(v)`` and its quotient together (2 copies of the tensor), while the previous tensor's
      ``denom`` is still bound (the name is rebound only after the new one exists): tensor ``i``
      peaks at ``numel[i-1] + 2 numel[i]`` elements within a group.
    """
    peak = 0
    for sizes in groups:
        if not sizes:
            continue
        if foreach:
            peak = max(peak, sum(sizes) * elem_bytes)
            continue
        prev = 0
        for n in sizes:
            peak = max(peak, (prev + 2 * n) * elem_bytes)
            prev = n
    return peak


def torch_muon_phase_bytes(matrices: Iterable[tuple[int, int]], elem_bytes: int) -> int:
    """Largest transient of ``torch.optim.Muon`` (one matrix at a time; ``_single_tensor_muon``):
    ``update = grad.lerp(buf, momentum)`` (``elem_bytes n``), its bf16 copy (``2 n``; none when the
    gradient is bf16 already), and in each Newton-Schulz iteration the new iterate (``2 n``) while
    the old one and the bf16 Gram matrix and its polynomial (``2 r^2`` each, ``r = min(rows, cols)``)
    are alive: ``elem_bytes n + (2 n if fp32) + 2 n + 4 r^2``."""
    peak = 0
    for rows, cols in matrices:
        n, r = rows * cols, min(rows, cols)
        copy = 2 * n if elem_bytes != 2 else 0
        peak = max(peak, elem_bytes * n + copy + 2 * n + 4 * r * r)
    return peak


def ns_phase_bytes(matrices: Sequence[tuple[int, int, bool]], ns_bytes: int, grad_bytes: int, *,
                   device: str, batch_budget: float = pipeline.DEFAULT_BATCH_BUDGET) -> int:
    """Largest transient of QMuon's Newton-Schulz phase (:func:`qmuon_lightning.core.pipeline.orthogonalize`).

    Matrices of one NS shape are stacked in batches of ``B = max(1, cap // (rows cols))``, ``cap``
    being ``batch_budget`` times the largest matrix (on CPU also at most
    :data:`~qmuon_lightning.core.pipeline.CPU_BATCH_MAX_ELEMENTS`). :func:`newton_schulz_folded
    <qmuon_lightning.core.newton_schulz.newton_schulz_folded>` of a batch holds the batch (a copy in
    the NS dtype, except for a lone matrix whose gradient has that dtype already), the iterate and
    its ping-pong buffer (``2 B n`` in the NS dtype) and the ``B x r x r`` Gram matrix and polynomial.
    """
    if not matrices:
        return 0
    budget = max(1, int(batch_budget * max(r * c for r, c, _ in matrices)))
    cap = min(budget, pipeline.CPU_BATCH_MAX_ELEMENTS) if torch.device(device).type == "cpu" else budget
    peak = 0
    shapes: dict[tuple[int, int, bool], int] = {}
    for rows, cols, t in matrices:
        key = (cols, rows, True) if t else (rows, cols, False)
        shapes[key] = shapes.get(key, 0) + 1
    for (rows, cols, transposed), count in shapes.items():
        n, r = rows * cols, min(rows, cols)
        b = min(count, max(1, cap // n))
        copied = not (b == 1 and not transposed and grad_bytes == ns_bytes)
        peak = max(peak, ns_bytes * b * ((3 if copied else 2) * n + 2 * r * r))
    return peak


def qmuon_muon_phase_bytes(groups: Sequence[Sequence[ParamInfo]], opts_of: Callable[[], qstate.FormatOptions],
                           fmt: qstate.StateFormat) -> int:
    """Largest transient of QMuon's momentum phase: per Muon group, the per-row-block sums of
    squares of every matrix of the group (fp32 ``rows x ceil(cols / block_size)``, alive until the
    group's NS items are made) plus the largest :meth:`~qmuon_lightning.quant.formats.base.StateFormat.update_workspace_nbytes`
    of one matrix (0 for the formats whose compiled kernels update in place)."""
    opts = opts_of()
    peak = 0
    for params in groups:
        sums = sum(p.rows * math.ceil(p.cols / opts.block_size) * 4 for p in params)
        ws = max((fmt.update_workspace_nbytes(p.rows, p.cols, opts) for p in params), default=0)
        peak = max(peak, sums + ws)
    return peak


# ------------------------------------------------------------------------------------ estimate
def _weight_state_nbytes(p: ParamInfo, dtype: torch.dtype, bf16_update: str | None) -> int:
    """Bytes of the weight-correction state ``bf16_update`` keeps for a parameter stored in ``dtype``
    (``core.apply.weight_state_init`` on a meta tensor: the rule's own tensors)."""
    if dtype == torch.float32 or bf16_update is None:
        return 0
    from .core import apply as core_apply

    st = core_apply.weight_state_init(torch.empty(p.shape, dtype=dtype, device="meta"), bf16_update)
    return sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))


def _adamw_state_nbytes(p: ParamInfo, dtype: torch.dtype, family: str | None) -> int:
    """AdamW state of one parameter: ``torch.optim.AdamW``'s ``exp_avg`` and ``exp_avg_sq``
    (``zeros_like(param)``) and its 0-d ``step`` (``family=None``); or QMuon's AdamW state in moment
    family ``family`` (``adamw_state_format``): the tensors
    :func:`qmuon_lightning.quant.adamw.init_adamw_state` creates, on the meta device."""
    if family is None:
        return 2 * p.numel * _itemsize(dtype) + STEP_BYTES
    qadamw = _quant_adamw()
    st = qadamw.init_adamw_state(family, p.shape, p.shape, torch.device("meta"))
    return sum(t.numel() * t.element_size() for t in st.values() if isinstance(t, torch.Tensor))


def _quant_adamw() -> Any:
    """:mod:`qmuon_lightning.quant.adamw` (the AdamW moment formats), when this installation has it."""
    try:
        from .quant import adamw as qadamw
    except ImportError:
        raise NotImplementedError("this qmuon_lightning has no AdamW state formats (adamw_state_format)") from None
    return qadamw


def _core_adamw() -> Any:
    """:mod:`qmuon_lightning.core.adamw` (QMuon's per-tensor, row-chunked AdamW step), or None where
    QMuon still calls torch's functional AdamW."""
    try:
        from .core import adamw as core_adamw
    except ImportError:
        return None
    return core_adamw


def adamw_chunked_step_bytes(shape: Sequence[int], family: str, weight_bytes: int) -> int:
    """Transient of QMuon's per-tensor AdamW step of one parameter
    (:func:`qmuon_lightning.core.adamw.adamw_param_step`): blocks of whole rows of at most
    ``DEFAULT_CHUNK_ELEMENTS`` elements, each with its fp32 update buffer (``4 c`` bytes, ``c`` the
    block's elements), plus, for dense moments, torch's ops on the block: ``sqrt(v)`` (``4 c``) and
    fp32 copies of bf16 moments and gradient (``4 c`` each); quantized moments are updated by the
    fused kernel in place. Writing a bf16 weight (:func:`qmuon_lightning.core.apply.apply_update_`)
    adds the block's fp32 weights (``4 c``)."""
    core_adamw, qadamw = _core_adamw(), _quant_adamw()
    rows, cols = qadamw.matrix_shape(shape)
    c = core_adamw.chunk_rows(rows, cols) * cols
    m_fmt, v_fmt = qadamw.moment_formats(family, shape)
    words = 1  # the fp32 update buffer
    if m_fmt.spec.kind.startswith("adamw_dense") and v_fmt.spec.kind.startswith("adamw_dense"):
        words += 1  # denom = sqrt(v)
        words += sum(1 for f in (m_fmt, v_fmt) if f.spec.dtype != torch.float32)
        words += 1 if weight_bytes != 4 else 0  # grad.float()
    if weight_bytes != 4:
        words += 1  # apply_update_: the block's weights in fp32
    return 4 * c * words


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
    parts = {"muon momentum": 0, "adamw moments": 0, "weight correction": 0}
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
        adamw_fmt = getattr(cfg, "adamw_state_format", None) if _core_adamw() is not None else None
        bf16_update = getattr(cfg, "bf16_update", None)
        for p in inv.of("muon"):
            parts["muon momentum"] += fmt.nbytes(p.rows, p.cols, opts) + STEP_BYTES
        for p in inv.of("adamw", "adamw_no_decay"):
            parts["adamw moments"] += _adamw_state_nbytes(p, wdtype, adamw_fmt)
        for p in live:
            parts["weight correction"] += _weight_state_nbytes(p, wdtype, bf16_update)
        ns_dtype = resolve_ns_dtype(cfg.ns_dtype, torch.device(device))
        nsb = _itemsize(ns_dtype)
        matrices = [m for p in inv.of("muon") for m in p.matrices()]
        phases["muon momentum"] = qmuon_muon_phase_bytes(_muon_groups(inv), lambda: opts, fmt)
        phases["adamw"] = _qmuon_adamw_phase(inv, wb, adamw_fmt, foreach)
        phases["newton-schulz"] = ns_phase_bytes(matrices, nsb, wb, device=device)
        if setup.gradient_release:
            for p in inv.of("muon"):
                ws = fmt.update_workspace_nbytes(p.rows, p.cols, opts) + p.rows * math.ceil(p.cols / opts.block_size) * 4
                per_param_step[p.name] = max(ws, ns_phase_bytes(p.matrices(), nsb, wb, device=device))
            for p in inv.of("adamw", "adamw_no_decay"):
                per_param_step[p.name] = _qmuon_adamw_phase_one(p, wb, adamw_fmt, foreach)

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


def _qmuon_adamw_phase(inv: Inventory, wb: int, family: str | None, foreach: bool) -> int:
    """QMuon's AdamW groups: one parameter at a time (:func:`adamw_chunked_step_bytes`), or, in an
    installation without :mod:`qmuon_lightning.core.adamw`, torch's functional AdamW
    (:func:`adamw_phase_bytes`)."""
    groups = _adamw_groups(inv, "qmuon")
    if family is None:
        return adamw_phase_bytes([[p.numel for p in g] for g in groups], wb, foreach=foreach)
    return max((adamw_chunked_step_bytes(p.shape, family, wb) for g in groups for p in g), default=0)


def _qmuon_adamw_phase_one(p: ParamInfo, wb: int, family: str | None, foreach: bool) -> int:
    """The AdamW step of one parameter on its own (gradient release)."""
    if family is None:
        return adamw_phase_bytes([[p.numel]], wb, foreach=foreach)
    return adamw_chunked_step_bytes(p.shape, family, wb)


def estimate_all(model_or_inventory: nn.Module | Inventory, setups: Sequence[Setup] = STANDARD_SETUPS, *,
                 device: str = "cuda") -> list[MemoryEstimate]:
    inv = model_or_inventory if isinstance(model_or_inventory, Inventory) else parameter_inventory(model_or_inventory)
    return [estimate(inv, s, device=device) for s in setups]


def largest_within(inventory_at: Callable[[int], Inventory | nn.Module], setup: Setup, budget: int, *,
                   start: int = 1, limit: int = 1 << 16, device: str = "cuda") -> tuple[int, MemoryEstimate | None]:
    """The largest size ``k`` (``inventory_at(k)``: the inventory, or a meta-device model, of size
    ``k``, e.g. ``k`` layers; :func:`depth_inventories` makes one without building deep models)
    whose step fits ``budget`` bytes, and its estimate; ``(0, None)`` when even ``start`` does not
    fit. The step grows with ``k``, so a doubling search then bisection finds it exactly."""

    def fits(k: int) -> MemoryEstimate | None:
        e = estimate(inventory_at(k), setup, device=device)
        return e if e.available and e.total <= budget else None

    if fits(start) is None:
        return 0, None
    lo, hi = start, start * 2
    while hi <= limit and fits(hi) is not None:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) is not None else (lo, mid)
    return lo, fits(lo)


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

    def at(k: int) -> Inventory:
        if k < base:
            return parameter_inventory(build(k))
        reps = [dataclasses.replace(x, name=f"{x.name}#{i}") for i in range(k - base) for x in layer]
        return Inventory(a.params[:p] + tuple(reps) + a.params[p:], a.buffer_numels + tuple(buf_extra) * (k - base))

    return at


# ------------------------------------------------------------------------------------ output
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """``"128GiB"``, ``"128 GB"``, ``"96gib"``, ``1e9`` -> bytes (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, (int, float)):
        return int(text)
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):] or "b"
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot read a memory size from {text!r}; write e.g. 128GiB, 96GB or 4096MiB")
    return int(float(num) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Human-readable, accelerate's style (``"1.23 GB"`` uses powers of 1024 there; so do we, as GiB)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_table(rows: Sequence[Sequence[str]], title: str = "") -> str:
    """A boxed table in the style of ``accelerate estimate-memory`` (title row, header row, body)."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    inner = sum(widths) + 3 * (len(widths) - 1)
    if title and len(title) > inner:
        widths[0] += len(title) - inner
        inner = len(title)
    bar = "┌" + "─" * (inner + 2) + "┐"
    out = [bar] if title else []
    if title:
        out.append("│ " + title.center(inner) + " │")
        out.append("├" + "┬".join("─" * (w + 2) for w in widths) + "┤")
    else:
        out.append("┌" + "┬".join("─" * (w + 2) for w in widths) + "┐")
    for i, r in enumerate(rows):
        cells = [str(c).ljust(w) if j == 0 else str(c).rjust(w) for j, (c, w) in enumerate(zip(r, widths))]
        out.append("│ " + " │ ".join(cells) + " │")
        if i == 0:
            out.append("├" + "┼".join("─" * (w + 2) for w in widths) + "┤")
    out.append("└" + "┴".join("─" * (w + 2) for w in widths) + "┘")
    return "\n".join(out)


def with_options(setup: Setup, **changes: Any) -> Setup:
    return dataclasses.replace(setup, **changes)


# ------------------------------------------------------------------------------------ measurement
#: ``torch.optim.AdamW`` / ``torch.optim.Muon`` settings of the compared baselines (build_optimizer's
#: AdamW defaults; weight decay 0.1 on matrices, 0 on 1-D tensors).
BASELINE_ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
BASELINE_ADAMW_WD = 0.1
BASELINE_MUON = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def build_optimizers(model: nn.Module, setup: Setup, **build_kwargs: Any) -> list[torch.optim.Optimizer]:
    """The optimizer(s) of ``setup`` on ``model`` (whose weights are already in ``setup.weights``):
    ``torch.optim.AdamW`` on every parameter; ``torch.optim.Muon`` on what ``route_parameters``
    sends to Muon plus ``torch.optim.AdamW`` on the rest; or :func:`~qmuon_lightning.build_optimizer`
    with the setup's options."""
    missing = setup.missing()
    if missing:
        raise ValueError(f"setup {setup.label!r} needs {', '.join(missing)}, which this qmuon_lightning does not have")
    if setup.optimizer == "adamw":
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        return [torch.optim.AdamW([{"params": decay, "weight_decay": BASELINE_ADAMW_WD},
                                   {"params": no_decay, "weight_decay": 0.0}], **BASELINE_ADAMW)]
    if setup.optimizer == "torch_muon":
        decisions = route_parameters(model)
        muon = [d.param for d in decisions if d.target == "muon"]
        adamw = [{"params": [d.param for d in decisions if d.target == t], "weight_decay": wd}
                 for t, wd in (("adamw", BASELINE_ADAMW_WD), ("adamw_no_decay", 0.0))]
        return [torch.optim.Muon(muon, **BASELINE_MUON), torch.optim.AdamW([g for g in adamw if g["params"]],
                                                                           **BASELINE_ADAMW)]
    from .optim.routing import build_optimizer

    kw = dict(setup.options)
    kw.setdefault("verbose", False)
    return [build_optimizer(model, **kw, **build_kwargs)]


@dataclass
class Measurement:
    """What ``MemTracker`` saw over a few training steps: the peak of live tensor bytes and its split."""

    peak: int
    split: dict[str, int]
    state_bytes: int
    losses: list[float]


def measure_step(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], loss_fn: Callable[[], torch.Tensor],
                 steps: int = 2) -> Measurement:
    """Peak live tensor bytes of ``steps`` training steps (``loss_fn().backward()``, every
    optimizer's ``step()``, ``zero_grad(set_to_none=True)``), by PyTorch's
    ``torch.distributed._tools.mem_tracker.MemTracker`` (its *peak* snapshot: live bytes by
    category at the moment they were highest). The first step allocates the optimizer state; the
    peak of a later step includes it. ``state_bytes``: the optimizers' state after the run."""
    from torch.distributed._tools.mem_tracker import MemTracker

    device = next(model.parameters()).device
    tracker = MemTracker()
    tracker.track_external(model, *optimizers)
    losses: list[float] = []
    with tracker:
        for _ in range(steps):
            tracker.reset_mod_stats()
            loss = loss_fn()
            loss.backward()
            losses.append(float(loss.detach()))
            del loss
            for o in optimizers:
                o.step()
            for o in optimizers:
                o.zero_grad(set_to_none=True)
    seen: set[int] = set()
    state = 0
    for o in optimizers:
        for st in o.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    local = v.to_local() if hasattr(v, "to_local") else v
                    ptr = local.untyped_storage().data_ptr()
                    if ptr not in seen:
                        seen.add(ptr)
                        state += local.untyped_storage().nbytes()
    snap = tracker.get_tracker_snapshot("peak")[device]
    split = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    peak = split.pop("Total")
    return Measurement(peak, split, state, losses)
