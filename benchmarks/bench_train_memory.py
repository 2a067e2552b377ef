"""The memory headline: what a full training step of one GPT model costs with AdamW,
torch.optim.Muon, QMuon int8 and QMuon grasp4, split into weights, gradients, optimizer state,
activations and temporaries, and the deepest model of that width that fits a memory budget.

Accounting: ``torch.distributed._tools.mem_tracker.MemTracker`` (PyTorch's own tracker, used by its
FSDP memory estimator) sees every tensor storage created through the dispatcher and files it as
parameter, buffer, gradient, activation, optimizer state or temporary; its *peak* snapshot is the
split at the moment live tensor bytes were highest during the run. Live tensor bytes are what an
accelerator's caching allocator has to hold (``torch.cuda.max_memory_allocated`` on a GPU, printed
beside it there), free of glibc's retained heap, so one configuration gives the same figure in every
process and the depth search below is exact. The process's peak RSS (``VmHWM``) is reported too, as a
cross-check that includes the Python runtime, Lightning's imports and the allocator's slack; it varies
by tens of MiB from process to process. Scratch allocated inside the compiled kernels without going
through the dispatcher (none above a few rows) is not seen.

Each (optimizer, depth) runs in its own process: ``--steps`` training steps (forward, backward,
``optimizer.step()``, ``zero_grad(set_to_none=True)``) of ``DecoderLM`` with fp32 parameters, on
random tokens. The first step allocates the optimizer state; the peak of a later step includes it.

Largest depth under ``--budget-gib``: peak live bytes are linear in depth at a fixed width (every layer
adds the same weights, state and activations; the step's transient is bounded by one matrix), so a
least-squares line through the ``--fit-layers`` measurements predicts the depth; the script then
*measures* that depth and its neighbours until it has a depth that fits and the next one that does
not. The budget is compared with the peak live tensor bytes; say which budget you mean (an accelerator
also needs its CUDA context and allocator slack, a CPU process its runtime: see the RSS column).

    python benchmarks/bench_train_memory.py                          # GPT-2 small width, writes results/train_memory.md
    python benchmarks/bench_train_memory.py --budget-gib 4 --no-write   # another budget
    python benchmarks/bench_train_memory.py --d-model 1024 --heads 16 --fit-layers 2,4,6 --budget-gib 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MiB = 2**20
GiB = 2**30
MARKER = "@@TRAIN_MEMORY_RESULT@@ "
OPTIMIZERS = ("torch.AdamW", "torch.Muon", "qmuon-int8", "qmuon-grasp4")
BASELINE = "torch.Muon"
#: MemTracker's categories, in the order of the table, with the column names used here. MemTracker files
#: every tensor created inside ``optimizer.step()`` as optimizer state; the table splits that into the
#: persistent state (counted after the run) and the step's temporaries (the rest, plus "Temp").
CATEGORIES = (("Parameter", "weights"), ("Buffer", "buffers"), ("Gradient", "grads"), ("Activation", "activations"),
              ("Other", "other"))


def split_of(res: dict[str, Any]) -> dict[str, int]:
    """The peak split with the optimizer category divided into persistent state and step temporaries."""
    split = dict(res["peak_split"])
    opt_cat = split.pop("Optstate", 0)
    state = min(res["state_bytes"], opt_cat)
    split["state"] = state
    split["step temporaries"] = opt_cat - state + split.pop("Temp", 0)
    return split


# ---------------------------------------------------------------------------------------------- child
def _vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    import qmuon_lightning
    from qmuon_lightning.models.decoder_lm import DecoderLM

    torch.set_num_threads(cfg["threads"])
    dev = torch.device("cuda" if torch.cuda.is_available() and not cfg["cpu"] else "cpu")
    if dev.type == "cpu":
        qmuon_lightning.ops.backend()  # build / load the kernels before the measured region
    torch.manual_seed(cfg["seed"])
    model = DecoderLM(vocab_size=cfg["vocab"], d_model=cfg["d_model"], n_layers=cfg["layers"],
                      n_heads=cfg["heads"], max_seq_len=cfg["seq"]).to(dev)
    decisions = qmuon_lightning.route_parameters(model)
    out: dict[str, Any] = {
        "device": str(dev),
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_muon": sum(d.param.numel() for d in decisions if d.target == "muon"),
    }
    del decisions
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import build_compared_optimizers

    opts = build_compared_optimizers(cfg["optimizer"], model)
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g).to(dev)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    tracker = MemTracker()
    tracker.track_external(model, *opts)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here on
        f.write("5")
    t0 = time.perf_counter()
    losses = []
    with tracker:
        for _ in range(cfg["steps"]):
            tracker.reset_mod_stats()  # per-module stats are per iteration; the global peak is kept
            loss = model.loss(x, y)
            loss.backward()
            losses.append(float(loss))
            del loss
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad(set_to_none=True)
    out["seconds"] = time.perf_counter() - t0
    seen: set[int] = set()
    out["state_bytes"] = 0
    for o in opts:
        for st in o.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                    seen.add(v.untyped_storage().data_ptr())
                    out["state_bytes"] += v.untyped_storage().nbytes()
    out["losses"] = losses
    out["rss_peak"] = _vm_kib("VmHWM") * 1024
    snap = tracker.get_tracker_snapshot("peak")[dev]
    out["peak_split"] = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    out["peak_live"] = out["peak_split"].pop("Total")
    if dev.type == "cuda":
        out["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        out["cuda_max_reserved"] = torch.cuda.max_memory_reserved()
    return out


# --------------------------------------------------------------------------------------------- parent
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{cfg['optimizer']} at {cfg['layers']} layers: timed out after {timeout:.0f}s")
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
    raise SystemExit(f"{cfg['optimizer']} at {cfg['layers']} layers failed (exit {proc.returncode}): {tail}")


def fit_line(xs: list[int], ys: list[int]) -> tuple[float, float, float]:
    """Least-squares ``y = a + b x``; returns ``(a, b, max |residual|)``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    return a, b, max(abs(y - (a + b * x)) for x, y in zip(xs, ys))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=50304, help="GPT-2's 50257 padded to a multiple of 64")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", default="12", help="depths to report the split for (default 12: GPT-2 small)")
    ap.add_argument("--fit-layers", default="2,4,6", help="depths the line for the budget search is fitted to")
    ap.add_argument("--budget-gib", type=float, default=2.0,
                    help="memory budget for the depth search, compared with peak live tensor bytes")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="stay on the CPU even when CUDA is available")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per process")
    ap.add_argument("--out", type=Path, help="markdown output (default benchmarks/results/train_memory.md; "
                    "a .json with the raw numbers is written beside it)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    if args.child is not None:
        print(MARKER + json.dumps(child(json.loads(args.child))), flush=True)
        return 0

    names = [s.strip() for s in args.optimizers.split(",") if s.strip()]
    for n in names:
        if n not in OPTIMIZERS:
            raise SystemExit(f"unknown optimizer {n!r}; choose from {', '.join(OPTIMIZERS)}")
    report_layers = [int(s) for s in args.layers.split(",") if s.strip()]
    fit_layers = sorted({int(s) for s in args.fit_layers.split(",") if s.strip()})
    if len(fit_layers) < 2:
        raise SystemExit("--fit-layers needs at least two depths to fit a line")
    if args.d_model % args.heads:
        raise SystemExit(f"--d-model {args.d_model} must be divisible by --heads {args.heads}")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from _common import RESULTS_DIR, header_lines, md_table

    torch.set_num_threads(args.threads)
    header = header_lines("Training-step memory: weights, gradients, optimizer state, activations")
    cap = torch.backends.cpu.get_cpu_capability()
    t_start = time.perf_counter()
    cache: dict[tuple[str, int], dict[str, Any]] = {}

    def measure(name: str, layers: int) -> dict[str, Any]:
        key = (name, layers)
        if key not in cache:
            cfg = {"optimizer": name, "layers": layers, "d_model": args.d_model, "heads": args.heads,
                   "vocab": args.vocab, "seq": args.seq, "batch": args.batch, "steps": args.steps,
                   "threads": args.threads, "seed": args.seed, "cpu": args.cpu}
            _log(f"[{time.perf_counter() - t_start:6.0f}s] {name}, {layers} layers ...")
            res = _run(cfg, args.timeout)
            _log(f"    peak live {res['peak_live'] / MiB:.1f} MiB, RSS peak {res['rss_peak'] / MiB:.1f} MiB, "
                 f"{res['seconds']:.1f}s")
            cache[key] = res
        return cache[key]

    def judged(res: dict[str, Any]) -> int:
        return res.get("cuda_max_allocated", res["peak_live"])

    # ---- the split at the reported depths
    for L in report_layers:
        for n in names:
            measure(n, L)
    # ---- the budget search: fit, then measure around the prediction until a fit / no-fit pair is bracketed
    budget = int(args.budget_gib * GiB)
    depth: dict[str, dict[str, Any]] = {}
    for n in names:
        for L in fit_layers:
            measure(n, L)
        a, b, resid = fit_line(fit_layers, [judged(measure(n, L)) for L in fit_layers])
        guess = max(1, int((budget - a) // b))
        L = guess
        while L > 1 and judged(measure(n, L)) > budget:
            L -= 1
        while judged(measure(n, L + 1)) <= budget:
            L += 1
        fits = judged(measure(n, L)) <= budget
        depth[n] = {"intercept": a, "per_layer": b, "max_residual": resid, "predicted": guess,
                    "largest": L if fits else 0, "peak_at_largest": judged(measure(n, L)) if fits else None,
                    "peak_at_next": judged(measure(n, L + 1))}
    elapsed = time.perf_counter() - t_start

    # ---- report
    first = next(iter(cache.values()))
    on_cuda = first["device"].startswith("cuda")
    lines = list(header)
    lines.insert(-1, f"- CPU capability (`torch.backends.cpu.get_cpu_capability()`): {cap}; total run time {elapsed:.0f}s")
    lines += [
        f"Model: `DecoderLM(vocab_size={args.vocab}, d_model={args.d_model}, n_heads={args.heads}, n_layers=L)` "
        "(SwiGLU MLP, fused qkv and gate_up, untied head), fp32 parameters, "
        f"batch {args.batch} x {args.seq} tokens, {args.steps} training steps per process, "
        f"{'CUDA' if on_cuda else 'CPU'}, seed {args.seed}. `torch.AdamW`: AdamW on every parameter; `torch.Muon`: "
        "`torch.optim.Muon` on the matrices `route_parameters` sends to Muon plus `torch.optim.AdamW` on the rest; "
        "`qmuon-*`: `build_optimizer(model, state_format=...)` (the same split).",
        "",
        "Split of the peak: PyTorch's `MemTracker` (live tensor bytes by category at the moment of the peak; "
        "*opt state* is the optimizer state that persists between steps, *step temporaries* what `optimizer.step()` "
        "allocates and frees, e.g. Newton-Schulz working sets and foreach AdamW buffers). "
        "*peak live* is what an accelerator must hold; *RSS peak* is the process's high-water mark (runtime, "
        "imports and glibc's retained heap included; it varies by tens of MiB between processes).",
        "",
    ]
    for L in report_layers:
        base = cache.get((BASELINE, L))
        r0 = cache[(names[0], L)]
        lines += [f"## {L} layers: {r0['n_params'] / 1e6:.1f}M parameters, {r0['n_muon'] / 1e6:.1f}M routed to Muon", ""]
        hdr = ["optimizer", "peak live MiB", *[f"{c} MiB" for _, c in CATEGORIES], "opt state MiB",
               "step temporaries MiB", "vs torch.Muon MiB",
               "vs torch.Muon B / Muon param", "RSS peak MiB"]
        if on_cuda:
            hdr += ["CUDA max allocated MiB", "CUDA max reserved MiB"]
        rows = []
        for n in names:
            res = cache[(n, L)]
            split = split_of(res)
            d = judged(res) - judged(base) if base else None
            row = [f"`{n}`", f"{res['peak_live'] / MiB:.1f}", *[f"{split.get(k, 0) / MiB:.1f}" for k, _ in CATEGORIES],
                   f"{split['state'] / MiB:.1f}", f"{split['step temporaries'] / MiB:.1f}",
                   "n/a" if d is None else f"{d / MiB:+.1f}", "n/a" if d is None else f"{d / res['n_muon']:+.2f}",
                   f"{res['rss_peak'] / MiB:.1f}"]
            if on_cuda:
                row += [f"{res['cuda_max_allocated'] / MiB:.1f}", f"{res['cuda_max_reserved'] / MiB:.1f}"]
            rows.append(row)
        lines += [md_table(hdr, rows), ""]
    lines += [
        f"## Largest depth within {args.budget_gib:g} GiB of peak live tensor bytes"
        + (" (CUDA max allocated)" if on_cuda else ""),
        "",
        f"Line fitted to depths {', '.join(map(str, fit_layers))}; the depths in the table were then measured "
        "(*fits* = the largest measured depth at or under the budget, whose next depth measured over it).",
        "",
    ]
    rows = []
    for n in names:
        dd = depth[n]
        rows.append([f"`{n}`", f"{dd['per_layer'] / MiB:.2f}", f"{dd['intercept'] / MiB:.1f}",
                     f"{dd['max_residual'] / MiB:.2f}", str(dd["predicted"]), f"**{dd['largest']}**",
                     "n/a" if dd["peak_at_largest"] is None else f"{dd['peak_at_largest'] / MiB:.1f}",
                     f"{dd['peak_at_next'] / MiB:.1f}"])
    lines += [md_table(["optimizer", "MiB per layer", "MiB at 0 layers", "fit max residual MiB", "predicted depth",
                        "largest depth that fits", "peak at that depth MiB", "peak one layer deeper MiB"], rows), ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        out = args.out or RESULTS_DIR / "train_memory.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        raw = {"header": header, "cpu_capability": cap, "platform": platform.platform(),
               "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"},
               "runs": {f"{n}@{L}": v for (n, L), v in cache.items()}, "depth": depth, "elapsed_s": elapsed,
               "loadavg": os.getloadavg()}
        out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
        _log(f"wrote {out} and {out.with_suffix('.json').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
