"""Tiny Hugging Face mixture-of-experts models built from configs (no download) and the per-expert
yardstick: each expert's gate, up and down matrix, as ``(out, in)``, read from the models' own
forward code (not from QMuon's router). Shared by tests/test_moe.py and its worker processes."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

VOCAB, D, INTER, EXPERTS, TOPK, HEADS, LAYERS, SEQ, BATCH = 128, 32, 16, 4, 2, 4, 2, 32, 4
LR = 0.02
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "olmoe")


def make_moe(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny MoE causal LM of ``family`` (random weights, fp32, no dropout)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=HEADS // 2, max_position_embeddings=SEQ, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0, num_experts_per_tok=TOPK)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(moe_intermediate_size=INTER, intermediate_size=2 * INTER, num_experts=EXPERTS,
                                head_dim=D // HEADS, decoder_sparse_step=1, mlp_only_layers=[], **common)
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif family == "mixtral":
        cfg = tf.MixtralConfig(intermediate_size=INTER, num_local_experts=EXPERTS, head_dim=D // HEADS, **common)
        model = tf.MixtralForCausalLM(cfg)
    elif family == "gpt_oss":
        cfg = tf.GptOssConfig(intermediate_size=INTER, num_local_experts=EXPERTS, head_dim=D // HEADS,
                              sliding_window=SEQ, layer_types=["full_attention"] * LAYERS, **common)
        model = tf.GptOssForCausalLM(cfg)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(intermediate_size=INTER, num_experts=EXPERTS, **common)
        model = tf.OlmoeForCausalLM(cfg)
    else:
        raise ValueError(family)
    model.config._experts_implementation = "eager"
    return model.float()


def tokens(step: int = 0, rank: int = 0, batch: int = BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (batch, SEQ), generator=g)


def lm_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def expert_blocks(family: str) -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """Every expert matrix as ``(out, in)``: name -> (parameter name, stored bank -> layer matrix).

    Qwen3-MoE / Mixtral / OLMoE: ``F.linear(x, gate_up_proj[e]).chunk(2, -1)``: gate rows then up
    rows; ``F.linear(h, down_proj[e])``. gpt-oss: ``x @ gate_up_proj[e]``, gate = columns ``::2``,
    up = columns ``1::2``; ``h @ down_proj[e]`` (stored ``(in, out)``)."""
    out: dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = {}
    mlp = "mlp"
    for i in range(LAYERS):
        pre = f"model.layers.{i}.{mlp}.experts"
        for e in range(EXPERTS):
            gu, dn = f"{pre}.gate_up_proj", f"{pre}.down_proj"
            if family == "gpt_oss":
                out[f"{pre}.{e}.gate"] = (gu, lambda t, e=e: t[e][:, 0::2].T)
                out[f"{pre}.{e}.up"] = (gu, lambda t, e=e: t[e][:, 1::2].T)
                out[f"{pre}.{e}.down"] = (dn, lambda t, e=e: t[e].T)
            else:
                out[f"{pre}.{e}.gate"] = (gu, lambda t, e=e: t[e][:INTER])
                out[f"{pre}.{e}.up"] = (gu, lambda t, e=e: t[e][INTER:])
                out[f"{pre}.{e}.down"] = (dn, lambda t, e=e: t[e])
    return out


def torch_muon_update(w: torch.Tensor, g: torch.Tensor, lr: float = LR) -> torch.Tensor:
    """``torch.optim.Muon``'s first-step update of an ``(out, in)`` layer ``w`` with gradient ``g``."""
    p = torch.nn.Parameter(w.detach().clone().contiguous())
    p.grad = g.detach().clone().contiguous()
    torch.optim.Muon([p], lr=lr, weight_decay=0.0, adjust_lr_fn="original").step()
    return p.detach() - w


def compare(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(cosine, norm ratio) of two updates."""
    cos = F.cosine_similarity(ours.flatten().double(), ref.flatten().double(), dim=0).item()
    return cos, (ours.norm() / ref.norm()).item()


def expert_report(family: str, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                  grads: dict[str, torch.Tensor]) -> dict[str, tuple[float, float]]:
    """Per expert block: (cosine, norm ratio) of the update against torch.optim.Muon on that block."""
    report = {}
    for block, (pname, view) in expert_blocks(family).items():
        ours = view(after[pname] - before[pname])
        ref = torch_muon_update(view(before[pname]), view(grads[pname]))
        report[block] = compare(ours, ref)
    return report
