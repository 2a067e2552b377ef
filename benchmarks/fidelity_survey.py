"""Measure per-layer update cosines with :class:`QuantFidelityMonitor` in short Lightning runs.

``python benchmarks/fidelity_survey.py --formats int8 grasp4 e0m3 int4 bf16`` trains the byte-level
DecoderLM of ``benchmarks/demo.py`` once per state format (same seed and data order) with the monitor
attached and prints, per measurement, the min / mean and every layer's cosine. The table in
``docs/callbacks.md`` (and the default threshold) came from these runs::

    --d-model 64  --layers 2 --seq-len 32 --steps 120 --every 60  --window 50
    --d-model 64  --layers 2 --seq-len 32 --steps 200 --every 100 --window 60
    --d-model 128 --layers 2 --seq-len 64 --heads 4 --steps 300 --every 100 --window 60
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Sequence

import torch
from torch.utils.data import DataLoader

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from demo import DemoModule  # noqa: E402  (benchmarks/demo.py)

from qmuon_lightning.callbacks import QuantFidelityMonitor  # noqa: E402
from qmuon_lightning.data.bytes_corpus import RandomWindowDataset, build_stdlib_corpus  # noqa: E402


def main(argv: Sequence[str] | None = None) -> dict[str, list[dict]]:
    p = argparse.ArgumentParser(prog="python benchmarks/fidelity_survey.py",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--formats", nargs="+", default=["int8", "grasp4", "e0m3", "int4", "bf16"])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=60)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--corpus-mb", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    corpus = build_stdlib_corpus(max_bytes=int(args.corpus_mb * (1 << 20)))
    out: dict[str, list[dict]] = {}
    for fmt in args.formats:
        L.seed_everything(0, verbose=False)
        ds = RandomWindowDataset(corpus.train, args.seq_len, args.steps * args.batch_size, seed=0)
        module = DemoModule(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len,
                            state_format=fmt, max_steps=args.steps, warmup_steps=5)
        monitor = QuantFidelityMonitor(args.every, window=args.window, threshold=-1.0)
        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[monitor])
        t0 = time.perf_counter()
        trainer.fit(module, DataLoader(ds, batch_size=args.batch_size))
        print(f"\n{fmt}: {time.perf_counter() - t0:.1f} s")
        for h in monitor.history:
            v = list(h["cos"].values())
            print(f"  step {h['step']}: min {min(v):.4f} mean {sum(v) / len(v):.4f}  "
                  + "  ".join(f"{k}={c:.3f}" for k, c in h["cos"].items()))
        out[fmt] = monitor.history
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
