"""LoRA's A and B factors: Muon or AdamW? A byte-level fine-tune of a tiny Llama, measured.

The task: a tiny Llama (built from a config, no download) is pretrained with AdamW on the Python
standard library's sources (bytes, ``qmuon_lightning.data.bytes_corpus``), then fine-tuned with PEFT
LoRA (rank ``--rank`` on every attention and MLP projection; the base frozen) on English text: this
repository's ``docs/*.md`` as of a fixed commit (``--docs-commit``; files hashed into train /
validation). The score is the validation loss
on held-out docs files, in bits per byte, after ``--steps`` fine-tuning steps.

Compared, each at every learning rate of ``--lrs`` (one lr for all groups; linear warmup then
cosine, as the Trainer's ``cosine`` schedule) and ``--seeds`` seeds (the data order and LoRA's
initialization):

- ``qmuon lora=muon``: ``QMuonFactory(lora="muon")``: A and B in Muon (int8 momentum,
  ``match_rms_adamw`` lr scaling), the optimizer the Trainer gets;
- ``qmuon lora=adamw``: ``QMuonFactory(lora="adamw")``: A and B in QMuon's AdamW;
- ``torch AdamW``: ``torch.optim.AdamW`` on the LoRA parameters, PEFT's usual optimizer (reference).

The training loop is written out (no Trainer) so that every run evaluates on the same windows; the
optimizer is the one ``QMuonFactory`` builds for the Trainer. Prints the table and writes it with
``--out``.

    python benchmarks/bench_lora.py --out benchmarks/results/lora.md
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header_lines, md_table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def docs_corpus(commit: str, val_fraction: float = 0.2) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """docs/*.md bytes as of git ``commit`` (fixed, so the task does not change with the docs), split
    by file (SHA-1 of the name), NUL-separated."""
    import subprocess

    def git(*a: str) -> bytes:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, check=True).stdout

    names = sorted(n for n in git("ls-tree", "--name-only", commit, "docs/").decode().split() if n.endswith(".md"))
    train, val = bytearray(), bytearray()
    nt = nv = 0
    for name in names:
        data = git("show", f"{commit}:{name}") + b"\0"
        if int.from_bytes(hashlib.sha1(Path(name).name.encode()).digest()[:8], "big") < val_fraction * 2**64:
            val += data
            nv += 1
        else:
            train += data
            nt += 1
    t = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()  # noqa: E731
    return t(train), t(val), nt, nv


def tiny_llama(d: int, layers: int, seq: int, seed: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
                                   tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg).float()


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def bits_per_byte(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, batch: int) -> float:
    model.eval()
    total = sum(loss_of(model, xs[i:i + batch], ys[i:i + batch]).item() * len(xs[i:i + batch])
                for i in range(0, len(xs), batch))
    model.train()
    return total / len(xs) / math.log(2)


def schedule(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return step / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def pretrain(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    from qmuon_lightning.data.bytes_corpus import RandomWindowDataset, build_stdlib_corpus

    corpus = build_stdlib_corpus(max_bytes=2 << 20)
    model = tiny_llama(args.d, args.layers, args.seq, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    ds = RandomWindowDataset(corpus.train, args.seq, args.pretrain_steps * args.batch, seed=0)
    for step in range(args.pretrain_steps):
        for g in opt.param_groups:
            g["lr"] = 3e-3 * schedule(step, args.pretrain_steps, 20)
        xs, ys = zip(*(ds[step * args.batch + j] for j in range(args.batch)))
        loss = loss_of(model, torch.stack(xs), torch.stack(ys))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def finetune(base: dict[str, torch.Tensor], method: str, lr: float, seed: int, train: torch.Tensor,
             evals: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace) -> tuple[list[float], float]:
    import peft

    from qmuon.integrations.transformers import QMuonFactory
    from qmuon_lightning.data.bytes_corpus import RandomWindowDataset

    model = tiny_llama(args.d, args.layers, args.seq, seed=0)
    model.load_state_dict(base)
    torch.manual_seed(1000 + seed)  # LoRA A's initialization
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    if method == "torch AdamW":
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    else:
        opt = QMuonFactory()(model, lr=lr, weight_decay=0.0, lora=method.split("=")[1], verbose=False)
    initial = [g["lr"] for g in opt.param_groups]
    ds = RandomWindowDataset(train, args.seq, args.steps * args.batch, seed=seed)
    curve = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        f = schedule(step, args.steps, args.warmup)
        for g, lr0 in zip(opt.param_groups, initial):
            g["lr"] = lr0 * f
        xs, ys = zip(*(ds[step * args.batch + j] for j in range(args.batch)))
        loss = loss_of(model, torch.stack(xs), torch.stack(ys))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve.append(bits_per_byte(model, *evals, args.batch))
    return curve, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--pretrain-steps", type=int, default=300)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--docs-commit", default="12108b8", help="the git commit whose docs/*.md are the fine-tuning text")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from qmuon_lightning.data.bytes_corpus import fixed_windows

    t0 = time.perf_counter()
    base = pretrain(args)
    train, val, nt, nv = docs_corpus(args.docs_commit)
    evals = fixed_windows(val, args.seq, args.eval_windows, seed=123)
    import peft

    probe = tiny_llama(args.d, args.layers, args.seq, 0)
    probe.load_state_dict(base)
    base_bpb = bits_per_byte(probe, *evals, args.batch)
    print(f"pretrained {args.pretrain_steps} steps in {time.perf_counter() - t0:.0f} s; docs val before "
          f"fine-tuning: {base_bpb:.4f} bits/byte", flush=True)
    methods = ["qmuon lora=muon", "qmuon lora=adamw", "torch AdamW"]
    results: dict[tuple[str, float], list[list[float]]] = {}
    secs: dict[str, float] = {m: 0.0 for m in methods}
    for lr in args.lrs:
        for method in methods:
            for seed in range(args.seeds):
                curve, s = finetune(base, method, lr, seed, train, evals, args)
                secs[method] += s
                results.setdefault((method, lr), []).append(curve)
                print(f"{method:17s} lr {lr:.0e} seed {seed}: val bits/byte {' '.join(f'{v:.4f}' for v in curve)}",
                      flush=True)
    evals_at = [min((i + 1) * args.eval_every, args.steps) for i in range(len(next(iter(results.values()))[0]))]
    rows = []
    best: dict[str, tuple[float, float]] = {}
    for (method, lr), curves in results.items():
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(len(evals_at))]
        spread = max(c[-1] for c in curves) - min(c[-1] for c in curves)
        rows.append([method, f"{lr:.0e}"] + [f"{v:.4f}" for v in mean] + [f"{spread:.4f}"])
        if method not in best or mean[-1] < best[method][1]:
            best[method] = (lr, mean[-1])
    header = ["optimizer of A, B", "lr"] + [f"val bpb @ {s}" for s in evals_at] + ["seed spread (final)"]
    summary = [[m, f"{best[m][0]:.0e}", f"{best[m][1]:.4f}", f"{best[m][1] - best['torch AdamW'][1]:+.4f}",
                f"{secs[m] / args.seeds / len(args.lrs) / args.steps * 1e3:.0f}"] for m in methods]
    n_lora = sum(p.numel() for n, p in peft.get_peft_model(probe, peft.LoraConfig(
        r=args.rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        .named_parameters() if "lora_" in n)
    lines = header_lines("LoRA factors: Muon vs AdamW (tiny Llama, byte-level fine-tune)") + [
        f"Tiny Llama (d={args.d}, {args.layers} layers, vocab 256 bytes, seq {args.seq}) pretrained "
        f"{args.pretrain_steps} steps with torch AdamW on the Python stdlib sources, then LoRA rank {args.rank} on every attention and MLP "
        f"projection ({n_lora:,} trainable parameters, base frozen) fine-tuned {args.steps} steps (batch {args.batch}, "
        f"warmup {args.warmup} then cosine, weight decay 0) on this repository's docs/*.md at commit "
        f"{args.docs_commit} ({nt} train files, {nv} "
        f"held out). Validation: {args.eval_windows} fixed windows of the held-out docs, bits per byte; before "
        f"fine-tuning **{base_bpb:.4f}**. Mean over {args.seeds} seeds (data order and LoRA init).",
        "",
        "Best learning rate per optimizer (lowest final mean):",
        "",
        md_table(["optimizer of A, B", "best lr", f"val bpb @ {args.steps}", "vs torch AdamW", "ms / step"], summary),
        "",
        "Every run:",
        "",
        md_table(header, rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
