"""The memory headline: what one training step holds per optimizer configuration, measured side by
side in one run and set against the accounting model of ``qmuon-estimate``.

Configurations: every :data:`qmuon_lightning.memory.STANDARD_SETUPS` entry this installation can
build (AdamW, torch.optim.Muon + AdamW, QMuon int8 / grasp4, and the full stacks: int8 AdamW state,
bf16 weights with ``bf16_update="stochastic"`` / ``"ecc8"``, gradient release, grasp4 + int4), plus
``torchao.optim.AdamW8bit`` / ``AdamW4bit`` on bf16 weights with ``bf16_stochastic_round=True``
(optional: skipped with a note when torchao is not installed).

Models: ``gpt2s``, ``DecoderLM`` at GPT-2-small width (d_model 768, 12 heads, 12 layers, vocabulary
50304, untied head: 162.2M parameters), and ``llama``, a Hugging Face ``LlamaForCausalLM`` built from
a local config (hidden 512, 8 layers, 8 heads / 4 KV heads, MLP 1408, untied 32k vocabulary:
56.4M parameters).

Measurement: each (model, configuration) runs in its own process: ``--steps`` training steps on
random tokens (batch ``--batch`` x ``--seq``), tracked by PyTorch's ``MemTracker``
(``qmuon_lightning.memory.measure_step``): *peak live* is the most tensor bytes alive at once, split
by category at that moment. The batch is small (1 x 64 tokens by default) so that activations stay
a small share; the *activations + autograd temporaries at the peak* column says how much of the peak
they are. *B/param* is the whole-step peak divided by the parameter count.

Estimate: ``qmuon_lightning.memory.estimate`` of the same configuration from the model built on the
meta device (``device="cpu"``: torch's per-tensor AdamW path and the CPU NS dtype, as measured here);
*error* is (estimate - measured) / measured. *Largest within budget* is the deepest model of the same
width whose estimated step fits ``--budget-gib`` (:func:`qmuon_lightning.memory.largest_within`), with
its parameter count, against AdamW's.

    python benchmarks/bench_train_memory.py                       # both models, writes results/train_memory.{md,json}
    python benchmarks/bench_train_memory.py --models llama --no-write
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

# This checkout's package first (an installed qmuon_lightning elsewhere would otherwise be measured).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 2**20
GiB = 2**30
MARKER = "@@TRAIN_MEMORY_RESULT@@ "
TORCHAO = ("torchao AdamW8bit bf16 SR", "torchao AdamW4bit bf16 SR")
MODELS = ("gpt2s", "llama")
#: issue 19's targets, whole-step bytes per parameter (activations aside), by configuration label
TARGETS = {
    "int8 + int8 AdamW + bf16 stochastic": 5.8,
    "int8 + int8 AdamW + bf16 ecc8": 6.8,
    "int8 + int8 AdamW + stochastic + release": 4.4,
    "grasp4 + int4 AdamW + stochastic + release": 3.6,
}


def llama_config(layers: int = 8):
    import transformers

    return transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=layers,
                                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                    tie_word_embeddings=False)


def build_model(name: str, layers: int | None = None, seq: int = 64):
    """The benchmark's models (on the current default device: ``meta`` inside ``torch.device("meta")``)."""
    if name == "gpt2s":
        from qmuon_lightning.models.decoder_lm import DecoderLM

        return DecoderLM(vocab_size=50304, d_model=768, n_layers=12 if layers is None else layers, n_heads=12,
                         max_seq_len=max(seq, 64))
    if name == "llama":
        import transformers

        return transformers.LlamaForCausalLM(llama_config(8 if layers is None else layers))
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def _setups():
    from qmuon_lightning import memory as mem

    return {s.label: s for s in mem.STANDARD_SETUPS}


# ---------------------------------------------------------------------------------------------- child
def child(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch

    import qmuon
    from qmuon_lightning import memory as mem

    torch.set_num_threads(cfg["threads"])
    qmuon.ops.backend()  # build / load the kernels before the measured region
    torch.manual_seed(cfg["seed"])
    label = cfg["setup"]
    bf16 = label in TORCHAO or _setups()[label].weights == "bf16"
    model = build_model(cfg["model"], seq=cfg["seq"])
    if bf16:
        model = model.to(torch.bfloat16)
    if label in TORCHAO:
        import torchao.optim as tao

        cls = tao.AdamW8bit if "8bit" in label else tao.AdamW4bit
        opts = [cls(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, bf16_stochastic_round=True)]
    else:
        opts = mem.build_optimizers(model, _setups()[label])
    vocab = 50304 if cfg["model"] == "gpt2s" else 32000
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    tokens = torch.randint(0, vocab, (cfg["batch"], cfg["seq"] + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if cfg["model"] == "gpt2s":
        loss_fn = lambda: model.loss(x, y)  # noqa: E731
    else:
        loss_fn = lambda: model(input_ids=x, labels=x).loss  # noqa: E731
    t0 = time.perf_counter()
    m = mem.measure_step(model, opts, loss_fn, steps=cfg["steps"])
    return {"peak_live": m.peak, "peak_split": m.split, "state_bytes": m.state_bytes, "losses": m.losses,
            "peak_no_act": m.peak_no_act, "split_no_act": m.split_no_act, "peak_where": m.peak_where,
            "peak_no_act_where": m.peak_no_act_where,
            "seconds": time.perf_counter() - t0, "n_params": sum(p.numel() for p in model.parameters())}


# --------------------------------------------------------------------------------------------- parent
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _run(cfg: dict[str, Any], timeout: float) -> dict[str, Any] | str:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)]
    try:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), *filter(None, [os.environ.get("PYTHONPATH")])])}
        if cfg["setup"] in TORCHAO:
            # torchao compiles its step; Dynamo refuses to trace under MemTracker's dispatch mode, so the
            # step runs eagerly here (its eager temporaries: an upper bound of the compiled step's)
            env["TORCHDYNAMO_DISABLE"] = "1"
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f}s"
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
    return f"failed (exit {proc.returncode}): {tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--setups", help="comma-separated configuration labels (default: every available one + torchao)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-gib", type=float, default=2.0, help="budget of the largest-depth column (estimate)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per process")
    ap.add_argument("--out", type=Path, help="markdown output (default benchmarks/results/train_memory.md; "
                    "a .json with the raw numbers is written beside it)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--report-only", type=Path, nargs="+", help="rewrite the report from the JSON of earlier runs "
                    "(no measurement; several: one report, e.g. one run per model, each run's header kept)")
    args = ap.parse_args()

    if args.child is not None:
        print(MARKER + json.dumps(child(json.loads(args.child))), flush=True)
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    from _common import RESULTS_DIR, header_lines, md_table

    from qmuon_lightning import memory as mem

    setups = _setups()
    try:
        import torchao.optim  # noqa: F401

        have_torchao = True
    except Exception:  # noqa: BLE001 - optional benchmark dependency
        have_torchao = False
    labels = [s.strip() for s in args.setups.split(",")] if args.setups else [*setups, *TORCHAO]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for lab in labels:
        if lab not in setups and lab not in TORCHAO:
            raise SystemExit(f"unknown configuration {lab!r}; choose from {', '.join([*setups, *TORCHAO])}")
    torch.set_num_threads(args.threads)
    header = header_lines("Training-step memory per configuration: measured (MemTracker) and estimated (qmuon-estimate)")
    header.insert(-1, f"- CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    t_start = time.perf_counter()
    notes: list[str] = []
    runs: dict[str, dict[str, Any]] = {}
    estimates: dict[str, dict[str, Any]] = {}
    largest: dict[str, dict[str, Any]] = {}
    budget = int(args.budget_gib * GiB)
    def report(final: bool) -> None:
        elapsed = time.perf_counter() - t_start

        lines = list(header)
        if args.report_only is None:
            lines.insert(-1, f"- total run time {elapsed:.0f}s")
        lines += [
            f"Batch {args.batch} x {args.seq} tokens, {args.steps} training steps per process, CPU, seed {args.seed}. "
            "Two peaks of the same run (PyTorch's `MemTracker`, live tensor bytes):",
            "",
            "- *peak live*: the most tensor bytes alive at once, every category (what an accelerator's allocator "
            "must hold, activations included); *B/param*: peak live / parameters; *act.+temp. at peak*: MemTracker's "
            "`Activation` + `Temp` bytes alive at that moment (saved tensors, logits, activation gradients; MemTracker "
            "files a parameter's gradient under `Temp` from its creation until autograd hands it to the parameter's "
            "hooks, so at a peak inside the head's backward this column holds the head's gradient too: *in* says where "
            "the total peaked);",
            "- *peak w/o act.*: issue 19's metric, \"whole-step peak (weights + grads + state + step temporaries, "
            "activations aside)\": the most bytes alive at once of parameters, buffers, gradients, optimizer state "
            "and the optimizer's temporaries (every MemTracker category but `Activation` and `Temp`), its own "
            "maximum over the run (it can fall at another moment than *peak live*). With gradient release the "
            "optimizer steps inside backward; what its hooks allocate is counted as optimizer bytes there "
            "(`qmuon_lightning.memory.measure_step`). *weights / grads / state / step temp.* split this peak; "
            "the second *in*: what ran at it; *target*: issue 19's bound, checked on this metric (the total is shown beside).",
            "",
            "*estimate*: `qmuon_lightning.memory.estimate` (the model `qmuon-estimate` prints) from the meta-device "
            "model, which leaves activations aside, compared with *peak w/o act.*; "
            f"*largest in {args.budget_gib:g} GiB*: the deepest model of this width whose estimated step fits. "
            "torchao's optimizers run eagerly (`TORCHDYNAMO_DISABLE=1`: Dynamo does not trace under MemTracker's "
            "dispatch mode), so their rows hold eager temporaries, an upper bound of the compiled step's.",
            "",
        ]
        for model_name in models:
            keys = [k for k in runs if k.startswith(model_name + "|")]
            if not keys:
                continue
            n = runs[keys[0]]["n_params"]
            with torch.device("meta"):
                inv = mem.parameter_inventory(build_model(model_name, seq=args.seq))
            base = runs.get(f"{model_name}|AdamW")
            base_largest = largest.get(f"{model_name}|AdamW")
            desc = ("`DecoderLM` GPT-2-small width (d_model 768, 12 heads, 12 layers, vocabulary 50304, untied head)"
                    if model_name == "gpt2s" else
                    "Hugging Face `LlamaForCausalLM` (hidden 512, 8 layers, 8 heads / 4 KV heads, MLP 1408, untied 32k vocabulary)")
            lines += [f"## {desc}: {n / 1e6:.1f}M parameters, {inv.n_muon / 1e6:.1f}M in Muon matrices", ""]
            hdr = ["configuration", "peak live MiB", "B/param", "act.+temp. at peak MiB", "in", "peak w/o act. MiB",
                   "B/param w/o act.", "vs AdamW", "weights MiB", "grads MiB", "state MiB", "step temp. MiB", "in ",
                   "estimate MiB", "error vs w/o act.", f"largest in {args.budget_gib:g} GiB", "params there",
                   "vs AdamW params", "target B/param (w/o act.)"]
            rows = []
            for lab in labels:
                key = f"{model_name}|{lab}"
                if key not in runs:
                    continue
                r = runs[key]
                sp = r["peak_split"]
                act = sp.get("Activation", 0) + sp.get("Temp", 0)
                na = r.get("peak_no_act", r["peak_live"] - act)  # runs before the metric existed: peak less act.
                sq = r.get("split_no_act", sp)
                opt_cat = sq.get("Optstate", 0)
                state = min(r["state_bytes"], opt_cat)
                temp = opt_cat - state
                base_na = base.get("peak_no_act", base["peak_live"]) if base else None
                est = estimates.get(key)
                lg = largest.get(key)
                tgt = ""
                if lab in TARGETS:
                    t = TARGETS[lab]
                    tgt = (f"<= {t}: " + ("met" if na / n <= t else "**missed**")
                           + f" (total {r['peak_live'] / n:.2f}: " + ("met" if r["peak_live"] / n <= t else "missed") + ")")
                rows.append([
                    f"`{lab}`", f"{r['peak_live'] / MiB:.1f}", f"{r['peak_live'] / n:.2f}", f"{act / MiB:.1f}",
                    r.get("peak_where", "").replace("release hook: ", "hook: "), f"{na / MiB:.1f}", f"**{na / n:.2f}**", f"{na / base_na:.2f}x" if base_na else "n/a",
                    f"{(sq.get('Parameter', 0) + sq.get('Buffer', 0)) / MiB:.1f}", f"{sq.get('Gradient', 0) / MiB:.1f}",
                    f"{state / MiB:.1f}", f"{temp / MiB:.1f}", r.get("peak_no_act_where", "").replace("release hook: ", "hook: "),
                    f"{est['total'] / MiB:.1f}" if est else "not modelled",
                    f"{(est['total'] / na - 1) * 100:+.1f}%" if est else "-",
                    str(lg["layers"]) if lg else "-", f"{lg['n_params'] / 1e6:.0f}M" if lg else "-",
                    f"{lg['n_params'] / base_largest['n_params']:.2f}x" if lg and base_largest and base_largest["n_params"] else "-",
                    tgt,
                ])
            lines += [md_table(hdr, rows), ""]
        if notes:
            lines += ["Not measured:", ""] + [f"- {x}" for x in dict.fromkeys(notes)] + [""]
        text = "\n".join(lines)
        if final:
            print(text)
        if not args.no_write:
            out = args.out or RESULTS_DIR / "train_memory.md"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            raw = {"header": header, "platform": platform.platform(),
                   "args": {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
                            for k, v in vars(args).items() if k != "child"},
                   "runs": runs, "estimates": estimates, "largest_within_budget": largest, "notes": notes,
                   "elapsed_s": elapsed, "loadavg": os.getloadavg()}
            out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
            _log(f"wrote {out} and {out.with_suffix('.json').name}")

    if args.report_only is not None:
        header.clear()
        for i, path in enumerate(args.report_only):
            raw = json.loads(path.read_text())
            runs.update(raw["runs"])
            estimates.update(raw["estimates"])
            largest.update(raw["largest_within_budget"])
            notes.extend(raw["notes"])
            run_header = [x for x in raw["header"] if x]
            if i == 0:
                header.extend([run_header[0], ""])  # the title
            header.extend([f"Run {i + 1} ({path.name}, {raw['elapsed_s']:.0f}s, load average "
                           f"{', '.join(f'{x:.1f}' for x in raw.get('loadavg', []))} at its end):", ""])
            header.extend(run_header[1:] + [""])
        header.append("")
        models = [m for m in MODELS if any(k.startswith(m + "|") for k in runs)] or models
        labels = list(dict.fromkeys(k.split("|", 1)[1] for k in runs))
        report(final=True)
        return 0
    for model_name in models:
        with torch.device("meta"):
            meta = build_model(model_name, seq=args.seq)
        inv = mem.parameter_inventory(meta)
        depth_at = mem.depth_inventories(lambda k: _meta_build(model_name, k, args.seq))
        for lab in labels:
            key = f"{model_name}|{lab}"
            if lab in TORCHAO and not have_torchao:
                notes.append(f"{lab}: torchao is not installed (pip install torchao); not measured")
                continue
            if lab in setups:
                s = setups[lab]
                if s.missing():
                    notes.append(f"{lab}: not available in this installation (needs {', '.join(s.missing())})")
                    continue
                e = mem.estimate(inv, s, device="cpu")
                estimates[key] = e.as_dict()
                k, le = mem.largest_within(depth_at, s, budget, device="cpu")
                largest[key] = {"layers": k, "n_params": le.n_params if le else 0}
            cfg = {"model": model_name, "setup": lab, "seq": args.seq, "batch": args.batch, "steps": args.steps,
                   "threads": args.threads, "seed": args.seed}
            _log(f"[{time.perf_counter() - t_start:6.0f}s] {model_name}: {lab} ...")
            res = _run(cfg, args.timeout)
            if isinstance(res, str):
                notes.append(f"{model_name}, {lab}: {res}")
                _log("    " + res)
                continue
            runs[key] = res
            est = estimates.get(key)
            _log(f"    peak live {res['peak_live'] / MiB:.1f} MiB ({res['peak_live'] / res['n_params']:.2f} B/param), "
                 f"w/o act. {res['peak_no_act'] / MiB:.1f} MiB ({res['peak_no_act'] / res['n_params']:.2f} B/param)"
                 + (f", estimate {est['total'] / MiB:.1f} MiB" if est else "") + f", {res['seconds']:.0f}s")
            report(final=False)  # a partial run leaves what it measured
    report(final=True)
    return 0


def _meta_build(model_name: str, layers: int, seq: int):
    import torch

    with torch.device("meta"):
        return build_model(model_name, layers, seq)


if __name__ == "__main__":
    raise SystemExit(main())
