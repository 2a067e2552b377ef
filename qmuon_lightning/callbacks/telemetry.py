"""Run telemetry that :class:`~qmuon_lightning.callbacks.summary.TrainSummary` logs and reports:
model FLOPs per token, the device's peak bf16 FLOP/s (for MFU), peak memory and the gradient norm.

The peak table holds dense (no 2:4 sparsity) bf16 tensor-core FLOP/s; where each number comes
from is in docs/callbacks.md ("Telemetry"). A device that is not in the table (or a CPU) has no
MFU unless the caller passes its own peak.
"""

from __future__ import annotations

import resource
import sys
from typing import Iterable

import torch
from torch import Tensor, nn

from qmuon.optim.heads import first_positive_int

__all__: list[str] = []

#: Dense bf16 tensor-core peak in TFLOP/s, matched against ``torch.cuda.get_device_name()`` in
#: order (first hit wins; the more specific names come first). Sources: docs/callbacks.md.
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("GB10",), 125.0),  # DGX Spark: derived from NVIDIA's 1 PFLOP FP4-with-sparsity figure (see docs)
    (("H200", "NVL"), 835.0),
    (("H200",), 989.0),
    (("H100", "NVL"), 835.0),
    (("H100", "PCIe"), 756.0),
    (("H100",), 989.0),  # SXM5 and other variants
)


def transformer_flops_per_token(n_params: int, n_layers: int, d_attn: int, seq_len: int) -> int:
    """Training FLOPs per token of a decoder transformer: ``6 * N + 12 * L * d_attn * T``.

    ``6 N``: forward (2 FLOPs per multiply-add per parameter) plus backward (twice the forward) of
    every matmul weight (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section 2.1).
    ``12 L d_attn T``: the attention scores ``Q K^T`` and their weighted sum with ``V`` (``2 x 2 x
    d_attn x T`` FLOPs per token and layer forward, x3 for training), counted over the full
    ``T x T`` score matrix as in PaLM (Chowdhery et al. 2022, appendix B), so the causal mask's
    skipped half still counts; this is the convention MFU numbers of nanoGPT, torchtitan and
    LitGPT use. ``N`` is every parameter except the input embedding table (a lookup, no
    multiply-adds); an untied output head is a matmul and counts; norm gains are counted too (a
    negligible share). ``d_attn`` is ``n_heads * head_dim``.
    """
    if min(n_params, n_layers, d_attn, seq_len) < 0:
        raise ValueError("n_params, n_layers, d_attn and seq_len must be non-negative")
    return 6 * n_params + 12 * n_layers * d_attn * seq_len


def _matmul_parameters(module: nn.Module) -> int:
    """Parameters except input embedding tables (a tied table counts once, as the output head's weight)."""
    params = {id(p): p for p in module.parameters()}
    linear_weights = {id(m.weight) for m in module.modules() if isinstance(m, nn.Linear)}
    for m in module.modules():
        if isinstance(m, nn.Embedding) and id(m.weight) not in linear_weights:
            params.pop(id(m.weight), None)
    return sum(p.numel() for p in params.values())


def model_flops_per_token(module: nn.Module, seq_len: int) -> int | None:
    """:func:`transformer_flops_per_token` for ``module``, or ``None`` when its shape is unknown.

    The layer count and attention width come from a ``config`` on the module or its ``model``
    attribute: ``n_layers`` / ``num_hidden_layers`` / ``n_layer`` and ``n_heads`` x ``head_dim``
    (or ``d_model`` / ``hidden_size`` / ``n_embd``), as in :class:`DecoderLMConfig` and Hugging
    Face configs. Parameter counts are global under FSDP (a DTensor's ``numel`` is the full size).
    """
    configs = [c for c in (getattr(module, "config", None), getattr(getattr(module, "model", None), "config", None))
               if c is not None]
    n_layers = first_positive_int(configs, ("n_layers", "num_hidden_layers", "n_layer"))
    heads = first_positive_int(configs, ("n_heads", "num_attention_heads", "n_head"))
    head_dim = first_positive_int(configs, ("head_dim",))
    d_attn = heads * head_dim if heads and head_dim else first_positive_int(configs, ("d_model", "hidden_size", "n_embd"))
    if n_layers is None or d_attn is None:
        return None
    return transformer_flops_per_token(_matmul_parameters(module), n_layers, d_attn, seq_len)


def peak_bf16_flops(device: torch.device) -> tuple[str, float | None]:
    """``(device name, dense bf16 peak FLOP/s or None)`` for ``device`` (``None``: CPU or not in the table)."""
    if device.type != "cuda":
        return device.type, None
    name = torch.cuda.get_device_name(device)
    for keys, tflops in PEAK_BF16_TFLOPS:
        if all(k.lower() in name.lower() for k in keys):
            return name, tflops * 1e12
    return name, None


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak memory of this process: CUDA ``{"allocated", "reserved"}`` bytes since the last
    ``torch.cuda.reset_peak_memory_stats``, else ``{"rss"}``: the process' peak resident set size
    (``getrusage``; the process lifetime, it cannot be reset)."""
    if device.type == "cuda":
        return {"allocated": int(torch.cuda.max_memory_allocated(device)),
                "reserved": int(torch.cuda.max_memory_reserved(device))}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rss": int(rss if sys.platform == "darwin" else rss * 1024)}  # bytes on macOS, KiB on Linux


def total_grad_norm(parameters: Iterable[Tensor]) -> float | None:
    """L2 norm of all gradients together (``None`` when no parameter has one, e.g. under DeepSpeed ZeRO).

    Sharded (FSDP2 DTensor) gradients give the norm over the full tensors: the per-shard partial
    result is reduced across ranks (a collective, so every rank must call this).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
