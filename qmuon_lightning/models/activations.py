"""Activations of a :class:`~qmuon_lightning.models.DecoderLM` training step, with and without
activation checkpointing: the bytes autograd keeps for backward and the most of them alive at once.
It lives beside the model (its ops are what it counts); :mod:`qmuon_lightning.memory` re-exports
:func:`decoder_activations`.

A count of the tensors DecoderLM's ops save, per token (``b``: bytes of the compute dtype, 2 under
bf16 autocast or bf16 weights, 4 in fp32; ``d``: width; ``q = n_heads * head_dim``; ``kv`` the
key/value width; ``H`` heads; ``h`` the SwiGLU hidden size):

* each RMSNorm (two per block, one before the head): its input or an fp32 copy of it, the fp32
  normalized input, the fp32 ``rstd``, and the next linear layer's input in the compute dtype:
  ``8d + 4 + b d``;
* attention: the fused q/k/v output (``v`` reaches SDPA as a view of it) and the rotated q and k,
  or with grouped-query heads the rotated q and the repeated k and v (``repeat_interleave`` keeps
  no input); SDPA's output and its fp32 log-sum-exp; the output projection's input (a copy):
  ``b (4q + 3kv) + 4H`` (MHA) or ``b 5q + 4H`` (GQA);
* SwiGLU: the fused gate/up output, ``silu(gate)`` and the down projection's input: ``4 b h``;
* the head: the final norm and ``log_softmax``'s fp32 output (``4 V``); bf16 autocast also keeps
  the bf16 copy of every linear weight (2 bytes per element) and of the rotary tables.

Where the step peaks (held to ``MemTracker`` by ``tests/test_activation_checkpointing.py`` and
``benchmarks/bench_activation_checkpointing.py``): without checkpointing at the start of backward,
every block's tensors plus the head's plus the fp32 gradients of ``log_softmax`` and of the logits
(``8 V`` per token); with checkpointing, only the blocks' inputs are kept (``d`` in the residual's
dtype: fp32 unless the weights are bf16), and backward rebuilds one block at a time: the peak is
the kept inputs, the head, and the larger of the logits' gradients or one rebuilt block plus the
gradient of the residual stream.

Counted from the CPU kernels of torch 2.13. On CUDA the fused RMSNorm keeps only its input and
``rstd`` and flash attention its output and log-sum-exp, so the estimate is high there by up to
``8 d`` bytes per norm and token (conservative).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ActivationEstimate", "compute_bytes", "decoder_activations"]


def compute_bytes(precision: str) -> tuple[int, int, bool]:
    """``(compute dtype bytes, residual stream bytes, autocast)`` of a Lightning ``precision``:
    ``"bf16-mixed"``: bf16 matmuls over fp32 weights (residual fp32); ``"bf16-true"`` / ``"bf16"``:
    bf16 weights; anything else fp32."""
    p = str(precision)
    if p.startswith("bf16-true") or p == "bf16":
        return 2, 2, False
    if p.startswith("bf16"):
        return 2, 4, True
    return 4, 4, False


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes of a step's activations (see the module docstring).

    ``kept``: what autograd holds from the end of forward to backward (every block's saved tensors,
    or under checkpointing the blocks' inputs, plus the head's); ``peak``: the most activation bytes
    alive at once, ``kept`` plus backward's working set at its largest moment, which ``where`` names."""

    kept: int
    peak: int
    where: str
    per_block: int
    checkpointing: bool

    def as_dict(self) -> dict[str, Any]:
        return {"kept": self.kept, "peak": self.peak, "where": self.where, "per_block": self.per_block,
                "checkpointing": self.checkpointing}


def decoder_activations(cfg: Any, batch_size: int, seq_len: int, *, precision: str = "32-true",
                        checkpointing: bool | None = None) -> ActivationEstimate:
    """The activations of one training step of a DecoderLM with config ``cfg``
    (:class:`~qmuon_lightning.models.DecoderLMConfig`) on ``batch_size x seq_len`` tokens.
    ``checkpointing``: default ``cfg.activation_checkpointing``."""
    ckpt = cfg.activation_checkpointing if checkpointing is None else bool(checkpointing)
    b, r, autocast = compute_bytes(precision)
    n = batch_size * seq_len
    d, h, heads, hd = cfg.d_model, cfg.hidden, cfg.n_heads, cfg.head_dim
    q, kv = heads * hd, cfg.kv_heads * hd
    norm = 8 * d + 4 + b * d
    attn = b * (5 * q if kv != q else 4 * q + 3 * kv) + 4 * heads
    block = n * (2 * norm + attn + 4 * b * h)
    if autocast:  # bf16 copies of the block's weights, and of the rotary tables (cos, sin, for q and k)
        block += 2 * (d * (q + 2 * kv) + q * d + 2 * d * h + h * d) + 4 * 2 * seq_len * (hd // 2)
    head = n * (norm + 4 * cfg.vocab_size) + (2 * d * cfg.vocab_size if autocast else 0)
    head_grads = n * 8 * cfg.vocab_size
    if not ckpt:
        kept = cfg.n_layers * block + head
        return ActivationEstimate(kept, kept + head_grads, "backward: gradient of the logits", block, False)
    kept = cfg.n_layers * n * d * r + head
    rebuild = block + n * d * r  # one block's tensors again, and the gradient of the residual stream
    where = "backward: a block rebuilt" if rebuild > head_grads else "backward: gradient of the logits"
    return ActivationEstimate(kept, kept + max(head_grads, rebuild), where, block, True)
