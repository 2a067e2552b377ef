"""LitGPT's fused layers, read by class and attribute names (``litgpt`` is never imported).

What LitGPT (checked against ``litgpt/model.py``, ``lora.py``, ``adapter_v2.py`` of 0.5.13) stores
fused, and what the router makes of it:

=============================================  =========================================  ==================
layer                                          stored rows (dim 0)                        Muon parts
=============================================  =========================================  ==================
``CausalSelfAttention.qkv`` (``nn.Linear``)    ``[all q; all k; all v]``: ``n_head * hs``,  q, k, v
                                               ``n_query_groups * hs`` twice (GQA / MQA)
``qkv.linear`` of ``LoRAQKVLinear`` /          the same                                   q, k, v
``AdapterV2Linear``
``LoRAQKVLinear.lora_B``                       the enabled ones of q, k, v (``qkv_shapes``) one per enabled
``LoRAQKVLinear.lora_A``                       ``r`` rows per enabled matrix               one per enabled
legacy ``CausalSelfAttention.attn`` (< 0.5)    per query group ``[q..., k, v]`` interleaved refused (see below)
=============================================  =========================================  ==================

Not fused, so nothing to read: the MLPs (``GptNeoxMLP.fc``/``proj``, ``LLaMAMLP`` and
``GemmaMLP`` keep ``fc_1``, ``fc_2``, ``proj`` as separate ``nn.Linear``), ``LLaMAMoE`` (a
``ModuleList`` of ``LLaMAMLP`` experts), the attention output ``proj``. LitGPT's
``MultiheadLatentAttention`` (DeepSeek V3) packs per-head ``[k_nope, v]`` rows in ``kv_b_proj`` and
``[nope, rope]`` rows in ``q_b_proj``; those are per-head interleavings that no contiguous split
reproduces, and Moonlight ("Muon is Scalable", which trained this attention with Muon)
orthogonalizes each of these projections as one matrix: the router does the same (no parts).

The legacy layout (LitGPT < 0.5: ``CausalSelfAttention.attn``, q, k, v interleaved per query group)
cannot be written as contiguous parts: Muon's update of "all q" needs rows from every group. It is
refused with a message (unless ``n_query_groups == 1``, where interleaved and contiguous agree);
LitGPT >= 0.5 converts such checkpoints on load (``CausalSelfAttention._load_from_state_dict``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..core.plan import FusedParts

__all__: list[str] = []

#: LitGPT versions whose ``model.py`` / ``lora.py`` / ``adapter_v2.py`` these rules were checked against.
LITGPT_TESTED_VERSIONS = ("0.5.13",)

#: Class names (LitGPT's ``model``, ``adapter``, ``adapter_v2`` and ``lora`` each define a
#: ``CausalSelfAttention``; all store ``qkv`` the same way).
ATTENTION = "CausalSelfAttention"
LORA_QKV = "LoRAQKVLinear"
ADAPTER_V2_LINEAR = "AdapterV2Linear"


class LayoutRefusal(str):
    """A layout the router can read but not express as Muon parts: the message says why and what to do."""


def litgpt_qkv_sizes(config: Any) -> tuple[int, int, int] | None:
    """``(q rows, k rows, v rows)`` of LitGPT's fused ``qkv`` from its ``Config``: ``n_head *
    head_size``, ``n_query_groups * head_size`` twice (``litgpt/model.py``: the ``qkv`` Linear has
    ``(n_head + 2 n_query_groups) head_size`` outputs, split ``(query, key, value)`` in forward).
    ``None`` when the config lacks one of these fields."""
    try:
        n_head, groups, hs = int(config.n_head), int(config.n_query_groups), int(config.head_size)
    except (AttributeError, TypeError, ValueError):
        return None
    if min(n_head, groups, hs) <= 0:
        return None
    return n_head * hs, groups * hs, groups * hs


def _weight(module: Any) -> torch.Tensor | None:
    w = getattr(module, "weight", None)
    return w if isinstance(w, torch.Tensor) and w.ndim == 2 else None


def _qkv_entries(attn: nn.Module, sizes: tuple[int, int, int], where: str) -> dict[tuple[int, str], Any]:
    """Parts of the parameters under ``attn.qkv`` (plain, LoRA or adapter-v2 wrapped)."""
    qkv = attn.qkv
    out: dict[tuple[int, str], Any] = {}
    kind = type(qkv).__name__
    linear = qkv.linear if kind in (LORA_QKV, ADAPTER_V2_LINEAR) and isinstance(getattr(qkv, "linear", None), nn.Module) else qkv
    w = _weight(linear)
    if w is not None:
        if w.shape[0] == sum(sizes):
            out[(id(linear), "weight")] = FusedParts(sizes, 0)
        else:
            out[(id(linear), "weight")] = LayoutRefusal(
                f"LitGPT {where}.qkv has {w.shape[0]} rows, but its config gives q, k, v of {list(sizes)} rows "
                f"(n_head * head_size, n_query_groups * head_size twice; sum {sum(sizes)}); the layout is not one "
                "this router knows (checked against litgpt " + ", ".join(LITGPT_TESTED_VERSIONS) + "). Declare it: "
                "build_optimizer(model, fused_parts={r'attn\\.qkv\\.weight$': (n_q, n_k, n_v)}), or None for one matrix")
    if kind == LORA_QKV:
        r = int(getattr(qkv, "r", 0) or 0)
        enabled = [bool(e) for e in (getattr(qkv, "enable_lora", None) or [])]
        shapes = [int(s) for s in (getattr(qkv, "qkv_shapes", None) or [])]
        if r > 0 and sum(enabled) > 1:
            a, b = getattr(qkv, "lora_A", None), getattr(qkv, "lora_B", None)
            if isinstance(a, torch.Tensor) and a.ndim == 2 and a.shape[0] == r * sum(enabled):
                out[(id(qkv), "lora_A")] = FusedParts((r,) * sum(enabled), 0)
            if isinstance(b, torch.Tensor) and b.ndim == 2 and len(shapes) == sum(enabled) and b.shape[0] == sum(shapes):
                out[(id(qkv), "lora_B")] = FusedParts(tuple(shapes), 0)
    return out


def _legacy_entry(attn: nn.Module, sizes: tuple[int, int, int], where: str) -> dict[tuple[int, str], Any]:
    """LitGPT < 0.5 (``attn.attn``): per query group ``[q_per_kv * hs; hs; hs]`` rows."""
    w = _weight(attn.attn)
    if w is None or w.shape[0] != sum(sizes):
        return {}
    groups = sizes[1] // max(1, int(attn.config.head_size))
    if groups == 1:  # one group: [all q; k; v], the same rows as the current layout
        return {(id(attn.attn), "weight"): FusedParts(sizes, 0)}
    return {(id(attn.attn), "weight"): LayoutRefusal(
        f"{where}.attn is LitGPT's legacy fused attention (before litgpt 0.5): q, k and v are interleaved per query "
        f"group ({groups} groups of [{sizes[0] // groups} q rows; {sizes[1] // groups} k rows; {sizes[2] // groups} v "
        "rows]), which Muon's per-layer update (one matrix each for q, k and v) cannot read as contiguous parts. "
        "Use litgpt >= 0.5, whose CausalSelfAttention.qkv holds [all q; all k; all v] and converts legacy checkpoints "
        "on load; or orthogonalize the fused matrix as one: build_optimizer(model, fused_parts={r'attn\\.attn\\.weight$': "
        "None})")}


def litgpt_fused_parts(model: nn.Module) -> dict[tuple[int, str], FusedParts | LayoutRefusal]:
    """``(id(module), attribute) -> FusedParts`` (or a :class:`LayoutRefusal`) for the fused LitGPT
    layers of ``model`` (see the module docstring); empty for a model without LitGPT attention."""
    out: dict[tuple[int, str], Any] = {}
    for name, attn in model.named_modules():
        if type(attn).__name__ != ATTENTION:
            continue
        sizes = litgpt_qkv_sizes(getattr(attn, "config", None))
        if sizes is None:
            continue
        where = name or "<root>"
        if isinstance(getattr(attn, "qkv", None), nn.Module):
            out.update(_qkv_entries(attn, sizes, where))
        elif isinstance(getattr(attn, "attn", None), nn.Module):
            out.update(_legacy_entry(attn, sizes, where))
    return out
