"""Newton-Schulz time and accuracy: standard (``newton_schulz_folded``) vs Gram
(``newton_schulz_gram``) on square, 3:1 / 1:3 and 4:1 / 1:4 gradient-like matrices, in bf16 and fp32,
batches of 1 and 4, with the mean |sigma - 1| of each result.

The two methods run interleaved in one process (standard, gram, standard, gram, ...), so load from
other processes hits both alike. Each repetition times both with the thread's CPU time
(``time.thread_time``: the work the calling thread did, not the time it waited for a core; with 1
intra-op thread PyTorch runs every kernel on the calling thread) and with wall time. The speedup
columns are the median over repetitions of the per-repetition ratio standard / gram.

    OMP_NUM_THREADS=1 python benchmarks/bench_gram_ns.py --threads 1 --reps 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from _common import cpu_name
from qmuon.core.gram_newton_schulz import newton_schulz_gram, pick_ns_method
from qmuon.core.newton_schulz import newton_schulz_folded, resolve_schedule

DEFAULT_SHAPES = "512x512,768x256,256x768,1024x256,256x1024,3072x768,768x3072"


def gradlike(rows: int, cols: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """Rank-8 signal plus noise: the spectrum of a momentum of a few batches' gradients."""
    low = torch.randn(batch, rows, 8, generator=gen) @ torch.randn(batch, 8, cols, generator=gen)
    return 0.1 * low + 0.3 * torch.randn(batch, rows, cols, generator=gen)


def sigma_err(o: torch.Tensor) -> float:
    """Mean over the batch of the mean |sigma_i - 1| over the singular values (float64 SVD)."""
    return statistics.mean((torch.linalg.svdvals(m.double()) - 1).abs().mean().item() for m in o)


def time_pair(g, inv, sch, steps, dtype, reps):
    """Interleaved timings: per-rep (cpu, wall) seconds for standard and gram, and the CPU time of
    the ``.contiguous()`` the optimizer's apply makes of a non-contiguous result (standard NS
    returns a tall result as a transposed view, core/pipeline.py ``apply_to``; gram returns it
    contiguous)."""
    fns = (("standard", newton_schulz_folded), ("gram", newton_schulz_gram))
    for _, f in fns:  # warm-up: oneDNN primitive creation, allocator
        f(g, inv, sch, steps, dtype)
    cpu = {k: [] for k, _ in fns}
    wall = {k: [] for k, _ in fns}
    contig = {k: [] for k, _ in fns}
    for _ in range(reps):
        for k, f in fns:
            w0, c0 = time.perf_counter(), time.thread_time()
            out = f(g, inv, sch, steps, dtype)
            cpu[k].append(time.thread_time() - c0)
            wall[k].append(time.perf_counter() - w0)
            c0 = time.thread_time()
            if not out.is_contiguous():
                out = out.contiguous()
            contig[k].append(time.thread_time() - c0)
    return cpu, wall, contig


def ratio(d: dict, extra: dict | None = None) -> float:
    """Median over repetitions of standard / gram (``extra``: added to both, per repetition)."""
    e = extra or {k: [0.0] * len(v) for k, v in d.items()}
    return statistics.median((s + es) / (g + eg) for s, g, es, eg in
                             zip(d["standard"], d["gram"], e["standard"], e["gram"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--schedules", default="muon:5,polar_express:6")
    ap.add_argument("--no-accuracy", action="store_true", help="skip the SVDs (mean |sigma - 1|)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"CPU: {cpu_name()}; {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"{args.threads} thread(s), median of {args.reps} interleaved repetitions; "
          f"1-min load at start {os.getloadavg()[0]:.1f}")
    print()
    print("| dtype | schedule | shape | batch | standard ms (cpu) | gram ms (cpu) | speedup cpu | speedup wall "
          "| speedup cpu incl. apply's .contiguous() | auto picks | mean abs(sigma-1) standard / gram |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|---|")
    for dname in args.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dname]
        for spec in args.schedules.split(","):
            name, steps_s = spec.split(":")
            steps = int(steps_s)
            sch = resolve_schedule(name, steps)
            for shape in args.shapes.split(","):
                r, c = (int(x) for x in shape.split("x"))
                for batch in (int(b) for b in args.batches.split(",")):
                    g = gradlike(r, c, batch, gen)
                    inv = g.flatten(1).norm(dim=1).reciprocal()
                    x = g.to(dtype)  # the pipeline hands NS a batch in the NS dtype
                    cpu, wall, contig = time_pair(x, inv, sch, steps, dtype, args.reps)
                    if args.no_accuracy:
                        acc = "-"
                    else:
                        a = newton_schulz_folded(x, inv, sch, steps, dtype)
                        b = newton_schulz_gram(x, inv, sch, steps, dtype)
                        acc = f"{sigma_err(a):.4f} / {sigma_err(b):.4f}"
                    auto = pick_ns_method("auto", r, c, "cpu", dtype)
                    print(f"| {dname} | {name} | {shape} | {batch} | {1e3 * statistics.median(cpu['standard']):.2f} | "
                          f"{1e3 * statistics.median(cpu['gram']):.2f} | {ratio(cpu):.2f}x | {ratio(wall):.2f}x | "
                          f"{ratio(cpu, contig):.2f}x | "
                          f"{auto} | {acc} |", flush=True)
    print()
    print(f"1-min load at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
