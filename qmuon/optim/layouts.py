"""What a Muon parameter's layer means: fused parts, orientation, expert banks, read from the model.

- *Fused matrices* (several layers stored in one parameter) are declared with ``fused_parts``
  (``{name_regex: spec}``), by a module attribute ``qmuon_fused_parts = {"weight": spec}``, or found
  automatically for ``nn.MultiheadAttention.in_proj_weight`` (q, k, v along dim 0), GPT-2's
  ``c_attn`` (q, k, v along dim 1) and LitGPT's ``CausalSelfAttention.qkv`` (q, k, v along dim 0,
  GQA sizes from its config; LoRA and adapter wrappers too; legacy interleaved layouts refused:
  :mod:`.litgpt_layouts`). ``spec``: ``(n0, n1, ...)`` (parts along dim 0),
  ``{"sizes": [n0, ...], "axis": 1}``, a :class:`~qmuon.core.plan.FusedParts`, or
  ``None`` in ``fused_parts`` (not fused: turns the automatic detection off for that name).
- *Orientation*: a 2-D weight stored ``(in, out)`` is declared with ``orientations``
  (``{name_regex: "in_out"}``) or a module attribute ``qmuon_orientation = {"weight": "in_out"}``;
  Hugging Face ``Conv1D`` (matched by class name, transformers is never imported) is ``(in, out)``
  by itself. Newton-Schulz and the lr adjustment then use the layer's ``(out, in)`` matrix.

- *Banks* (mixture-of-experts layers that store their experts as one ``(E, out, in)`` tensor):
  declared with ``banks`` (``{name_regex: bank_dims}``, ``None`` turns detection off), a module
  attribute ``qmuon_bank_dims = {"gate_up_proj": 1}``, or found automatically for transformers'
  expert modules (by class and attribute names; transformers is never imported): a module whose
  class name ends in ``Experts`` holding 3-D ``gate_up_proj`` / ``up_proj`` / ``down_proj``
  (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, gpt-oss, ...). Fused parts and orientation then apply
  to each expert: ``gate_up_proj`` is gate and up (two matrices per expert), stacked (``[gate;
  up]`` rows) or, for gpt-oss (``is_transposed``, not ``is_concatenated``: the attributes
  transformers' ``use_experts_implementation`` sets, or the class name ``GptOssExperts``), stored
  ``(in, out)`` with gate and up interleaved along the last dim.

Declarations are looked up in that order (argument, module attribute, automatic) and the first
one found wins, for parts, orientation and banks separately.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import nn

from ..core.plan import ORIENTATIONS, FusedParts, true_shape
from .litgpt_layouts import LayoutRefusal

if TYPE_CHECKING:
    from .routing import RouteDecision

__all__ = ["BankLayout", "HF_EXPERT_BANKS", "HF_EXPERT_LAYOUTS"]


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
    if type(module).__name__ != HF_CONV1D or attr != "weight" or len(true_shape(p)) != 2:
        return False
    nf = getattr(module, "nf", None)
    return nf is None or int(nf) == int(true_shape(p)[1])


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
        shape = true_shape(w) if isinstance(w, torch.Tensor) else None
        if shape is not None and len(shape) == 2 and shape[1] % split == 0 and shape[1] > split:
            out[id(child)] = FusedParts((split,) * (shape[1] // split), axis=1)
    return out


#: Attribute names of the expert banks of transformers' MoE modules (``(E, out, in)`` per expert,
#: or ``(E, in, out)`` when the module is transposed).
HF_EXPERT_BANKS = ("gate_up_proj", "up_proj", "gate_proj", "down_proj")
#: Expert modules whose layout is not transformers' default (``[gate; up]`` rows, ``(out, in)``
#: members), by class name, for versions without the ``is_transposed`` / ``is_concatenated``
#: attributes: ``class name -> (is_transposed, is_concatenated)``.
HF_EXPERT_LAYOUTS = {"GptOssExperts": (True, False)}


@dataclass(frozen=True)
class BankLayout:
    """What automatic detection found for one expert bank: member orientation and, for a fused
    ``gate_up_proj``, its two parts (gate, up) along the member's output dim."""

    orientation: str
    parts: FusedParts | None


def _hf_banks(model: nn.Module) -> dict[tuple[int, str], BankLayout]:
    """``(id(module), attribute) -> BankLayout`` for the 3-D expert banks of transformers' MoE
    modules, found by class name (``*Experts``) and attribute names; the layout is read from the
    attributes transformers' ``use_experts_implementation`` sets (``is_transposed``,
    ``is_concatenated``), else from :data:`HF_EXPERT_LAYOUTS`."""
    out: dict[tuple[int, str], BankLayout] = {}
    for module in model.modules():
        cls = type(module).__name__
        if not cls.endswith("Experts"):
            continue
        transposed, concatenated = HF_EXPERT_LAYOUTS.get(cls, (False, True))
        transposed = bool(getattr(module, "is_transposed", transposed))
        concatenated = bool(getattr(module, "is_concatenated", concatenated))
        for attr in HF_EXPERT_BANKS:
            p = module._parameters.get(attr)
            if p is None or len(true_shape(p)) != 3:
                continue
            parts = None
            if attr == "gate_up_proj":
                axis = 1 if transposed else 0  # the output dim of each member, as stored
                n = int(true_shape(p)[1 + axis])
                if n % 2:
                    raise ValueError(f"{cls}.gate_up_proj of shape {tuple(true_shape(p))}: its output dim {n} must hold "
                                     "gate and up (even); declare its layout with fused_parts / banks")
                parts = FusedParts((n // 2, n // 2), axis, interleaved=not concatenated)
            out[(id(module), attr)] = BankLayout("in_out" if transposed else "out_in", parts)
    return out


def _declared_bank(name: str, module: nn.Module, attr: str, p: torch.Tensor, banks: Mapping[str, Any],
                   auto_banks: Mapping[tuple[int, str], BankLayout]) -> int:
    """Bank dims of a Muon parameter: ``banks`` argument, ``qmuon_bank_dims`` attribute, automatic."""
    value: Any = None
    where = ""
    for pattern, spec in banks.items():
        if re.search(pattern, name):
            if spec is None:
                return 0  # declared not a bank (turns automatic detection off)
            value, where = spec, f"banks[{pattern!r}] (matched {name!r})"
            break
    else:
        declared = getattr(module, "qmuon_bank_dims", None)
        if isinstance(declared, Mapping) and attr in declared:
            value, where = declared[attr], f"{type(module).__name__}.qmuon_bank_dims[{attr!r}] of {name!r}"
        elif (id(module), attr) in auto_banks:
            return 1
        else:
            return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value and len(true_shape(p)) != value + 2):
        raise ValueError(f"{where}: bank dims must be an int n >= 0 with the parameter of shape (*bank, rows, cols) "
                         f"(n + 2 dims); {name!r} has shape {tuple(true_shape(p))}, got {value!r}")
    return value


def _declared_parts(name: str, module: nn.Module, attr: str, fused_parts: Mapping[str, Any],
                    auto: Mapping[Any, Any],
                    auto_banks: Mapping[tuple[int, str], BankLayout] | None = None) -> FusedParts | None:
    for pattern, spec in fused_parts.items():
        if re.search(pattern, name):  # None: declared unfused (turns automatic detection off)
            return None if spec is None else _parse_parts(spec, f"fused_parts[{pattern!r}] (matched {name!r})")
    declared = getattr(module, "qmuon_fused_parts", None)
    if isinstance(declared, Mapping) and attr in declared:
        return _parse_parts(declared[attr], f"{type(module).__name__}.qmuon_fused_parts[{attr!r}] of {name!r}")
    if auto_banks and (id(module), attr) in auto_banks:
        return auto_banks[(id(module), attr)].parts
    if isinstance(module, nn.MultiheadAttention) and attr == "in_proj_weight":
        e = module.embed_dim
        return FusedParts((e, e, e), 0)
    if attr == "weight" and id(module) in auto:
        return auto[id(module)]
    found = auto.get((id(module), attr))  # LitGPT layers (.litgpt_layouts), keyed by (module, attribute)
    if isinstance(found, LayoutRefusal):
        raise ValueError(f"cannot read the layout of {name!r}: {found}")
    return found


def _parse_parts(spec: Any, where: str) -> FusedParts:
    try:
        return FusedParts.parse(spec)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _declared_orientation(name: str, module: nn.Module, attr: str, p: torch.Tensor,
                          orientations: Mapping[str, str], bank_dims: int = 0,
                          auto_banks: Mapping[tuple[int, str], BankLayout] | None = None) -> str:
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
        if bank_dims and auto_banks and (id(module), attr) in auto_banks:
            return auto_banks[(id(module), attr)].orientation
        return "in_out" if _is_hf_conv1d(module, attr, p) else "out_in"
    value, where = found
    if value not in ORIENTATIONS:
        raise ValueError(f"{where}: orientation must be one of {ORIENTATIONS} ('out_in': stored (out, in) like "
                         f"nn.Linear; 'in_out': stored (in, out) like transformers' Conv1D), got {value!r}")
    if value != "out_in" and len(true_shape(p)) != 2 + bank_dims:
        raise ValueError(f"{where}: orientation {value!r} applies to 2-D weights and to the matrices of a bank; "
                         f"{name!r} has shape {tuple(true_shape(p))}")
    return value


def _read_layout(d: RouteDecision, module: nn.Module, attr: str, p: torch.Tensor, fused_parts: Mapping[str, Any],
                 orientations: Mapping[str, str], auto: Mapping[int, FusedParts], banks: Mapping[str, Any] | None = None,
                 auto_banks: Mapping[tuple[int, str], BankLayout] | None = None) -> None:
    """Fill ``d``'s bank dims, parts and orientation, checked against the parameter's shape (for
    a bank, parts and orientation are those of each member)."""
    d.bank_dims = _declared_bank(d.name, module, attr, p, banks or {}, auto_banks or {})
    if not d.bank_dims:
        auto_banks = None  # a bank turned off by `banks` is a plain (flattened) matrix
    d.orientation = _declared_orientation(d.name, module, attr, p, orientations, d.bank_dims, auto_banks)
    parts = _declared_parts(d.name, module, attr, fused_parts, auto, auto_banks)
    if parts is None:
        return
    b = d.bank_dims
    if parts.axis == 1 and len(true_shape(p)) != 2 + b:
        raise ValueError(f"fused parts of {d.name!r} along axis 1 need a 2-D weight (or the matrices of a bank), got "
                         f"shape {tuple(true_shape(p))}")
    if parts.interleaved and not b:
        raise ValueError(f"fused parts of {d.name!r}: interleaved parts are supported on the matrices of a bank; "
                         "declare it with banks / qmuon_bank_dims")
    dim = b + parts.axis
    if sum(parts.sizes) != true_shape(p)[dim]:
        raise ValueError(f"fused parts of {d.name!r}: sizes {list(parts.sizes)} sum to {sum(parts.sizes)}, but dim "
                         f"{dim} of its shape {tuple(true_shape(p))} is {true_shape(p)[dim]}; fix the sizes or the axis")
    d.parts, d.parts_axis, d.parts_interleaved = parts.sizes, parts.axis, parts.interleaved
