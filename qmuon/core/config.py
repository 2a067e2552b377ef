"""One typed configuration for QMuon, and one compatibility check for resuming its state.

:class:`QMuonConfig` holds every argument of :class:`~qmuon.QMuon` with the single set
of defaults that ``QMuon``, :func:`~qmuon.build_optimizer`, the ``qmuon_fsdp``
strategy's ``optimizer_kwargs`` and the checkpoint manifest share. Validation lives here too, so a
bad value fails when a strategy is constructed (before processes start), with the same message
the optimizer would give, and without building a throwaway optimizer.

:func:`check_resume` is the one place that decides whether saved Muon state can be resumed by an
optimizer: ``QMuon.load_state_dict``, ``QuantizedStateCheckpoint`` and the strategy call it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ..quant import adamw as qadamw
from ..quant import state as qstate
from .apply import BF16_UPDATES, DEFAULT_BF16_UPDATE
from ..quant.adamw import DEFAULT_ADAMW_STATE_FORMAT
from .gram_newton_schulz import NS_METHODS
from .newton_schulz import NS_DTYPES, resolve_schedule
from .plan import ADJUST_LR_FNS, ORIENTATIONS
from .variants import NORMUON_BETA2, VARIANTS

__all__ = [
    "QMuonConfig",
    "DEFAULT_CONFIG",
    "ROUNDING_MODES",
    "NONFINITE_POLICIES",
    "NS_INPUTS",
    "COMM_CARRIERS",
    "COMM_RETURNS",
    "STRUCTURAL_KEYS",
    "validate_muon_group",
    "validate_adamw_group",
    "validate_bf16_update",
    "state_layout",
    "check_resume",
    "ResumeMismatch",
    "describe_layout",
    "FORMAT_OVERRIDES",
    "param_group_view",
    "validate_format_overrides",
]

ROUNDING_MODES = ("nearest", "stochastic")
NONFINITE_POLICIES = ("skip", "raise")
#: What Newton-Schulz reads: the NS input as it is, or its MXFP8 carrier (quant.mxfp8).
NS_INPUTS = ("bf16", "mxfp8")
#: Carriers of the distributed Newton-Schulz exchange (sharded parameters only); the
#: distributed layer's carrier registry must offer these (a test checks).
COMM_CARRIERS = ("bf16", "fp32", "int8", "mxfp8")
COMM_RETURNS = ("bf16", "fp32", "int8")


@dataclass(frozen=True)
class QMuonConfig:
    """Every QMuon argument, with the defaults ``QMuon`` and ``build_optimizer`` share.

    Muon (hidden matrices):
        lr: 0.02, the Muon learning rate of KellerJordan/Muon and modded-nanogpt with the
            ``"original"`` shape adjustment (``torch.optim.Muon`` defaults to 1e-3; pass it for
            torch's default). Use ``adjust_lr_fn="match_rms_adamw"`` to reuse an AdamW lr instead.
        weight_decay, momentum, nesterov, eps, ns_steps, adjust_lr_fn: as ``torch.optim.Muon``
            (0.1, 0.95, True, 1e-7, 5, None = "original").
        ns_coefficients: ``"muon"`` (torch.optim.Muon's ``(3.4445, -4.7750, 2.0315)``, default),
            ``"polar_express"``, one ``(a, b, c)`` tuple, or a list of per-iteration tuples.
        ns_dtype: ``"auto"`` (bf16 on CUDA and on CPUs with fast native bf16 matmul, fp32
            elsewhere), ``"bf16"`` (exactly ``torch.optim.Muon``'s arithmetic) or ``"fp32"``.
    State:
        state_format: momentum storage (``quant.state.FORMATS``), default ``"int8"``.
        block_size: elements per absmax block along a row; ``None`` takes the format's default.
        rank, grid_block: grasp4's factor rank and grid tile side.
        rounding: ``"nearest"`` or ``"stochastic"``, of the quantized Muon momentum and of the AdamW
            groups' quantized (int8 / int4) moments; seed: its counter-based noise seed.
        nonfinite: ``"skip"`` (leave a parameter and its state untouched for a step with a
            NaN/Inf gradient) or ``"raise"``.
        ns_input: ``"bf16"`` or ``"mxfp8"`` (NS reads the decoded MXFP8 carrier).
        max_nonfinite_skips: with ``nonfinite="skip"``, the most optimizer steps in a row that one
            parameter's update may be skipped for a non-finite gradient; one more raises
            :class:`~qmuon.NonFiniteGradientError` naming the parameters. A finite
            update resets the parameter's count. ``None`` (default): unlimited, as before.
    Weights: bf16_update: how an update reaches a parameter stored in bf16 (``model.to(torch.bfloat16)``,
        Lightning ``precision="bf16-true"``), in the Muon and the AdamW groups alike:
        ``"stochastic"`` (default: counter-based stochastic rounding, 0 extra bytes),
        ``"ecc8"`` (an int8 error-correction code per weight, +1 B/param, ~16-bit master weight) or
        ``"nearest"`` (loses updates below half a bf16 gap); see :mod:`qmuon.core.apply`.
        fp32 parameters ignore it.
    Variants (:mod:`qmuon.core.variants`):
        variant: ``"muon"`` (default) or ``"normuon"`` (a per-output-row second moment of the
            orthogonalized update rescales its rows, Frobenius norm kept; fp32 state of one value
            per row beside the momentum). normuon_beta2: its EMA factor (0.95, dion's and
            modded-nanogpt's default).
        cautious_weight_decay: decay only the weights whose update agrees with them in sign
            (Muon and AdamW groups; default False).
        ns_method: ``"auto"`` (default: gram on CPU where it measured faster and as accurate: fp32
            from 3:1 with a short side >= 64, bf16 from 4:1 with a short side >= 192 and the
            ``"muon"`` coefficients; the standard iteration elsewhere, CUDA included;
            :func:`~qmuon.core.gram_newton_schulz.pick_ns_method`), ``"standard"`` or
            ``"gram"`` (iterate on the Gram matrix of every rectangular update,
            :mod:`qmuon.core.gram_newton_schulz`). A checkpoint saved before ``ns_method``
            existed resumes with ``"standard"``, the iteration it ran.
    AdamW (embeddings, head, 1-D tensors): adamw_lr 3e-4, adamw_betas (0.9, 0.95),
        adamw_eps 1e-8, adamw_weight_decay 0.1 (the usual GPT pretraining values).
        adamw_state_format: how the AdamW moments are stored: ``"fp32"`` (``torch.optim.AdamW``'s
        state), ``"bf16"``, ``"int8"`` or ``"int4"`` (blockwise, row blocks; see
        :mod:`qmuon.quant.adamw` and docs/formats.md). 1-D tensors and tensors under 4096
        elements keep fp32 moments. A group may set its own (``{"params": ..., "use_muon": False,
        "state_format": "fp32"}``), e.g. to keep one parameter at full precision.
    Sharded parameters: comm_carrier / comm_return: encodings of the distributed NS exchange.
    """

    lr: float = 0.02
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    ns_coefficients: Any = "muon"
    eps: float = 1e-7
    ns_steps: int = 5
    adjust_lr_fn: str | None = None
    ns_dtype: str = "auto"
    state_format: str = "int8"
    block_size: int | None = None
    rank: int = 4
    grid_block: int = 32
    rounding: str = "nearest"
    seed: int = 0
    nonfinite: str = "skip"
    ns_input: str = "bf16"
    max_nonfinite_skips: int | None = None
    adamw_lr: float = 3e-4
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.1
    adamw_state_format: str = DEFAULT_ADAMW_STATE_FORMAT
    comm_carrier: str = "int8"
    comm_return: str = "int8"
    bf16_update: str = DEFAULT_BF16_UPDATE
    variant: str = "muon"
    normuon_beta2: float = NORMUON_BETA2
    cautious_weight_decay: bool = False
    ns_method: str = "auto"

    def __post_init__(self) -> None:
        # Hashable, canonical forms (YAML and JSON give lists).
        object.__setattr__(self, "adamw_betas", tuple(self.adamw_betas))
        object.__setattr__(self, "ns_coefficients", _freeze(self.ns_coefficients))

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "QMuonConfig":
        """Build and validate; an unknown key raises naming the accepted ones."""
        unknown = sorted(set(kwargs) - set(cls.field_names()))
        if unknown:
            raise TypeError(f"unknown QMuon argument(s) {unknown}; accepted: {', '.join(cls.field_names())}")
        return cls(**kwargs).validate()

    def replace(self, **changes: Any) -> "QMuonConfig":
        return dataclasses.replace(self, **changes).validate()

    def validate(self) -> "QMuonConfig":
        """Raise ``ValueError`` naming the first bad argument and its accepted values."""
        if self.comm_carrier not in COMM_CARRIERS or self.comm_return not in COMM_RETURNS:
            raise ValueError(
                f"QMuon: comm_carrier must be one of {COMM_CARRIERS} and comm_return one of {COMM_RETURNS}, "
                f"got comm_carrier={self.comm_carrier!r}, comm_return={self.comm_return!r}")
        m = self.max_nonfinite_skips
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(
                f"QMuon: max_nonfinite_skips must be None (unlimited) or an int >= 1 (steps in a row one parameter may "
                f"be skipped for a non-finite gradient), got {m!r}")
        validate_muon_group(self.muon_group_defaults(), "QMuon")
        validate_adamw_group(self.adamw_group_defaults(), "QMuon (AdamW defaults)")
        return self

    def muon_group_defaults(self) -> dict[str, Any]:
        """Defaults of a Muon parameter group (what torch.optim stores as ``defaults``)."""
        return {
            "lr": self.lr, "weight_decay": self.weight_decay, "momentum": self.momentum,
            "nesterov": self.nesterov, "ns_coefficients": _freeze(self.ns_coefficients), "eps": self.eps,
            "ns_steps": self.ns_steps, "adjust_lr_fn": self.adjust_lr_fn, "ns_dtype": self.ns_dtype,
            "state_format": self.state_format, "block_size": self.block_size, "rank": self.rank,
            "grid_block": self.grid_block, "rounding": self.rounding, "seed": self.seed,
            "nonfinite": self.nonfinite, "ns_input": self.ns_input, "use_muon": True, "parts": None,
            "parts_axis": 0, "orientation": "out_in", "parts_interleaved": False, "bank_dims": 0,
            "bf16_update": self.bf16_update, "variant": self.variant,
            "normuon_beta2": self.normuon_beta2, "cautious_weight_decay": self.cautious_weight_decay,
            "ns_method": self.ns_method,
        }

    def adamw_group_defaults(self) -> dict[str, Any]:
        return {"lr": self.adamw_lr, "betas": tuple(self.adamw_betas), "eps": self.adamw_eps,
                "weight_decay": self.adamw_weight_decay, "bf16_update": self.bf16_update,
                "state_format": self.adamw_state_format, "cautious_weight_decay": self.cautious_weight_decay}

    def to_dict(self) -> dict[str, Any]:
        """Plain values (for manifests and logs)."""
        d = dataclasses.asdict(self)
        d["ns_coefficients"] = plain_coefficients(d["ns_coefficients"])
        d["adamw_betas"] = list(d["adamw_betas"])
        return d


def _freeze(spec: Any) -> Any:
    """A hashable form of an ``ns_coefficients`` spec (tuples all the way down)."""
    if isinstance(spec, str):
        return spec
    seq = list(spec)
    if seq and isinstance(seq[0], (list, tuple)):
        return tuple(tuple(float(x) for x in c) for c in seq)
    return tuple(float(x) for x in seq)


def plain_coefficients(spec: Any) -> Any:
    """An ``ns_coefficients`` spec as plain lists (for JSON-like manifests)."""
    if spec is None or isinstance(spec, str):
        return spec
    return [list(c) if isinstance(c, (list, tuple)) else c for c in spec]


#: The defaults, as one object (``QMuon``'s signature reads its defaults from it).
DEFAULT_CONFIG = QMuonConfig()


#: Keys that describe how a group is built, not how it is tuned: on ``load_state_dict`` the
#: constructed optimizer's values win over the checkpoint's (torch would silently take the saved
#: ones, e.g. switch a run back to the state format or NS precision it was saved with).
STRUCTURAL_KEYS = ("use_muon", "state_format", "block_size", "rank", "grid_block", "rounding", "seed", "parts",
                   "parts_axis", "orientation", "nonfinite", "ns_input", "ns_dtype", "ns_coefficients", "bf16_update",
                   "parts_interleaved", "bank_dims", "variant")


def validate_bf16_update(group: dict[str, Any], where: str) -> None:
    """Check (default in place) a group's ``bf16_update``."""
    rule = group.setdefault("bf16_update", DEFAULT_BF16_UPDATE)
    if rule not in BF16_UPDATES:
        raise ValueError(
            f"{where}: bf16_update must be one of {BF16_UPDATES} (how an update reaches a bf16 weight: stochastic "
            f"rounding, an 8-bit error-correction term, or nearest rounding), got {rule!r}")


def validate_muon_group(group: dict[str, Any], where: str) -> None:
    """Check (and normalize in place: ``block_size``, ``parts``, ``ns_coefficients``) a Muon group."""

    def bad(msg: str) -> ValueError:
        return ValueError(f"{where}: {msg}")

    if not _real_or_scalar_tensor(group["lr"]) or not group["lr"] >= 0.0:
        raise bad(f"lr must be >= 0 (a number or a one-element tensor), got {group['lr']}")
    if not _real(group["momentum"]) or not 0.0 <= group["momentum"] < 1.0:
        raise bad(f"momentum must be in [0, 1), got {group['momentum']}")
    if not _real_or_scalar_tensor(group["weight_decay"]) or not group["weight_decay"] >= 0.0:
        raise bad(f"weight_decay must be >= 0 (a number or a one-element tensor), got {group['weight_decay']}")
    if not _real(group["eps"]) or not group["eps"] > 0.0:
        raise bad(f"eps must be > 0 (it bounds 1 / ||G|| for a zero gradient), got {group['eps']}")
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise bad(f"adjust_lr_fn must be None, 'original' or 'match_rms_adamw', got {group['adjust_lr_fn']!r}")
    if not isinstance(group["ns_steps"], int) or isinstance(group["ns_steps"], bool) or not 0 <= group["ns_steps"] < 100:
        raise bad(f"ns_steps must be an int in [0, 100), got {group['ns_steps']!r}")
    try:
        group["ns_coefficients"] = _freeze(group["ns_coefficients"])
        resolve_schedule(group["ns_coefficients"], int(group["ns_steps"]))
    except (TypeError, ValueError) as e:
        raise bad(f"ns_coefficients: {e}") from None
    group.setdefault("ns_dtype", "auto")
    if group["ns_dtype"] not in NS_DTYPES:
        raise bad(f"ns_dtype must be one of {NS_DTYPES}, got {group['ns_dtype']!r}")
    fmt = qstate.get_format(group["state_format"])  # raises with the list of formats
    if group.get("block_size") is None:
        group["block_size"] = fmt.default_block_size
    group.setdefault("rank", 4)
    group.setdefault("grid_block", 32)
    bs = group["block_size"]
    if not isinstance(bs, int) or isinstance(bs, bool) or bs <= 0 or bs % 32 or bs > 4096:
        raise bad(f"block_size must be a multiple of 32 in [32, 4096] (kernel warp granularity), got {bs!r}")
    try:
        fmt.validate_options(qstate.format_options(group))
    except ValueError as e:
        raise bad(str(e)) from None
    if group["rounding"] not in ROUNDING_MODES:
        raise bad(f"rounding must be 'nearest' or 'stochastic', got {group['rounding']!r}")
    if group["nonfinite"] not in NONFINITE_POLICIES:
        raise bad(f"nonfinite must be 'skip' or 'raise', got {group['nonfinite']!r}")
    if group.setdefault("ns_input", "bf16") not in NS_INPUTS:
        raise bad(f"ns_input must be 'bf16' (the NS input as it is) or 'mxfp8' (MXFP8 carrier), got {group['ns_input']!r}")
    if group.setdefault("variant", "muon") not in VARIANTS:
        raise bad(f"variant must be one of {VARIANTS} ('normuon': per-row second moment after Newton-Schulz), "
                  f"got {group['variant']!r}")
    b2 = group.setdefault("normuon_beta2", NORMUON_BETA2)
    if not _real(b2) or not 0.0 <= b2 < 1.0:
        raise bad(f"normuon_beta2 must be in [0, 1), got {b2!r}")
    _check_cautious(group, bad)
    if group.setdefault("ns_method", "auto") not in NS_METHODS:
        raise bad(f"ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")
    validate_format_overrides(group, where)
    parts = group.get("parts")
    if parts is not None:
        try:
            parts = tuple(int(n) for n in parts)
        except (TypeError, ValueError):
            raise bad(f"parts must be a sequence of positive row counts, got {group['parts']!r}") from None
        if not parts or min(parts) <= 0:
            raise bad(f"parts must be positive row counts, got {group['parts']!r}")
        group["parts"] = parts
    axis = group.setdefault("parts_axis", 0)
    if axis not in (0, 1) or isinstance(axis, bool):
        raise bad(f"parts_axis must be 0 (parts are row blocks) or 1 (column blocks of a 2-D weight), got {axis!r}")
    validate_bf16_update(group, where)
    if group.setdefault("orientation", "out_in") not in ORIENTATIONS:
        raise bad(f"orientation must be one of {ORIENTATIONS} (how a 2-D weight stores its layer: nn.Linear is "
                  f"'out_in', Hugging Face Conv1D 'in_out'), got {group['orientation']!r}")
    interleaved = group.setdefault("parts_interleaved", False)
    if not isinstance(interleaved, bool):
        raise bad(f"parts_interleaved must be a bool, got {interleaved!r}")
    if interleaved and (group["parts"] is None or len(set(group["parts"])) != 1):
        raise bad(f"parts_interleaved=True needs equal parts (part k of m holds indices k, k + m, ...), "
                  f"got parts={group['parts']!r}")
    bank_dims = group.setdefault("bank_dims", 0)
    if not isinstance(bank_dims, int) or isinstance(bank_dims, bool) or bank_dims < 0:
        raise bad(f"bank_dims must be an int >= 0 (leading dims that index matrices, 1 for an (E, out, in) "
                  f"expert bank), got {bank_dims!r}")
    if bank_dims and not fmt.row_local:
        raise bad(bank_format_error(fmt.name))


def bank_format_error(fmt_name: str) -> str:
    """Why a bank cannot keep its momentum in a format that is not row-local, and what to do."""
    return (f"state_format {fmt_name!r} keeps statistics over the whole stored matrix (a low-rank factor or a "
            "tensor scale); on an expert bank they would mix experts (one stored row per expert). Banks "
            "(bank_dims >= 1) need a row-local format: fp32, bf16, int8, uint8 or int4. Put the banks in a group "
            "with one of those (build_optimizer(..., bank_state_format='int8'))")


#: Group key of per-parameter layout overrides: ``{index in group: {"state_format": ..., <layout
#: options>}}``, written by :meth:`QMuon.promote_param` (the fidelity guard) and saved with the
#: group, so a resumed run keeps a promoted parameter's format.
FORMAT_OVERRIDES = "format_overrides"


def param_group_view(group: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The group as parameter ``index`` of it is stepped: the group itself, or a shallow copy with
    the parameter's layout override (:data:`FORMAT_OVERRIDES`) applied."""
    override = (group.get(FORMAT_OVERRIDES) or {}).get(index)
    return {**group, **override} if override else group  # type: ignore[return-value]


def validate_format_overrides(group: dict[str, Any], where: str) -> None:
    """Check the per-parameter layout overrides of a Muon group (formats and options valid,
    indices in range); normalizes the keys to ``int``."""
    overrides = group.get(FORMAT_OVERRIDES)
    if not overrides:
        group.pop(FORMAT_OVERRIDES, None)
        return
    if not isinstance(overrides, Mapping):
        raise ValueError(f"{where}: {FORMAT_OVERRIDES} must map a parameter index to layout keys, got {overrides!r}")
    clean: dict[int, dict[str, Any]] = {}
    n = len(group["params"]) if "params" in group else None
    for idx, layout in overrides.items():
        i = int(idx)
        if n is not None and not 0 <= i < n:
            raise ValueError(f"{where}: {FORMAT_OVERRIDES} names parameter #{i} but the group has {n} parameters")
        if not isinstance(layout, Mapping) or "state_format" not in layout:
            raise ValueError(f"{where}: {FORMAT_OVERRIDES}[{i}] must hold a state_format, got {layout!r}")
        unknown = set(layout) - {"state_format", "block_size", "rank", "grid_block"}
        if unknown:
            raise ValueError(f"{where}: {FORMAT_OVERRIDES}[{i}] has keys {sorted(unknown)}; only layout keys "
                             "(state_format, block_size, rank, grid_block) can be overridden per parameter")
        view = {**group, **layout}
        fmt = qstate.get_format(view["state_format"])
        try:
            fmt.validate_options(qstate.format_options(view))
        except ValueError as e:
            raise ValueError(f"{where}: {FORMAT_OVERRIDES}[{i}]: {e}") from None
        if group.get("bank_dims") and not fmt.row_local:
            raise ValueError(f"{where}: {FORMAT_OVERRIDES}[{i}]: {bank_format_error(fmt.name)}")
        clean[i] = dict(layout)
    group[FORMAT_OVERRIDES] = clean


def _check_cautious(group: dict[str, Any], bad: Any) -> None:
    if not isinstance(group.setdefault("cautious_weight_decay", False), bool):
        raise bad(f"cautious_weight_decay must be True or False, got {group['cautious_weight_decay']!r}")


def validate_adamw_group(group: dict[str, Any], where: str) -> None:
    validate_bf16_update(group, where + " (AdamW)")
    qadamw.check_adamw_state_format(group.get("state_format"), f"{where} (AdamW)")
    _check_cautious(group, lambda msg: ValueError(f"{where} (AdamW): {msg}"))
    b1, b2 = group["betas"]
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"{where} (AdamW): betas must be in [0, 1), got {group['betas']}")
    for key in ("lr", "weight_decay"):
        if not _real_or_scalar_tensor(group[key]):
            raise ValueError(f"{where} (AdamW): {key} must be a number or a one-element tensor, got {group[key]!r}")
    if not group["eps"] >= 0.0 or not group["lr"] >= 0.0 or not group["weight_decay"] >= 0.0:
        raise ValueError(f"{where} (AdamW): lr, eps and weight_decay must be >= 0")


def _real(x: Any) -> bool:
    """A real number (NaN included: the range checks that follow reject it with the value shown)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _real_or_scalar_tensor(x: Any) -> bool:
    """A real number, or a one-element real tensor: ``torch.optim`` takes ``lr=torch.tensor(0.02)``
    (and a tensor weight decay); the step reads it with ``float()``."""
    if isinstance(x, torch.Tensor):
        return x.numel() == 1 and (x.is_floating_point() or (x.dtype != torch.bool and not x.is_complex()))
    return _real(x)


# ------------------------------------------------------------------------------------ resume
class ResumeMismatch(qstate.StateFormatError):
    """Saved Muon state that cannot be resumed as it is by this optimizer."""


def state_layout(group: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a Muon group that fixes how its momentum is stored: the format and the
    options that are part of that format's layout (for example int8's ``block_size``)."""
    fmt = qstate.get_format(group["state_format"])
    opts = qstate.format_options(dict(group))
    out: dict[str, Any] = {"state_format": fmt.name}
    for key in fmt.layout_options:
        out[key] = getattr(opts, key)
    return out


def describe_layout(layout: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in layout.items())


def check_resume(saved: Mapping[str, Any], current: Mapping[str, Any], *, where: str,
                 allow_format_change: bool) -> str | None:
    """Whether Muon state saved with group ``saved`` can be resumed by group ``current`` (the one
    check ``QMuon.load_state_dict``, ``QuantizedStateCheckpoint`` and the strategy make).

    Same layout: fine (returns None). Options that must match for the codes to be kept (the rule
    is :func:`qmuon.quant.registry.layout_conflicts`: e.g. int8 saved with
    ``block_size=128``, resumed with 256) differ: always :class:`ResumeMismatch`, naming the
    constructor argument that resumes it. Another format: allowed only when
    ``allow_format_change`` (the momentum is dequantized and re-encoded: returns a note saying
    so), else :class:`ResumeMismatch`.
    """
    conflicts = qstate.layout_conflicts(saved, current)
    if conflicts:
        raise ResumeMismatch(qstate.describe_conflicts(conflicts, where))
    a, b = state_layout(saved), state_layout(current)
    if a["state_format"] == b["state_format"]:
        return None
    msg = f"{where}: saved with {describe_layout(a)}, this optimizer uses {describe_layout(b)}"
    if allow_format_change:
        return msg + "; QMuon.load_state_dict converts the momentum (dequantize and re-encode; not bit-exact)"
    raise ResumeMismatch(
        msg + f". Build the optimizer with {describe_layout(a)} to resume, or allow a format change (QMuon."
        "load_state_dict converts; QuantizedStateCheckpoint(allow_format_change=True))")


def config_fields_of(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that are QMuon arguments."""
    names = set(QMuonConfig.field_names())
    return {k: v for k, v in kwargs.items() if k in names}
