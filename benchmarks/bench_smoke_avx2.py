"""The quickstart recipe natively and with the CPU capped at AVX2 (bf16 matmul emulated), side by side.

    python benchmarks/bench_smoke_avx2.py --steps 60 --rounds 2 --threads 1 --out benchmarks/results/smoke_avx2.md

Each round runs ``qmuon-train fit --config recipes/cpu/smoke.yaml`` bounded to ``--steps`` steps, once
natively and once under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, in alternating order,
after one untimed warm-up run that builds the kernels. It reports each fit's wall time (from the
summary), the mean and median optimizer step, and the capped / native ratio of the fit. On a shared
machine the OpenMP threads of one step wait for each other whenever another process runs (10-50x
single steps); ``--threads 1`` and the median keep that out of the comparison, and the load average
before each run is printed so a loaded run can be told apart.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_name, header_lines, md_table  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CAPPED = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def run(steps: int, threads: int, capped: bool, root: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **(CAPPED if capped else {}))
    cmd = ["qmuon-train", "fit", "--config", str(REPO / "recipes/cpu/smoke.yaml"), f"--trainer.max_steps={steps}",
           f"--trainer.val_check_interval={steps}", f"--trainer.default_root_dir={root}", "--ckpt_path=null",
           "--trainer.enable_progress_bar=false"]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    (summary,) = Path(root).rglob("summary.json")
    s = json.loads(summary.read_text())
    return {"capped": capped, "load": load, "wall_s": s["fit_seconds"],
            "step_mean_ms": s["optimizer_step_ms_mean"], "step_median_ms": s.get("optimizer_step_ms_median"),
            "summary": s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(2, args.threads, False, os.path.join(tmp, "warmup"))  # builds the kernels (not timed)
        results = []
        for r in range(args.rounds):
            for capped in ((False, True) if r % 2 == 0 else (True, False)):
                res = run(args.steps, args.threads, capped, os.path.join(tmp, f"r{r}_{int(capped)}"))
                results.append(res)
                print(f"round {r} {'capped' if capped else 'native'}: fit {res['wall_s']:.1f} s, step mean "
                      f"{res['step_mean_ms']:.1f} ms, median {res['step_median_ms']}, load {res['load']:.2f}", flush=True)
    rows = [[str(i // 2), "AVX2-capped" if x["capped"] else "native", f"{x['load']:.2f}", f"{x['wall_s']:.1f}",
             f"{x['step_mean_ms']:.1f}", f"{x['step_median_ms']:.1f}" if x["step_median_ms"] is not None else "-"]
            for i, x in enumerate(results)]
    nat = [x["wall_s"] for x in results if not x["capped"]]
    cap = [x["wall_s"] for x in results if x["capped"]]
    ratio = statistics.median(cap) / statistics.median(nat)
    lines = header_lines("Quickstart recipe, native vs AVX2-capped") + [
        "", f"`python benchmarks/bench_smoke_avx2.py --steps {args.steps} --rounds {args.rounds} --threads {args.threads}`"
        f" on {cpu_name()}; {args.steps} steps of recipes/cpu/smoke.yaml each (validation once at the end).", "",
        md_table(["round", "mode", "load before", "fit (s)", "optimizer step mean (ms)", "median (ms)"], rows), "",
        f"**Capped / native fit (medians): {ratio:.2f}x** (target <= 1.5x).", ""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
