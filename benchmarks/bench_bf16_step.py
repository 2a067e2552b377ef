"""Optimizer-step time with bf16 weights (no fp32 master) against fp32 weights, interleaved.

One QMuon (int8 momentum, AdamW for embedding / head / gains) per weight setting on the same
GPT-shaped model (`DecoderLM`): fp32 weights, and bf16 weights with ``bf16_update`` nearest /
stochastic / ecc8. Every repetition steps each optimizer once on fixed gradients, in an order rotated
per repetition, so all settings see the same machine load; the median per setting and its ratio to
fp32 weights are reported. Also the time of the weight write alone (``apply_update_`` on the model's
largest matrix). Writes ``benchmarks/results/bf16_step.md``.

    python benchmarks/bench_bf16_step.py [--d-model 256 --layers 4 --reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from _common import cpu_name, ensure_backend  # noqa: E402

from qmuon_lightning import build_optimizer  # noqa: E402
from qmuon_lightning.core import apply as wa  # noqa: E402
from qmuon_lightning.models import DecoderLM  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = ("fp32", "nearest", "stochastic", "ecc8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "bf16_step.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch.ops.qmuon backend: {ensure_backend()}", flush=True)
    runs = {}
    for s in SETTINGS:
        torch.manual_seed(0)
        m = DecoderLM(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=4, max_seq_len=64)
        if s != "fp32":
            m = m.to(torch.bfloat16)
        opt = build_optimizer(m, verbose=False, **({} if s == "fp32" else {"bf16_update": s}))
        g = torch.Generator().manual_seed(1)
        for p in m.parameters():
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
        grads = [p.grad.clone() for p in m.parameters()]
        runs[s] = (m, opt, grads)
    n_params = sum(p.numel() for p in runs["fp32"][0].parameters())
    times = {s: [] for s in SETTINGS}
    for rep in range(args.reps + 2):
        order = SETTINGS[rep % 4:] + SETTINGS[: rep % 4]
        for s in order:
            m, opt, grads = runs[s]
            for p, gr in zip(m.parameters(), grads):
                p.grad = gr.clone()
            t0 = time.process_time()  # CPU time of this (1-thread) process: the machine is shared
            opt.step()
            dt = time.process_time() - t0
            if rep >= 2:  # the first two: state creation, warm-up
                times[s].append(dt)
    # the write alone, on the largest matrix
    big = max(runs["fp32"][0].parameters(), key=lambda p: p.numel())
    shape = tuple(big.shape)
    u = torch.randn(shape) * 1e-3
    wtimes = {s: [] for s in SETTINGS}
    w32 = torch.randn(shape)
    wb = {s: w32.to(torch.bfloat16) for s in SETTINGS[1:]}
    st = {s: wa.weight_state_init(wb[s], s) for s in SETTINGS[1:]}
    for rep in range(args.reps * 4):
        for s in SETTINGS[rep % 4:] + SETTINGS[: rep % 4]:
            t0 = time.process_time()
            for _ in range(5):  # process_time ticks coarsely: 5 writes per sample
                if s == "fp32":
                    wa.apply_update_(w32, u, alpha=-1e-3, decay=0.9999)
                else:
                    wa.apply_update_(wb[s], u, alpha=-1e-3, decay=0.9999, bf16_update=s, state=st[s],
                                     rng=(0, 1, rep, 0))
            wtimes[s].append((time.process_time() - t0) / 5)
    med = {s: statistics.median(v) for s, v in times.items()}
    wmed = {s: statistics.median(v) for s, v in wtimes.items()}
    lines = [
        "# Optimizer step with bf16 weights vs fp32 weights (interleaved)",
        "",
        f"`python benchmarks/bench_bf16_step.py --d-model {args.d_model} --layers {args.layers} --vocab {args.vocab} "
        f"--reps {args.reps} --threads {args.threads}`; {cpu_name()}, {args.threads} thread(s); DecoderLM "
        f"{n_params / 1e6:.1f}M parameters; QMuon int8 momentum, AdamW for embedding / head / gains; medians of "
        f"{args.reps} interleaved steps (rotated order), CPU time of the process (`time.process_time`, one "
        "thread: the machine is shared by other jobs, so wall time would count their share).",
        "",
        "| weights | optimizer step (ms) | ratio vs fp32 weights | weight write of the largest matrix "
        f"{shape[0]}x{shape[1]} (ms) | ratio |",
        "|---|---|---|---|---|",
    ]
    for s in SETTINGS:
        name = "fp32" if s == "fp32" else f"bf16, `{s}`"
        lines.append(f"| {name} | {1e3 * med[s]:.1f} | {med[s] / med['fp32']:.2f}x | {1e3 * wmed[s]:.2f} | "
                     f"{wmed[s] / wmed['fp32']:.2f}x |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
