"""Optimizer-step time of the full memory stack against today's QMuon int8 step, interleaved, on CPU.

Issue 19's target: the step of the full stack (int8 momentum + int8 AdamW moments + bf16 weights
without an fp32 master, ``bf16_update="stochastic"``; no gradient release) within **1.05x** the step
of QMuon int8 as it was before (int8 momentum, fp32 weights, fp32 AdamW moments). Measured here, on
the same model in one process, for:

* ``torch.Muon + AdamW``: ``torch.optim.Muon`` on the Muon-routed matrices, ``torch.optim.AdamW`` on the rest;
* ``QMuon int8``: the baseline (``state_format="int8"``, ``adamw_state_format="fp32"``, fp32 weights);
* ``int8 + int8 AdamW``: the quantized AdamW moments alone (fp32 weights);
* ``full stack, stochastic`` and ``full stack, ecc8``: int8 + int8 AdamW + bf16 weights with that rule.

The setups are :data:`qmuon_lightning.memory.STANDARD_SETUPS` (what ``bench_train_memory.py`` measures).
Models: ``gpt`` (``DecoderLM`` d=256, 4 layers, 8192 vocabulary: bench_step's 256x4 shape with its
embedding and head) and ``llama`` (bench_train_memory's Hugging Face ``LlamaForCausalLM``: hidden 512,
8 layers, untied 32k vocabulary, 56.4M parameters).

Method: every setup owns a copy of the model (same init) and fixed random gradients (restored before
each step, outside the timed region: QMuon overwrites ``.grad``). Each round steps every setup once, in
an order rotated per round; the time is the CPU time of the process (``time.process_time``) with one
torch thread, because the machine may be shared (wall time would count other jobs' share). Reported:
medians, the ratio of medians and the median of per-round ratios to ``QMuon int8`` (paired: the one
the target is judged on). Then the parts of the step the setups do differently are timed alone the
same way: the AdamW step of every AdamW-routed parameter (fp32 / int8 moments, fp32 / bf16 weights)
and the weight write of every Muon matrix (fp32, bf16 stochastic, bf16 ecc8). (``torch.profiler``
times ops by wall clock, which a shared machine inflates; these are CPU times.)

ISAs: ``native`` (the compiled kernels built for this CPU, ATen's best vector ISA) and ``avx2``: a
child process with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` (ATen / oneDNN capped at AVX2:
bf16 matmuls emulated) and ``QMUON_CPU_ARCH=x86-64-v3`` (the qmuon kernels built for an AVX2 CPU), as
an AVX2-only CPU would run.

    python benchmarks/bench_bf16_step.py                       # both models, native + avx2
    python benchmarks/bench_bf16_step.py --models gpt --isas native --reps 5 --no-write   # quick look
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from _common import RESULTS_DIR, cpu_name, ensure_backend, header_lines, md_table  # noqa: E402

TARGET = 1.05
BASELINE = "QMuon int8"
#: row name -> STANDARD_SETUPS label
SETUPS = {
    "torch.Muon + AdamW": "torch.Muon + AdamW",
    "QMuon int8": "QMuon int8",
    "int8 + int8 AdamW": "int8 + int8 AdamW",
    "full stack, stochastic": "int8 + int8 AdamW + bf16 stochastic",
    "full stack, ecc8": "int8 + int8 AdamW + bf16 ecc8",
}
ISA_ENV = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "QMUON_CPU_ARCH": "x86-64-v3"},
}
#: the parts of the step the setups do differently, timed alone (component name -> how)
COMPONENTS = {
    "AdamW params": ("fp32 moments, fp32 weights", "int8 moments, fp32 weights", "int8 moments, bf16 stochastic",
                     "int8 moments, bf16 ecc8"),
    "Muon weight writes": ("fp32 weights", "bf16 stochastic", "bf16 ecc8"),
}


def build_model(name: str) -> torch.nn.Module:
    if name == "gpt":
        from qmuon_lightning.models import DecoderLM

        return DecoderLM(vocab_size=8192, d_model=256, n_layers=4, n_heads=4, max_seq_len=64)
    if name == "llama":
        from bench_train_memory import build_model as build_memory_model

        return build_memory_model("llama")
    raise ValueError(f"unknown model {name!r}; choose gpt or llama")


# ---------------------------------------------------------------------------------------------- child
def components(model_name: str, reps: int) -> dict[str, dict[str, float]]:
    """Median CPU time (ms) of the parts of the step the setups do differently, each alone and
    interleaved: the AdamW step of every AdamW-routed parameter (``core.adamw.adamw_param_step``:
    moments, update, weight write) and the weight write of every Muon matrix (``core.apply.apply_update_``
    of a fixed update), per weight / state setting."""
    import qmuon
    from qmuon.core import adamw as cadamw
    from qmuon.core import apply as capply

    torch.manual_seed(0)
    model = build_model(model_name)
    decisions = qmuon.route_parameters(model)
    adamw = [d.param.detach() for d in decisions if d.target in ("adamw", "adamw_no_decay")]
    muon = [d.param.detach() for d in decisions if d.target == "muon"]
    g = torch.Generator().manual_seed(2)
    cases = {}
    for name, (fmt, dtype, rule) in zip(COMPONENTS["AdamW params"], (
            ("fp32", torch.float32, "nearest"), ("int8", torch.float32, "nearest"),
            ("int8", torch.bfloat16, "stochastic"), ("int8", torch.bfloat16, "ecc8"))):
        items = []
        for i, p in enumerate(adamw):
            w = p.clone().to(dtype)
            grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
            st = cadamw.init_state(fmt, p.shape, w, rule)
            st["step"] = torch.tensor(0.0)
            items.append((w, grad, st, i))
        group = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8, seed=0, weight_decay=0.1, state_format=fmt, bf16_update=rule)

        def run(items=items, group=group):
            for w, grad, st, i in items:
                cadamw.adamw_param_step(w, grad, st, group, global_shape=w.shape, key=i)

        cases[("AdamW params", name)] = run
    for name, (dtype, rule) in zip(COMPONENTS["Muon weight writes"], (
            (torch.float32, "nearest"), (torch.bfloat16, "stochastic"), (torch.bfloat16, "ecc8"))):
        items = []
        for i, p in enumerate(muon):
            w = p.clone().to(dtype)
            upd = torch.randn(p.shape, generator=g) * 1e-3
            items.append((w, upd, capply.weight_state_init(w, rule), i))

        def run(items=items, rule=rule):
            for w, upd, st, i in items:
                capply.apply_update_(w, upd, alpha=-0.02, decay=1 - 0.02 * 0.1, bf16_update=rule, state=st or None,
                                     rng=(0, i, 1, 0))

        cases[("Muon weight writes", name)] = run
    keys = list(cases)
    t: dict = {k: [] for k in keys}
    for rnd in range(reps + 1):
        k0 = rnd % len(keys)
        for k in keys[k0:] + keys[:k0]:
            t0 = time.process_time()
            cases[k]()
            if rnd:
                t[k].append(time.process_time() - t0)
    out: dict[str, dict[str, float]] = {}
    for (comp, name), ts in t.items():
        out.setdefault(comp, {})[name] = 1e3 * statistics.median(ts)
    out["_numel"] = {"AdamW params": float(sum(p.numel() for p in adamw)),
                     "Muon weight writes": float(sum(p.numel() for p in muon))}
    return out


def child(model_name: str, reps: int, skip: tuple[str, ...] = ()) -> dict:
    from qmuon_lightning import memory as mem

    std = {s.label: s for s in mem.STANDARD_SETUPS}
    runs = {}
    for row, label in SETUPS.items():
        if row in skip:
            continue
        setup = std[label]
        torch.manual_seed(0)
        model = build_model(model_name)
        if setup.weights == "bf16":
            model = model.to(torch.bfloat16)
        opts = mem.build_optimizers(model, setup)
        g = torch.Generator().manual_seed(1)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = [(torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype) for p in params]
        runs[row] = (params, opts, grads)
    n_params = sum(p.numel() for p in runs[BASELINE][0])

    def step(row: str) -> float:
        params, opts, grads = runs[row]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        t0 = time.process_time()
        for o in opts:
            o.step()
        return time.process_time() - t0

    rows = [r for r in SETUPS if r not in skip]
    times: dict[str, list[float]] = {r: [] for r in rows}
    for rnd in range(reps + 1):  # round 0: state creation and warm-up, not counted
        k = rnd % len(rows)
        for row in rows[k:] + rows[:k]:
            dt = step(row)
            if rnd:
                times[row].append(dt)
    parts = components(model_name, reps)
    return {"model": model_name, "n_params": n_params, "times": times, "parts": parts,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def child_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    backend = ensure_backend()
    from qmuon.ops import _extension

    out = {"backend": backend, "qmuon_cpu_loops": _extension.cpu_vector_isa(), "models": []}
    for m in args.models.split(","):
        skip = ("torch.Muon + AdamW",) if m in args.no_torch_muon.split(",") else ()
        out["models"].append(child(m, args.reps, skip))
        print(f"  {m}: done", file=sys.stderr, flush=True)
    print("@@RESULT@@" + json.dumps(out))


# --------------------------------------------------------------------------------------------- parent
def run_isa(isa: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, **ISA_ENV[isa], OMP_NUM_THREADS=str(args.threads))
    cmd = [sys.executable, __file__, "--child", "--models", args.models, "--reps", str(args.reps),
           "--threads", str(args.threads),
           "--no-torch-muon", args.no_torch_muon if isa == "avx2" else ""]
    print(f"[{isa}] {' '.join(f'{k}={v}' for k, v in ISA_ENV[isa].items())} {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    sys.stderr.write(proc.stderr[-3000:])
    for line in proc.stdout.splitlines():
        if line.startswith("@@RESULT@@"):
            return json.loads(line[len("@@RESULT@@"):])
    raise RuntimeError(f"[{isa}] child failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def tables(isa: str, res: dict) -> list[str]:
    lines = []
    for m in res["models"]:
        t = m["times"]
        base = statistics.median(t[BASELINE])
        head = (f"### {m['model']} ({m['n_params'] / 1e6:.1f}M parameters), {isa}: ATen `{m['cpu_capability']}`, "
                f"qmuon loops `{res['qmuon_cpu_loops']}`, {m['threads']} thread(s), {len(t[BASELINE])} rounds")
        rows = []
        for row, ts in t.items():
            med = statistics.median(ts)
            paired = statistics.median(a / b for a, b in zip(ts, t[BASELINE]))
            q1, _, q3 = statistics.quantiles(ts, n=4) if len(ts) >= 2 else (med, med, med)
            verdict = ""
            if row.startswith("full stack"):
                verdict = f"{'PASS' if paired <= TARGET else 'MISS'} (<= {TARGET:.2f}x)"
            rows.append([row, f"{1e3 * med:.1f}", f"{1e3 * q1:.1f} - {1e3 * q3:.1f}", f"{med / base:.3f}x",
                         f"{paired:.3f}x", verdict])
        lines += [head, "", md_table(["setup", "step (ms, median)", "25-75% (ms)", "ratio of medians",
                                      f"median per-round ratio vs {BASELINE}", "target"], rows), ""]
        parts = m["parts"]
        for comp, names in COMPONENTS.items():
            base_c = parts[comp][names[0]]
            crow = [[n, f"{parts[comp][n]:.1f}", f"{parts[comp][n] / base_c:.2f}x",
                     f"{1e6 * parts[comp][n] / parts['_numel'][comp]:.2f}"] for n in names]
            lines += [f"{comp} of {m['model']} alone ({parts['_numel'][comp] / 1e6:.1f}M elements; {isa}; "
                      "median CPU ms, interleaved):", "",
                      md_table([comp, "ms", f"vs {names[0]}", "ns / element"], crow), ""]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    ap.add_argument("--isas", default="native,avx2", help="comma-separated: native, avx2")
    ap.add_argument("--reps", type=int, default=9, help="timed rounds (after one warm-up round)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS_DIR / "bf16_step.md"))
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--no-torch-muon", default="llama",
                    help="models whose torch.optim.Muon row is left out of the avx2 run (its Newton-Schulz runs "
                         "in bf16, emulated there: ~30x the fp32 time, docs/newton_schulz.md; bench_step.py "
                         "measures it); '' keeps it everywhere")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args)
        return
    torch.set_num_threads(args.threads)
    lines = header_lines("Optimizer step: full stack (int8 + int8 AdamW + bf16 weights) vs QMuon int8, CPU")
    lines += [f"CPU: {cpu_name()}. Target (issue 19): full stack, stochastic <= {TARGET:.2f}x the `{BASELINE}` "
              "step (fp32 weights, fp32 AdamW moments), judged on the median per-round ratio; ecc8 reported "
              "against the same bound. CPU time of the process (`time.process_time`), one torch thread, "
              "setups interleaved in rotated order (benchmarks/bench_bf16_step.py docstring).", ""]
    for isa in args.isas.split(","):
        res = run_isa(isa, args)
        lines += [f"## {isa}" + (" (" + ", ".join(f"`{k}={v}`" for k, v in ISA_ENV[isa].items()) + ")"
                                 if ISA_ENV[isa] else ""), ""]
        if args.no_torch_muon and isa == "avx2":
            lines += [f"torch.optim.Muon left out for {args.no_torch_muon}: it runs its Newton-Schulz in bf16, "
                      "which this run emulates (~30x the fp32 time, docs/newton_schulz.md).", ""]
        lines += tables(isa, res)
        print("\n".join(tables(isa, res)), flush=True)
        if not args.no_write:  # after every ISA: a later one that fails leaves the earlier ones written
            Path(args.out).write_text("\n".join(lines) + "\n")
            print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
