"""The checks of a built optimizer's param groups: a Muon group (:func:`validate_muon_group`), an
AdamW group (:func:`validate_adamw_group`), ``bf16_update`` and per-parameter layout overrides
(:data:`FORMAT_OVERRIDES`, :func:`param_group_view`), and which group keys are structural
(:data:`STRUCTURAL_KEYS`). Part of the configuration (:mod:`qmuon.core.config`, which re-exports
every name): the options and defaults live there, these checks read its constants.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ...quant import adamw as qadamw
from ...quant import state as qstate
from ..apply import BF16_UPDATES, DEFAULT_BF16_UPDATE
from ..gram_newton_schulz import NS_METHODS
from ..newton_schulz import NS_DTYPES, resolve_schedule
from ..plan import ADJUST_LR_FNS, ORIENTATIONS
from ..variants import NORMUON_BETA2, VARIANTS
from . import NONFINITE_POLICIES, NS_INPUTS, ROUNDING_MODES, _freeze


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
