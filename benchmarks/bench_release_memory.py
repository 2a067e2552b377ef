"""Gradient release: the whole training step's peak with and without it, on a GPT-shaped model.

Measured as ``bench_train_memory.py`` measures (PyTorch's ``MemTracker``: live tensor bytes by
category at the moment of the peak, over whole steps: forward, backward, ``optimizer.step()``,
``zero_grad``), one process per configuration:

- ``torch.AdamW``: the reference of the issue's tables;
- ``qmuon-int8`` / ``qmuon-int8+release``: ``build_optimizer(model, state_format="int8")``
  without and with ``gradient_release=True``;
- ``qmuon-grasp4`` / ``qmuon-grasp4+release``: the same with GRASP 4-bit momentum.

Release steps each parameter inside backward and frees its gradient, so the step's floor becomes
weights + optimizer state + the largest single gradient in flight; the table prints that floor
(computed from the measured weights and state, plus the largest parameter's gradient bytes) next
to the measured peak. ``B/param`` divides by every parameter of the model. The weights are fp32
here (bf16 weights and quantized AdamW state are other parts of issue 19); activations are small
by construction (batch 1 x ``--seq`` tokens) and listed apart. The runs with and without release
must produce the same losses bit for bit: the table says whether they did.

    python benchmarks/bench_release_memory.py                       # writes results/release_memory.md
    python benchmarks/bench_release_memory.py --d-model 768 --heads 12 --layers 12 --vocab 50304 --no-write
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MiB = 2**20
MARKER = "@@RELEASE_MEMORY_RESULT@@ "
CONFIGS = ("torch.AdamW", "qmuon-int8", "qmuon-int8+release", "qmuon-grasp4", "qmuon-grasp4+release")
CATEGORIES = (("Parameter", "weights"), ("Gradient", "grads"), ("Activation", "activations"))


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    import qmuon
    from qmuon_lightning.models.decoder_lm import DecoderLM

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import build_compared_optimizers

    torch.set_num_threads(cfg["threads"])
    qmuon.ops.backend()  # build / load the kernels before the measured region
    torch.manual_seed(cfg["seed"])
    model = DecoderLM(vocab_size=cfg["vocab"], d_model=cfg["d_model"], n_layers=cfg["layers"],
                      n_heads=cfg["heads"], max_seq_len=cfg["seq"])
    name, release = cfg["config"].removesuffix("+release"), cfg["config"].endswith("+release")
    tracker = MemTracker()
    # The model first: MemTracker's own post-accumulate-grad hooks must run before release's, which
    # free the gradient (hooks run in registration order).
    tracker.track_external(model)
    opts = build_compared_optimizers(name, model, **({"gradient_release": True} if release else {}))
    tracker.track_external(*opts)
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses, times = [], []
    with tracker:
        for _ in range(cfg["steps"]):
            tracker.reset_mod_stats()
            t0 = time.perf_counter()
            loss = model.loss(x, y)
            loss.backward()
            losses.append(loss.item())
            del loss
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
    seen: set[int] = set()
    state = 0
    for o in opts:
        for st in o.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                    seen.add(v.untyped_storage().data_ptr())
                    state += v.untyped_storage().nbytes()
    snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    split = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    return {"n_params": sum(p.numel() for p in model.parameters()),
            "largest_param": max(p.numel() * p.element_size() for p in model.parameters()),
            "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
            "state_bytes": state, "peak_split": split, "peak_live": split.pop("Total"),
            "losses": losses, "step_seconds": times}


def timing_child(cfg: dict[str, Any]) -> dict[str, Any]:
    """Step time with and without release, interleaved in one process (the machine's load drifts
    between processes): two copies of the model, the same batches, alternating which goes first."""
    import statistics

    import torch

    import qmuon
    from qmuon_lightning.models.decoder_lm import DecoderLM

    torch.set_num_threads(cfg["threads"])
    qmuon.ops.backend()
    models, opts = [], []
    for release in (False, True):
        torch.manual_seed(cfg["seed"])
        m = DecoderLM(vocab_size=cfg["vocab"], d_model=cfg["d_model"], n_layers=cfg["layers"], n_heads=cfg["heads"],
                      max_seq_len=cfg["seq"])
        models.append(m)
        opts.append(qmuon.build_optimizer(m, state_format=cfg["format"], verbose=False,
                                          gradient_release=release))
    g = torch.Generator().manual_seed(cfg["seed"] + 1)
    times: list[list[float]] = [[], []]
    losses: list[list[float]] = [[], []]
    for step in range(cfg["time_steps"] + 1):
        tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        for j in ((0, 1) if step % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            loss = models[j].loss(x, y)
            loss.backward()
            opts[j].step()
            opts[j].zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            losses[j].append(loss.item())
            if step > 0:  # the first step allocates the state
                times[j].append(dt)
    return {"median_s": [statistics.median(t) for t in times], "times_s": times, "same_losses": losses[0] == losses[1]}


def _run(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
    raise SystemExit(f"{cfg['config']} failed (exit {proc.returncode}): {tail}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--time-steps", type=int, default=6,
                    help="steps timed with and without release, interleaved in one process (0: skip)")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    if args.child is not None:
        cfg = json.loads(args.child)
        print(MARKER + json.dumps(timing_child(cfg) if cfg.get("time_steps") else child(cfg)), flush=True)
        return 0

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import RESULTS_DIR, header_lines, md_table

    names = [s.strip() for s in args.configs.split(",") if s.strip()]
    for n in names:
        if n not in CONFIGS:
            raise SystemExit(f"unknown config {n!r}; choose from {', '.join(CONFIGS)}")
    res: dict[str, dict[str, Any]] = {}
    for n in names:
        cfg = {"config": n, **{k: getattr(args, k) for k in ("d_model", "heads", "layers", "vocab", "seq", "batch",
                                                            "steps", "threads", "seed")}}
        print(f"{n} ...", file=sys.stderr, flush=True)
        res[n] = _run(cfg, args.timeout)
        print(f"    peak live {res[n]['peak_live'] / MiB:.1f} MiB", file=sys.stderr, flush=True)

    r0 = next(iter(res.values()))
    n_params = r0["n_params"]
    lines = header_lines("Gradient release: whole-step peak with and without it")
    lines += [
        f"Model: `DecoderLM(vocab_size={args.vocab}, d_model={args.d_model}, n_heads={args.heads}, "
        f"n_layers={args.layers})`, {n_params / 1e6:.1f}M parameters (largest: "
        f"{r0['largest_param'] / MiB:.1f} MiB of fp32), fp32 weights, batch {args.batch} x {args.seq} tokens, "
        f"{args.steps} steps per process, CPU, {args.threads} threads. Split of the peak by PyTorch's `MemTracker` "
        "(live tensor bytes at the moment of the peak). *floor* = weights + optimizer state + the largest "
        "parameter's gradient: what a step must hold with release, activations aside.",
        "",
    ]
    rows = []
    for n, r in res.items():
        split = dict(r["peak_split"])
        opt_cat = split.pop("Optstate", 0)
        state = min(r["state_bytes"], opt_cat)
        temps = opt_cat - state + split.pop("Temp", 0)
        acts = split.get("Activation", 0)
        floor = r["weights"] + r["state_bytes"] + r["largest_param"]
        base = n.removesuffix("+release")
        same = ""
        if n.endswith("+release") and base in res:
            same = "yes" if res[base]["losses"] == r["losses"] else "**no**"
        rows.append([f"`{n}`", f"{r['peak_live'] / MiB:.1f}", *[f"{split.get(k, 0) / MiB:.1f}" for k, _ in CATEGORIES],
                     f"{state / MiB:.1f}", f"{temps / MiB:.1f}", f"{r['peak_live'] / n_params:.2f}",
                     f"{(r['peak_live'] - acts) / n_params:.2f}", f"{floor / n_params:.2f}", same])
    lines += [md_table(["config", "peak live MiB", *[f"{c} MiB" for _, c in CATEGORIES], "opt state MiB",
                        "step temporaries MiB", "B/param", "B/param w/o activations", "floor B/param",
                        "losses == without release"], rows), ""]
    if args.time_steps:
        cfg = {"config": "timing", "format": "int8", "time_steps": args.time_steps,
               **{k: getattr(args, k) for k in ("d_model", "heads", "layers", "vocab", "seq", "batch", "threads", "seed")}}
        print("timing ...", file=sys.stderr, flush=True)
        t = _run(cfg, args.timeout)
        res["timing"] = t
        lines += [f"Step time, `qmuon-int8` without / with release, {args.time_steps} steps each after one warm-up, "
                  "interleaved in one process (alternating which goes first), no MemTracker: median "
                  f"{1e3 * t['median_s'][0]:.0f} ms / {1e3 * t['median_s'][1]:.0f} ms, ratio "
                  f"**{t['median_s'][1] / t['median_s'][0]:.3f}x**; losses identical: {t['same_losses']}.", ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        out = args.out or RESULTS_DIR / "release_memory.md"
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                        "runs": res}, indent=1))
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
