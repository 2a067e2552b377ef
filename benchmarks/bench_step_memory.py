"""Peak memory of a full training step (forward, backward, ``optimizer.step()``, ``zero_grad``) of a
GPT-shaped :class:`~qmuon_lightning.models.DecoderLM`, per optimizer, each in a fresh process.

Every optimizer runs in its own child process with the same imports and the same process layout:
``import torch, qmuon_lightning`` (which imports Lightning), load the compiled ``torch.ops.qmuon``
kernels (``qmuon.ops.backend()``; ``--no-preload-extension`` leaves that to QMuon's first
step), build the same model with the same seed, the same batch (``batch x seq`` random tokens), then
``--steps`` training steps. Only the optimizer differs:

``torch.AdamW``  ``torch.optim.AdamW`` on every parameter (lr 3e-4, betas (0.9, 0.95), weight decay 0.1)
``torch.Muon``   ``torch.optim.Muon`` on the parameters ``qmuon.route_parameters`` sends to
                 Muon (hidden matrices; fused q/k/v and gate/up are orthogonalized whole, as
                 torch.optim.Muon does), ``torch.optim.AdamW`` on the rest with build_optimizer's
                 settings (weight decay 0.1 for matrices, 0 for 1-D tensors)
``qmuon-FORMAT`` ``qmuon_lightning.build_optimizer(model, state_format=FORMAT, verbose=False, **kwargs)``
                 (``--qmuon-kwargs`` adds keyword arguments to every QMuon run)

Measured in the child (Linux): the peak RSS of each phase of each step, from ``VmHWM`` in
``/proc/self/status`` after resetting it with ``echo 5 > /proc/self/clear_refs`` before the phase
(exact, no sampling; where the reset is not permitted, a thread samples ``/proc/self/statm`` every
0.5 ms instead, and the method is recorded). The process peak is the maximum over all phases
(what ``ru_maxrss`` would report for a run without resets). Also: RSS after the imports, after the
extension load, after the model is built, after the optimizer is built, after each step; bytes of
optimizer state; on CUDA ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` per phase.

Judged: process peak minus ``torch.Muon``'s, in bytes per Muon-routed parameter element, against
the targets int8 <= -2.5 B/param and grasp4 <= -3.0 B/param at every model size.

Noise: with glibc's default (dynamic) mmap threshold, freed tensors below the threshold stay in the
heap, so RSS is live bytes plus retained free memory, and the peak of one configuration varies from
process to process (measured at 8 layers: torch.Muon 807-850 MiB over 9 processes). ``--repeats N``
runs every configuration N times (interleaved) and reports the median; ``--env
MALLOC_MMAP_THRESHOLD_=131072`` fixes the threshold, so large tensors are unmapped when freed and RSS
tracks live tensor bytes (the same configuration then repeats to within ~1 MiB).

Experiments without editing the library:

* ``--env KEY=VAL`` (repeatable) sets an environment variable in every child, e.g.
  ``--env QMUON_BACKEND=reference``.
* ``--variant JSON`` (repeatable) adds a run: ``{"name": "int8-b4", "optimizer": "qmuon-int8",
  "kwargs": {"batch_budget": 4}, "env": {"KEY": "VAL"}, "patch": {"module.path:ATTR": value}}``.
  ``patch`` sets module attributes in the child before the optimizer is built (a benchmark-side
  monkeypatch, reported as such; a missing attribute is an error before any child starts); the
  value ``"largest"`` stands for the element count of the largest Muon matrix (a fused matrix's
  largest part). ``env`` can point ``PYTHONPATH`` at another source tree or at a directory with a
  ``sitecustomize.py`` that installs a prototype.

    python benchmarks/bench_step_memory.py                      # 8 and 16 layers, writes results/step_memory.md
    python benchmarks/bench_step_memory.py --layers 8 --no-write                       # quick look
    python benchmarks/bench_step_memory.py --repeats 3 --optimizers torch.Muon,qmuon-int8,qmuon-grasp4
    python benchmarks/bench_step_memory.py --env MALLOC_MMAP_THRESHOLD_=131072 --out benchmarks/results/step_memory_mmap.md
    python benchmarks/bench_step_memory.py --qmuon-kwargs '{"ns_dtype": "fp32"}' --optimizers torch.Muon,qmuon-int8
    python benchmarks/bench_step_memory.py --optimizers torch.Muon \
        --variant '{"name": "int8 budget 4", "optimizer": "qmuon-int8", "kwargs": {"batch_budget": 4}}'
    # another commit's library, unchanged script:
    git archive <commit> qmuon_lightning csrc | tar -x -C /tmp/snap && git rev-parse <commit> > /tmp/snap/.source_commit
    PYTHONPATH=/tmp/snap python benchmarks/bench_step_memory.py --out benchmarks/results/step_memory_<commit>.md
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MiB = 2**20
MARKER = "@@STEP_MEMORY_RESULT@@ "
BASELINE = "torch.Muon"
QMUON_FORMATS = ("fp32", "bf16", "int8", "uint8", "int4", "e0m3", "grasp4")
ALL_OPTIMIZERS = ("torch.AdamW", "torch.Muon", *(f"qmuon-{f}" for f in QMUON_FORMATS))
DEFAULT_OPTIMIZERS = ("torch.AdamW", "torch.Muon", "qmuon-fp32", "qmuon-int8", "qmuon-grasp4")
#: (optimizer, bytes per Muon parameter its peak must be below torch.Muon's peak by at least)
TARGETS = {"qmuon-int8": -2.5, "qmuon-grasp4": -3.0}
#: keyword arguments of build_optimizer the script sets itself
RESERVED_KWARGS = ("state_format", "verbose")


# ---------------------------------------------------------------------------------------------- child
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _rss() -> int:
    return _status_kib("VmRSS") * 1024


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class PeakMeter:
    """Peak RSS of a code region: VmHWM after a reset through clear_refs, or a sampling thread."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.method = "VmHWM reset via /proc/self/clear_refs (exact)"
            self._exact = True
        except OSError:
            self.method = "sampling /proc/self/statm every 0.5 ms (may miss short spikes)"
            self._exact = False
        self._peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        with open("/proc/self/statm") as f:
            while not self._stop.is_set():
                f.seek(0)
                self._peak = max(self._peak, int(f.read().split()[1]) * _PAGE)
                time.sleep(0.0005)

    def start(self) -> None:
        if self._exact:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self._peak = _rss()
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def stop(self) -> int:
        if self._exact:
            return _status_kib("VmHWM") * 1024
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        return max(self._peak, _rss())


def _resolve(path: str):
    import importlib

    mod_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"patch target {path!r} must be 'module.path:ATTRIBUTE'")
    mod = importlib.import_module(mod_name)
    if not hasattr(mod, attr):
        raise AttributeError(f"patch target {path!r}: module {mod_name} has no attribute {attr!r} (renamed?)")
    return mod, attr


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"rss_start": _rss()}
    meter = PeakMeter()
    out["peak_method"] = meter.method
    phases: list[dict[str, Any]] = []

    meter.start()
    import torch

    import qmuon
    from qmuon_lightning.models.decoder_lm import DecoderLM

    torch.set_num_threads(cfg["threads"])
    out["rss_imports"] = _rss()
    if cfg["preload_extension"]:
        from qmuon import ops

        out["backend"] = ops.backend()
    out["rss_extension"] = _rss()
    phases.append({"step": -1, "phase": "startup", "peak": meter.stop()})

    cuda = torch.cuda.is_available() and not cfg["cpu"]
    dev = torch.device("cuda" if cuda else "cpu")
    out["device"] = str(dev)

    def cuda_mark() -> None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def cuda_read(rec: dict[str, Any]) -> None:
        if cuda:
            torch.cuda.synchronize()
            rec["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
            rec["cuda_max_reserved"] = torch.cuda.max_memory_reserved()
            rec["cuda_allocated"] = torch.cuda.memory_allocated()

    meter.start()
    cuda_mark()
    torch.manual_seed(cfg["seed"])
    extra = {"n_heads": cfg["heads"]} if cfg["heads"] else {}  # else DecoderLMConfig's default
    model = DecoderLM(vocab_size=cfg["vocab"], d_model=cfg["d_model"], n_layers=cfg["layers"], **extra).to(dev)
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g).to(dev)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    decisions = qmuon.route_parameters(model)
    muon_dec = [d for d in decisions if d.target == "muon"]
    out["n_params"] = sum(p.numel() for p in model.parameters())
    out["n_muon"] = sum(d.param.numel() for d in muon_dec)
    largest = 0
    for d in muon_dec:
        cols = d.param.numel() // d.shape[0]
        for rows in (d.parts or (d.shape[0],)):
            largest = max(largest, rows * cols)
    out["largest_matrix"] = largest
    rec = {"step": -1, "phase": "model"}
    cuda_read(rec)
    out["rss_model"] = _rss()
    rec["peak"] = meter.stop()
    phases.append(rec)

    # benchmark-side monkeypatches (never the library's files)
    applied = {}
    for path, value in (cfg.get("patch") or {}).items():
        mod, attr = _resolve(path)
        v = largest if value == "largest" else value
        applied[path] = {"old": repr(getattr(mod, attr)), "new": repr(v)}
        setattr(mod, attr, v)
    out["patched"] = applied

    meter.start()
    cuda_mark()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import build_compared_optimizers

    opts = build_compared_optimizers(cfg["optimizer"], model, decisions, **cfg.get("kwargs", {}))
    for d in decisions:
        d.param = None
    del decisions, muon_dec
    rec = {"step": -1, "phase": "optimizer"}
    cuda_read(rec)
    out["rss_optimizer"] = _rss()
    rec["peak"] = meter.stop()
    phases.append(rec)

    def state_bytes() -> int:
        seen, total = set(), 0
        for o in opts:
            for st in o.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor) and v.data_ptr() not in seen:
                        seen.add(v.data_ptr())
                        total += v.numel() * v.element_size()
        return total

    out["steps"] = []
    for step in range(cfg["steps"]):
        srec: dict[str, Any] = {"step": step}
        for phase in ("forward+backward", "optimizer.step", "zero_grad"):
            rec = {"step": step, "phase": phase, "rss_before": _rss()}
            meter.start()
            cuda_mark()
            t0 = time.perf_counter()
            if phase == "forward+backward":
                loss = model.loss(x, y)
                loss.backward()
                srec["loss"] = float(loss)
                del loss
            elif phase == "optimizer.step":
                for o in opts:
                    o.step()
            else:
                for o in opts:
                    o.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            rec["seconds"] = time.perf_counter() - t0
            rec["peak"] = meter.stop()
            rec["rss_after"] = _rss()
            cuda_read(rec)
            phases.append(rec)
        srec["rss_after"] = _rss()
        out["steps"].append(srec)
    out["state_bytes"] = state_bytes()
    out["phases"] = phases
    out["peak"] = max(p["peak"] for p in phases)
    if cuda:
        out["cuda_peak_allocated"] = max(p.get("cuda_max_allocated", 0) for p in phases)
        out["cuda_peak_reserved"] = max(p.get("cuda_max_reserved", 0) for p in phases)
    steps = [p for p in phases if p["phase"] == "optimizer.step"]
    out["step_peak"] = max(p["peak"] for p in steps)
    out["step_transient"] = max(p["peak"] - p["rss_before"] for p in steps)
    out["fb_peak"] = max(p["peak"] for p in phases if p["phase"] == "forward+backward")
    out["step_seconds"] = [p["seconds"] for p in steps]
    return out


# --------------------------------------------------------------------------------------------- parent
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _mib(n: float) -> str:
    return f"{n / MiB:.1f}"


def _judged(res: dict[str, Any]) -> int:
    """The figure the targets are judged on: peak CUDA memory allocated on a GPU run, else peak RSS."""
    return res["cuda_peak_allocated"] if "cuda_peak_allocated" in res else res["peak"]


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise SystemExit(f"--env expects KEY=VALUE, got {it!r}")
        env[k] = v
    return env


def _check_qmuon_kwargs(kwargs: dict[str, Any], where: str) -> None:
    """Fail before any child starts: unknown names, names the script sets, or values QMuon rejects."""
    import torch

    from qmuon import build_optimizer
    from qmuon_lightning.models.decoder_lm import DecoderLM

    sig = inspect.signature(build_optimizer)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    known = [n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    for k in kwargs:
        if k in RESERVED_KWARGS:
            raise SystemExit(f"{where}: {k!r} is set by the benchmark (the optimizer name picks state_format); remove it")
        if k not in sig.parameters and not takes_any:
            raise SystemExit(
                f"{where}: the imported qmuon_lightning.build_optimizer() has no keyword argument {k!r}.\n"
                f"Its keyword arguments are: {', '.join(known)}")
    try:  # the values, on a tiny model
        m = DecoderLM(d_model=64, n_layers=1, n_heads=2, max_seq_len=16)
        build_optimizer(m, state_format="int8", verbose=False, **kwargs)
    except (TypeError, ValueError) as e:
        raise SystemExit(f"{where}: build_optimizer(..., **{kwargs!r}) rejects these arguments: {e}") from None
    del torch


def _library_source() -> str:
    """Where the children import qmuon_lightning from (PYTHONPATH may point at a snapshot of another
    commit, e.g. ``git archive HEAD qmuon_lightning csrc | tar -x -C /tmp/snap``)."""
    import qmuon_lightning

    pkg = Path(qmuon_lightning.__file__).resolve().parent
    root = Path(__file__).resolve().parent.parent
    if pkg.parent == root:
        return f"`{pkg}` (this checkout; see the source line)"
    note = f"`{pkg}`, not this checkout (the source line above describes the checkout, not the measured code)"
    marker = pkg.parent / ".source_commit"
    if marker.is_file():
        note += f"; `{marker}` says commit {marker.read_text().strip()}"
    return note


def _run_child(cfg: dict[str, Any], env_extra: dict[str, str], timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env.update(env_extra)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    wall = time.perf_counter() - t0
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            res = json.loads(line[len(MARKER):])
            res["wall_s"] = wall
            return res
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-6:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", default="8,16", help="comma list of model depths (default 8,16)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: DecoderLMConfig's)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2, help="training steps per child (default 2: the first "
                    "allocates the optimizer state, the second is a steady-state step)")
    ap.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS),
                    help=f"comma list from {','.join(ALL_OPTIMIZERS)} (default {','.join(DEFAULT_OPTIMIZERS)})")
    ap.add_argument("--qmuon-kwargs", default="{}", help="JSON object of extra build_optimizer keyword arguments "
                    "for every qmuon-* run, e.g. '{\"ns_input\": \"mxfp8\"}'")
    ap.add_argument("--variant", action="append", default=[], help="JSON run spec (repeatable), see the docstring")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE set in every child (repeatable)")
    ap.add_argument("--no-preload-extension", action="store_true",
                    help="do not load the compiled kernels at startup in every child (QMuon loads them on its first step)")
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per run (interleaved); the table "
                    "shows the repeat with the median peak (lower median for an even count) and the range")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="stay on the CPU even when CUDA is available")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child")
    ap.add_argument("--out", type=Path, help="markdown output (default benchmarks/results/step_memory.md; "
                    "a .json with the raw numbers is written beside it)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    if args.child is not None:
        res = child(json.loads(args.child))
        print(MARKER + json.dumps(res), flush=True)
        return 0

    # ---- validate everything before the first child starts
    try:
        qkw = json.loads(args.qmuon_kwargs)
        if not isinstance(qkw, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise SystemExit(f"--qmuon-kwargs must be a JSON object: {e}")
    env_all = _parse_env(args.env)
    layers = [int(s) for s in args.layers.split(",") if s.strip()]
    runs: list[dict[str, Any]] = []
    for name in [s.strip() for s in args.optimizers.split(",") if s.strip()]:
        if name not in ALL_OPTIMIZERS:
            raise SystemExit(f"unknown optimizer {name!r}; choose from {', '.join(ALL_OPTIMIZERS)}")
        runs.append({"name": name, "optimizer": name, "kwargs": qkw if name.startswith("qmuon-") else {},
                     "env": {}, "patch": {}})
    for spec_text in args.variant:
        try:
            spec = json.loads(spec_text)
        except ValueError as e:
            raise SystemExit(f"--variant must be JSON: {e}: {spec_text!r}")
        unknown = set(spec) - {"name", "optimizer", "kwargs", "env", "patch"}
        if unknown or "optimizer" not in spec or spec["optimizer"] not in ALL_OPTIMIZERS:
            raise SystemExit(f"--variant {spec_text!r}: needs 'optimizer' (one of {', '.join(ALL_OPTIMIZERS)}); "
                             f"optional 'name', 'kwargs', 'env', 'patch'; unknown keys: {sorted(unknown)}")
        if spec.get("kwargs") and not spec["optimizer"].startswith("qmuon-"):
            raise SystemExit(f"--variant {spec_text!r}: 'kwargs' apply to qmuon-* optimizers only")
        kwargs = {**(qkw if spec["optimizer"].startswith("qmuon-") else {}), **spec.get("kwargs", {})}
        runs.append({"name": spec.get("name", spec["optimizer"] + "*"), "optimizer": spec["optimizer"],
                     "kwargs": kwargs, "env": {k: str(v) for k, v in spec.get("env", {}).items()},
                     "patch": spec.get("patch", {})})
    names = [r["name"] for r in runs]
    if len(set(names)) != len(names):
        raise SystemExit(f"run names must be unique, got {names}")
    for r in runs:
        if r["optimizer"].startswith("qmuon-") and r["kwargs"]:
            _check_qmuon_kwargs(r["kwargs"], f"run {r['name']!r}")
        for path in r["patch"]:
            try:
                _resolve(path)
            except (ValueError, AttributeError, ImportError) as e:
                raise SystemExit(f"run {r['name']!r}: {e}")

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from _common import RESULTS_DIR, header_lines, md_table

    torch.set_num_threads(args.threads)
    header = header_lines("Peak memory of a training step (DecoderLM, one process per optimizer)")
    cap = torch.backends.cpu.get_cpu_capability()
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    results: dict[int, dict[str, dict[str, Any]]] = {}
    repeats: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for n_layers in layers:
        repeats[n_layers] = {r["name"]: [] for r in runs}
        for rep in range(args.repeats):
            for r in runs:  # interleaved: repeat k of every run before repeat k+1 of any
                cfg = {"optimizer": r["optimizer"], "kwargs": r["kwargs"], "patch": r["patch"], "threads": args.threads,
                       "seed": args.seed, "d_model": args.d_model, "layers": n_layers, "heads": args.heads,
                       "vocab": args.vocab, "batch": args.batch, "seq": args.seq, "steps": args.steps, "cpu": args.cpu,
                       "preload_extension": not args.no_preload_extension}
                _log(f"[{time.perf_counter() - t_start:6.1f}s] {n_layers} layers, {r['name']}"
                     + (f" (repeat {rep + 1}/{args.repeats})" if args.repeats > 1 else "") + " ...")
                res = _run_child(cfg, {**env_all, **r["env"]}, args.timeout)
                repeats[n_layers][r["name"]].append(res)
                if "error" in res:
                    _log(f"    ERROR {res['error']}")
                else:
                    _log(f"    peak {_mib(res['peak'])} MiB, step peak {_mib(res['step_peak'])} MiB "
                         f"(+{_mib(res['step_transient'])} over the RSS before the step), state {_mib(res['state_bytes'])} MiB, "
                         f"step {min(res['step_seconds']):.2f}s, child {res['wall_s']:.0f}s")
        # per run: the repeat with the median process peak (any failure makes the run an error)
        results[n_layers] = {}
        for name, reps in repeats[n_layers].items():
            bad = [x for x in reps if "error" in x]
            if bad:
                results[n_layers][name] = bad[0]
                continue
            ordered = sorted(reps, key=lambda x: x["peak"])
            med = dict(ordered[(len(ordered) - 1) // 2])
            med["peak_all"] = [x["peak"] for x in reps]
            results[n_layers][name] = med
    elapsed = time.perf_counter() - t_start
    load_end = os.getloadavg()

    # ---- report
    any_cuda = any(res.get("device", "").startswith("cuda") for per in results.values() for res in per.values())
    lines = list(header)
    lines.insert(-1, f"- CPU capability (`torch.backends.cpu.get_cpu_capability()`): {cap}; libc {' '.join(platform.libc_ver())}; "
                     f"1-min load average at start / end {load_start[0]:.1f} / {load_end[0]:.1f}; total run time {elapsed:.0f}s")
    lines.insert(-1, "- library imported from: " + _library_source())
    if env_all:
        lines.insert(-1, f"- environment of every child: {', '.join(f'`{k}={v}`' for k, v in env_all.items())}")
    first = next((res for per in results.values() for res in per.values() if "error" not in res), None)
    method = first["peak_method"] if first else "?"
    lines += [
        f"Model: `DecoderLM(vocab_size={args.vocab}, d_model={args.d_model}, n_layers=L"
        + (f", n_heads={args.heads}" if args.heads else "") + ")` (other settings DecoderLMConfig's defaults: "
        "SwiGLU MLP, fused qkv and gate_up declared with `qmuon_fused_parts`), "
        f"batch {args.batch} x {args.seq} tokens, {args.steps} training steps per process (forward, backward, "
        "`optimizer.step()`, `zero_grad(set_to_none=True)`), fp32 parameters, "
        f"{'CUDA' if any_cuda else 'CPU'}, torch threads = {args.threads}, seed {args.seed}.",
        "",
        "Each optimizer runs in a fresh process with the same imports (`torch`, `qmuon_lightning`, which imports "
        "Lightning) and " + ("the compiled `torch.ops.qmuon` kernels loaded at startup in every process"
                             if not args.no_preload_extension else "the kernels loaded lazily (QMuon only)")
        + f". Peak RSS per phase: {method}; *peak* is the maximum over all phases of the process "
        "(imports included), *step peak* that of the `optimizer.step()` calls, *step transient* the most any "
        "`optimizer.step()` rose above the RSS just before it. *state* counts the optimizer state tensors "
        "(all parameters) after the last step. "
        + ("With `MALLOC_MMAP_THRESHOLD_` fixed, glibc unmaps large freed blocks at once, so RSS follows the live "
           "tensor bytes (repeats agree to ~1 MiB); the default dynamic threshold would add retained free memory"
           if any(k.startswith("MALLOC_") for k in env_all) else
           "RSS includes memory glibc keeps after `free` (default dynamic mmap threshold), so a single process's peak "
           "varies from process to process (torch.Muon at 8 layers: 807-850 MiB over 9 processes in 3 runs)")
        + (f"; each configuration ran {args.repeats} times (interleaved) and the table shows the run with the median peak."
           if args.repeats > 1 else "; use `--repeats 3` when a verdict is within that."),
        "",
        "`torch.Muon`: `torch.optim.Muon` on the parameters `route_parameters` sends to Muon (it orthogonalizes "
        "the fused qkv / gate_up matrices whole) plus `torch.optim.AdamW` on the rest with build_optimizer's "
        "settings; `torch.AdamW`: AdamW on every parameter; `qmuon-*`: `build_optimizer(model, state_format=...)`"
        + (f" with `--qmuon-kwargs {json.dumps(qkw)}`" if qkw else "") + ".",
        "",
    ]
    extra_runs = [r for r in runs if r["kwargs"] != (qkw if r["optimizer"].startswith("qmuon-") else {})
                  or r["env"] or r["patch"]]
    if extra_runs:
        lines += ["Variants:", ""]
        for r in extra_runs:
            bits = [f"base `{r['optimizer']}`"]
            if r["kwargs"]:
                bits.append(f"kwargs `{json.dumps(r['kwargs'])}`")
            if r["env"]:
                bits.append("env " + ", ".join(f"`{k}={v}`" for k, v in r["env"].items()))
            if r["patch"]:
                bits.append("benchmark-side monkeypatch " + ", ".join(f"`{k} = {v}`" for k, v in r["patch"].items()))
            lines.append(f"- `{r['name']}`: " + "; ".join(bits))
        lines.append("")

    verdicts: list[str] = []
    for n_layers, per in results.items():
        base = per.get(BASELINE)
        ok = {k: v for k, v in per.items() if "error" not in v}
        ref_res = next(iter(ok.values()), None)
        if ref_res is None:
            lines += [f"## {n_layers} layers", "", "every run failed:", ""]
            lines += [f"- `{k}`: {v['error']}" for k, v in per.items()] + [""]
            continue
        n_muon = ref_res["n_muon"]
        lines += [
            f"## {n_layers} layers: {ref_res['n_params'] / 1e6:.1f}M parameters, {n_muon:,} routed to Muon "
            f"(largest Muon matrix / part {ref_res['largest_matrix']:,} elements)",
            "",
        ]
        hdr = ["optimizer", "peak MiB"] + (["peak range MiB"] if args.repeats > 1 else []) + ["vs torch.Muon MiB" + (" (CUDA allocated)" if any_cuda else ""), "vs torch.Muon B / Muon param", "step peak MiB",
               "step transient MiB", "fwd+bwd peak MiB", "RSS after imports + ext MiB", "RSS after model MiB",
               "RSS after step 1 MiB", "state MiB", "step s (min)"]
        if any_cuda:
            hdr += ["CUDA max allocated MiB", "CUDA max reserved MiB"]
        rows = []
        for name, res in per.items():
            if "error" in res:
                rows.append([f"`{name}`", "error: " + res["error"].replace("|", "/")] + [""] * (len(hdr) - 2))
                continue
            if base is not None and "error" not in base:
                d = _judged(res) - _judged(base)
                dm, db = f"{d / MiB:+.1f}", f"{d / n_muon:+.2f}"
            else:
                dm = db = "n/a"
            rng = ([f"{min(res['peak_all']) / MiB:.1f} - {max(res['peak_all']) / MiB:.1f}"] if args.repeats > 1 else [])
            row = [f"`{name}`", _mib(res["peak"]), *rng, dm, db, _mib(res["step_peak"]), _mib(res["step_transient"]),
                   _mib(res["fb_peak"]), _mib(res["rss_extension"]), _mib(res["rss_model"]),
                   _mib(res["steps"][0]["rss_after"]), _mib(res["state_bytes"]), f"{min(res['step_seconds']):.2f}"]
            if any_cuda:
                row += [_mib(res.get("cuda_peak_allocated", 0)), _mib(res.get("cuda_peak_reserved", 0))]
            rows.append(row)
        lines += [md_table(hdr, rows), ""]
        # which phase set each process peak
        where = []
        for name, res in ok.items():
            top = max(res["phases"], key=lambda p: p["peak"])
            where.append(f"`{name}` {top['phase']}" + (f" (step {top['step'] + 1})" if top["step"] >= 0 else ""))
        lines += ["Phase that set the peak: " + ", ".join(where) + ".", ""]
        for name, res in per.items():
            tgt = TARGETS.get(next((r["optimizer"] for r in runs if r["name"] == name), ""))
            if tgt is None:
                continue
            if "error" in res or base is None or "error" in base:
                verdicts.append(f"- {n_layers} layers, `{name}` <= {tgt:+.1f} B / Muon param vs torch.Muon: "
                                "**NOT MEASURED** (a run failed)")
                continue
            d = (_judged(res) - _judged(base)) / n_muon
            lim = _judged(base) + tgt * n_muon
            verdicts.append(
                f"- {n_layers} layers, `{name}` {'CUDA max allocated' if any_cuda else 'peak'} <= torch.Muon's {tgt:+.1f} B x {n_muon / 1e6:.1f}M Muon params "
                f"({_mib(lim)} MiB): {_mib(_judged(res))} MiB, {d:+.2f} B / Muon param: **{'PASS' if d <= tgt else 'MISS'}**"
                + ("" if d <= tgt else f" (over by {(_judged(res) - lim) / MiB:.1f} MiB)"))
    if verdicts:
        lines += ["## Targets", "", *verdicts, ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        out = args.out or RESULTS_DIR / "step_memory.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        raw = {"header": header, "cpu_capability": cap, "args": {k: (str(v) if isinstance(v, Path) else v)
                                                                  for k, v in vars(args).items() if k != "child"},
               "runs": runs, "env": env_all, "results": {str(k): v for k, v in results.items()},
               "repeats": {str(k): v for k, v in repeats.items()},
               "elapsed_s": elapsed, "loadavg": [load_start[0], load_end[0]]}
        out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
        _log(f"wrote {out} and {out.with_suffix('.json').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
