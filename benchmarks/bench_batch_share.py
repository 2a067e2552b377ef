"""QMuon int8 step (default options) vs the bare batched Newton-Schulz floor, for several values of
``core.pipeline.BATCH_STEP_SHARE`` (the share of the step's Muon elements a batch may hold),
interleaved in one process on GPT-shaped matrices (d x 4 layers: qkv 3d x d, out d x d, fc 4d x d,
proj d x 4d).

The floor: every same-shape gradient stacked into one batch, ``newton_schulz_folded`` in the
``ns_dtype="auto"`` dtype, nothing else. Gradients are restored outside the timed region.

    OMP_NUM_THREADS=1 python benchmarks/bench_batch_share.py --d 256 --rounds 14 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from qmuon import QMuon
from qmuon.core import pipeline
from qmuon.core.newton_schulz import newton_schulz_folded, resolve_ns_dtype, resolve_schedule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--shares", default="0.25,0.5,1.0")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    d = args.d
    shapes = [s for _ in range(args.layers) for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    shares = [float(x) for x in args.shares.split(",")]
    runs = {}
    for sh in shares:
        ps = [torch.nn.Parameter(0.02 * torch.randn(s, generator=gen)) for s in shapes]
        runs[sh] = (ps, QMuon(ps))
    sch, dtype = resolve_schedule("muon", 5), resolve_ns_dtype("auto", "cpu")

    def floor() -> None:
        by: dict = {}
        for g in grads:
            by.setdefault(tuple(g.shape), []).append(g)
        for gs in by.values():
            b = torch.stack(gs)
            newton_schulz_folded(b, b.flatten(1).norm(dim=1).reciprocal(), sch, 5, dtype=dtype)

    keys: list = shares + ["floor"]
    times: dict = {k: [] for k in keys}
    load0 = os.getloadavg()[0]
    for r in range(args.warmup + args.rounds):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for k in order:
            if k == "floor":
                t = time.perf_counter()
                floor()
            else:
                ps, opt = runs[k]
                for p, g in zip(ps, grads):
                    p.grad = g.clone()
                pipeline.BATCH_STEP_SHARE = k
                t = time.perf_counter()
                opt.step()
            if r >= args.warmup:
                times[k].append(time.perf_counter() - t)
    fl = times["floor"]
    print(f"d={d} x {args.layers} layers, {args.threads} thread(s), NS dtype {dtype}, {args.rounds} rounds; "
          f"1-min load {load0:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print("| BATCH_STEP_SHARE | median ms/step | median per-round ratio to floor |")
    print("|---:|---:|---:|")
    for k in shares:
        x = times[k]
        print(f"| {k} | {1e3 * statistics.median(x):.1f} | {statistics.median([a / b for a, b in zip(x, fl)]):.3f}x |")
    print(f"| floor (bare batched NS) | {1e3 * statistics.median(fl):.1f} | 1.000x |")


if __name__ == "__main__":
    main()
