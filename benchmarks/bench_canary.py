"""What the first-use canary costs a process: every compiled op's check, each in a fresh (cold) process.

    python benchmarks/bench_canary.py                          # CPU, 9 processes each, writes results/canary_cost.md
    python benchmarks/bench_canary.py --runs 5 --no-write      # a quick look
    python benchmarks/bench_canary.py --device cuda --out benchmarks/results/canary_cost_cuda.md

Each run is a new Python process that imports qmuon, loads the compiled kernels (not timed: a process pays
that with or without the canary), then makes the first-use check of every compiled op in turn
(``_canary.passes``: the op's canary cases, kernel and reference each, compared), as a process that uses
every op pays it once. Recorded per run: the wall time of all the checks, the process CPU time (user +
system, all threads) over them, and each op's check time (``_canary.timings()``). For comparison the same
is measured in other fresh processes for the canary before issue 37: one sample call per op
(``_canary_samples.samples()``, 9 x 100). The two kinds of process alternate, so that a busy neighbour slows both
alike; the 1-minute load average before and after is recorded (above the CPU count, other processes
competed for the cores and wall times say little: the CPU times say more then).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, cpu_name, default_threads, header_lines, md_table  # noqa: E402 (after the path)


def _child(kind: str, device_name: str) -> None:
    """One cold process: the first-use check of every compiled op; prints a JSON line."""
    import torch

    from qmuon.ops import _canary, _canary_cases, _canary_samples, _extension, _kernels
    from qmuon.ops._library import OPS

    st = _extension.status()  # load (or build) the kernels first: not the canary's cost
    device = torch.device(device_name)
    if not (st.cuda if device.type == "cuda" else st.cpu):
        raise SystemExit(f"no compiled kernels for {device.type}: {st.reason}")
    names = sorted(n for n, op in OPS.items() if op.supported is not None)
    fns = {n: _kernels.compiled_op(n, device.type) for n in names}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    per: dict[str, float] = {}
    bad: dict[str, str] = {}
    w0, c0 = time.perf_counter(), time.process_time()
    if kind == "cases":
        for n in names:
            if not _canary.passes(OPS[n], fns[n], device):
                bad[n] = _canary.failures()[(n, device.type)]
        per = {n: s for (n, _), s in _canary.timings().items()}
    else:  # the canary before issue 37: the one sample call of each op
        for n in names:
            t = time.perf_counter()
            problem = _canary._check_one(OPS[n], fns[n], _canary_samples.samples(device)[n])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            per[n] = time.perf_counter() - t
            if problem:
                bad[n] = problem
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    calls = {n: len(_canary_cases.cases(device, n)[n]) if kind == "cases" else 1 for n in names}
    print(json.dumps({"wall": wall, "cpu": cpu, "per": per, "calls": calls, "bad": bad,
                      "threads": torch.get_num_threads()}))


def _run(kind: str, device: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", kind, "--device", device], capture_output=True,
                         text=True, check=True, env={**os.environ, "QMUON_CANARY": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ms(xs: list[float], low: bool = False) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} / {max(xs) * 1e3:.1f}" + (f" ({min(xs) * 1e3:.1f})" if low else "")


def _amx() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return "yes" if "amx_tile" in flags else "no"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--runs", type=int, default=9, help="cold processes of each kind")
    p.add_argument("--budget-ms", type=float, default=50.0, help="PASS when the median is under this")
    p.add_argument("--out", default=str(RESULTS_DIR / "canary_cost.md"))
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--child", choices=["cases", "sample"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args.child, args.device)
        return 0

    import torch

    load0 = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"cases": [], "sample": []}
    for _ in range(args.runs):
        for kind, rs in runs.items():
            rs.append(_run(kind, args.device))
    load1 = os.getloadavg()[0]
    for kind, rs in runs.items():
        for r in rs:
            if r["bad"]:
                print(f"canary FAILED ({kind}): {r['bad']}", file=sys.stderr)
    new, old = runs["cases"], runs["sample"]
    wall, cpu = [r["wall"] for r in new], [r["cpu"] for r in new]
    verdicts = {what: "PASS" if statistics.median(xs) * 1e3 < args.budget_ms else "MISS"
                for what, xs in (("wall", wall), ("CPU", cpu))}

    lines = header_lines(f"First-use canary: cost of every op's check in a cold process ({args.device})")
    lines[-1:-1] = [(f"- CPU: {cpu_name()}, AMX {_amx()}, torch.backends.cpu.get_cpu_capability() = "
                     f"{torch.backends.cpu.get_cpu_capability()}, torch threads in the runs = {new[0]['threads']} "
                     f"({default_threads()} CPU(s))"),
                    f"- 1-minute load average: {load0:.2f} before, {load1:.2f} after"]
    n_ops, n_calls = len(new[0]["per"]), sum(new[0]["calls"].values())
    lines += [(f"{args.runs} cold processes of each kind, alternating; each makes the first-use check of all "
               f"{n_ops} compiled ops after loading the kernels. Median / max (min) over the processes, ms."), ""]
    lines.append(md_table(
        ["canary", "calls", "wall, all ops", "CPU (all threads), all ops"],
        [["coverage cases (qmuon/ops/_canary.py)", str(n_calls), _ms(wall, True), _ms(cpu, True)],
         ["one 9 x 100 sample per op (before issue 37)", str(n_ops), _ms([r["wall"] for r in old], True),
          _ms([r["cpu"] for r in old], True)]], ["l", "r", "r", "r"]))
    lines += ["", (f"Budget {args.budget_ms:.0f} ms per process: {verdicts['wall']} on the median wall time "
                   f"({statistics.median(wall) * 1e3:.1f} ms), {verdicts['CPU']} on the median CPU time "
                   f"({statistics.median(cpu) * 1e3:.1f} ms; the canary runs on one thread: where nothing else "
                   "competes for the core, its wall time is its CPU time)"), "",
              "Per op (median / max wall over the processes, ms; a process pays only for the ops it uses):", ""]
    names = sorted(new[0]["per"], key=lambda n: -statistics.median(r["per"][n] for r in new))
    lines.append(md_table(
        ["op", "cases", "coverage cases", "one sample"],
        [[n, str(new[0]["calls"][n]), _ms([r["per"][n] for r in new]), _ms([r["per"][n] for r in old])]
         for n in names], ["l", "r", "r", "r"]))
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_write:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
