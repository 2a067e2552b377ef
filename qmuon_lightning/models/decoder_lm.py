"""A small decoder-only language model for demos, benchmarks and recipes.

LLaMA-style: token embedding, pre-norm blocks (RMSNorm, causal self-attention with rotary position
embeddings and optional grouped-query heads, SwiGLU MLP), final RMSNorm, untied output head. The
attention's q/k/v projection and the MLP's gate/up projection are each one fused ``nn.Linear``
that declares its parts with ``qmuon_fused_parts``, so :func:`qmuon_lightning.build_optimizer`
normalizes and orthogonalizes q, k, v (and gate, up) as separate matrices. The attention reports
its queries and keys to QK-clip (``build_optimizer(model, qk_clip={"tau": 100})``,
:mod:`qmuon.optim.qk_clip`), which measures each head's largest logit while it is on.

Activation checkpointing (``DecoderLM(activation_checkpointing=True)``): each block's forward runs
under ``torch.utils.checkpoint`` (non-reentrant), so a training step keeps only the blocks' inputs
and recomputes one block's activations at a time in backward (about one more forward's compute).
The recomputation replays the same kernels on the same inputs, so losses and gradients are
bit-identical (``tests/test_activation_checkpointing.py``); parameters receive their gradient once
(the recomputed graph is never backpropagated), so gradient-release hooks fire once per step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from qmuon.optim.qk_clip import AttentionSpec, observe_logits

__all__ = ["Block", "DecoderLM", "DecoderLMConfig", "mean_window_loss"]


@dataclass
class DecoderLMConfig:
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: same as n_heads (no grouped-query attention)
    mlp_hidden: int | None = None  # None: 8/3 * d_model rounded up to a multiple of 64
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    #: run each block under torch.utils.checkpoint (non-reentrant) in training: keep the blocks'
    #: inputs only, recompute a block's activations in backward
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        kv = self.n_kv_heads or self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={kv}")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("the head dimension must be even for rotary embeddings")
        if not isinstance(self.activation_checkpointing, bool):
            raise TypeError(f"activation_checkpointing must be True or False, got {self.activation_checkpointing!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 64 * math.ceil(self.d_model * 8 / 3 / 64)


def _rope_tables(cfg: DecoderLMConfig, device: torch.device | None = None) -> tuple[Tensor, Tensor]:
    half = cfg.head_dim // 2
    freqs = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=device) / half)
    t = torch.arange(cfg.max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(t, freqs)
    return angles.cos(), angles.sin()


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) by position-dependent angles. x: (B, H, T, D)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, None].to(x.dtype), sin[None, None].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, q + 2 * kv, bias=False)
        self.qkv.qmuon_fused_parts = {"weight": (q, kv, kv)}  # read by build_optimizer's router
        self.proj = nn.Linear(q, cfg.d_model, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        cfg = self.cfg
        q, k, v = self.qkv(x).split([cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim], dim=-1)
        q = q.view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos[:t], sin[:t]), _apply_rope(k, cos[:t], sin[:t])
        # QK-clip (build_optimizer(..., qk_clip={...})): this layer's per-head max logit, on the device,
        # and the queries capped at tau (forward_cap); q itself when no QK-clip watches this layer
        q = observe_logits(self, q, k, scale=cfg.head_dim ** -0.5, causal=True)
        if cfg.kv_heads != cfg.n_heads:
            rep = cfg.n_heads // cfg.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))

    def qmuon_attention(self) -> AttentionSpec:
        """Where QK-clip finds this layer's heads: q rows first, then k rows, of the fused ``qkv``."""
        cfg = self.cfg
        return AttentionSpec(name="", module=self, n_heads=cfg.n_heads, n_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                             q=[(self.qkv, "weight", 0)], k=[(self.qkv, "weight", cfg.n_heads * cfg.head_dim)])


class SwiGLU(nn.Module):
    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.gate_up = nn.Linear(cfg.d_model, 2 * h, bias=False)
        self.gate_up.qmuon_fused_parts = {"weight": (h, h)}
        self.down = nn.Linear(h, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """One pre-norm transformer block: the unit that FSDP wraps."""

    def __init__(self, cfg: DecoderLMConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class DecoderLM(nn.Module):
    def __init__(self, cfg: DecoderLMConfig | None = None, **overrides) -> None:
        super().__init__()
        cfg = dataclasses.replace(cfg, **overrides) if cfg is not None else DecoderLMConfig(**overrides)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = _rope_tables(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.ndim >= 2:
                # GPT-2 style: residual output projections scaled down by depth.
                scale = 1.0 / math.sqrt(2 * self.cfg.n_layers) if name.endswith(("proj.weight", "down.weight")) else 1.0
                nn.init.normal_(p, std=std * scale)
        for m in self.modules():
            if isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        if self.rope_cos.device != idx.device or self.rope_cos.is_meta:
            cos, sin = _rope_tables(self.cfg, idx.device)
        else:
            cos, sin = self.rope_cos, self.rope_sin
        x = self.embed(idx)
        recompute = self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            x = checkpoint(block, x, cos, sin, use_reentrant=False) if recompute else block(x, cos, sin)
        return self.lm_head(self.norm(x))

    @property
    def activation_checkpointing(self) -> bool:
        """Whether each block runs under ``torch.utils.checkpoint`` in training."""
        return self.cfg.activation_checkpointing

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def mean_window_loss(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` over fixed windows ``x`` -> ``y``, in eval mode
    (logits taken in fp32). Under FSDP2 every rank must call it: the forward is collective."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, x.size(0), batch_size):
        logits = model(x[i: i + batch_size])
        tgt = y[i: i + batch_size]
        total += float(F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), tgt.reshape(-1), reduction="sum"))
        count += tgt.numel()
    model.train(was_training)
    return total / count
