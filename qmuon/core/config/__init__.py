"""The one configuration of QMuon, and the one compatibility check for resuming its state.

:class:`QMuonConfig` is where every option, its default, its check and its documentation live.
Nine options sit at the top (the ones users set); the rest is grouped into six sections:

=================  =====================================================================
``newton_schulz``  :class:`NewtonSchulz`: steps, coefficients, dtype, method, input, eps,
                   the batching budget, and the carriers of the distributed exchange
``update``         :class:`UpdateRule`: Nesterov, lr adjustment, variants, AdamW betas / eps,
                   how group lr ratios are kept
``state``          :class:`StateOptions`: block size, GRASP rank / grid, rounding, seed
``safety``         :class:`Safety`: non-finite gradients, per-parameter clipping under release
``routing``        :class:`Routing`: which parameters go to Muon (``build_optimizer`` only)
``qk_clip``        :class:`QKClip`: MuonClip's per-head rescale of W_q / W_k (``build_optimizer``
                   only; :mod:`qmuon.optim.qk_clip`)
=================  =====================================================================

``QMuon``, :func:`~qmuon.build_optimizer`, the Lightning strategies' ``optimizer_kwargs``,
``qmuon-train``'s ``model.optimizer`` section and the other drivers take this object (or its keys)
and copy nothing. A section can be given as its dataclass or as a dict of its fields; a misspelled
key raises :class:`ConfigError` naming the closest valid one, wherever it was written.

Inside the optimizer, param groups stay flat dicts as torch.optim wants them, each with its own
optimizer's options: a Muon group holds :data:`GROUP_KEYS` (``newton_schulz.dtype`` is the group
key ``ns_dtype``) and its layout keys, an AdamW group :data:`ADAMW_GROUP_KEYS` (``adamw_lr`` is its
``lr``).

:func:`check_resume` is the one place that decides whether saved Muon state can be resumed by an
optimizer: ``QMuon.load_state_dict``, ``QuantizedStateCheckpoint`` and the strategy call it.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ...quant import state as qstate
from ..apply import DEFAULT_BF16_UPDATE
from ...quant.adamw import DEFAULT_ADAMW_STATE_FORMAT
from ..pipeline import DEFAULT_BATCH_BUDGET
from ..variants import NORMUON_BETA2

__all__ = [
    "QMuonConfig",
    "NewtonSchulz",
    "UpdateRule",
    "StateOptions",
    "Safety",
    "Routing",
    "QKClip",
    "ConfigError",
    "DEFAULT_CONFIG",
    "GROUP_KEYS",
    "ADAMW_GROUP_KEYS",
    "STRUCTURAL_KEYS",
    "PER_HEAD_KEYS",
    "check_per_head",
    "validate_muon_group",
    "validate_adamw_group",
    "check_resume",
    "ResumeMismatch",
    "state_layout",
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
COMM_CARRIERS = ("auto", "bf16", "fp32", "int8", "mxfp8")
COMM_RETURNS = ("bf16", "fp32", "int8")
#: How QMuon keeps each group's lr ratio to the Muon lr when a loop writes one lr into every group.
LR_RATIO_MODES = ("warn", "hold", "off")


class ConfigError(ValueError, TypeError):
    """A QMuon option that does not exist (a ``TypeError`` as for any unknown keyword) or holds a
    value it does not accept (a ``ValueError``)."""


@dataclass(frozen=True)
class NewtonSchulz:
    """How the momentum is orthogonalized (the ``newton_schulz`` section).

    Args:
        steps: Newton-Schulz iterations (torch.optim.Muon: 5).
        coefficients: ``"muon"`` (torch.optim.Muon's quintic ``(3.4445, -4.7750, 2.0315)``),
            ``"polar_express"`` (per-iteration coefficients, arXiv 2505.16932), one ``(a, b, c)``
            or a list of per-iteration triples.
        dtype: ``"auto"`` (bf16 on CUDA and on CPUs with fast native bf16 matmul, fp32 elsewhere:
            :func:`~qmuon.core.newton_schulz.resolve_ns_dtype`), ``"bf16"`` (torch.optim.Muon's
            arithmetic) or ``"fp32"``.
        method: ``"auto"`` (Gram Newton-Schulz on CPU for elongated matrices where it measured
            faster and as accurate, the standard iteration elsewhere, CUDA included), ``"standard"``
            or ``"gram"`` (:mod:`qmuon.core.gram_newton_schulz`).
        input: ``"bf16"`` (the NS input as it is) or ``"mxfp8"`` (NS reads its MXFP8 carrier).
        eps: the floor of ``||G||`` in the normalization (torch.optim.Muon: 1e-7).
        batch_budget: same-shape matrices are orthogonalized in batches of at most this many times
            the largest matrix's elements (or a fixed share of all Muon elements if more; on CPU at
            most 2^20 elements: :class:`~qmuon.core.pipeline.BatchSizes`).
        comm_carrier, comm_return: sharded parameters only (FSDP2, HSDP, TP; DeepSpeed ZeRO): how the
            distributed Newton-Schulz encodes what it sends to the rank that orthogonalizes a matrix
            (the NS input: FSDP2's rows, DeepSpeed ZeRO's flat slices, each rank keeping the momentum
            of what it holds) and the result it sends back (:mod:`qmuon.distributed`; bytes per step
            in ``comm_stats``). ``comm_carrier="auto"`` (the default) is ``"int8"`` under FSDP2 / HSDP
            / TP and the NS input's own dtype under DeepSpeed ZeRO (with int8 a 4-rank ZeRO-2 run
            measured update cosine 0.986 against one process, below issue 38's 0.99 target,
            docs/deepspeed.md).
    """

    steps: int = 5
    coefficients: Any = "muon"
    dtype: str = "auto"
    method: str = "auto"
    input: str = "bf16"
    eps: float = 1e-7
    batch_budget: float = DEFAULT_BATCH_BUDGET
    comm_carrier: str = "auto"
    comm_return: str = "int8"

    def __post_init__(self) -> None:
        object.__setattr__(self, "coefficients", _freeze(self.coefficients))


@dataclass(frozen=True)
class UpdateRule:
    """The update rules' details beyond the top-level options (the ``update`` section).

    Args:
        nesterov: Nesterov momentum for Muon (torch.optim.Muon: True).
        adjust_lr_fn: Muon's lr scaling by shape: ``None`` / ``"original"`` (``lr * sqrt(max(1,
            rows / cols))``, KellerJordan/Muon) or ``"match_rms_adamw"`` (``lr * 0.2 * sqrt(max(rows,
            cols))``, Moonlight: one lr serves Muon and AdamW).
        variant: ``"muon"`` or ``"normuon"`` (a per-output-row second moment of the orthogonalized
            update rescales its rows: :mod:`qmuon.core.variants`).
        normuon_beta2: the EMA factor of NorMuon's second moment (dion's and modded-nanogpt's 0.95).
        cautious_weight_decay: decay only where the update and the weight agree in sign (both
            families).
        adamw_betas, adamw_eps: the auxiliary AdamW's (0.9, 0.95) and 1e-8.
        lr_ratios: what happens when a training loop writes one lr into every group (LitGPT's
            does): ``"warn"``, ``"hold"`` (keep each group's configured ratio to the Muon lr) or
            ``"off"`` (:attr:`QMuon.lr_ratios`).
        capturable: torch.optim's ``capturable``: step counters live on the parameters' device and
            the step reads the learning rates from device copies, so the step can be captured in a
            CUDA graph (:func:`qmuon.capture_step`) and a compiled step (:func:`qmuon.compile_step`)
            follows an lr schedule without recompiling. The lr- and step-dependent writes (weights,
            AdamW moments) then run as torch ops (the kernels' references), fused when compiled.
            Needs ``state.rounding="nearest"`` and parameters that are not sharded.
    """

    nesterov: bool = True
    adjust_lr_fn: Optional[str] = None
    variant: str = "muon"
    normuon_beta2: float = NORMUON_BETA2
    cautious_weight_decay: bool = False
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    lr_ratios: str = "warn"
    capturable: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "adamw_betas", tuple(self.adamw_betas))


@dataclass(frozen=True)
class StateOptions:
    """How the momentum (and the AdamW moments) are stored, beyond the format (the ``state`` section).

    Args:
        block_size: elements per absmax block along a row; ``None`` takes the format's default
            (int8 256, int4 128, ...).
        rank, grid_block: grasp4's factor rank and grid tile side.
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased, counter-based) for the quantized Muon
            momentum and the AdamW groups' int8 / int4 moments.
        seed: the seed of the stochastic-rounding noise (and of GRASP's first power-iteration start).
    """

    block_size: Optional[int] = None
    rank: int = 4
    grid_block: int = 32
    rounding: str = "nearest"
    seed: int = 0


@dataclass(frozen=True)
class Safety:
    """What happens to bad gradients (the ``safety`` section).

    Args:
        nonfinite: ``"skip"`` (leave a parameter and its state untouched for a step whose gradient
            holds NaN / Inf, decided on the device; counted in ``QMuon.nonfinite_skips``) or ``"raise"``
            (a debugging policy: the step reads the flags back, so it waits for the device).
        max_nonfinite_skips: ``None`` (unlimited) or the most steps in a row one parameter's update
            may be skipped; the next step (the flags are read one step late) raises
            :class:`~qmuon.NonFiniteGradientError` naming the parameters, before it changes anything.
            A finite update resets the count.
        release_clip_norm: with ``gradient_release=True``, per-parameter L2 clipping of the AdamW
            groups' gradients (global-norm clipping cannot combine with release).
    """

    nonfinite: str = "skip"
    max_nonfinite_skips: Optional[int] = None
    release_clip_norm: Optional[float] = None


@dataclass(frozen=True)
class Routing:
    """Which parameters ``build_optimizer`` sends to Muon (the ``routing`` section; ``QMuon`` takes
    its groups as given). See :func:`~qmuon.optim.routing.route_parameters`.

    Args:
        rules: a list of :class:`~qmuon.RoutingRule` (first match wins) replacing the default table.
        fused_parts: ``{name regex: parts}`` for fused weights (q, k, v in one matrix): each part is
            orthogonalized as its own matrix.
        orientations: ``{name regex: "in_out"}`` for 2-D weights stored ``(in, out)``.
        banks: ``{name regex: spec}`` for stacked expert matrices (docs/moe.md).
        bank_state_format: the momentum format of bank groups (a row-local one).
        per_head: orthogonalize each attention head's block as its own matrix (q, k, v by output
            rows, fused or not, GQA included; the output projection by input columns): ``True``
            (head counts read from the model), or a dict of :data:`PER_HEAD_KEYS`: ``num_heads``,
            ``num_kv_heads``, ``head_dim`` (given counts) and ``modules`` (a name regex of the
            attention modules it applies to). docs/usage.md, "Per-head Muon".
    """

    rules: Any = None
    fused_parts: Any = None
    orientations: Any = None
    banks: Any = None
    bank_state_format: Optional[str] = None
    per_head: Any = False


#: Keys of a ``routing.per_head`` dict: head counts (positive ints; unset: read from the model) and
#: ``modules``, a regex on the attention modules' qualified names.
PER_HEAD_KEYS = ("num_heads", "num_kv_heads", "head_dim", "modules")


def check_per_head(value: Any) -> dict[str, Any] | None:
    """``routing.per_head`` as a dict of :data:`PER_HEAD_KEYS` (``None``: off); a bad value raises
    :class:`ConfigError` naming the accepted forms."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    forms = ("routing.per_head must be False, True (head counts read from the model) or a dict with keys "
             f"{PER_HEAD_KEYS} (num_heads / num_kv_heads / head_dim: ints >= 1; modules: a name regex)")
    if not isinstance(value, Mapping):
        raise ConfigError(f"QMuon: {forms}; got {value!r}")
    unknown = [k for k in value if k not in PER_HEAD_KEYS]
    if unknown:
        close = difflib.get_close_matches(str(unknown[0]), PER_HEAD_KEYS, n=1)
        raise ConfigError(f"QMuon: routing.per_head: unknown key {unknown[0]!r}"
                          + (f"; did you mean {close[0]!r}?" if close else "") + f" ({forms})")
    out = dict(value)
    for key in ("num_heads", "num_kv_heads", "head_dim"):
        n = out.get(key)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigError(f"QMuon: routing.per_head[{key!r}] must be an int >= 1, got {n!r}")
    modules = out.get("modules")
    if modules is not None:
        try:
            re.compile(modules)
        except (TypeError, re.error) as e:
            raise ConfigError(f"QMuon: routing.per_head['modules'] must be a name regex, got {modules!r} ({e})") from None
    return out


@dataclass(frozen=True)
class QKClip:
    """QK-clip (MuonClip, Kimi K2): keep every attention head's largest pre-softmax logit at or under
    ``tau`` (the ``qk_clip`` section; ``build_optimizer`` only: it needs the model's attention layers).

    The forward pass measures each head's exact maximum logit ``max_ij q_i . k_j * scale`` over the
    pairs the mask allows; after each optimizer step, a head whose maximum exceeded ``tau`` gets its
    W_q and W_k rows rescaled so that the logit comes back to ``tau`` (docs/qk_clip.md).

    Args:
        tau: the logit threshold (Kimi K2: 100); ``None`` (default) turns QK-clip off. It measures
            the kit's ``DecoderLM``, Hugging Face attention with ``q_proj`` / ``k_proj`` (Llama,
            Qwen3, their GQA) under the ``eager`` or ``sdpa`` implementation, and modules with a
            ``qmuon_attention()`` method; any other attention is refused at setup.
        forward_cap: also cap the logits in the forward that measured them: a head over ``tau`` has
            its queries scaled by ``tau / max`` before the attention kernel, so the softmax sees at
            most ``tau`` on every step (training and evaluation forwards of the watched model). The
            weight rescale alone (``False``: MuonClip as Kimi K2 ran it) clips with the logits of the
            forward before the update, so the next forward can exceed ``tau`` by one update's growth.
    """

    tau: Optional[float] = None
    forward_cap: bool = True


#: Section name -> its dataclass.
SECTIONS: dict[str, type] = {"newton_schulz": NewtonSchulz, "update": UpdateRule, "state": StateOptions,
                             "safety": Safety, "routing": Routing, "qk_clip": QKClip}

#: Options -> the param-group key that holds them inside the optimizer (torch.optim groups are flat).
GROUP_KEYS: dict[str, str] = {
    "lr": "lr", "weight_decay": "weight_decay", "momentum": "momentum", "state_format": "state_format",
    "bf16_update": "bf16_update",
    "newton_schulz.steps": "ns_steps", "newton_schulz.coefficients": "ns_coefficients",
    "newton_schulz.dtype": "ns_dtype", "newton_schulz.method": "ns_method", "newton_schulz.input": "ns_input",
    "newton_schulz.eps": "eps",
    "update.nesterov": "nesterov", "update.adjust_lr_fn": "adjust_lr_fn", "update.variant": "variant",
    "update.normuon_beta2": "normuon_beta2", "update.cautious_weight_decay": "cautious_weight_decay",
    "state.block_size": "block_size", "state.rank": "rank", "state.grid_block": "grid_block",
    "state.rounding": "rounding", "state.seed": "seed",
    "safety.nonfinite": "nonfinite",
}

#: Options -> the key that holds them in an AdamW param group: AdamW's own, and the weight-write,
#: state-rounding and non-finite options that apply to it (no Newton-Schulz, layout or momentum key).
ADAMW_GROUP_KEYS: dict[str, str] = {
    "adamw_lr": "lr", "update.adamw_betas": "betas", "update.adamw_eps": "eps", "adamw_weight_decay": "weight_decay",
    "adamw_state_format": "state_format", "bf16_update": "bf16_update",
    "update.cautious_weight_decay": "cautious_weight_decay", "state.rounding": "rounding", "state.seed": "seed",
    "safety.nonfinite": "nonfinite",
}


@dataclass(frozen=True)
class QMuonConfig:
    """Every QMuon option, with its default (the module docstring lists the sections).

    Args:
        lr: the Muon learning rate, 0.02 (KellerJordan/Muon and modded-nanogpt, with the
            ``"original"`` shape adjustment; ``torch.optim.Muon`` defaults to 1e-3). With
            ``update.adjust_lr_fn="match_rms_adamw"`` an AdamW lr works for Muon too.
        weight_decay: Muon's decoupled weight decay, 0.1 (``p *= 1 - lr * wd``).
        momentum: the EMA factor of the Muon momentum, 0.95 (torch.optim.Muon's).
        state_format: how the Muon momentum is stored: ``"int8"`` (default, 1.016 B/element),
            ``"uint8"``, ``"int4"``, ``"e0m3"``, ``"grasp4"`` (4-bit, ~0.58 B), ``"bf16"`` or ``"fp32"``
            (docs/formats.md).
        adamw_lr, adamw_weight_decay: the auxiliary AdamW (embeddings, head, norms, biases): 3e-4
            and 0.1, the usual GPT pretraining values. 1-D parameters get no weight decay.
        adamw_state_format: how the AdamW moments are stored: ``"int8"`` (default), ``"int4"``,
            ``"bf16"`` or ``"fp32"`` (torch.optim.AdamW's). 1-D tensors and tensors under 4096
            elements keep fp32 moments.
        bf16_update: how an update reaches a weight stored in bf16 (no fp32 master copy):
            ``"stochastic"`` (default, 0 extra bytes), ``"ecc8"`` (+1 B/param, ~16-bit master) or
            ``"nearest"``. fp32 weights ignore it.
        gradient_release: step each parameter inside backward and free its gradient
            (``build_optimizer`` attaches it; :mod:`qmuon.optim.release`).
        newton_schulz, update, state, safety, routing, qk_clip: the sections (their own docstrings).
    """

    lr: float = 0.02
    weight_decay: float = 0.1
    momentum: float = 0.95
    state_format: str = "int8"
    adamw_lr: float = 3e-4
    adamw_weight_decay: float = 0.1
    adamw_state_format: str = DEFAULT_ADAMW_STATE_FORMAT
    bf16_update: str = DEFAULT_BF16_UPDATE
    gradient_release: bool = False
    newton_schulz: NewtonSchulz = field(default_factory=NewtonSchulz)
    update: UpdateRule = field(default_factory=UpdateRule)
    state: StateOptions = field(default_factory=StateOptions)
    safety: Safety = field(default_factory=Safety)
    routing: Routing = field(default_factory=Routing)
    qk_clip: QKClip = field(default_factory=QKClip)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            object.__setattr__(self, name, _section(name, cls, getattr(self, name)))
        self.validate()

    # ---------------------------------------------------------------- construction
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, config: "QMuonConfig | Mapping[str, Any] | None" = None, /, **kwargs: Any) -> "QMuonConfig":
        """``config`` (a config, a dict of options, or None for the defaults) with ``kwargs`` laid
        over it: top-level options replace, sections merge field by field (``newton_schulz={"dtype":
        "fp32"}`` keeps the other Newton-Schulz fields), ``None`` keeps the config's value. Unknown keys raise :class:`ConfigError`
        naming the closest valid one."""
        if config is None:
            base: dict[str, Any] = {}
        elif isinstance(config, QMuonConfig):  # a subclass (qmuon-train's section) adds keys of its own
            base = {name: getattr(config, name) for name in QMuonConfig.field_names()}
        elif isinstance(config, Mapping):
            base = dict(config)
        else:
            raise ConfigError(f"QMuon: config must be a QMuonConfig or a dict of its options, got {type(config).__name__}")
        _check_keys(base, cls.field_names(), "")
        _check_keys(kwargs, cls.field_names(), "")
        merged = dict(base)
        for key, value in kwargs.items():
            if value is None:  # the entry points' keyword default: keep the config's value
                continue
            if key in SECTIONS and key in merged:
                merged[key] = {**_section_dict(key, merged[key]), **_section_dict(key, value)}
            else:
                merged[key] = value
        return cls(**{k: v for k, v in merged.items() if v is not None or k not in SECTIONS})

    def replace(self, **changes: Any) -> "QMuonConfig":
        """A copy with ``changes`` laid over it (sections merge field by field, as in :meth:`from_kwargs`)."""
        return QMuonConfig.from_kwargs(self, **changes)

    # ---------------------------------------------------------------- checks
    def validate(self) -> "QMuonConfig":
        """Raise :class:`ConfigError` naming the first bad option and its accepted values."""
        ns, safety, upd = self.newton_schulz, self.safety, self.update
        if ns.comm_carrier not in COMM_CARRIERS or ns.comm_return not in COMM_RETURNS:
            raise ConfigError(
                f"QMuon: newton_schulz.comm_carrier must be one of {COMM_CARRIERS} and newton_schulz.comm_return one of "
                f"{COMM_RETURNS}, got {ns.comm_carrier!r} and {ns.comm_return!r}")
        if not (_real(ns.batch_budget) and ns.batch_budget > 0):
            raise ConfigError(f"QMuon: newton_schulz.batch_budget must be > 0 (a multiple of the largest matrix), "
                              f"got {ns.batch_budget!r}")
        m = safety.max_nonfinite_skips
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ConfigError(
                f"QMuon: safety.max_nonfinite_skips must be None (unlimited) or an int >= 1 (steps in a row one parameter "
                f"may be skipped for a non-finite gradient), got {m!r}")
        if upd.lr_ratios not in LR_RATIO_MODES:
            raise ConfigError(f"QMuon: update.lr_ratios must be one of {LR_RATIO_MODES}, got {upd.lr_ratios!r}")
        if not isinstance(upd.capturable, bool):
            raise ConfigError(f"QMuon: update.capturable must be True or False, got {upd.capturable!r}")
        if upd.capturable and self.state.rounding != "nearest":
            raise ConfigError(
                "QMuon: update.capturable=True needs state.rounding='nearest': stochastic rounding of the quantized "
                "momentum draws its noise stream from the step count in the kernels' host arguments, which a captured "
                "graph would freeze. Use state.rounding='nearest', or capturable=False")
        if not isinstance(self.gradient_release, bool):
            raise ConfigError(f"QMuon: gradient_release must be True or False, got {self.gradient_release!r}")
        clip = safety.release_clip_norm
        if clip is not None:
            if not (_real(clip) and clip > 0):
                raise ConfigError(f"QMuon: safety.release_clip_norm must be None or > 0, got {clip!r}")
            if not self.gradient_release:
                raise ConfigError(
                    "QMuon: safety.release_clip_norm applies with gradient_release=True only; without release clip the "
                    "global norm as usual (torch.nn.utils.clip_grad_norm_, Trainer(gradient_clip_val=...))")
        check_per_head(self.routing.per_head)
        tau = self.qk_clip.tau
        if tau is not None and not (_real(tau) and 0 < tau < float("inf")):
            raise ConfigError(f"QMuon: qk_clip.tau must be None (off) or a finite logit threshold > 0 (Kimi K2: 100), "
                              f"got {tau!r}")
        if not isinstance(self.qk_clip.forward_cap, bool):
            raise ConfigError(f"QMuon: qk_clip.forward_cap must be True or False, got {self.qk_clip.forward_cap!r}")
        bank_format = self.routing.bank_state_format
        if bank_format is not None and not qstate.get_format(bank_format).row_local:
            raise ConfigError(f"QMuon: routing.bank_state_format: {bank_format_error(bank_format)}")
        try:
            validate_muon_group(self.muon_group_defaults(), "QMuon")
            validate_adamw_group(self.adamw_group_defaults(), "QMuon (AdamW defaults)")
        except ConfigError:
            raise
        except ValueError as e:  # the group checks name group keys; say the option as the user writes it
            if type(e) is not ValueError:  # a more specific error (StateFormatError) keeps its type
                raise
            msg = str(e)
            for path, key in GROUP_KEYS.items():
                if msg.startswith(f"QMuon: {key} "):
                    msg = f"QMuon: {path} " + msg[len(f"QMuon: {key} "):]
                    break
            raise ConfigError(msg) from None
        return self

    # ---------------------------------------------------------------- what the optimizer stores
    def option(self, path: str) -> Any:
        """The value of ``"lr"`` or ``"newton_schulz.dtype"``."""
        head, _, tail = path.partition(".")
        value = getattr(self, head)
        return getattr(value, tail) if tail else value

    def muon_group_defaults(self) -> dict[str, Any]:
        """Defaults of a Muon parameter group (what torch.optim stores as ``defaults``)."""
        out = {key: self.option(path) for path, key in GROUP_KEYS.items()}
        out.update({"use_muon": True, "parts": None, "parts_axis": 0, "orientation": "out_in",
                    "parts_interleaved": False, "bank_dims": 0})
        return out

    def adamw_group_defaults(self) -> dict[str, Any]:
        """Defaults of an AdamW parameter group: :data:`ADAMW_GROUP_KEYS` only."""
        out = {key: self.option(path) for path, key in ADAMW_GROUP_KEYS.items()}
        out["betas"] = tuple(out["betas"])
        return out

    def to_dict(self) -> dict[str, Any]:
        """Plain values, sections as dicts (for manifests, logs and ``from_kwargs``)."""
        d = {name: getattr(self, name) for name in QMuonConfig.field_names()}
        for name in SECTIONS:
            d[name] = {f.name: getattr(d[name], f.name) for f in dataclasses.fields(d[name])}
        d["newton_schulz"]["coefficients"] = plain_coefficients(d["newton_schulz"]["coefficients"])
        d["update"]["adamw_betas"] = list(d["update"]["adamw_betas"])
        return d


def _check_keys(given: Mapping[str, Any], valid: tuple[str, ...], prefix: str) -> None:
    for key in given:
        if key not in valid:
            raise ConfigError(unknown_key_message(prefix + key, [prefix + v for v in valid]))


def unknown_key_message(key: str, valid: list[str]) -> str:
    """``unknown QMuon option 'x'; did you mean 'y'?`` (a flat name of a sectioned option is
    pointed at its section: ``ns_dtype`` -> ``newton_schulz.dtype``)."""
    leaf = key.rpartition(".")[2]
    by_group_key = {k: path for path, k in GROUP_KEYS.items() if "." in path}
    by_group_key.update({"comm_carrier": "newton_schulz.comm_carrier", "comm_return": "newton_schulz.comm_return",
                         "batch_budget": "newton_schulz.batch_budget", "adamw_betas": "update.adamw_betas",
                         "adamw_eps": "update.adamw_eps", "lr_ratios": "update.lr_ratios",
                         "capturable": "update.capturable",
                         "max_nonfinite_skips": "safety.max_nonfinite_skips",
                         "release_clip_norm": "safety.release_clip_norm", "tau": "qk_clip.tau",
                         "forward_cap": "qk_clip.forward_cap",
                         **{f.name: f"routing.{f.name}" for f in dataclasses.fields(Routing)}})
    hint = by_group_key.get(leaf)
    if hint is None:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        hint = close[0] if close else None
    if hint is not None:
        section, _, name = hint.partition(".")
        spelled = f" ({section}={{{name!r}: ...}})" if name else ""
        return f"unknown QMuon option {key!r}; did you mean {hint!r}{spelled}?"
    return f"unknown QMuon option {key!r}; the options are: {', '.join(valid)}"


def _section_dict(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, SECTIONS[name]):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return dict(value)
    raise ConfigError(f"QMuon: {name} must be a {SECTIONS[name].__name__} or a dict of its fields, got "
                      f"{type(value).__name__}")


def _section(name: str, cls: type, value: Any) -> Any:
    """A section given as its dataclass, a dict of its fields, or None (the defaults)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    fields = _section_dict(name, value)
    valid = tuple(f.name for f in dataclasses.fields(cls))
    _check_keys(fields, valid, name + ".")
    return cls(**fields)


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




# The group checks and the resume check live in submodules, split along those seams; they read the
# constants above, so they are imported once those exist (QMuonConfig's checks call them at run time).
from .groups import (FORMAT_OVERRIDES, STRUCTURAL_KEYS, _real, bank_format_error,  # noqa: E402
                     param_group_view, validate_adamw_group, validate_format_overrides, validate_muon_group)
from .resume import ResumeMismatch, check_resume, describe_layout, state_layout  # noqa: E402

#: The defaults, as one object.
DEFAULT_CONFIG = QMuonConfig()
