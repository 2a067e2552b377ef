"""The eager vs compiled step-time table of benchmarks/gpu_check.sh's summary, from bench_step.py's JSON files.

    python benchmarks/gpu_check_tables.py cuda WORK/step_compiled_gpt_small.json WORK/step_compiled_1b.json

One row per matrix set: the median ms per ``step()`` of ``torch.optim.Muon``, QMuon int8 eager and QMuon
int8 through ``qmuon.compile_step`` (inductor), and the medians of the per-round ratios (each round times
every optimizer once). The captured CUDA-graph step is n/a: a capturable step is not implemented. Files
that are missing (a step that failed or did not run) are listed as such.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

MUON, EAGER, COMPILED = "torch.Muon", "qmuon-int8-noparts", "qmuon-int8-noparts-compiled"


def _ratio(times: dict, a: str, b: str) -> str:
    if a not in times or b not in times:
        return "-"
    return f"{statistics.median(x / y for x, y in zip(times[a], times[b])):.2f}x"


def _ms(times: dict, name: str) -> str:
    return f"{statistics.median(times[name]):.2f}" if times.get(name) else "-"


def main(device: str, paths: list[str]) -> int:
    rows, missing = [], []
    for p in map(Path, paths):
        if not p.is_file():
            missing.append(p.stem)
            continue
        meta = json.loads(p.read_text())
        for c in meta["configs"]:
            t = c["times_ms"]
            rows.append(f"| d={c['d_model']} x {c['layers']} ({c['elements'] / 1e6:.{0 if c['elements'] >= 1e7 else 1}f}M in {c['matrices']} matrices) "
                        f"| {_ms(t, MUON)} | {_ms(t, EAGER)} | {_ms(t, COMPILED)} | {_ratio(t, EAGER, MUON)} "
                        f"| {_ratio(t, COMPILED, MUON)} | {_ratio(t, COMPILED, EAGER)} | {c['rounds']} "
                        "| n/a: capturable step not implemented |")
    print("### optimizer.step(): eager vs compiled (qmuon.compile_step, inductor) vs torch.optim.Muon")
    print()
    print("Median ms per step (each timed step synchronized), ratios are medians of per-round ratios; QMuon int8 "
          "with its defaults, one group without parts (the same Newton-Schulz work as torch.optim.Muon); the "
          "warm-up rounds compile. Full tables below." + (" (CPU stand-in sizes: no CUDA.)" if device == "cpu" else ""))
    print()
    print("| matrices | torch.Muon ms | QMuon eager ms | QMuon compiled ms | eager / Muon | compiled / Muon "
          "| compiled / eager | rounds | captured CUDA graph |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    print("\n".join(rows) if rows else "| (no results) | | | | | | | | |")
    if missing:
        print()
        print(f"No results from: {', '.join(missing)} (failed, skipped or not run: see the step table).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2:]))
