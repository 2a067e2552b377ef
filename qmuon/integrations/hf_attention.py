"""QK-clip for Hugging Face attention without editing model code: transformers' attention interface.

transformers' attention modules (``LlamaAttention``, ``Qwen3Attention``, ...) project q / k / v, apply
RoPE (and Qwen3's QK-norm), then call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` with
the module, the queries ``(B, H, T, D)``, the keys and values ``(B, KV, S, D)`` (GQA: not repeated
yet), the mask and ``scaling``. This adapter registers, for each supported implementation ``impl``,
a function ``"qmuon_qk_<impl>"`` (``transformers.AttentionInterface.register``, with ``impl``'s mask
builder under the same name in ``AttentionMaskInterface``) that hands the queries, keys, mask and
scaling to :func:`qmuon.optim.qk_clip.observe_logits` and then calls ``impl`` itself with the
queries it returns (capped at ``tau`` under ``forward_cap``); installing QK-clip sets the attention
modules' ``config._attn_implementation`` to it. The attention kernel that runs is the one that ran
before (SDPA stays SDPA), so outputs are bit-identical while no head exceeds ``tau``.

Supported implementations: :data:`SUPPORTED_IMPLEMENTATIONS` (``eager``, ``sdpa``). Others
(FlashAttention, flex, paged) pass masks this side computation does not read the same way; a model
using one is refused at setup with this list (switch with ``model.set_attn_implementation("sdpa")``).

Imported by ``qmuon`` itself to register its adapter (:func:`qmuon.optim.qk_clip.register_attention_adapter`);
it imports transformers only when it meets a transformers module (the model's own import did).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from torch import Tensor, nn

from ..optim.qk_clip import AttentionSpec, observe_logits, register_attention_adapter

__all__ = ["SUPPORTED_IMPLEMENTATIONS", "hf_attention_spec", "measuring_implementation"]

#: Attention implementations whose queries, keys and masks the measure reads correctly.
SUPPORTED_IMPLEMENTATIONS = ("eager", "sdpa")
_PREFIX = "qmuon_qk_"


def _eager_of(module: nn.Module) -> Callable[..., Any]:
    """The model file's own ``eager_attention_forward`` (each model file defines one)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"qk_clip: {type(module).__name__}'s module defines no eager_attention_forward")
    return fn


def measuring_implementation(impl: str) -> str:
    """Register (once) and return the name of the measuring wrapper of attention implementation ``impl``."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface

    name = _PREFIX + impl
    if name in transformers.AttentionInterface._global_mapping:
        return name

    def attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  *args: Any, **kwargs: Any) -> Any:
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        # A 4-D mask already holds causality and padding (boolean for SDPA, additive for eager);
        # without one, SDPA applies is_causal itself and so does the measure.
        mask = attention_mask if isinstance(attention_mask, Tensor) and attention_mask.ndim == 4 else None
        query = observe_logits(module, query, key, scale=float(scaling),
                               causal=bool(is_causal) and query.shape[2] > 1, mask=mask)
        fn = _eager_of(module) if impl == "eager" else transformers.AttentionInterface._global_mapping[impl]
        return fn(module, query, key, value, attention_mask, *args, **kwargs)

    transformers.AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, AttentionMaskInterface._global_mapping[impl])
    return name


def hf_attention_spec(name: str, module: nn.Module) -> AttentionSpec | None:
    """The :class:`~qmuon.optim.qk_clip.AttentionSpec` of a transformers attention module (one with
    ``q_proj``, ``k_proj``, ``head_dim`` and a ``config``), ``None`` for any other module, and
    ``ValueError`` for one whose attention implementation or QK-norm the measure cannot handle."""
    if not type(module).__module__.startswith("transformers."):
        return None
    config = getattr(module, "config", None)
    q_proj, k_proj = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    head_dim = getattr(module, "head_dim", None)
    if config is None or not isinstance(q_proj, nn.Linear) or not isinstance(k_proj, nn.Linear) or not head_dim:
        return None
    impl = getattr(config, "_attn_implementation", None) or "eager"
    base = impl[len(_PREFIX):] if impl.startswith(_PREFIX) else impl
    if base not in SUPPORTED_IMPLEMENTATIONS:
        raise ValueError(
            f"qk_clip: {type(module).__name__} at {name!r} runs attn_implementation={impl!r}, whose logits QK-clip "
            f"cannot measure; supported: {SUPPORTED_IMPLEMENTATIONS} (model.set_attn_implementation('sdpa'))")
    n_heads = q_proj.out_features // head_dim
    n_kv = k_proj.out_features // head_dim
    if n_heads * head_dim != q_proj.out_features or n_kv * head_dim != k_proj.out_features or n_heads % n_kv:
        raise ValueError(f"qk_clip: {type(module).__name__} at {name!r}: q_proj ({q_proj.out_features} rows) and "
                         f"k_proj ({k_proj.out_features} rows) are not whole heads of {head_dim}")
    qk_norm = None
    q_norm, k_norm = getattr(module, "q_norm", None), getattr(module, "k_norm", None)
    if q_norm is not None or k_norm is not None:
        qw, kw = getattr(q_norm, "weight", None), getattr(k_norm, "weight", None)
        if qw is None or kw is None or qw.shape != (head_dim,) or kw.shape != (head_dim,):
            raise ValueError(
                f"qk_clip: {type(module).__name__} at {name!r} normalizes q / k ({type(q_norm).__name__}) in a way "
                "QK-clip cannot rescale (it needs per-head-dim gains q_norm.weight / k_norm.weight of shape "
                f"({head_dim},), as Qwen3's)")
        qk_norm = ((q_norm, "weight"), (k_norm, "weight"))

    def rows(proj: nn.Linear) -> list[tuple[nn.Module, str, int]]:
        return [(proj, "weight", 0)] + ([(proj, "bias", 0)] if proj.bias is not None else [])

    def install() -> None:
        config._attn_implementation = measuring_implementation(base)

    return AttentionSpec(name=name, module=module, n_heads=n_heads, n_kv_heads=n_kv, head_dim=int(head_dim),
                         q=rows(q_proj), k=rows(k_proj), qk_norm=qk_norm, install=install)


register_attention_adapter(hf_attention_spec)
