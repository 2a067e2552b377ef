"""``optimizer.step()`` wall time: QMuon int8 with its default Newton-Schulz dtype (``ns_dtype="auto"``)
vs ``ns_dtype="bf16"`` vs ``ns_dtype="fp32"`` vs ``torch.optim.Muon`` on the same GPT-shaped matrices,
the CPU it ran on (ATen CPU capability, bf16 flags, what ``"auto"`` resolved to and why), the ratios
the step-time targets need (PASS / MISS), and a breakdown of where each optimizer spends its step
(non-finite check, momentum-update op, Newton-Schulz, batch assembly / apply, the rest).

Optimizer names
---------------
``torch.Muon``, ``torch.AdamW``, and ``qmuon-<state_format>[-noparts][-ns<auto|bf16|fp32>][-<coefficients>]``:

* ``<state_format>``: ``int8``, ``uint8``, ``fp32``, ``bf16``, ... (QMuon's ``state_format``);
* ``-noparts``: one Muon group without ``parts``: the fused qkv matrix is orthogonalized whole, the
  same work as ``torch.optim.Muon`` (with ``parts=(d, d, d)`` QMuon runs three d x d Newton-Schulz
  instead of one 3d x d: more matmul flops, an algorithmic difference);
* ``-nsbf16`` / ``-nsfp32`` / ``-nsauto``: ``ns_dtype``; without it QMuon's default (``"auto"``);
* ``-polar_express`` (or any other ``ns_coefficients`` preset name): ``ns_coefficients``; default ``"muon"``;
* ``-compiled``: the step compiled as one graph with :func:`qmuon.compile_step` (inductor); its warm-up
  steps compile it, so the timed rounds see only compiled steps.
* ``-capturable``: ``update.capturable`` (step counters and lrs on the device; the weight and AdamW
  writes through the kernels' references), eagerly or with ``-compiled``;
* ``-captured`` (CUDA): ``update.capturable`` and the step captured as one CUDA graph with
  :func:`qmuon.capture_step` (one eager warm-up call, the second captures): give ``--warmup`` >= 2
  so the timed rounds see only replays.

Targets (judged per matrix set on the median of per-round ratios)
----------------------------------------------------------------
1. ``qmuon-int8-noparts`` (default ``ns_dtype``) <= 1.0x ``torch.optim.Muon``;
2. ``qmuon-int8-noparts`` within 1.15x of the faster (lower median) of ``-nsbf16`` / ``-nsfp32``;
3. on a CPU without native bf16 matmul: ``qmuon-int8-noparts`` <= 0.1x ``torch.optim.Muon``
   (reported as not applicable where bf16 matmul is native; emulate such a CPU with
   ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``);
4. with ``ns-floor`` / ``ns-floor-auto`` in ``--optimizers``: ``qmuon-int8-noparts`` <= 1.05x the bare
   batched Newton-Schulz of the same matrices, standard iteration (the issue's floor) / the
   iteration the default ``ns_method="auto"`` runs (the floor of the default's own NS work).

Method
------
* Every optimizer owns its own copy of the same matrices (same init) and its own ``.grad`` tensors.
* Gradients come from a pool of pre-generated random sets. Before *every* timed step each
  optimizer's ``.grad`` tensors are restored from the pool (``copy_``, outside the timed region):
  QMuon overwrites ``.grad`` with the Newton-Schulz input, so grads must be reset each step.
* ``ns_dtype="auto"`` is resolved (and a bf16 / fp32 matmul timed, for the record) before anything
  is timed, so no decision lands in a timed step.
* Repetitions are interleaved: in each round every optimizer takes one step (round-robin, the
  starting optimizer rotates each round), so machine noise hits all of them alike. The tables
  report the median over rounds, the 25th-75th percentile, the ratio of medians and the median of
  per-round ratios (paired, the less noise-sensitive one and the one the targets use).
* The breakdown runs after the timing rounds under ``torch.profiler`` with ``record_function``
  ranges added by a benchmark-only subclass and module-level wrappers (the library is not
  modified), again interleaved.

    python benchmarks/bench_step.py                       # d=256 x 4 and d=512 x 4 layers, writes results/step_time.md
    python benchmarks/bench_step.py --preset gpt-small    # d=768, 12 layers
    python benchmarks/bench_step.py --configs 256x4:30,512x4:16   # DxLAYERS[:rounds], any number
    python benchmarks/bench_step.py --steps 5 --warmup 1 --profile-steps 1 --no-write   # quick look
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_step.py --configs 256x4 \\
        --steps 8 --warmup 1 --profile-steps 1 --out benchmarks/results/step_time_avx2.md   # no native bf16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections import defaultdict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS_DIR, cpu_name, default_threads, ensure_backend, gpt_matrices, header_lines, make_params, md_table, qmuon_param_groups  # noqa: E402

import qmuon.optim.qmuon as qmuon_mod  # noqa: E402
from qmuon_lightning import QMuon  # noqa: E402

try:  # the refactored QMuon: the step runs through qmuon.core.pipeline
    import qmuon.core.pipeline as pipeline_mod  # noqa: E402
except ImportError:  # pragma: no cover - older checkouts
    pipeline_mod = None
try:
    from qmuon.core import newton_schulz as ns_mod  # noqa: E402
except ImportError:  # pragma: no cover - older checkouts (no ns_dtype)
    ns_mod = None

NS_DTYPES = tuple(getattr(ns_mod, "NS_DTYPES", ()))
NS_PRESETS = tuple(getattr(ns_mod, "NS_PRESETS", {}))
NS_DTYPE_ENV = getattr(ns_mod, "NS_DTYPE_ENV", "QMUON_NS_DTYPE")

#: preset -> matrix sets (d_model, layers); the default covers the issue's d=256 x 4 layers (3.1M
#: elements) and a 4x bigger set.
PRESETS = {"default": ((256, 4), (512, 4)), "small": ((512, 4),), "gpt-small": ((768, 12),)}
BASELINE = "torch.Muon"
#: --device: where the matrices, grads and optimizer states live (each timed step is synchronized on CUDA).
DEVICE = torch.device("cpu")
FLOOR = "ns-floor"  # bare batched Newton-Schulz of the same matrices (NSFloor), standard iteration
FLOOR_AUTO = "ns-floor-auto"  # the same with the iteration ns_method="auto" picks per shape (gram where it pays)
T_FLOOR = 1.05  # issue 23: the default step <= 1.05x the bare batched-NS floor
DEFAULT = "qmuon-int8-noparts"  # QMuon int8, default ns_dtype ("auto"), same NS work as torch.optim.Muon
BF16 = DEFAULT + "-nsbf16"
FP32 = DEFAULT + "-nsfp32"
POLAR = DEFAULT + "-polar_express"
DEFAULT_OPTIMIZERS = (BASELINE, DEFAULT, BF16, FP32, POLAR)
EXAMPLES = ("torch.Muon", "torch.AdamW", "qmuon-int8", "qmuon-int8-noparts", "qmuon-int8-noparts-nsfp32",
            "qmuon-fp32", "qmuon-bf16", "qmuon-uint8", "qmuon-int8-noparts-polar_express")
#: target thresholds (median per-round ratios)
T_VS_MUON = 1.0
T_VS_EXPLICIT = 1.15
T_NO_BF16 = 0.1


# ---------------------------------------------------------------------------------------- phases
class PhasedQMuon(QMuon):
    """QMuon with profiler ranges around its internal phases (benchmark only; same behaviour)."""

    # The non-finite gradient check: ``_updatable_params`` (called by ``step()`` before the groups)
    # in current versions, ``_finite_mask`` (called inside ``_muon_momentum_step``) in older ones.
    if hasattr(QMuon, "_updatable_params"):
        def _updatable_params(self, *args, **kwargs):
            with record_function("phase/finite_check"):
                return super()._updatable_params(*args, **kwargs)
    if hasattr(QMuon, "_finite_mask"):
        def _finite_mask(self, *args, **kwargs):
            with record_function("phase/finite_check"):
                return super()._finite_mask(*args, **kwargs)

    # Momentum + NS items of one group: ``_muon_group_step`` (pipeline QMuon), ``_muon_momentum_step`` before.
    if hasattr(QMuon, "_muon_group_step"):
        def _muon_group_step(self, *args, **kwargs):
            with record_function("phase/momentum_step"):
                return super()._muon_group_step(*args, **kwargs)
    elif hasattr(QMuon, "_muon_momentum_step"):
        def _muon_momentum_step(self, *args, **kwargs):
            with record_function("phase/momentum_step"):
                return super()._muon_momentum_step(*args, **kwargs)

    # Older QMuon: a staticmethod; the pipeline QMuon calls ``pipeline.orthogonalize`` (patched below).
    if hasattr(QMuon, "_orthogonalize_and_apply"):
        @staticmethod
        def _orthogonalize_and_apply(*args, **kwargs):
            with record_function("phase/orthogonalize_and_apply"):
                return QMuon._orthogonalize_and_apply(*args, **kwargs)


#: Older QMuon ran the finite check inside ``_muon_momentum_step``; current ones run it first in ``step()``.
FINITE_CHECK_IN_MOMENTUM_STEP = not hasattr(QMuon, "_updatable_params")


@contextmanager
def _patched(module, name: str, label: str):
    """Wrap ``module.name`` (a function looked up at call time) in a profiler range; nothing if
    ``module`` has no such attribute."""
    orig = getattr(module, name, None) if module is not None else None
    if orig is None:
        yield False
        return

    def wrapper(*args, **kwargs):
        with record_function(label):
            return orig(*args, **kwargs)

    setattr(module, name, wrapper)
    try:
        yield True
    finally:
        setattr(module, name, orig)


def _module_patches() -> list[tuple[object, str, str]]:
    """(module, function, range) for the module-level functions the step calls: pipeline QMuon
    calls ``pipeline.orthogonalize`` which calls the pipeline module's own ``newton_schulz_folded``
    global (``from .newton_schulz import newton_schulz_folded``, so it is patched there)."""
    import torch.optim._muon as torch_muon_mod

    out: list[tuple[object, str, str]] = []
    if pipeline_mod is not None and hasattr(pipeline_mod, "orthogonalize"):
        out += [(pipeline_mod, "orthogonalize", "phase/orthogonalize_and_apply"),
                (pipeline_mod, "newton_schulz_folded", "phase/newton_schulz")]
    elif hasattr(qmuon_mod, "newton_schulz_folded"):  # older checkouts
        out.append((qmuon_mod, "newton_schulz_folded", "phase/newton_schulz"))
    out.append((torch_muon_mod, "_zeropower_via_newtonschulz", "phase/newton_schulz"))
    return out


# ---------------------------------------------------------------------------------------- names
def parse_qmuon_name(name: str) -> tuple[str, bool, dict]:
    """``qmuon-<fmt>[-noparts][-ns<dtype>][-<coefficients preset>]`` -> (fmt, noparts, QMuon kwargs)."""
    tokens = name.split("-")
    if tokens[0] != "qmuon" or len(tokens) < 2 or not tokens[1]:
        raise ValueError(_unknown(name))
    fmt, noparts, kw = tokens[1], False, {}
    for m in tokens[2:]:
        if m == "noparts":
            noparts = True
        elif m == "compiled":
            kw["compiled"] = True
        elif m == "capturable":
            kw.setdefault("update", {})["capturable"] = True
        elif m == "captured":
            kw["captured"] = True
            kw.setdefault("update", {})["capturable"] = True
        elif m.startswith("ns") and m[2:] in NS_DTYPES:
            kw.setdefault("newton_schulz", {})["dtype"] = m[2:]
        elif m in NS_PRESETS:
            kw.setdefault("newton_schulz", {})["coefficients"] = m
        elif m in ("gram", "auto", "standard"):  # newton_schulz.method (core.gram_newton_schulz)
            kw.setdefault("newton_schulz", {})["method"] = m
        else:
            raise ValueError(_unknown(name))
    return fmt, noparts, kw


def _unknown(name: str) -> str:
    return (f"unknown optimizer {name!r}; use torch.Muon, torch.AdamW or "
            f"qmuon-<state_format>[-noparts][-ns<{'|'.join(NS_DTYPES) or 'dtype'}>][-<{'|'.join(NS_PRESETS) or 'preset'}>], "
            f"e.g. {', '.join(EXAMPLES)}")


def _dtype_name(dt: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dt, str(dt))


# ---------------------------------------------------------------------------------------- setup
class Runner:
    def __init__(self, name: str, specs, seed: int, phased: bool = False) -> None:
        self.name = name
        self.params = [torch.nn.Parameter(p.detach().to(DEVICE)) for p in make_params(specs, seed)]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        qcls = PhasedQMuon if phased else QMuon
        if name == "torch.Muon":
            self.opt = torch.optim.Muon(self.params)
        elif name == FLOOR:
            self.opt = NSFloor(self.params)
        elif name == FLOOR_AUTO:
            self.opt = NSFloor(self.params, method="auto")
        elif name == "torch.AdamW":
            self.opt = torch.optim.AdamW(self.params)
        elif name.startswith("qmuon-"):
            fmt, noparts, kw = parse_qmuon_name(name)
            compiled = kw.pop("compiled", False)
            captured = kw.pop("captured", False)
            groups = [{"params": self.params}] if noparts else qmuon_param_groups(specs, self.params)
            self.opt = qcls(groups, state_format=fmt, **kw)
            if compiled:
                import qmuon

                self.step = qmuon.compile_step(self.opt)
            elif captured:
                import qmuon

                self.step = qmuon.capture_step(self.opt, warmup_steps=1)  # .grad is restored in place
        else:
            raise ValueError(_unknown(name))
        if not hasattr(self, "step"):
            self.step = self.opt.step

    def ns_label(self) -> tuple[str, str]:
        """(NS dtype, NS coefficients) this optimizer runs, as shown in the table."""
        if self.name == "torch.Muon":
            return "bf16 (always)", "muon"
        if isinstance(self.opt, NSFloor):
            return f"auto → {_dtype_name(self.opt._dtype)}", f"muon ({self.opt._method})"
        if not isinstance(self.opt, QMuon):
            return "-", "-"
        g = self.opt.param_groups[0]
        req = g.get("ns_dtype", "bf16")
        coeffs = g.get("ns_coefficients", "muon")
        coeffs = coeffs if isinstance(coeffs, str) else "custom"
        coeffs = f"{coeffs} ({g.get('ns_method', 'standard')})"
        if ns_mod is None:
            return str(req), coeffs
        res = _dtype_name(ns_mod.resolve_ns_dtype(req, DEVICE.type))
        if req != "auto":
            return res, coeffs
        pinned = f", pinned by {NS_DTYPE_ENV}" if os.environ.get(NS_DTYPE_ENV, "").strip() else ""
        return f"auto → {res}{pinned}", coeffs

    def restore_grads(self, grads: list[torch.Tensor]) -> None:
        for p, g in zip(self.params, grads):
            p.grad.copy_(g)

    def timed_step(self) -> tuple[float, int]:
        """Wall seconds and minor page faults (whole process) of one ``step()``."""
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        _sync()
        t0 = time.perf_counter()
        self.step()
        _sync()  # a CUDA step is timed to its last kernel, not to its last launch
        dt = time.perf_counter() - t0
        return dt, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


class NSFloor:
    """The bare batched Newton-Schulz of the same matrices (the step's floor): every same-shape
    gradient stacked into one batch (no cap), in the ``"auto"`` NS dtype, nothing else (no
    momentum, no apply). ``method="standard"``: ``newton_schulz_folded`` on every shape (the
    issue's floor, torch.optim.Muon's iteration); ``"auto"``: the iteration ``ns_method="auto"``
    picks per shape (``newton_schulz_gram`` where it pays), i.e. the NS the default step runs."""

    def __init__(self, params, method: str = "standard") -> None:
        from qmuon.core.gram_newton_schulz import newton_schulz_gram, pick_ns_method
        from qmuon.core.newton_schulz import newton_schulz_folded, resolve_ns_dtype, resolve_schedule

        self.params = params
        self._ns, self._sch = newton_schulz_folded, resolve_schedule("muon", 5)
        self._dtype = resolve_ns_dtype("auto", DEVICE.type)
        self._method = method
        self.param_groups = [{"params": params, "ns_dtype": "auto", "ns_coefficients": "muon", "ns_method": method}]
        # decided before timing, per shape: the floor's step runs NS only
        self._iterations = {tuple(p.shape): newton_schulz_gram if pick_ns_method(
            method, p.shape[0], p[0].numel(), DEVICE.type, self._dtype, self._sch) == "gram" else newton_schulz_folded
            for p in params}

    def step(self) -> None:
        by_shape: dict = {}
        for p in self.params:
            by_shape.setdefault(tuple(p.shape), []).append(p.grad.view(p.shape[0], -1))
        for shape, gs in by_shape.items():
            batch = torch.stack(gs)
            inv = batch.flatten(1).norm(dim=1).clamp_min(1e-7).reciprocal()
            self._iterations[shape](batch, inv, self._sch, 5, dtype=self._dtype)


def make_pool(specs, n: int, seed: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed + 1000)
    return [[torch.randn(s.shape, generator=g).to(DEVICE) for s in specs] for _ in range(n)]


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def rotated(names: list[str], k: int) -> list[str]:
    k %= len(names)
    return names[k:] + names[:k]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = (len(xs) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def paired(a: list[float], b: list[float]) -> float:
    """Median of per-round ratios a_i / b_i."""
    return statistics.median([x / y for x, y in zip(a, b)])


# ---------------------------------------------------------------------------------------- timing
def time_interleaved(runners: dict[str, Runner], pool, steps: int, warmup: int, log: Callable):
    names = list(runners)
    times: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[int]] = {n: [] for n in names}
    k = 0
    gc.collect()
    gc.disable()
    try:
        for rnd in range(warmup + steps):
            t_round = time.perf_counter()
            for n in rotated(names, rnd):
                runners[n].restore_grads(pool[k % len(pool)])
                dt, nf = runners[n].timed_step()
                if rnd >= warmup:
                    times[n].append(dt)
                    faults[n].append(nf)
            k += 1
            tag = "warmup" if rnd < warmup else f"round {rnd - warmup + 1}/{steps}"
            log(f"  {tag}: {time.perf_counter() - t_round:.1f}s")
    finally:
        gc.enable()
    return times, faults


# ---------------------------------------------------------------------------------------- breakdown
def profile_breakdown(specs, names: list[str], pool, reps: int, seed: int, log: Callable) -> dict[str, dict]:
    """Per optimizer: mean ms per step of each phase and the top aten ops (self CPU)."""
    runners = {n: Runner(n, specs, seed, phased=True) for n in names}
    for n in names:  # create state, warm up kernels outside the profile
        runners[n].restore_grads(pool[0])
        runners[n].step()
    acc: dict[str, dict] = {n: {"events": defaultdict(lambda: [0.0, 0.0, 0]), "steps": 0, "wall": []} for n in names}
    with ExitStack() as stack:
        for mod, fn, label in _module_patches():
            stack.enter_context(_patched(mod, fn, label))
        for rep in range(reps):
            for n in rotated(names, rep):
                r = runners[n]
                r.restore_grads(pool[(rep + 1) % len(pool)])
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    with record_function("phase/step"):
                        t0 = time.perf_counter()
                        r.step()
                        acc[n]["wall"].append(time.perf_counter() - t0)
                for e in prof.key_averages():
                    ev = acc[n]["events"][e.key]
                    ev[0] += e.self_cpu_time_total / 1e3  # us -> ms
                    ev[1] += e.cpu_time_total / 1e3
                    ev[2] += e.count
                acc[n]["steps"] += 1
            log(f"  profiled round {rep + 1}/{reps}")
    out = {}
    for n in names:
        s = acc[n]["steps"]
        ev = {k: (v[0] / s, v[1] / s, v[2] / s) for k, v in acc[n]["events"].items()}

        def tot(key: str) -> float:
            return ev.get(key, (0.0, 0.0, 0))[1]

        step = tot("phase/step")
        ns = tot("phase/newton_schulz")
        phases: list[tuple[str, float]] = []
        if n.startswith("qmuon-"):
            # the public op (``qmuon::``) only: the compiled kernel (``qmuon_C::``) is nested in it
            op = sum(v[1] for k, v in ev.items() if k.startswith("qmuon::") and k.endswith("_momentum_update_multi_"))
            finite = tot("phase/finite_check")
            mstep = tot("phase/momentum_step")
            ortho = tot("phase/orthogonalize_and_apply")
            nested = FINITE_CHECK_IN_MOMENTUM_STEP
            group_fn = "_muon_group_step" if hasattr(QMuon, "_muon_group_step") else "_muon_momentum_step"
            ortho_fn = "pipeline.orthogonalize" if pipeline_mod is not None else "_orthogonalize_and_apply"
            ns_fn = "pipeline.newton_schulz_folded" if pipeline_mod is not None else "newton_schulz_folded"
            phases = [
                ("non-finite gradient check (`_updatable_params`: fused `_foreach_norm`)", finite),
                ("momentum-update op (`torch.ops.qmuon.*_momentum_update_multi_`)", op),
                (f"rest of `{group_fn}` (state init, `step += 1`, weight decay, NS items)",
                 mstep - op - (finite if nested else 0.0)),
                (f"Newton-Schulz (`{ns_fn}`)", ns),
                (f"NS batch assembly + parameter update (`{ortho_fn}` minus NS)", ortho - ns),
                ("rest of `step()` (Python, dict bookkeeping)", step - mstep - ortho - (0.0 if nested else finite)),
            ]
        elif n == "torch.Muon":
            mom = tot("aten::lerp_") + tot("aten::lerp")
            phases = [
                ("momentum + Nesterov blend (`lerp_`, `lerp`)", mom),
                ("Newton-Schulz (`_zeropower_via_newtonschulz`)", ns),
                ("rest (weight decay, update, Python)", step - mom - ns),
            ]
        else:
            phases = [("whole step", step)]
        top = sorted(
            ((k, v) for k, v in ev.items() if not k.startswith("phase/") and not k.startswith("Optimizer.")
             and not k.startswith("qmuon::")),
            key=lambda kv: -kv[1][0],
        )[:12]
        out[n] = {"step": step, "wall": statistics.median(acc[n]["wall"]) * 1e3, "phases": phases, "top": top}
    return out


def contention_note(load_start: float, load_end: float, threads: int) -> list[str]:
    """A warning, computed from the load average, when other processes competed for the CPUs."""
    cpus = default_threads()
    if max(load_start, load_end) <= cpus:
        return []
    msg = (f"**Contended run:** the 1-minute load average ({load_start:.1f} at start, {load_end:.1f} at end) "
           f"exceeded the {cpus} available CPUs, so other processes shared the cores during the measurement. ")
    if threads > 1:
        msg += ("With several torch threads every parallel region can stall until a descheduled worker thread "
                "runs again (up to a scheduler tick), which inflates absolute times and favours implementations "
                "with fewer, larger ops (QMuon batches its Newton-Schulz matmuls; torch.optim.Muon runs ~15 small "
                "ops per matrix). Treat the ratios vs torch.optim.Muon as indicative only and cross-check with "
                "`--threads 1` (insensitive to that effect) or on an idle machine; the QMuon-vs-QMuon ratios "
                "(ns_dtype) share the same batching and are less affected.")
    else:
        msg += "Single-threaded timings are affected by time slicing but not by thread stalls; ratios stay usable."
    return [msg, ""]


# ---------------------------------------------------------------------------------------- the CPU
@dataclass
class CpuInfo:
    model: str
    capability: str
    bf16_flags: list[str]
    env: dict[str, str]
    auto: str  # what ns_dtype="auto" resolved to on CPU in this process
    native_bf16: bool | None  # the library's instruction-set rule; None if unknown
    reason: str
    t_bf16_ms: float | None
    t_fp32_ms: float | None

    @property
    def emulated(self) -> bool:
        """bf16 GEMMs run emulated (no bf16 instructions, or ATen / oneDNN capped below them): the
        case of the "<= 0.1x torch.optim.Muon" target. A CPU whose bf16 instructions are merely
        slower than fp32 (an Intel AVX512-BF16 without AMX) makes ``"auto"`` pick fp32 too, but
        torch.optim.Muon's bf16 there is not emulated."""
        isa = self.env.get("ONEDNN_MAX_CPU_ISA", "").upper()
        capped = bool(isa) and isa != "ALL" and "BF16" not in isa and "AMX" not in isa
        return not self.bf16_flags or not self.capability.upper().startswith("AVX512") or capped


def cpu_info() -> CpuInfo:
    """The CPU, ``ns_dtype="auto"``'s decision (resolved now, before anything is timed) and a
    single-thread bf16 vs fp32 matmul timing for the record."""
    try:
        cap = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover - very old torch
        cap = "unknown"
    flags = ns_mod.cpu_flags() if ns_mod is not None and hasattr(ns_mod, "cpu_flags") else set()
    bf16 = sorted(f for f in flags if f in ("avx512_bf16", "amx_bf16", "amx_tile", "bf16"))
    env = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", NS_DTYPE_ENV) if os.environ.get(k)}
    if ns_mod is None:
        return CpuInfo(cpu_name(), cap, bf16, env, "n/a (no ns_dtype in this checkout)", None, "", None, None)
    auto = _dtype_name(ns_mod.resolve_ns_dtype("auto", "cpu"))
    native, reason = ns_mod._probe_cpu_bf16() if hasattr(ns_mod, "_probe_cpu_bf16") else (None, "")
    t16 = t32 = None
    if hasattr(ns_mod, "measure_cpu_bf16_ratio"):
        t16, t32 = ns_mod.measure_cpu_bf16_ratio(reps=9)
        t16, t32 = t16 * 1e3, t32 * 1e3
    return CpuInfo(cpu_name(), cap, bf16, env, auto, native, reason, t16, t32)


def cpu_lines(c: CpuInfo) -> list[str]:
    if DEVICE.type == "cuda":
        i = DEVICE.index if DEVICE.index is not None else torch.cuda.current_device()
        cap = torch.cuda.get_device_capability(i)
        return [f"- device: **{torch.cuda.get_device_name(i)}** (sm_{cap[0]}{cap[1]}), torch CUDA {torch.version.cuda}; "
                f"`ns_dtype=\"auto\"` -> **{_dtype_name(ns_mod.resolve_ns_dtype('auto', 'cuda'))}**; every timed step "
                f"ends in torch.cuda.synchronize(); host CPU: {c.model}"]
    env = ", ".join(f"`{k}={v}`" for k, v in c.env.items()) or "none of `ATEN_CPU_CAPABILITY`, `ONEDNN_MAX_CPU_ISA`, " \
        f"`{NS_DTYPE_ENV}` set"
    lines = [
        f"- CPU: {c.model}; ATen CPU capability **{c.capability}**; bf16 flags in /proc/cpuinfo: "
        f"{', '.join(c.bf16_flags) or 'none'}; environment: {env}",
    ]
    if c.emulated and c.bf16_flags:
        lines.append("- **Emulated CPU without native bf16 matmul:** the CPU has bf16 instructions, but the environment "
                     "caps ATen / oneDNN below them, so bf16 GEMMs run emulated as on an AVX2-only CPU.")
    elif c.emulated:
        lines.append("- **No bf16 instructions:** bf16 GEMMs run emulated.")
    if c.env.get(NS_DTYPE_ENV):
        lines.append(f"- `ns_dtype=\"auto\"` -> **{c.auto}**, pinned by `{NS_DTYPE_ENV}={c.env[NS_DTYPE_ENV]}` "
                     f"(the instruction-set rule would say: {c.reason})")
    else:
        lines.append(f"- `ns_dtype=\"auto\"` -> **{c.auto}** (resolved before timing): {c.reason or 'n/a'}")
    if c.t_bf16_ms is not None:
        lines.append(f"- For the record (`measure_cpu_bf16_ratio`: 256x256 matmul, 1 thread, median of 9; the automatic "
                     f"choice does not time anything): bf16 {c.t_bf16_ms:.3f} ms vs fp32 {c.t_fp32_ms:.3f} ms, "
                     f"bf16/fp32 = {c.t_bf16_ms / c.t_fp32_ms:.2f}")
    return lines


# ---------------------------------------------------------------------------------------- verdicts
def targets(times: dict[str, list[float]], c: CpuInfo) -> list[dict]:
    """The step-time targets on one matrix set: [{name, ratio, rom, ok_rounds, rounds, verdict, note}]."""
    med = {n: statistics.median(t) for n, t in times.items()}
    out: list[dict] = []

    def row(label: str, a: str, b: str, limit: float, applicable: bool = True, note: str = "") -> None:
        r = paired(times[a], times[b])
        ok_rounds = sum(x / y <= limit for x, y in zip(times[a], times[b]))
        verdict = ("PASS" if r <= limit else "MISS") if applicable else "n/a"
        out.append({"target": label, "a": a, "b": b, "limit": limit, "ratio": r, "rom": med[a] / med[b],
                    "ok_rounds": ok_rounds, "rounds": len(times[a]), "verdict": verdict, "note": note})

    if DEFAULT in times and BASELINE in times:
        row(f"default QMuon int8 <= {T_VS_MUON:.1f}x torch.optim.Muon", DEFAULT, BASELINE, T_VS_MUON)
    if DEFAULT in times and BF16 in times and FP32 in times:
        faster = BF16 if med[BF16] <= med[FP32] else FP32
        row(f"default within {T_VS_EXPLICIT:.2f}x of the faster explicit ns_dtype "
            f"(`{'bf16' if faster == BF16 else 'fp32'}`, lower median)", DEFAULT, faster, T_VS_EXPLICIT)
    if DEFAULT in times and BASELINE in times and DEVICE.type != "cpu":
        row(f"no native bf16 matmul: default <= {T_NO_BF16:.1f}x torch.optim.Muon", DEFAULT, BASELINE, T_NO_BF16,
            applicable=False, note=f"a CPU target; this run is on {DEVICE}")
    elif DEFAULT in times and BASELINE in times:
        if c.emulated:
            row(f"no native bf16 matmul: default <= {T_NO_BF16:.1f}x torch.optim.Muon", DEFAULT, BASELINE, T_NO_BF16)
        else:
            row(f"no native bf16 matmul: default <= {T_NO_BF16:.1f}x torch.optim.Muon", DEFAULT, BASELINE, T_NO_BF16,
                applicable=False, note="this CPU has native bf16 matmul (bf16 GEMMs not emulated); see the AVX2-capped run")
    if DEFAULT in times and FLOOR in times:
        row(f"default <= {T_FLOOR:.2f}x the bare batched-NS floor (standard iteration: the issue's floor)",
            DEFAULT, FLOOR, T_FLOOR)
    if DEFAULT in times and FLOOR_AUTO in times:
        row(f"default <= {T_FLOOR:.2f}x the floor running the default's own iteration (`ns_method=\"auto\"`)",
            DEFAULT, FLOOR_AUTO, T_FLOOR)
    if c.env.get(NS_DTYPE_ENV):
        for t in out:
            t["note"] = (t["note"] + "; " if t["note"] else "") + f"default pinned by {NS_DTYPE_ENV}"
    return out


def fmt_ratio(t: dict) -> str:
    return f"{t['ratio']:.3f}x"


# ---------------------------------------------------------------------------------------- main
def parse_configs(args) -> tuple[list[tuple[int, int, int]], str]:
    """[(d_model, layers, rounds)] and the output-name tag ('' for the default preset)."""
    if args.configs:
        out = []
        for spec in args.configs.split(","):
            spec = spec.strip()
            if not spec:
                continue
            shape, _, rounds = spec.partition(":")
            d, _, layers = shape.lower().partition("x")
            try:
                out.append((int(d), int(layers), int(rounds) if rounds else args.steps))
            except ValueError:
                raise SystemExit(f"--configs: expected DxLAYERS[:ROUNDS] entries like 256x4:20, got {spec!r}") from None
        shapes = tuple((d, l) for d, l, _ in out)
        return out, "" if shapes == PRESETS["default"] else "_".join(f"d{d}_l{l}" for d, l in shapes)
    sets = PRESETS[args.preset]
    if args.d_model is not None or args.layers is not None:
        d = args.d_model or sets[-1][0]
        layers = args.layers or sets[-1][1]
        return [(d, layers, args.steps)], f"d{d}_l{layers}"
    return [(d, layers, args.steps) for d, layers in sets], "" if args.preset == "default" else args.preset


def run_config(d: int, layers: int, steps: int, names: list[str], args, c: CpuInfo, log: Callable) -> dict:
    specs = gpt_matrices(d, layers)
    n_elems = sum(s.shape[0] * s.shape[1] for s in specs)
    log(f"d={d}, {layers} layers: {len(specs)} matrices, {n_elems:,} elements, {steps} rounds")
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    pool = make_pool(specs, args.pool, args.seed)
    runners = {n: Runner(n, specs, args.seed) for n in names}
    ns_labels = {n: r.ns_label() for n, r in runners.items()}
    times, faults = time_interleaved(runners, pool, steps, args.warmup, log)
    del runners
    gc.collect()

    base = times[BASELINE]
    med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
    rows = []
    for n in names:
        t = [x * 1e3 for x in times[n]]
        rows.append([
            f"`{n}`", ns_labels[n][0], ns_labels[n][1], f"{med[n]:.1f}", f"{pct(t, 0.25):.1f} - {pct(t, 0.75):.1f}",
            f"{min(t):.1f}", f"{med[n] / med[BASELINE]:.3f}x", f"{paired(times[n], base):.3f}x",
            f"{sum(a <= b for a, b in zip(times[n], base))}/{len(t)}", f"{statistics.median(faults[n]):,.0f}",
        ])
    table = md_table(
        ["optimizer", "NS dtype", "NS coefficients (method)", "median ms/step", "p25 - p75 ms", "min ms",
         "ratio of medians vs torch.Muon", "median per-round ratio vs torch.Muon", "rounds <= torch.Muon",
         "minor page faults / step"],
        rows, align=["l", "l", "l"] + ["r"] * 7,
    )
    tg = targets(times, c)
    verdict_lines = []
    for t in tg:
        verdict_lines.append(
            f"- **{t['target']}: {t['verdict']}** - `{t['a']}` / `{t['b']}`: median per-round ratio {fmt_ratio(t)}, "
            f"ratio of medians {t['rom']:.3f}x, {t['ok_rounds']} of {t['rounds']} rounds within {t['limit']:g}x"
            + (f" ({t['note']})" if t["note"] else "") + ".")
    info = []
    if BF16 in times and FP32 in times:
        info.append(f"- QMuon NS in bf16 vs fp32 (`-nsbf16` / `-nsfp32`): median per-round ratio "
                    f"{paired(times[BF16], times[FP32]):.3f}x.")
    if POLAR in times and DEFAULT in times:
        info.append(f"- `ns_coefficients=\"polar_express\"` vs `\"muon\"` (same ns_dtype, same 5 steps): median per-round "
                    f"ratio {paired(times[POLAR], times[DEFAULT]):.3f}x.")
    if "qmuon-int8" in times:
        info.append(f"- `qmuon-int8` (fused qkv orthogonalized as separate q, k, v: more matmul work) vs torch.optim.Muon: "
                    f"median per-round ratio {paired(times['qmuon-int8'], base):.3f}x.")
    elapsed_timing = time.perf_counter() - t0
    load_end = os.getloadavg()[0]
    body = [
        f"## d={d}, {layers} layers: {n_elems / 1e6:.1f}M elements",
        "",
        f"{len(specs)} fp32 matrices, {n_elems:,} elements (qkv {3 * d}x{d}, with `parts=({d}, {d}, {d})` only in "
        f"`qmuon-<fmt>` without `-noparts`; attn out {d}x{d}, mlp fc {4 * d}x{d}, mlp proj {d}x{4 * d}). "
        f"{steps} timed rounds after {args.warmup} warm-up rounds ({elapsed_timing:.0f}s); 1-min load average at "
        f"start / end {load_start:.1f} / {load_end:.1f} on {default_threads()} CPUs.",
        "",
        table,
        "",
        *verdict_lines,
        *info,
        "",
        *contention_note(load_start, load_end, torch.get_num_threads()),
    ]
    print("\n".join(body), flush=True)

    prof_md: list[str] = []
    bd = None
    if args.profile_steps > 0:
        prof_names = [n for n in names if n != "torch.AdamW"]
        bd = profile_breakdown(specs, prof_names, pool, args.profile_steps, args.seed, log)
        ns_where = ("`qmuon.core.pipeline.newton_schulz_folded` (QMuon)" if pipeline_mod is not None
                    else "`qmuon.core.newton_schulz.newton_schulz_folded` (QMuon)")
        prof_md += [
            f"### Where the step goes (d={d}, {layers} layers)",
            "",
            f"`torch.profiler` (CPU), {args.profile_steps} profiled step(s) per optimizer, interleaved; mean ms per step "
            "of each phase (profiled steps are slightly slower than unprofiled ones). QMuon phases come from "
            "`record_function` ranges added by a benchmark-only subclass (`_updatable_params`, `_muon_group_step`) and "
            f"module-level wrappers (`qmuon.core.pipeline.orthogonalize`); the NS ranges wrap {ns_where} and "
            "`torch.optim._muon._zeropower_via_newtonschulz`.",
            "",
        ]
        for n in prof_names:
            b = bd[n]
            prow = [[p, f"{ms:.1f}", f"{100 * ms / b['step']:.1f}%"] for p, ms in b["phases"]]
            prow.append(["**step total (profiled)**", f"**{b['step']:.1f}**", "100%"])
            prof_md += [f"#### `{n}` (NS dtype {ns_labels[n][0]})", "", md_table(["phase", "ms / step", "share"], prow), ""]
        for n in (DEFAULT, "torch.Muon"):
            if n not in bd:
                continue
            trow = [[f"`{k}`", f"{v[0]:.2f}", f"{v[2]:.0f}"] for k, v in bd[n]["top"]]
            prof_md += [
                f"Top ops of `{n}` by self CPU time (ms per step, calls per step):",
                "",
                md_table(["op", "self ms / step", "calls / step"], trow),
                "",
            ]
        print("\n".join(prof_md), flush=True)
    return {
        "d_model": d, "layers": layers, "matrices": len(specs), "elements": n_elems, "rounds": steps,
        "warmup": args.warmup, "load_start": load_start, "load_end": load_end,
        "ns": {n: {"dtype": ns_labels[n][0], "coefficients": ns_labels[n][1]} for n in names},
        "times_ms": {n: [round(x * 1e3, 3) for x in t] for n, t in times.items()},
        "minor_faults": faults,
        "targets": tg,
        "phases_ms": {n: {p: round(ms, 3) for p, ms in b["phases"]} | {"step": round(b["step"], 3)}
                      for n, b in bd.items()} if bd else {},
        "md": body + prof_md,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default",
                    help="default: d=256 x 4 and d=512 x 4 layers; small: d=512 x 4; gpt-small: d=768 x 12")
    ap.add_argument("--configs", help="matrix sets DxLAYERS[:ROUNDS], comma separated (e.g. 256x4:20,512x4:10); "
                                      "overrides --preset / --d-model / --layers")
    ap.add_argument("--d-model", type=int, help="one matrix set: override the preset's d_model")
    ap.add_argument("--layers", type=int, help="one matrix set: override the preset's number of layers")
    ap.add_argument("--steps", type=int, default=15, help="timed rounds (each optimizer steps once per round)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    ap.add_argument("--pool", type=int, default=3, help="pre-generated gradient sets, used in turn")
    ap.add_argument("--profile-steps", type=int, default=2, help="profiled rounds per matrix set (0: skip)")
    ap.add_argument("--optimizers", default=",".join(DEFAULT_OPTIMIZERS),
                    help=f"comma list; names: torch.Muon, torch.AdamW, qmuon-<fmt>[-noparts][-ns<dtype>][-<preset>] "
                         f"(e.g. {', '.join(EXAMPLES)})")
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]: where the matrices and states live (on CUDA "
                    "each timed step ends in a synchronize; the CPU-only targets are reported as n/a)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="markdown output (default benchmarks/results/step_time[_TAG].md); "
                                             "a .json with the raw per-round times is written beside it")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    configs, tag = parse_configs(args)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    if BASELINE not in names:
        names.insert(0, BASELINE)
    for n in names:  # fail on a bad name before anything runs
        try:
            if n.startswith("qmuon-"):
                parse_qmuon_name(n)
            elif n not in ("torch.Muon", "torch.AdamW", FLOOR, FLOOR_AUTO):
                raise ValueError(_unknown(n))
        except ValueError as e:
            raise SystemExit(str(e)) from None

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    backend = ensure_backend()  # builds the compiled kernels, if any, before anything is timed
    c = cpu_info()  # resolves ns_dtype="auto" now, outside any timed step
    log(f"threads={torch.get_num_threads()}, torch.ops.qmuon backend: {backend}, optimizers: {', '.join(names)}")
    for line in cpu_lines(c):
        log(line)
    t_start = time.perf_counter()
    results = [run_config(d, layers, steps, names, args, c, log) for d, layers, steps in configs]
    elapsed = time.perf_counter() - t_start

    summary_rows = []
    for r in results:
        for t in r["targets"]:
            summary_rows.append([f"d={r['d_model']} x {r['layers']} ({r['elements'] / 1e6:.1f}M)", t["target"],
                                 f"`{t['a']}` / `{t['b']}`", fmt_ratio(t), f"{t['rom']:.3f}x",
                                 f"{t['ok_rounds']}/{t['rounds']}", f"**{t['verdict']}**"])
    summary = md_table(["matrices", "target", "compared", "median per-round ratio", "ratio of medians",
                        "rounds within target", "verdict"], summary_rows, align=["l", "l", "l", "r", "r", "r", "l"])
    print("\n" + summary)

    head = header_lines("optimizer.step() time: QMuon int8 ns_dtype auto / bf16 / fp32 vs torch.optim.Muon")
    if head and head[-1] == "":
        head = head[:-1]
    lines = head + cpu_lines(c) + [
        "",
        f"Optimizers: {', '.join(f'`{n}`' for n in names)}. `{DEFAULT}` is QMuon int8 with its defaults "
        "(`ns_dtype=\"auto\"`, `ns_coefficients=\"muon\"`, `ns_method=\"auto\"`, block_size 256, nearest rounding) in "
        "one group without `parts`, i.e. the same matrices as `torch.optim.Muon` (fused qkv orthogonalized whole; "
        "`-standard` also runs its iteration, while `\"auto\"` may pick Gram Newton-Schulz for elongated ones); "
        "`-nsbf16` / `-nsfp32` pin `ns_dtype`, `-polar_express` sets `ns_coefficients`, `-standard` / `-gram` / `-auto` "
        "`ns_method`; `ns-floor` / `ns-floor-auto` are the bare batched Newton-Schulz of the same matrices (standard "
        "iteration / the iteration `\"auto\"` picks), no momentum and no weight write. Every optimizer owns a copy of "
        f"the same matrices; in each round every optimizer takes one `step()` (round-robin, rotating start) after its "
        f"`.grad` tensors are restored from a pool of {args.pool} pre-generated random gradient sets (not timed). "
        f"Total run time {elapsed:.0f}s.",
        "",
        "### Targets",
        "",
        "Median of per-round ratios (each round times every optimizer once, so the pair shares the machine's state).",
        "",
        summary,
        "",
        *[x for r in results for x in r["md"]],
    ]
    text = "\n".join(lines)
    if not args.no_write:
        out = args.out or RESULTS_DIR / (f"step_time_{tag}.md" if tag else "step_time.md")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        meta = {
            "header": head, "threads": torch.get_num_threads(), "optimizers": names, "pool": args.pool,
            "python": platform.python_version(), "torch": torch.__version__, "backend": backend,
            "cpu": {"model": c.model, "capability": c.capability, "bf16_flags": c.bf16_flags, "env": c.env,
                    "auto": c.auto, "native_bf16_rule": c.native_bf16, "reason": c.reason,
                    "matmul256_1thread_ms": {"bf16": c.t_bf16_ms, "fp32": c.t_fp32_ms}},
            "elapsed_s": round(elapsed, 1),
            "configs": [{k: v for k, v in r.items() if k != "md"} for r in results],
        }
        out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
        log(f"wrote {out} and {out.with_suffix('.json').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
