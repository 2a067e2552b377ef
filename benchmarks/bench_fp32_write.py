"""The fp32 weight write: ``torch.ops.qmuon.fp32_weight_update_`` against what the optimizer did
before (``update.contiguous()``, then torch's ``p.mul_(decay); p.add_(update, alpha)``), on the
d=256 GPT matrix shapes, row-major and transposed (a tall Newton-Schulz output), bf16 and fp32
updates. Interleaved repetitions (every variant once per round, rotating start), median microseconds
per call and the median per-round ratio. Results are bit-identical (checked once per case).

    python benchmarks/bench_fp32_write.py [--threads 1] [--rounds 41] [--cold] [--out benchmarks/results/fp32_write.md]

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
from qmuon_lightning.ops import _extension, _kernels  # noqa: E402

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    st = _extension.status()
    if not st.cpu or not _kernels.fp32_write_matches_torch(torch.device("cpu")):
        print(f"compiled fp32 write unavailable here (backend {st.backend}; {st.reason}); nothing to compare")
        return 1
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
