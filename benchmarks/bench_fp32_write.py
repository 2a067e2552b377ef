"""The fp32 weight write: ``torch.ops.qmuon.fp32_weight_update_`` against what the optimizer did
before (``update.contiguous()``, then torch's ``p.mul_(decay); p.add_(update, alpha)``), on the
d=256 GPT matrix shapes, row-major and transposed (a tall Newton-Schulz output), bf16 and fp32
updates. Interleaved repetitions (every variant once per round, rotating start), median microseconds
per call and the median per-round ratio. Results are bit-identical (checked once per case).

    python benchmarks/bench_fp32_write.py [--threads 1] [--rounds 41] [--cold] [--out benchmarks/results/fp32_write.md]
    python benchmarks/bench_fp32_write.py --step [--rounds 40]   # the whole step, fused write on / off

``--step``: the whole QMuon int8 step (defaults, lr 0.02, weight decay 0.01, d=256 x 4 GPT matrices,
one group) with the compiled write and with it switched off (the op then runs torch's ``mul_`` +
``add_``), beside ``bench_step.py``'s bare batched Newton-Schulz floor, interleaved in one process:
medians and median per-round ratios to the floor.

``--cold``: each call writes a different weight matrix out of a set larger than the last-level
cache slice (32 MiB per case), as in a step where the weights come from DRAM; default: one matrix,
warm in cache (the kernel's own cost).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package

import qmuon_lightning  # noqa: E402,F401  (registers torch.ops.qmuon)
from qmuon.ops import _extension, _kernels  # noqa: E402

SHAPES = [(768, 256), (1024, 256), (256, 1024), (256, 256)]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def step_ab(rounds: int) -> None:
    """The whole step with the fused write on and off, against the floor (see the docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_step import NSFloor

    import qmuon

    shapes = [(768, 256), (256, 256), (1024, 256), (256, 1024)] * 4

    def params() -> list[torch.nn.Parameter]:
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]

    gen = torch.Generator().manual_seed(1)
    pool = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    runs = {}
    ps = params()
    runs["floor"] = (ps, NSFloor(ps))
    for name in ("fused write", "torch mul_ + add_"):
        ps = params()
        runs[name] = (ps, qmuon.QMuon([{"params": ps, "use_muon": True}], lr=0.02, weight_decay=0.01))
    for ps, _ in runs.values():
        for p in ps:
            p.grad = torch.zeros_like(p)
    times: dict[str, list[float]] = {k: [] for k in runs}
    names = list(runs)
    for r in range(rounds + 3):
        k0 = r % len(names)
        for name in names[k0:] + names[:k0]:
            ps, opt = runs[name]
            for p, g in zip(ps, pool[r % 3]):
                p.grad.copy_(g)
            _kernels._add_fused["cpu"] = name != "torch mul_ + add_"
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            if r >= 3:
                times[name].append(dt * 1e3)
    _kernels._add_fused["cpu"] = True
    fl = times["floor"]
    print(f"CPU: {_cpu_name()}, threads {torch.get_num_threads()}, {rounds} rounds, 1-min load {os.getloadavg()[0]:.1f}")
    for name in names:
        t = times[name]
        print(f"{name:20s} median {statistics.median(t):7.2f} ms   / floor: ratio of medians "
              f"{statistics.median(t) / statistics.median(fl):.3f}x, median per-round "
              f"{statistics.median([a / b for a, b in zip(t, fl)]):.3f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--step", action="store_true", help="the whole step, fused write on / off, vs the floor")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    st = _extension.status()
    if not st.cpu or not _kernels.fp32_write_matches_torch(torch.device("cpu")):
        print(f"compiled fp32 write unavailable here (backend {st.backend}; {st.reason}); nothing to compare")
        return 1
    if args.step:
        step_ab(args.rounds)
        return 0
    gen = torch.Generator().manual_seed(0)
    alpha, decay = -0.02, 0.9998
    rows_out = []
    for rows, cols in SHAPES:
        for layout in ("row-major", "transposed"):
            for udt in (torch.bfloat16, torch.float32):
                n_w = max(1, (32 << 20) // (rows * cols * 4)) if args.cold else 1
                ws = [torch.randn(rows, cols, generator=gen) for _ in range(n_w)]
                u = torch.randn(rows, cols, generator=gen) if layout == "row-major" else \
                    torch.randn(cols, rows, generator=gen).mT
                u = u.to(udt)
                a, b = ws[0].clone(), ws[0].clone()
                torch.ops.qmuon.fp32_weight_update_(a, u, alpha, decay)
                b.mul_(decay)
                b.add_(u.contiguous(), alpha=alpha)
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (rows, cols, layout, udt)

                def fused(w: torch.Tensor) -> None:
                    torch.ops.qmuon.fp32_weight_update_(w, u, alpha, decay)

                def before(w: torch.Tensor) -> None:
                    w.mul_(decay)
                    w.add_(u.contiguous(), alpha=alpha)

                variants = {"fused": fused, "before": before}
                times: dict[str, list[float]] = {k: [] for k in variants}
                names = list(variants)
                for r in range(args.rounds + 3):
                    for k in names[r % 2:] + names[:r % 2]:
                        w = ws[r % n_w]
                        t0 = time.perf_counter()
                        variants[k](w)
                        dt = time.perf_counter() - t0
                        if r >= 3:
                            times[k].append(dt * 1e6)
                med = {k: statistics.median(v) for k, v in times.items()}
                ratio = statistics.median([x / y for x, y in zip(times["fused"], times["before"])])
                rows_out.append((f"{rows}x{cols}", layout, str(udt).replace("torch.", ""), med["fused"], med["before"],
                                 ratio))
                print(f"{rows}x{cols} {layout:10s} {udt}: fused {med['fused']:.0f} us, before {med['before']:.0f} us, "
                      f"per-round ratio {ratio:.3f}")
    lines = [
        "# fp32 weight write: fused op vs contiguous() + mul_ + add_",
        "",
        f"- command: `python benchmarks/bench_fp32_write.py --threads {args.threads} --rounds {args.rounds}"
        f"{' --cold' if args.cold else ''}`",
        f"- CPU: {_cpu_name()}, torch {torch.__version__}, ATen capability "
        f"{torch.backends.cpu.get_cpu_capability()}, threads {args.threads}, 1-min load {os.getloadavg()[0]:.1f} at end",
        f"- weights: {'cold (a 32 MiB set per case, one matrix per call)' if args.cold else 'warm (one matrix)'};"
        f" {args.rounds} interleaved rounds; results bit-identical",
        "",
        "| matrix | update layout | update dtype | fused us | before us | median per-round ratio |",
        "|---|---|---|---:|---:|---:|",
    ]
    lines += [f"| {s} | {lay} | {dt} | {f:.0f} | {b:.0f} | {r:.3f}x |" for s, lay, dt, f, b, r in rows_out]
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
