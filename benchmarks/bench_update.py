"""Bandwidth of the fused 8-bit momentum update (``torch.ops.qmuon.q8_momentum_update_multi_``).

What is measured, in one process, with all cases interleaved repetition by repetition (so drift and
neighbours on a shared machine hit every case alike; every other repetition in reverse order, so no
case always runs right after the same one) and the median reported:

* the fused int8 update (dequantize, momentum lerp, Nesterov blend written into the grad, per-block
  sums of squares, requantize), for fp32 / bf16 grads, nearest and stochastic rounding. Bytes
  counted: grad read + write, codes read + write, absmax read + write (the sums of squares, 4 bytes
  per block, are not counted);
* ``dst.copy_(src)`` moving the same number of bytes (read + write): the memory roofline;
* the compiled kernel (``torch.ops.qmuon_C``) with and without the sums of squares
  (``compute_sumsq``): the price of the fused norms, kernel against kernel, and the update followed
  by a separate per-block sum-of-squares pass over the grad (what an unfused implementation does).
  The public op's dispatch (the C++ dispatcher, one Python kernel that checks the arguments, the
  version-counter bumps: a fixed cost per call of one multi-tensor update, not per element) is the
  median per-repetition difference between the public-op row and the kernel row, reported on its own;
* ``buf.lerp_(grad, 1 - beta)`` on an fp32 and on a bf16 momentum buffer (the dense formats);
* the 4-bit fused updates ``int4_momentum_update_multi_`` (block 128) and
  ``e0m3_momentum_update_multi_`` (UE4M3 scale per 16, fp32 tensor scale) and the compiled dense
  update ``dense_momentum_update_multi_`` (fp32 buffer), each against a ``copy_`` of the same number
  of bytes and against its pure-PyTorch reference (``--no-reference`` skips those: they are slow).
  Bytes counted are the format's minimum: grad read + write, packed codes read + write, scales read
  + write (e0m3 reads grad and state twice, because its tensor scale needs the new momentum's max
  before any code can be written; that extra traffic is not counted, so it shows as lower GB/s).

Targets: fused int8 update (nearest rounding) >= 0.8x the copy bandwidth (set for CPU; the same
line is computed on CUDA); update + sums of squares <= 1.05x the plain update (fp32 grads). PASS / FAIL is computed from the measurement. The 4-bit and dense
lines are reported (x copy_, x reference), not judged. Results go to ``benchmarks/results/update_bandwidth.md`` (``--out``).

    python benchmarks/bench_update.py                      # CPU, 16M elements
    python benchmarks/bench_update.py --device cuda --numel 268435456
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

import qmuon.ops as qops
from qmuon.ops import reference as ref
from qmuon.ops._extension import cpu_vector_isa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import header_lines  # noqa: E402

TARGET_FRACTION_OF_COPY = 0.8
TARGET_SUMSQ_RATIO = 1.05  # update + per-block sums of squares vs the update alone (the prototype: 1.69)


def _timer(device: torch.device, inner: int) -> Callable[[Callable[[], object]], float]:
    """Seconds per call, from `inner` back-to-back calls (on CUDA the host runs ahead, so the
    Python dispatch overhead of one call hides behind the previous call's kernel)."""
    if device.type == "cuda":
        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / inner
    else:
        def run(fn):
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            return (time.perf_counter() - t0) / inner
    return run


BS4 = 128  # int4 default block (quant/state.py); e0m3 sums of squares use the same granularity


def _add_4bit_cases(cases, state, rows, cols, beta, stream, device, compiled: bool, with_reference: bool):
    """Add the int4 / e0m3 / dense update cases (and equal-byte copies, references) to `cases`;
    return the table rows to report: (name, copy case, reference case or None)."""
    from qmuon.ops import reference_4bit as ref4

    numel = rows * cols
    m0 = torch.randn(rows, cols, generator=torch.Generator(device).manual_seed(1), device=device) * 1e-3
    st = {}
    st["int4"] = list(torch.ops.qmuon.int4_quantize(m0, BS4, -1, 0))
    st["e0m3"] = list(torch.ops.qmuon.e0m3_quantize(m0, True, -1, 0))
    st["dense"] = [m0.clone()]
    del m0
    nb4 = ref.num_blocks(cols, BS4)
    sums = [torch.empty(rows, nb4, device=device)]
    pk_bytes = 2 * rows * ((cols + 1) // 2)  # read + write
    gsz = {"g_fp32": 4, "g_bf16": 2}

    def nbytes(fmt, gname):
        g = 2 * numel * gsz[gname]
        if fmt == "int4":
            return g + pk_bytes + 2 * 4 * rows * nb4
        if fmt == "e0m3":
            return g + pk_bytes + 2 * rows * ref.num_blocks(cols, 16) + 8
        return g + 2 * 4 * numel  # fp32 buffer

    def op_call(fmt, gname, stochastic):
        g = state[gname]
        s = [stream if stochastic else -1]
        if fmt == "int4":
            return lambda: torch.ops.qmuon.int4_momentum_update_multi_(
                [st["int4"][0]], [st["int4"][1]], [g], sums, beta, True, BS4, s, [0])
        if fmt == "e0m3":
            return lambda: torch.ops.qmuon.e0m3_momentum_update_multi_(
                [st["e0m3"][0]], [st["e0m3"][1]], [st["e0m3"][2]], [g], sums, beta, True, BS4, s, [0])
        return lambda: torch.ops.qmuon.dense_momentum_update_multi_([st["dense"][0]], [g], sums, beta, True, BS4,
                                                                    s, [0])

    def ref_call(fmt, gname):
        g = state[gname]
        if fmt == "int4":
            return lambda: ref4.int4_momentum_update_(*st["int4"], g, beta=beta, nesterov=True, block_size=BS4)
        if fmt == "e0m3":
            return lambda: ref4.e0m3_momentum_update_(*st["e0m3"], g, beta=beta, nesterov=True, block_size=BS4)
        return lambda: ref.dense_momentum_update_(*st["dense"], g, beta=beta, nesterov=True, block_size=BS4)

    rows_out = []
    label = "compiled" if compiled else "reference backend"
    for fmt in ("int4", "e0m3", "dense"):
        copy_name = f"copy_ {fmt}-fp32-equivalent bytes"
        n = nbytes(fmt, "g_fp32") // 2
        src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty(n, dtype=torch.uint8, device=device)
        cases[copy_name] = ((lambda s_=src, d_=dst: d_.copy_(s_)), 2 * n)
        variants = [("g_fp32", False), ("g_fp32", True), ("g_bf16", False)] if fmt != "dense" else [("g_fp32", False)]
        for gname, stoch in variants:
            gl = gname[2:]
            name = f"{fmt} update ({label}), {gl} grad, {'stochastic' if stoch else 'nearest'}"
            cases[name] = (op_call(fmt, gname, stoch), nbytes(fmt, gname))
            ref_name = None
            if with_reference and gname == "g_fp32" and not stoch:
                ref_name = f"{fmt} update (pure-PyTorch reference), fp32 grad, nearest"
                cases[ref_name] = (ref_call(fmt, gname), nbytes(fmt, gname))
            rows_out.append((name, copy_name if gname == "g_fp32" else None, ref_name))
    return rows_out


def _report_4bit(rows_out, med, gbs) -> list[str]:
    if not rows_out:
        return []
    lines = ["", "## 4-bit and dense updates (compiled kernels vs copy_ and vs the reference)", "",
             f"int4 block {BS4}; e0m3 scale per 16 + fp32 tensor scale, sums of squares per {BS4}; dense = fp32 "
             "buffer. Bytes = the format's minimum traffic (see the script's docstring).", "",
             "| case | median ms | GB/s | x copy_ (equal bytes) | reference time / kernel time |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, copy_name, ref_name in rows_out:
        xc = f"{gbs[name] / gbs[copy_name]:.2f}" if copy_name else ""
        xr = f"{med[ref_name] / med[name]:.1f}x" if ref_name else ""
        lines.append(f"| {name} | {med[name] * 1e3:.2f} | {gbs[name]:.1f} | {xc} | {xr} |")
        if ref_name:
            lines.append(f"| {ref_name} | {med[ref_name] * 1e3:.2f} | {gbs[ref_name]:.1f} | "
                         f"{gbs[ref_name] / gbs[copy_name]:.2f} | 1.0x |")
    for name, copy_name, _ in rows_out:
        if copy_name:
            copy_ms = med[copy_name] * 1e3
            lines.append(f"- `{copy_name}`: {copy_ms:.2f} ms, {gbs[copy_name]:.1f} GB/s")
            break
    return lines


def _small_call_dispatch(device: torch.device, calls: int = 2001) -> tuple[float, float]:
    """Microseconds per call of the public int8 update and of the compiled op it runs, on a 64 x 256
    matrix (the per-call cost of the public op's dispatch, without the cache misses a large call
    causes): medians over `calls` alternating calls."""
    codes, absmax = torch.ops.qmuon.quantize_rows(torch.randn(64, 256, device=device), 256, True, -1, 0)
    grad = torch.randn(64, 256, device=device)
    sums = [torch.empty(64, 1, device=device)]
    args = ([codes], [absmax], [grad], sums, 0.95, True, 256, [-1], [0])
    pub, ker = [], []
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for i in range(calls + 10):
        sync()
        t0 = time.perf_counter()
        torch.ops.qmuon.q8_momentum_update_multi_(*args)
        sync()
        t1 = time.perf_counter()
        torch.ops.qmuon_C.q8_momentum_update_multi_(*args, compute_sumsq=True)
        sync()
        t2 = time.perf_counter()
        if i >= 10:
            pub.append(t1 - t0)
            ker.append(t2 - t1)
    return statistics.median(pub) * 1e6, statistics.median(ker) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=1 << 24, help="elements per tensor (default 16M)")
    p.add_argument("--cols", type=int, default=4096, help="matrix columns (rows = numel / cols)")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--reps", type=int, default=15, help="interleaved repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--inner", type=int, default=None, help="calls per timed sample (default: 1 on CPU, 10 on CUDA)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--no-reference", action="store_true", help="skip the pure-PyTorch reference cases (slow)")
    p.add_argument("--no-4bit", action="store_true", help="only the 8-bit cases")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "update_bandwidth.md")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = qops.backend()
    if device.type == "cuda" and backend != "cpu+cuda-extension":
        print(f"warning: backend is {backend!r}: CUDA runs the reference", file=sys.stderr)
    if device.type == "cpu" and backend == "reference":
        print("warning: backend is 'reference': measuring the pure-PyTorch reference", file=sys.stderr)
    compiled = backend != "reference" and (device.type == "cpu" or backend == "cpu+cuda-extension")

    cols = args.cols
    rows = max(1, args.numel // cols)
    numel = rows * cols
    bs = args.block_size
    nb = ref.num_blocks(cols, bs)
    beta = 0.95
    gen = torch.Generator(device).manual_seed(0)
    m0 = torch.randn(rows, cols, generator=gen, device=device)
    codes0, absmax0 = torch.ops.qmuon.quantize_rows(m0, bs, True, -1, 0)
    del m0
    grad32 = torch.randn(rows, cols, generator=gen, device=device)
    state = {
        "codes": codes0, "absmax": absmax0,
        "g_fp32": grad32, "g_bf16": grad32.to(torch.bfloat16),
        "buf_fp32": torch.zeros(rows, cols, device=device),
        "buf_bf16": torch.zeros(rows, cols, device=device, dtype=torch.bfloat16),
    }
    stream = ref.noise_stream(0, 1, 0)

    def update(gname: str, stochastic: bool, sumsq: str) -> Callable[[], object]:
        g = state[gname]
        streams = [stream if stochastic else -1]

        if sumsq == "fused":
            sums = [torch.empty(rows, nb, device=device)]
            return lambda: torch.ops.qmuon.q8_momentum_update_multi_(
                [state["codes"]], [state["absmax"]], [g], sums, beta, True, bs, streams, [0])
        if not compiled:
            return None
        if sumsq == "kernel":
            sums_k = [torch.empty(rows, nb, device=device)]
            return lambda: torch.ops.qmuon_C.q8_momentum_update_multi_(
                [state["codes"]], [state["absmax"]], [g], sums_k, beta, True, bs, streams, [0], compute_sumsq=True)

        def plain():
            return torch.ops.qmuon_C.q8_momentum_update_multi_(
                [state["codes"]], [state["absmax"]], [g], [], beta, True, bs, streams, [0], compute_sumsq=False)
        if sumsq == "none":
            return plain

        def unfused():
            plain()
            if cols % bs:
                return ref.block_sumsq(g, bs)
            return torch.linalg.vector_norm(g.view(rows, nb, bs), dim=-1, dtype=torch.float32).square()
        return unfused

    def q8_bytes(gname: str) -> int:
        return numel * (2 * state[gname].element_size() + 2) + 2 * 4 * rows * nb

    copy_bufs = {}
    for gname in ("g_fp32", "g_bf16"):
        n = q8_bytes(gname) // 2
        copy_bufs[gname] = (torch.empty(n, dtype=torch.uint8, device=device).fill_(1),
                            torch.empty(n, dtype=torch.uint8, device=device))

    cases: dict[str, tuple[Callable[[], object], int]] = {}
    for gname, gl in (("g_fp32", "fp32"), ("g_bf16", "bf16")):
        src, dst = copy_bufs[gname]
        cases[f"copy_ {gl}-equivalent bytes"] = ((lambda s=src, d=dst: d.copy_(s)), 2 * src.numel())
        for stoch in (False, True):
            r = "stochastic" if stoch else "nearest"
            cases[f"q8 update, {gl} grad, {r}"] = (update(gname, stoch, "fused"), q8_bytes(gname))
        # The sums-of-squares price is kernel vs kernel: both through torch.ops.qmuon_C, the compiled
        # op (the public op adds its Python dispatch, priced separately below).
        cases[f"q8 kernel, {gl} grad, nearest, + sumsq"] = (update(gname, False, "kernel"), q8_bytes(gname))
        cases[f"q8 kernel, {gl} grad, nearest, no sumsq"] = (update(gname, False, "none"), q8_bytes(gname))
        cases[f"q8 update, {gl} grad, nearest, + separate sumsq pass"] = (
            update(gname, False, "unfused"), q8_bytes(gname) + numel * state[gname].element_size())
    cases["fp32 buf.lerp_(fp32 grad)"] = (lambda: state["buf_fp32"].lerp_(state["g_fp32"], 1 - beta), 12 * numel)
    cases["bf16 buf.lerp_(bf16 grad)"] = (lambda: state["buf_bf16"].lerp_(state["g_bf16"], 1 - beta), 6 * numel)
    extra_lines = [] if args.no_4bit else _add_4bit_cases(cases, state, rows, cols, beta, stream, device,
                                                           compiled, not args.no_reference)
    cases = {k: v for k, v in cases.items() if v[0] is not None}

    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    inner = args.inner or (10 if device.type == "cuda" else 1)
    timer = _timer(device, inner)
    times: dict[str, list[float]] = {k: [] for k in cases}
    order = list(cases)
    for rep in range(args.warmup + args.reps):
        # Every other repetition runs the cases in reverse order, so that no case always follows the
        # same neighbour (the one before leaves part of the shared tensors in the last-level cache).
        for name in (order if rep % 2 == 0 else order[::-1]):
            fn = cases[name][0]
            t = timer(fn)
            if rep >= args.warmup:
                times[name].append(t)
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    med = {k: statistics.median(v) for k, v in times.items()}
    gbs = {k: cases[k][1] / med[k] / 1e9 for k in cases}

    # ---- report
    if device.type == "cuda":
        dev_desc = torch.cuda.get_device_name(device)
    else:
        dev_desc = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    lines = [
        *header_lines("Fused momentum updates: bandwidth"),
        f"- device: {device.type} ({dev_desc}); backend: `{backend}`"
        f"{f' (cpu loops: {isa})' if (isa := cpu_vector_isa()) else ''}; torch {torch.__version__}",
        f"- matrix {rows} x {cols} = {numel / 2**20:.0f} Mi elements, block_size {bs}, beta {beta}, nesterov, "
        f"{args.reps} interleaved repetitions (each {inner} back-to-back calls; odd ones in reverse case order) after "
        f"{args.warmup} warm-up, medians",
        f"- 1-minute load average {load_start:.1f} at start, {load_end:.1f} at end, on {os.cpu_count()} CPUs "
        "(above the CPU count other processes competed for the cores: compare ratios within this run)",
        "- q8 bytes = grad read + write, int8 codes read + write, absmax read + write "
        "(+ one more grad read for the separate sumsq pass); lerp_ bytes = buf read + write + grad read",
        "",
        "| case | median ms | GB/s | x copy_ | x fp32 lerp_ time |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    t_lerp32 = med["fp32 buf.lerp_(fp32 grad)"]
    extra_names = {n for row in extra_lines for n in row if n} | {k for k in cases if k.startswith("copy_ ") and
                                                                  ("int4" in k or "e0m3" in k or "dense" in k)}
    for name in (k for k in cases if k not in extra_names):
        gl = "bf16" if "bf16 grad" in name or name.startswith("copy_ bf16") else "fp32"
        copy_gbs = gbs[f"copy_ {gl}-equivalent bytes"]
        lines.append(f"| {name} | {med[name] * 1e3:.2f} | {gbs[name]:.1f} | {gbs[name] / copy_gbs:.2f} | "
                     f"{med[name] / t_lerp32:.2f} |")
    lines.append("")
    verdicts = []
    for gl in ("fp32", "bf16"):
        frac = gbs[f"q8 update, {gl} grad, nearest"] / gbs[f"copy_ {gl}-equivalent bytes"]
        ok = frac >= TARGET_FRACTION_OF_COPY
        verdicts.append(ok)
        lines.append(f"- {'PASS' if ok else 'FAIL'}: fused int8 update with {gl} grads (nearest) runs at "
                     f"{frac:.2f}x copy_ bandwidth (target >= {TARGET_FRACTION_OF_COPY}x)")
        frac_sr = gbs[f"q8 update, {gl} grad, stochastic"] / gbs[f"copy_ {gl}-equivalent bytes"]
        lines.append(f"  - stochastic rounding: {frac_sr:.2f}x copy_ (reported, not a target)")
        if f"q8 kernel, {gl} grad, nearest, no sumsq" in med:
            fused_k = med[f"q8 kernel, {gl} grad, nearest, + sumsq"]
            # Median of per-repetition ratios: the two kernels ran back to back in every repetition,
            # so this pairs samples that saw the same machine state (steadier than a ratio of medians).
            ratio = statistics.median(a / b for a, b in zip(times[f"q8 kernel, {gl} grad, nearest, + sumsq"],
                                                            times[f"q8 kernel, {gl} grad, nearest, no sumsq"]))
            unf = med[f"q8 update, {gl} grad, nearest, + separate sumsq pass"] / fused_k
            # The public op's fixed cost per call: median of per-repetition differences to the kernel.
            dispatch_ms = statistics.median(
                a - b for a, b in zip(times[f"q8 update, {gl} grad, nearest"],
                                      times[f"q8 kernel, {gl} grad, nearest, + sumsq"])) * 1e3
            if gl == "fp32":  # the target is set on fp32 grads, as the bandwidth target
                ok_ss = ratio <= TARGET_SUMSQ_RATIO
                verdicts.append(ok_ss)
                tag = f"{'PASS' if ok_ss else 'FAIL'}: "
                lead = "- "
            else:
                tag, lead = "", "  - "
            lines.append(f"{lead}{tag}update + per-block sums of squares takes {ratio:.3f}x the plain update "
                         f"({gl} grads, kernel vs kernel, median of paired repetitions{f'; target <= {TARGET_SUMSQ_RATIO}x' if tag else ''}); "
                         f"a separate sumsq pass after the plain update takes {unf:.2f}x the fused kernel; "
                         f"the public op's Python dispatch added {dispatch_ms:+.2f} ms per call")
    if compiled:
        us_pub, us_ker = _small_call_dispatch(device)
        lines.append(f"- a small call (64 x 256, fp32 grads): public op {us_pub:.1f} us, compiled op {us_ker:.1f} us "
                     f"(dispatch {us_pub - us_ker:.1f} us; medians of 2001 alternating calls)")
    overall = all(verdicts)
    lines.append(f"- overall: {'PASS' if overall else 'FAIL'}")
    lines.extend(_report_4bit(extra_lines, med, gbs))
    report = "\n".join(lines) + "\n"
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report)
    print(f"wrote {args.out}")
    return 0 if overall else 1


if __name__ == "__main__":
    raise SystemExit(main())
