"""Per-head Muon (``routing.per_head``): which weights hold attention heads, and the head blocks
each one splits into.

With ``per_head`` on, every attention head's block is its own Newton-Schulz matrix (its own norm
and lr adjustment), as ``torch.optim.Muon`` applied to each block would treat it:

- q, k and v by output rows: ``head_dim`` rows per head, ``num_heads`` blocks of q and
  ``num_kv_heads`` of k and of v (GQA, MQA); a fused q/k/v weight splits into all of them. Each
  head's q, k or v is ``head_dim`` contiguous output rows in every layout read here (``[all q; all
  k; all v]``, and the per-head ``[q_h; k_h; v_h]`` of GPT-NeoX / Falcon), so the blocks are
  contiguous parts;
- the output projection by input columns: ``head_dim`` input features per head (parts along the
  stored columns of an ``(out, in)`` weight, the stored rows of an ``(in, out)`` one).

The blocks are ordinary fused parts (:class:`~qmuon.core.plan.FusedParts`): they batch with every
other matrix of their shape, shard (FSDP2, HSDP, TP: a block cut by a shard is gathered whole on
its owner, as any part is) and checkpoint (the momentum keeps the parameter's stored layout) as
parts do.

Attention modules are found by their children's names (no model code is imported):

=================================================  ==========================  ===================
layout                                             q / k / v                   output
=================================================  ==========================  ===================
Hugging Face (Llama, Qwen, Mistral, Gemma, ...)    ``q_proj k_proj v_proj``    ``o_proj`` / ``out_proj`` / ``dense``
BERT-style, Meta Llama                             ``query key value``, ``wq wk wv``  ``wo``
fused (LitGPT, the kit's DecoderLM, timm, Phi-3,   ``qkv`` / ``qkv_proj`` /    ``proj`` / ``o_proj`` /
GPT-2's ``Conv1D``, GPT-NeoX / Falcon)             ``c_attn`` / ``query_key_value`` / ``Wqkv``  ``c_proj`` / ``dense`` / ``out_proj``
``nn.MultiheadAttention``                          ``in_proj_weight`` (or ``q/k/v_proj_weight``)  ``out_proj``
=================================================  ==========================  ===================

Head counts: the given ones (``per_head={"num_heads": ..., "num_kv_heads": ..., "head_dim": ...}``),
else read from the attention module or its ``config`` / ``cfg`` (Hugging Face
``num_attention_heads`` / ``num_key_value_heads`` / ``head_dim``, LitGPT ``n_head`` /
``n_query_groups`` / ``head_size``, the kit's ``DecoderLMConfig`` ``n_heads`` / ``kv_heads`` /
``head_dim``, ``nn.MultiheadAttention.num_heads``); ``num_kv_heads`` defaults to ``num_heads`` and
``head_dim`` to q's rows over ``num_heads``. A weight whose rows (or, for the output, columns) are
not the counts' multiple is refused by name, before anything is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from ..core.plan import true_shape

__all__ = ["HeadRole", "attention_heads"]

#: Children holding q, k and v as separate weights.
SEPARATE_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("wq", "wk", "wv"))
#: Children holding q, k and v as one fused weight.
FUSED_QKV = ("qkv", "qkv_proj", "c_attn", "query_key_value", "Wqkv")
#: Children holding the output projection (the first one present wins).
OUTPUT = ("o_proj", "out_proj", "proj", "c_proj", "dense", "wo")

#: Where head counts are read, on the attention module, then on its ``config`` / ``cfg``.
_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_heads", "n_query_groups")
_HEAD_DIM = ("head_dim", "head_size")

SUPPORTED = ("q_proj/k_proj/v_proj", "query/key/value", "wq/wk/wv", "fused " + "/".join(FUSED_QKV),
             "nn.MultiheadAttention")


@dataclass(frozen=True)
class HeadRole:
    """What one weight holds of an attention module: ``role`` (``"q"``, ``"k"``, ``"v"``,
    ``"qkv"`` fused, ``"o"`` output), the module's name and its head counts (``head_dim`` None:
    derived from the weight)."""

    role: str
    attention: str
    num_heads: int
    num_kv_heads: int
    head_dim: int | None

    def heads(self) -> int:
        """Head blocks along the split dim (q, o: ``num_heads``; k, v: ``num_kv_heads``; fused: all)."""
        return {"q": self.num_heads, "o": self.num_heads, "k": self.num_kv_heads, "v": self.num_kv_heads,
                "qkv": self.num_heads + 2 * self.num_kv_heads}[self.role]


def _weight(module: Any) -> torch.Tensor | None:
    """A child's 2-D ``weight`` (through LoRA / adapter wrappers: PEFT's ``weight`` property,
    LitGPT's ``.linear``)."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) and isinstance(getattr(module, "linear", None), nn.Module):
        w = getattr(module.linear, "weight", None)
    return w if isinstance(w, torch.Tensor) and len(true_shape(w)) == 2 else None


def first_positive_int(sources: Iterable[Any], names: tuple[str, ...]) -> int | None:
    """The first positive int attribute among ``names`` of the first source that has one (model
    configs name their sizes differently: ``num_attention_heads``, ``n_head``, ``n_heads``)."""
    for src in sources:
        for n in names:
            v = getattr(src, n, None)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _qkv_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{role: weight}`` of q, k, v (separate or fused) held by ``module``; empty if none."""
    if isinstance(module, nn.MultiheadAttention):
        if module.in_proj_weight is not None:
            return {"qkv": module.in_proj_weight}
        return {r: getattr(module, f"{r}_proj_weight") for r in "qkv"}
    for names in SEPARATE_QKV:
        ws = [_weight(getattr(module, n, None)) for n in names]
        if all(w is not None for w in ws) and all(isinstance(getattr(module, n), nn.Module) for n in names):
            return dict(zip("qkv", ws))  # type: ignore[arg-type]
    for n in FUSED_QKV:
        child = getattr(module, n, None)
        if isinstance(child, nn.Module) and _weight(child) is not None:
            return {"qkv": _weight(child)}  # type: ignore[dict-item]
    return {}


def _output_weight(module: nn.Module) -> torch.Tensor | None:
    for n in OUTPUT:
        child = getattr(module, n, None)
        if isinstance(child, nn.Module) and _weight(child) is not None:
            return _weight(child)
    return None


def attention_heads(model: nn.Module, spec: Mapping[str, Any]) -> dict[int, HeadRole]:
    """``id(weight) -> HeadRole`` for the attention modules of ``model`` (those whose name matches
    ``spec["modules"]`` when given), with ``spec``'s counts laid over the ones read from each
    module. Raises when none is found or a module's head count cannot be read."""
    pattern = spec.get("modules")
    out: dict[int, HeadRole] = {}
    found = 0
    for name, module in model.named_modules():
        qkv = _qkv_weights(module)
        if not qkv or (pattern is not None and re.search(pattern, name) is None):
            continue
        where = name or "<root>"
        sources = [module, getattr(module, "config", None), getattr(module, "cfg", None)]
        heads = spec.get("num_heads") or first_positive_int(sources, _HEADS)
        if heads is None:
            raise ValueError(
                f"routing.per_head: cannot read the head count of attention module {where!r} ({type(module).__name__}: "
                f"none of {_HEADS} on it or its config); give it: per_head={{'num_heads': ..., 'num_kv_heads': ...}}, "
                "or leave the module out with per_head={'modules': <regex of the others>}")
        kv = spec.get("num_kv_heads") or first_positive_int(sources, _KV_HEADS) or heads
        # given head counts without a head_dim: derive it from the weights (the model's own head_dim
        # goes with the model's own counts)
        head_dim = spec.get("head_dim") or (None if spec.get("num_heads") else first_positive_int(sources, _HEAD_DIM))
        found += 1
        weights = dict(qkv)
        o = _output_weight(module)
        if o is not None:
            weights["o"] = o
        for role, w in weights.items():
            out.setdefault(id(w), HeadRole(role, where, int(heads), int(kv), head_dim))
    if not found:
        which = f" matching {pattern!r}" if pattern is not None else ""
        raise ValueError(
            f"routing.per_head: no attention module{which} found in {type(model).__name__}; per-head Muon reads modules "
            f"holding {', '.join(SUPPORTED)} (docs/usage.md, 'Per-head Muon'). Turn per_head off, or fix "
            "per_head['modules']")
    return out


def head_parts(name: str, shape: tuple[int, ...], orientation: str, role: HeadRole, parts: tuple[int, ...] | None,
               parts_axis: int, interleaved: bool, bank_dims: int) -> tuple[tuple[int, ...] | None, int]:
    """``(parts, stored axis)`` of weight ``name`` (``shape``, stored ``orientation``) split per head,
    refining its fused ``parts`` (along ``parts_axis``) if it has any. Raises naming the weight when
    its rows (columns for the output) are not a multiple of the head count, or when fused parts
    cut through a head."""
    what = f"routing.per_head: {name!r} ({role.role} of attention {role.attention!r}, shape {tuple(shape)})"
    if bank_dims or len(shape) != 2 or interleaved:
        raise ValueError(f"{what}: per-head blocks split a plain 2-D weight; this one is "
                         f"{'a bank' if bank_dims else 'interleaved' if interleaved else f'{len(shape)}-D'}. "
                         "Leave its module out with per_head={'modules': ...}")
    out_dim = 0 if orientation == "out_in" else 1  # the stored dim of the layer's output features
    axis = 1 - out_dim if role.role == "o" else out_dim
    n, heads = int(shape[axis]), role.heads()
    unit = "input columns" if role.role == "o" else "output rows"
    d = role.head_dim
    if d is None:  # derived: the weight holds heads * head_dim along the split dim
        if n % heads:
            raise ValueError(f"{what}: its {n} {unit} are not a multiple of its {heads} heads "
                             f"({role.num_heads} q, {role.num_kv_heads} kv); give the counts: "
                             "per_head={'num_heads': ..., 'num_kv_heads': ..., 'head_dim': ...}")
        d = n // heads
    if n != heads * d:
        raise ValueError(f"{what}: its {n} {unit} are not {heads} heads of {d} ({role.num_heads} q heads, "
                         f"{role.num_kv_heads} kv heads, head_dim {d}); give the right counts: per_head={{'num_heads': "
                         "..., 'num_kv_heads': ..., 'head_dim': ...}, or leave the module out with per_head={'modules': ...}")
    if parts is not None and (parts_axis != axis or any(s % d for s in parts)):
        raise ValueError(f"{what}: its fused parts {list(parts)} (dim {parts_axis}) cut through heads of {d} along "
                         f"dim {axis}; fix the fused parts or the head counts")
    if heads == 1:
        return None, 0  # one head: the whole matrix
    return (d,) * heads, axis
