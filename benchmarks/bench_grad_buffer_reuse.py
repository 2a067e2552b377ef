"""What reusing the gradient buffer for the Newton-Schulz input saves (issue 37, item 4).

QMuon's momentum kernels write each Muon matrix's NS input (the Nesterov blend) into its gradient
buffer, so after ``step()`` a Muon parameter's ``.grad`` holds the NS input, not the gradient. This
benchmark measures, side by side in one run, the whole-step peak (weights + grads + optimizer state
+ step temporaries, activations aside; PyTorch's ``MemTracker`` through
``qmuon_lightning.memory.measure_step``, the metric of ``results/train_memory.md``) of three steps:

- ``reuse``: the library as it is (the NS input in ``.grad``);
- ``scratch per group``: the momentum update writes the NS input into a separate buffer per
  parameter (together: a scratch per parameter group), which stays alive until Newton-Schulz has
  consumed it. That is what the multi-tensor momentum kernels need as the step is built: the whole
  group's momentum update runs first, and Newton-Schulz of every group runs after it (items of all
  groups are batched together). Emulated by wrapping ``qmuon.core.pipeline.momentum_inputs`` so that
  the kernel's in/out buffer (``grads2d``) is a fresh copy of the gradient, which is then the NS source;
- ``scratch per NS batch``: only the NS inputs of the batch being orthogonalized exist outside the
  gradient (a step that ran the momentum update of a batch's matrices right before their
  Newton-Schulz). Emulated, for memory only, by wrapping ``qmuon.core.pipeline._orthogonalize_chunk``:
  each batch's NS sources are copied into fresh buffers (the gradient dtype) that the batch reads and
  that are freed after it. The gradient buffer itself still receives the kernel's output here (the
  library's kernel call is unchanged), which costs no memory.

Every variant steps the same bits: the weights after the run are compared with the ``reuse`` run's
(``same weights`` column). Library code is not changed; the wrappers are installed in the measuring
process only.

Configurations: ``build_optimizer`` defaults (int8 momentum, int8 AdamW state, fp32 weights), the
same with ``gradient_release=True``, the full stack (bf16 weights ``model.to(torch.bfloat16)``,
int8 AdamW state, ``bf16_update="stochastic"``) and the full stack with ``gradient_release=True``
(the ``STANDARD_SETUPS`` entries of ``qmuon_lightning.memory`` with these labels). Models: those of
``bench_train_memory.py`` (``llama``: Hugging Face ``LlamaForCausalLM`` from a local config, 56.4M
parameters; ``gpt2s``: ``DecoderLM`` at GPT-2-small width, 162.2M parameters).

    python benchmarks/bench_grad_buffer_reuse.py --threads 1            # writes results/grad_buffer_reuse.{md,json}
    python benchmarks/bench_grad_buffer_reuse.py --models llama --no-write
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# This checkout's package first (an installed qmuon_lightning elsewhere would otherwise be measured).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MiB = 2**20
MARKER = "@@GRAD_BUFFER_RESULT@@ "
MODELS = ("llama", "gpt2s")
SETUPS = (
    "int8 + int8 AdamW",
    "int8 + int8 AdamW + release",
    "int8 + int8 AdamW + bf16 stochastic",
    "int8 + int8 AdamW + stochastic + release",
)
VARIANTS = ("reuse", "scratch per group", "scratch per NS batch")
#: issue 37's threshold: below this saving (bytes per parameter) in every configuration, reuse is not worth it
SMALL = 0.25


def install_variant(variant: str) -> None:
    """Make this process's QMuon step the non-reusing ``variant`` (see the module docstring)."""
    import torch

    from qmuon.core import pipeline

    if variant == "reuse":
        return
    if variant == "scratch per group":
        inner_inputs = pipeline.momentum_inputs

        def momentum_inputs(*args: Any, **kwargs: Any) -> Any:
            out = inner_inputs(*args, **kwargs)
            # The kernel reads the gradient from grads2d and writes the NS input there: a fresh
            # buffer per parameter, alive while the step's items reference it (until NS is done).
            out.grads2d = [g.clone(memory_format=torch.contiguous_format) for g in out.grads2d]
            return out

        pipeline.momentum_inputs = momentum_inputs
        return
    if variant == "scratch per NS batch":
        inner_chunk = pipeline._orthogonalize_chunk

        def orthogonalize_chunk(chunk: list, *args: Any, **kwargs: Any) -> None:
            # The batch's NS inputs in their own buffers (gradient dtype) for the batch's duration.
            scratch = [dataclasses.replace(it, source=it.source.clone(memory_format=torch.contiguous_format))
                       if it.source is not None else it for it in chunk]
            inner_chunk(scratch, *args, **kwargs)

        pipeline._orthogonalize_chunk = orthogonalize_chunk
        return
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")


def _setups() -> dict[str, Any]:
    from qmuon_lightning import memory as mem

    return {s.label: s for s in mem.STANDARD_SETUPS}


# ---------------------------------------------------------------------------------------------- child
def child(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from bench_train_memory import build_model

    import qmuon
    from qmuon_lightning import memory as mem

    torch.set_num_threads(cfg["threads"])
    qmuon.ops.backend()  # build / load the kernels before the measured region
    install_variant(cfg["variant"])
    torch.manual_seed(cfg["seed"])
    setup = _setups()[cfg["setup"]]
    model = build_model(cfg["model"], seq=cfg["seq"])
    if setup.weights == "bf16":
        model = model.to(torch.bfloat16)
    opts = mem.build_optimizers(model, setup)
    vocab = 50304 if cfg["model"] == "gpt2s" else 32000
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    tokens = torch.randint(0, vocab, (cfg["batch"], cfg["seq"] + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if cfg["model"] == "gpt2s":
        loss_fn = lambda: model.loss(x, y)
    else:
        loss_fn = lambda: model(input_ids=x, labels=x).loss
    t0 = time.perf_counter()
    m = mem.measure_step(model, opts, loss_fn, steps=cfg["steps"])
    h = hashlib.sha256()
    for _, p in sorted(model.named_parameters()):
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return {"peak_live": m.peak, "peak_no_act": m.peak_no_act, "split_no_act": m.split_no_act,
            "peak_no_act_where": m.peak_no_act_where, "state_bytes": m.state_bytes, "losses": m.losses,
            "weights_sha256": h.hexdigest(), "seconds": time.perf_counter() - t0,
            "n_params": sum(p.numel() for p in model.parameters())}


# --------------------------------------------------------------------------------------------- parent
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run(cfg: dict[str, Any], timeout: float) -> dict[str, Any] | str:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f}s"
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
    return f"failed (exit {proc.returncode}): {tail}"


def _amx() -> str:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    found = sorted({f for f in ("amx_tile", "amx_bf16", "amx_int8") if f in flags})
    return "yes (" + ", ".join(found) + ")" if found else "no"


def computed_bounds(model_name: str, setup_label: str, seq: int) -> dict[str, float]:
    """What either scratch holds at most, from the optimizer's Muon matrices (pure shape arithmetic):
    ``group``: every Muon element once (the gradient dtype; with gradient release, which steps one
    parameter per call, the largest Muon parameter); ``batch_cpu`` / ``batch_cuda``: the
    largest NS batch (:class:`qmuon.core.pipeline.BatchSizes` on that device type) in the gradient
    dtype, bytes per parameter of the model."""
    import torch
    from bench_train_memory import build_model

    from qmuon.core import pipeline
    from qmuon_lightning import memory as mem

    with torch.device("meta"):
        model = build_model(model_name, seq=seq)
    setup = _setups()[setup_label]
    if setup.weights == "bf16":
        model = model.to(torch.bfloat16)
    opt = mem.build_optimizers(model, setup)[0]
    n = sum(p.numel() for p in model.parameters())
    shapes, per_param = [], []
    for gi, group in enumerate(opt.param_groups):
        if group["use_muon"]:
            for plan in opt._group_plans(gi):
                parts = [(pt.cols, pt.rows) if pt.transposed else (pt.rows, pt.cols) for pt in plan.parts]
                shapes += parts
                per_param.append(sum(r * c for r, c in parts))
    elem = 2 if setup.weights == "bf16" else 4
    sizes = pipeline.BatchSizes.of(shapes, opt.batch_budget)
    batch = {dev: max(sizes.per_batch(r, c, dev) * r * c for r, c in set(shapes)) for dev in ("cpu", "cuda")}
    # Gradient release steps one parameter per call: its "group" scratch is that parameter's.
    group_elems = max(per_param) if setup.options.get("gradient_release") else sum(per_param)
    return {"muon_elements": sum(per_param), "group": group_elems * elem / n,
            "batch_cpu": batch["cpu"] * elem / n, "batch_cuda": batch["cuda"] * elem / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--setups", default=",".join(SETUPS), help="comma-separated STANDARD_SETUPS labels")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    ap.add_argument("--out", type=Path, help="markdown output (default benchmarks/results/grad_buffer_reuse.md; "
                    "a .json with the raw numbers is written beside it)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--report-only", type=Path, nargs="+",
                    help="rewrite the report from the JSON of earlier runs (several: one report, headers kept)")
    args = ap.parse_args()

    if args.child is not None:
        print(MARKER + json.dumps(child(json.loads(args.child))), flush=True)
        return 0

    import torch
    from _common import RESULTS_DIR, header_lines, md_table

    torch.set_num_threads(args.threads)
    setups = _setups()
    labels = [s.strip() for s in args.setups.split(",") if s.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for lab in labels:
        if lab not in setups:
            raise SystemExit(f"unknown configuration {lab!r}; choose from {', '.join(setups)}")
    header = header_lines("Reusing the gradient buffer for the Newton-Schulz input: what it saves")
    header.insert(-1, f"- AMX: {_amx()}; torch.backends.cpu.get_cpu_capability(): "
                      f"{torch.backends.cpu.get_cpu_capability()}")
    t_start = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {}
    bounds: dict[str, dict[str, float]] = {}
    notes: list[str] = []

    def report(final: bool) -> None:
        elapsed = time.perf_counter() - t_start
        lines = list(header)
        if args.report_only is None:
            lines.insert(-1, f"- total run time {elapsed:.0f}s")
        lines += [
            (f"Batch {args.batch} x {args.seq} tokens, {args.steps} training steps per process (the second step "
            "holds the optimizer state), CPU, seed "
            f"{args.seed}; every (model, configuration, variant) is its own process. *Whole-step peak*: the most "
            "bytes alive at once of weights, buffers, gradients, optimizer state and the optimizer's temporaries "
            "(MemTracker, activations aside: issue 19's metric, as in [train_memory.md](train_memory.md)), per "
            "parameter of the model. Variants (see `benchmarks/bench_grad_buffer_reuse.py`): *reuse*, the library "
            "(the momentum kernel writes the NS input into `.grad`); *scratch per group*, the NS input in a "
            "separate buffer per parameter group, alive until Newton-Schulz is done (what the multi-tensor kernels "
            "need, since NS runs after the whole group's momentum update); *scratch per NS batch*, only the "
            "batch being orthogonalized has its NS inputs outside the gradient. *saves*: the non-reusing "
            "variant's peak minus reuse's, per parameter. *same weights*: the weights after the run are "
            "bit-identical to reuse's. *computed*: the scratch's own size per parameter (every Muon element, or "
            "the largest NS batch on CPU / CUDA, in the gradient dtype), whatever the peak."),
            "",
        ]
        desc = {"gpt2s": "`DecoderLM` GPT-2-small width (d_model 768, 12 heads, 12 layers, vocabulary 50304, "
                         "untied head)",
                "llama": "Hugging Face `LlamaForCausalLM` (hidden 512, 8 layers, 8 heads / 4 KV heads, MLP 1408, "
                         "untied 32k vocabulary)"}
        hdr = ["configuration", "reuse B/param", "in", "scratch per group B/param", "saves", "in ",
               "scratch per NS batch B/param", "saves ", "in  ", "same weights", "computed: group",
               "computed: NS batch CPU", "computed: NS batch CUDA"]
        for model_name in [m for m in MODELS if any(k.startswith(m + "|") for k in runs)]:
            keys = [k for k in runs if k.startswith(model_name + "|")]
            n = runs[keys[0]]["n_params"]
            b0 = next(iter(b for k, b in bounds.items() if k.startswith(model_name + "|")), None)
            muon = f", {b0['muon_elements'] / 1e6:.1f}M in Muon matrices" if b0 else ""
            lines += [f"## {desc[model_name]}: {n / 1e6:.1f}M parameters{muon}", ""]
            rows = []
            for lab in dict.fromkeys(k.split("|")[1] for k in keys):
                base = runs.get(f"{model_name}|{lab}|reuse")
                if base is None:
                    continue
                row = [f"`{lab}`", f"**{base['peak_no_act'] / n:.3f}**",
                       base["peak_no_act_where"].replace("release hook: ", "hook: ")]
                same = []
                for v in VARIANTS[1:]:
                    r = runs.get(f"{model_name}|{lab}|{v}")
                    if r is None:
                        row += ["-", "-", "-"]
                        continue
                    row += [f"{r['peak_no_act'] / n:.3f}", f"**{(r['peak_no_act'] - base['peak_no_act']) / n:+.3f}**",
                            r["peak_no_act_where"].replace("release hook: ", "hook: ")]
                    same.append("yes" if r["weights_sha256"] == base["weights_sha256"] else "**no**")
                b = bounds.get(f"{model_name}|{lab}")
                row += [" / ".join(same) or "-"]
                row += [f"{b['group']:.3f}", f"{b['batch_cpu']:.3f}", f"{b['batch_cuda']:.3f}"] if b else ["-"] * 3
                rows.append(row)
            lines += [md_table(hdr, rows), ""]
        if runs:
            savings = {v: [(runs[f"{k.rsplit('|', 1)[0]}|{v}"]["peak_no_act"] - r["peak_no_act"]) / r["n_params"]
                           for k, r in runs.items() if k.endswith("|reuse") and f"{k.rsplit('|', 1)[0]}|{v}" in runs]
                       for v in VARIANTS[1:]}
            lines += ["Largest saving of reuse over each variant (B/param, any model and configuration): "
                      + "; ".join(f"{v}: {max(s):+.3f}" + (f" ({'below' if max(s) < SMALL else 'not below'} "
                                                            f"issue 37's {SMALL} B/param)")
                                  for v, s in savings.items() if s), ""]
        if notes:
            lines += ["Not measured:", ""] + [f"- {x}" for x in dict.fromkeys(notes)] + [""]
        text = "\n".join(lines)
        if final:
            print(text)
        if not args.no_write:
            out = args.out or RESULTS_DIR / "grad_buffer_reuse.md"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            raw = {"header": header, "platform": platform.platform(),
                   "args": {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
                            for k, v in vars(args).items() if k != "child"},
                   "runs": runs, "bounds": bounds, "notes": notes, "elapsed_s": elapsed, "loadavg": os.getloadavg()}
            out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
            _log(f"wrote {out} and {out.with_suffix('.json').name}")

    if args.report_only is not None:
        header.clear()
        for i, path in enumerate(args.report_only):
            raw = json.loads(path.read_text())
            runs.update(raw["runs"])
            bounds.update(raw["bounds"])
            notes.extend(raw["notes"])
            run_header = [x for x in raw["header"] if x]
            if i == 0:
                header.extend([run_header[0], ""])
            header.extend([(f"Run {i + 1} ({path.name}, {raw['elapsed_s']:.0f}s, load average "
                           f"{', '.join(f'{x:.1f}' for x in raw.get('loadavg', []))} at its end):"), ""])
            header.extend(run_header[1:] + [""])
        header.append("")
        report(final=True)
        return 0

    for model_name in models:
        for lab in labels:
            bounds[f"{model_name}|{lab}"] = computed_bounds(model_name, lab, args.seq)
            for variant in VARIANTS:
                key = f"{model_name}|{lab}|{variant}"
                cfg = {"model": model_name, "setup": lab, "variant": variant, "seq": args.seq, "batch": args.batch,
                       "steps": args.steps, "threads": args.threads, "seed": args.seed}
                _log(f"[{time.perf_counter() - t_start:6.0f}s] {model_name}: {lab}: {variant} ...")
                res = _run(cfg, args.timeout)
                if isinstance(res, str):
                    notes.append(f"{model_name}, {lab}, {variant}: {res}")
                    _log("    " + res)
                    continue
                runs[key] = res
                _log(f"    whole-step peak {res['peak_no_act'] / MiB:.1f} MiB "
                     f"({res['peak_no_act'] / res['n_params']:.3f} B/param) in {res['peak_no_act_where']}, "
                     f"{res['seconds']:.0f}s")
                report(final=False)  # a partial run leaves what it measured
    report(final=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
