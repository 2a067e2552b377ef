"""Pretrain, then fine-tune, a tiny Llama / Qwen3 with QMuon in Hugging Face's Trainer and TRL's SFTTrainer.

Everything is local: the model is built from a config, the tokenizer is byte-level (built here), the
pretraining text is the Python standard library's sources and the fine-tuning text is this
repository's docs/*.md (files hashed into train / held out). The optimizer is one line in either
trainer::

    optimizer_cls_and_kwargs=(QMuonFactory, {"args": args, "state_format": "int8"})

Runs (from the repository root)::

    python examples/hf_finetune.py                                   # Trainer, full fine-tune
    python examples/hf_finetune.py --sft --lora muon                 # TRL SFTTrainer + PEFT LoRA
    torchrun --nproc_per_node 2 examples/hf_finetune.py --deepspeed 2   # ZeRO-2 (CPU: gloo)
    torchrun --nproc_per_node 2 examples/hf_finetune.py --fsdp2         # FSDP2 (GPUs; see below)

``--fsdp2`` on CPU: Accelerate keeps an FSDP plugin only on accelerators, so with ``use_cpu`` the
run is plain DDP; the script says so. ``--deepspeed`` runs without ``use_cpu`` (Accelerate drops
DeepSpeed under it): on a machine without GPUs DeepSpeed's CPU accelerator runs it over gloo.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402

from qmuon.integrations.transformers import QMuonFactory  # noqa: E402

SEQ = 128


def byte_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """256 byte tokens + 3 specials, no merges: any text, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")


def tiny_model(family: str, vocab: int) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=0,
                  eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    if family == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **common))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))


def docs_texts() -> tuple[list[str], list[str]]:
    """docs/*.md paragraphs, split by file into train / held out (SHA-1 of the file name)."""
    train, held = [], []
    for path in sorted((ROOT / "docs").glob("*.md")):
        paras = [p.strip() for p in path.read_text().split("\n\n") if len(p.strip()) > 40]
        h = int.from_bytes(hashlib.sha1(path.name.encode()).digest()[:8], "big")
        (held if h < 0.2 * 2**64 else train).extend(paras)
    return train, held


def windows(tok, texts: list[str], count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.tensor(tok("\n".join(texts))["input_ids"])
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - SEQ, (count,), generator=g)
    return [{"input_ids": ids[s:s + SEQ], "labels": ids[s:s + SEQ]} for s in starts.tolist()]


def stdlib_texts(max_bytes: int = 1 << 20) -> list[str]:
    import sysconfig

    out, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(errors="replace")
        out.append(text)
        total += len(text)
        if total > max_bytes:
            break
    return out


def training_args(ns: argparse.Namespace, out: str, steps: int, lr: float, **kw) -> transformers.TrainingArguments:
    extra: dict = dict(use_cpu=not torch.cuda.is_available())
    if ns.fsdp2:
        extra.update(fsdp=True, fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap":
                                             ["LlamaDecoderLayer", "Qwen3DecoderLayer"]})
    if ns.deepspeed is not None:
        extra = dict(use_cpu=False, deepspeed={"zero_optimization": {"stage": ns.deepspeed},
                                               "train_micro_batch_size_per_gpu": "auto",
                                               "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"})
    cls = transformers.TrainingArguments
    if kw.pop("sft", False) and ns.sft:
        import trl

        cls = trl.SFTConfig
        kw.update(max_length=SEQ, dataset_text_field="text")
    return cls(output_dir=out, max_steps=steps, per_device_train_batch_size=ns.batch, learning_rate=lr,
               warmup_steps=max(1, steps // 10), lr_scheduler_type="cosine", weight_decay=0.0, logging_steps=10,
               save_strategy="no", report_to=[], seed=0,
               ddp_backend="gloo" if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1
               else None,
               **extra, **kw)


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, rows: list[dict[str, torch.Tensor]]) -> float:
    model.eval()
    dev = next(model.parameters()).device
    x = torch.stack([r["input_ids"] for r in rows]).to(dev)
    loss = float(model(input_ids=x, labels=x).loss)
    model.train()
    return loss / math.log(2)  # bits per byte


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=["llama", "qwen3"], default="llama")
    ap.add_argument("--pretrain-steps", type=int, default=150)
    ap.add_argument("--steps", type=int, default=60, help="fine-tuning steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3, help="pretraining lr (both families: match_rms_adamw)")
    ap.add_argument("--ft-lr", type=float, default=1e-3, help="fine-tuning lr")
    ap.add_argument("--state-format", default="int8", help="Muon momentum: int8, grasp4, bf16, ...")
    ap.add_argument("--sft", action="store_true", help="fine-tune with TRL's SFTTrainer")
    ap.add_argument("--lora", choices=["muon", "adamw"], default=None, help="fine-tune PEFT LoRA factors with ...")
    ap.add_argument("--fsdp2", action="store_true")
    ap.add_argument("--deepspeed", type=int, choices=[0, 1, 2, 3], default=None, help="ZeRO stage")
    ap.add_argument("--out", default="runs/hf_finetune")
    ns = ap.parse_args()
    if ns.deepspeed is not None and not torch.cuda.is_available():
        from qmuon.integrations.deepspeed import avoid_cpu_op_builds

        avoid_cpu_op_builds()  # DeepSpeed's CPU accelerator would JIT-build an inference-only kernel first
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("WORLD_SIZE", "1"))))
    main_rank = int(os.environ.get("RANK", "0")) == 0
    tok = byte_tokenizer()
    train_txt, held_txt = docs_texts()
    held = windows(tok, held_txt, 64, seed=1)
    qmuon_kwargs = {"state_format": ns.state_format}

    # 1. pretrain on Python sources: every parameter, the Trainer's own loop, QMuon in one line
    model = tiny_model(ns.family, len(tok))
    args = training_args(ns, f"{ns.out}/pretrain", ns.pretrain_steps, ns.lr)
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=windows(tok, stdlib_texts(), ns.pretrain_steps * ns.batch, 0),
                                   optimizer_cls_and_kwargs=(QMuonFactory, {"args": args, **qmuon_kwargs}))
    if ns.fsdp2 and not trainer.is_fsdp_enabled and main_rank:
        print("note: Accelerate dropped the FSDP plugin (it applies FSDP only on accelerators); this run is DDP")
    trainer.train()
    model = trainer.model if not hasattr(trainer.model, "module") else trainer.model.module
    before = held_out_loss(model, held)

    # 2. fine-tune on the docs: full or LoRA, Trainer or SFTTrainer, the same line
    if ns.lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        qmuon_kwargs["lora"] = ns.lora
    args = training_args(ns, f"{ns.out}/finetune", ns.steps, ns.ft_lr, sft=True)
    hook = (QMuonFactory, {"args": args, **qmuon_kwargs})
    if ns.sft:
        import datasets
        import trl

        ds = datasets.Dataset.from_dict({"text": train_txt})
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                                 optimizer_cls_and_kwargs=hook)
    else:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=windows(tok, train_txt,
                                                                                     ns.steps * ns.batch, 2),
                                       optimizer_cls_and_kwargs=hook)
    trainer.train()
    after = held_out_loss(trainer.model, held)
    if main_rank:
        what = f"{'SFTTrainer' if ns.sft else 'Trainer'}, {'LoRA (' + ns.lora + ')' if ns.lora else 'full'}"
        print(f"held-out docs, bits per byte: {before:.3f} after pretraining -> {after:.3f} after fine-tuning ({what})")


if __name__ == "__main__":
    main()
    from qmuon.distributed import exit_after_distributed_run

    exit_after_distributed_run()  # under torchrun: gloo's threads can abort Python's finalization
