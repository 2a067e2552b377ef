"""Newton-Schulz time and accuracy: standard (``newton_schulz_folded``) vs Gram
(``newton_schulz_gram``) on square, 4:1 and 1:4 gradient-like matrices, interleaved, in bf16 and
fp32, with the mean |sigma - 1| of each result.

    OMP_NUM_THREADS=2 python benchmarks/bench_gram_ns.py --threads 2 --reps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from qmuon_lightning.core.gram_newton_schulz import newton_schulz_gram
from qmuon_lightning.core.newton_schulz import newton_schulz_folded, resolve_schedule


def gradlike(rows: int, cols: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    low = torch.randn(batch, rows, 8, generator=gen) @ torch.randn(batch, 8, cols, generator=gen)
    return 0.1 * low + 0.3 * torch.randn(batch, rows, cols, generator=gen)


def sigma_err(o: torch.Tensor) -> float:
    return statistics.mean((torch.linalg.svdvals(m.double()) - 1).abs().mean().item() for m in o)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--shapes", default="512x512,768x256,256x768,1024x256,256x1024")
    ap.add_argument("--schedules", default="muon:5,polar_express:6")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"{args.threads} thread(s), batch {args.batch}, median of {args.reps}; 1-min load {os.getloadavg()[0]:.1f}")
    print("| dtype | schedule | shape | standard ms | gram ms | speedup | mean abs(sigma-1) standard / gram |")
    print("|---|---|---|---:|---:|---:|---|")
    for dname in args.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dname]
        for spec in args.schedules.split(","):
            name, steps = spec.split(":")
            sch = resolve_schedule(name, int(steps))
            for shape in args.shapes.split(","):
                r, c = (int(x) for x in shape.split("x"))
                g = gradlike(r, c, args.batch, gen)
                inv = g.flatten(1).norm(dim=1).reciprocal()
                ts, tg = [], []
                for _ in range(args.reps):
                    t = time.perf_counter()
                    a = newton_schulz_folded(g, inv, sch, int(steps), dtype)
                    ts.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    b = newton_schulz_gram(g, inv, sch, int(steps), dtype)
                    tg.append(time.perf_counter() - t)
                ms, mg = statistics.median(ts), statistics.median(tg)
                print(f"| {dname} | {name} | {shape} | {1e3 * ms:.1f} | {1e3 * mg:.1f} | {ms / mg:.2f}x | "
                      f"{sigma_err(a):.4f} / {sigma_err(b):.4f} |")
    print(f"1-min load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
