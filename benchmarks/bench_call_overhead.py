"""Per-call overhead of the ctypes path (prebuilt GPU library) against the C++ binding (JIT build), and the
cost of the first-use canary.

    python benchmarks/bench_call_overhead.py                      # CPU: the same C ABI through both callers
    python benchmarks/bench_call_overhead.py --device cuda        # GPU: prebuilt library vs JIT build if both exist
    python benchmarks/bench_call_overhead.py --out benchmarks/results/call_overhead_cpu.md

The small call is bench_update.py's: the int8 momentum update of one 64 x 256 matrix, fp32 grads. The
kernel is the same in every row; what differs is the caller:

* ``qmuon_C op (C++ binding)``: ``torch.ops.qmuon_C.q8_momentum_update_multi_``, the JIT-built binding;
* ``C-ABI twin (ctypes)``: :class:`qmuon.ops._cabi.CAbiOps`, what the prebuilt GPU library is called
  through (on CPU it calls the ``qmuon_cpu_*`` functions of the JIT build, the same ABI);
* ``public op, ...``: ``torch.ops.qmuon.q8_momentum_update_multi_`` with its guarded kernel routed to
  one or the other (what a user's optimizer step pays per call).

Each row is the median of ``--calls`` calls, timed in rounds that alternate the callers (a shared,
loaded machine slows all rows alike). On CUDA each call is followed by a synchronize, so a row is
launch + kernel + sync latency; the host-only launch cost is printed too (calls without a sync,
divided). The canary rows time ``_canary.run_check`` of every compiled op (its canary cases, warm; median of
``--canary-reps``); ``bench_canary.py`` measures the canary in cold processes.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header_lines, md_table  # noqa: E402

from qmuon.ops import _cabi, _canary, _extension, _kernels  # noqa: E402
from qmuon.ops._library import OPS  # noqa: E402


def _callers(device: torch.device) -> dict[str, object]:
    st = _extension.status()
    out: dict[str, object] = {}
    if device.type == "cpu":
        if not st.cpu:
            raise SystemExit(f"no compiled CPU kernels: {st.reason}")
        out["qmuon_C op (C++ binding)"] = lambda *a: torch.ops.qmuon_C.q8_momentum_update_multi_(*a, compute_sumsq=True)
        out["C-ABI twin (ctypes)"] = _cabi.CAbiOps(ctypes.CDLL(st.library), "cpu").q8_momentum_update_multi_
    else:
        if st.cuda_source == "jit":
            out["qmuon_C op (C++ binding)"] = lambda *a: torch.ops.qmuon_C.q8_momentum_update_multi_(*a, compute_sumsq=True)
        lib = st.gpu_library
        if lib is not None and lib.ops is not None:
            out["C-ABI twin (ctypes)"] = lib.ops.q8_momentum_update_multi_
        elif lib is not None and lib.path:  # found but not chosen (e.g. stale): say why
            print(f"prebuilt library not usable: {lib.reason}", file=sys.stderr)
        if not out:
            raise SystemExit(f"no compiled CUDA kernels: {st.reason}")
    return out


def _time_rounds(fns: dict[str, object], args: tuple, calls: int, sync) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(calls + 10):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn(*args)
            sync()
            if i >= 10:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def _launch_only(fn, args: tuple, calls: int, sync) -> float:
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args)
    t1 = time.perf_counter()
    sync()
    return (t1 - t0) / calls * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--calls", type=int, default=2001)
    p.add_argument("--canary-reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    codes, absmax = torch.ops.qmuon.quantize_rows(torch.randn(64, 256, device=device), 256, True, -1, 0)
    grad = torch.randn(64, 256, device=device)
    call_args = ([codes], [absmax], [grad], [torch.empty(64, 1, device=device)], 0.95, True, 256, [-1], [0])

    direct = _callers(device)
    rows: dict[str, float] = dict(_time_rounds(direct, call_args, args.calls, sync))
    # The public op through each caller, alternating per call: the guarded kernel's compiled kernel is
    # one switch that forwards to the caller of the round (the same extra call level for both).
    real = _kernels.compiled_op
    current: list[object] = [None]

    def switch(*a):
        return current[0](*a)

    public: dict[str, list[float]] = {f"public op, {k}": [] for k in direct}
    try:
        _kernels.compiled_op = lambda n, d: switch if n == "q8_momentum_update_multi_" else real(n, d)
        _canary.reset()
        current[0] = next(iter(direct.values()))
        torch.ops.qmuon.q8_momentum_update_multi_(*call_args)  # resolves + canary, untimed
        for i in range(args.calls + 10):
            for name, fn in direct.items():
                current[0] = fn
                sync()
                t0 = time.perf_counter()
                torch.ops.qmuon.q8_momentum_update_multi_(*call_args)
                sync()
                if i >= 10:
                    public[f"public op, {name}"].append(time.perf_counter() - t0)
    finally:
        _kernels.compiled_op = real
        _canary.reset()
    rows.update({k: statistics.median(v) * 1e6 for k, v in public.items()})
    launch = {k: _launch_only(fn, call_args, args.calls, sync) for k, fn in direct.items()} if device.type == "cuda" else {}

    # A batched call, as an optimizer step makes it (one call per parameter group, up to 24 matrices a
    # launch): the Python twin pays its checks and struct per matrix, the C++ binding does them in C++.
    batched: dict[int, dict[str, float]] = {}
    for n in (8, 24):
        cs, ams = zip(*(torch.ops.qmuon.quantize_rows(torch.randn(16, 64, device=device), 256, True, -1, 0)
                        for _ in range(n)))
        many = (list(cs), list(ams), [torch.randn(16, 64, device=device) for _ in range(n)],
                [torch.empty(16, 1, device=device) for _ in range(n)], 0.95, True, 256, [-1] * n, list(range(n)))
        batched[n] = _time_rounds(direct, many, max(args.calls // 4, 100), sync)

    # The canary: every compiled op once, as a process pays it (each op on its first call only).
    per_op: dict[str, list[float]] = {n: [] for n, op in OPS.items() if op.supported is not None}
    for _ in range(args.canary_reps):
        for name in per_op:
            fn = _kernels.compiled_op(name, device.type)
            t0 = time.perf_counter()
            problem = _canary.run_check(OPS[name], fn, device)
            sync()
            per_op[name].append(time.perf_counter() - t0)
            if problem:
                print(f"canary FAILED for {name}: {problem}", file=sys.stderr)
    canary_ms = {n: statistics.median(v) * 1e3 for n, v in per_op.items()}

    st = _extension.status()
    lines = header_lines(f"Per-call overhead of the C-ABI (ctypes) path and the canary's cost ({device.type})")
    lines += ["", f"Backend: {st.backend}, CUDA kernels from: {st.cuda_source}; small call: int8 update of one "
                  f"64 x 256 fp32-grad matrix; medians of {args.calls} calls"
                  + ("; each call synchronized (launch + kernel + sync)" if device.type == "cuda" else ""), ""]
    table = [[k, f"{v:.1f}"] + ([f"{launch[k]:.1f}"] if k in launch else ([""] if launch else []))
             for k, v in rows.items()]
    head = ["caller", "us / call"] + (["us / launch (no sync)"] if launch else [])
    lines.append(md_table(head, table, ["l", "r"] + (["r"] if launch else [])))
    keys = list(direct)
    if len(keys) == 2:
        lines += ["", f"ctypes twin minus C++ binding: {rows[keys[1]] - rows[keys[0]]:+.1f} us per call "
                      f"(public op: {rows['public op, ' + keys[1]] - rows['public op, ' + keys[0]]:+.1f} us)"]
    lines += ["", "Batched calls: n matrices of 16 x 64 in one call (medians; the difference per matrix is the "
                  "Python twin's per-matrix checks and struct)", ""]
    lines.append(md_table(["caller"] + [f"n = {n}, us / call" for n in batched],
                          [[k] + [f"{batched[n][k]:.1f}" for n in batched] for k in direct], ["l"] + ["r"] * len(batched)))
    if len(keys) == 2:
        a, b = batched[8], batched[24]
        per = ((b[keys[1]] - b[keys[0]]) - (a[keys[1]] - a[keys[0]])) / 16
        lines += ["", f"ctypes twin minus C++ binding, per extra matrix in a call: {per:+.2f} us"]
    lines += ["", f"First-use canary on {device.type} (median of {args.canary_reps} runs of each op's check: "
                  "the compiled kernel and the reference on each of the op's canary cases, compared)", ""]
    top = sorted(canary_ms.items(), key=lambda kv: -kv[1])
    lines.append(md_table(["op", "ms"], [[n, f"{v:.2f}"] for n, v in top], ["l", "r"]))
    lines += ["", f"All {len(canary_ms)} ops: {sum(canary_ms.values()):.1f} ms; median op {statistics.median(canary_ms.values()):.2f} ms "
                  f"(a process pays it for the ops it uses, once each)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
