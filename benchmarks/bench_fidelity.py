"""Training fidelity of the momentum formats: a small byte-level decoder LM on the Python stdlib.

Every optimizer trains the same model (same init seed) on the same batches for the same number of
steps: AdamW, ``torch.optim.Muon`` (+ AdamW for embeddings / head / norms), and QMuon with
``state_format`` fp32 / bf16 / int8 / int4 / e0m3 / grasp4, and grasp4 with the MXFP8
Newton-Schulz input carrier (``ns_input="mxfp8"``). The runs are **interleaved step by step**
(all models live at once; at step ``t`` every optimizer takes its step ``t`` on the same batch, in
an order rotated by ``t``), so the step-time ratios are measured side by side under the same machine
load. Reported: final validation loss, gap vs fp32 Muon (%), momentum state bytes per
Muon-managed parameter, median optimizer-step and whole-step times and their ratio to QMuon fp32,
and the per-layer update cosine vs fp32-state Muon on gradients of the trained model.
Writes ``benchmarks/results/fidelity.{json,md}`` and ``fidelity_loss.png``.

    python benchmarks/bench_fidelity.py                   # full-length CPU run (see --scale cpu)
    python benchmarks/bench_fidelity.py --steps 100       # a shorter run with the same model
    python benchmarks/bench_fidelity.py --scale gpu       # larger model / longer run on a CUDA device
    python benchmarks/bench_fidelity.py --render-only     # redo fidelity.md / png from fidelity.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the checkout, when not pip-installed
from _common import cpu_name, default_threads, ensure_backend  # noqa: E402

from qmuon_lightning import QMuon, build_optimizer  # noqa: E402
from qmuon_lightning.data import RandomWindowDataset, build_stdlib_corpus, fixed_windows  # noqa: E402
from qmuon_lightning.models import DecoderLM  # noqa: E402
from qmuon.optim.routing import route_parameters  # noqa: E402
from qmuon.quant.fidelity import cosine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
QFORMATS = ("fp32", "bf16", "int8", "int4", "e0m3", "grasp4")
DEFAULT_OPTIMIZERS = ",".join(["adamw", "torch-muon", *(f"qmuon:{f}" for f in QFORMATS), "qmuon:grasp4:mxfp8"])

#: Presets. "cpu": the default full-length run; its step count was chosen from per-step costs measured on
#: the 2-core development machine so that the whole run takes <= 15 min there when idle (see
#: docs/fidelity.md). "gpu": a larger model and longer run for one CUDA device.
SCALES: dict[str, dict] = {
    "cpu": {"d_model": 128, "layers": 2, "heads": 4, "seq_len": 128, "batch": 16, "steps": 1000,
            "eval_every": 50, "val_windows": 64, "max_bytes": 2 << 20, "device": "cpu"},
    "gpu": {"d_model": 512, "layers": 8, "heads": 8, "seq_len": 512, "batch": 32, "steps": 3000,
            "eval_every": 100, "val_windows": 256, "max_bytes": 32 << 20, "device": "cuda"},
}


#: ``@w=<rule>``: the model's weights are bf16 (``model.to(torch.bfloat16)``, no fp32 master copy) and
#: QMuon writes them with ``bf16_update=<rule>``.
BF16_RULES = ("nearest", "stochastic", "ecc8")


def parse_kind(kind: str) -> tuple[str, str | None, str, dict]:
    """``"adamw"`` / ``"torch-muon"`` / ``"qmuon:<format>[:mxfp8][@rank=R][@grid=G][@lr=X][@w=RULE][@adamw=F]``
    ``[@variant=normuon][@cautious=1][@ns=gram][@perhead=1][@qkclip=TAU][@qkcap=0]"`` -> (family, format, ns_input, overrides). The ``@``
    overrides are for sweeps of grasp4's knobs, for bf16 weights (``@w=nearest|stochastic|ecc8``: the
    model in bf16, written with that rule), for the AdamW moments' storage (``@adamw=int8``:
    ``adamw_state_format``; without it the QMuon runs keep fp32 AdamW moments, the fp32-master reference
    of the quantized-AdamW comparisons), for the Muon variants, for per-head Muon (``@perhead=1``:
    ``routing.per_head=True``) and for QK-clip (``@qkclip=100``: ``qk_clip={"tau": 100}``; with
    ``@qkcap=0`` without the forward cap, MuonClip's weight rescale alone)."""
    base, *opts = kind.split("@")
    over: dict = {}
    for o in opts:
        k, _, v = o.partition("=")
        if k == "w" and v in BF16_RULES:
            over["bf16_update"] = v
            continue
        if k not in ("rank", "grid", "lr", "adamw", "variant", "cautious", "ns", "perhead", "qkclip", "qkcap") or not v:
            raise SystemExit(f"bad option {o!r} in {kind!r}: use @rank=R, @grid=G, @lr=X, @adamw=F, "
                             f"@w={'|'.join(BF16_RULES)}, @variant=normuon, @cautious=1, @ns=gram, @perhead=1, "
                             "@qkclip=TAU or @qkcap=0")
        if k == "adamw":
            over["adamw_state_format"] = v
        elif k == "variant":
            over.setdefault("update", {})["variant"] = v
        elif k == "cautious":
            over.setdefault("update", {})["cautious_weight_decay"] = v not in ("0", "false", "False")
        elif k == "ns":
            over.setdefault("newton_schulz", {})["method"] = v
        elif k == "perhead":
            over.setdefault("routing", {})["per_head"] = v not in ("0", "false", "False")
        elif k == "qkclip":
            over.setdefault("qk_clip", {})["tau"] = float(v)
        elif k == "qkcap":
            over.setdefault("qk_clip", {})["forward_cap"] = v not in ("0", "false", "False")
        elif k == "lr":
            over["lr"] = float(v)
        else:
            over.setdefault("state", {})[{"grid": "grid_block"}.get(k, k)] = int(v)
    if base in ("adamw", "torch-muon"):
        if over:
            raise SystemExit(f"{kind!r}: @ options apply to qmuon:<format> only")
        return base, None, "bf16", over
    parts = base.split(":")
    if parts[0] != "qmuon" or len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("bf16", "mxfp8")):
        raise SystemExit(f"unknown optimizer {kind!r}: use adamw, torch-muon or qmuon:<format>[:mxfp8][@rank=R][@grid=G][@lr=X]")
    return "qmuon", parts[1], parts[2] if len(parts) == 3 else "bf16", over


def make_model(args, kind: str = "") -> DecoderLM:
    torch.manual_seed(args.seed)
    model = DecoderLM(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq_len)
    if kind and "bf16_update" in parse_kind(kind)[3]:
        model = model.to(torch.bfloat16)  # bf16 weights, no fp32 master copy
    return model.to(args.device)


def make_optimizers(kind: str, model: nn.Module, args) -> list[torch.optim.Optimizer]:
    family, fmt, ns_input, over = parse_kind(kind)
    if family == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=0.1)]
    if family == "torch-muon":
        decisions = route_parameters(model)
        muon = [d.param for d in decisions if d.target == "muon"]
        other = [d.param for d in decisions if d.target != "muon"]
        return [torch.optim.Muon(muon, lr=args.lr, weight_decay=0.1),
                torch.optim.AdamW(other, lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=0.1)]
    # the @ overrides lie in their config sections (state, newton_schulz, update, routing): merged over
    # the command line's values section by section
    state = {"seed": args.seed, "rank": args.rank, "grid_block": args.grid_block, **over.get("state", {})}
    ns = {"input": ns_input, **over.get("newton_schulz", {})}
    sections = {k: over[k] for k in ("bf16_update", "update", "routing", "qk_clip") if k in over}
    return [build_optimizer(model, lr=over.get("lr", args.lr), weight_decay=0.1, state_format=fmt, adamw_lr=args.adamw_lr,
                            state=state, newton_schulz=ns, adamw_state_format=over.get("adamw_state_format", "fp32"),
                            verbose=False, **sections)]


def muon_state_bytes_per_param(opts: list[torch.optim.Optimizer]) -> float | None:
    """Momentum bytes per Muon-managed element (step counters excluded)."""
    opt = opts[0]
    if isinstance(opt, QMuon):
        n = sum(p.numel() for g in opt.param_groups if g["use_muon"] for p in g["params"])
        return (opt.state_nbytes() - 4 * sum(len(g["params"]) for g in opt.param_groups if g["use_muon"])) / n
    if isinstance(opt, torch.optim.Muon):  # one fp32 momentum_buffer per element
        return 4.0
    return None


@torch.no_grad()
def evaluate(model: DecoderLM, val: tuple[Tensor, Tensor], batch: int = 16) -> float:
    xs, ys = val
    losses = [model.loss(xs[i: i + batch], ys[i: i + batch]).item() for i in range(0, xs.shape[0], batch)]
    return sum(losses) / len(losses)


@dataclass
class Run:
    kind: str
    model: DecoderLM
    opts: list[torch.optim.Optimizer]
    train: list[float] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)
    opt_times: list[float] = field(default_factory=list)  # seconds of optimizer.step() per training step
    step_times: list[float] = field(default_factory=list)  # seconds of zero_grad + forward + backward + step

    def train_step(self, x: Tensor, y: Tensor, lr_factor: float, sync) -> None:
        t0 = time.perf_counter()
        for o in self.opts:
            for g in o.param_groups:
                g.setdefault("base_lr", g["lr"])
                g["lr"] = g["base_lr"] * lr_factor
            o.zero_grad(set_to_none=True)
        loss = self.model.loss(x, y)
        loss.backward()
        sync()
        t1 = time.perf_counter()
        for o in self.opts:
            o.step()
        sync()
        t2 = time.perf_counter()
        self.train.append(loss.item())
        self.opt_times.append(t2 - t1)
        self.step_times.append(t2 - t0)


def qk_clip_figures(opts: list) -> dict:
    """With ``@qkclip=TAU``: the largest attention logit of the last step and the head-clips of the run."""
    qk = getattr(opts[0], "qk_clip", None) if opts else None
    if qk is None:
        return {}
    m = qk.metrics()
    return {"qk_clip_tau": qk.tau, "qk_last_max_logit": max(v for k, v in m.items() if k.startswith("qk_clip/max_logit/")),
            "qk_heads_clipped_total": m["qk_clip/heads_clipped_total"]}


def train_interleaved(kinds: list[str], args, train_ds, val) -> list[Run]:
    """Train every optimizer on the same batches, interleaved step by step (see module docstring)."""
    runs = []
    for kind in kinds:
        model = make_model(args, kind)
        runs.append(Run(kind, model, make_optimizers(kind, model, args)))
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    t_start = time.perf_counter()
    for step in range(args.steps):
        f = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))  # cosine decay to 10 %
        batch = [train_ds[step * args.batch + i] for i in range(args.batch)]
        x = torch.stack([b[0] for b in batch]).to(args.device)
        y = torch.stack([b[1] for b in batch]).to(args.device)
        k = step % len(runs)
        for r in runs[k:] + runs[:k]:
            r.train_step(x, y, f, sync)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            for r in runs:
                r.val.append((step + 1, evaluate(r.model, val)))
            el = time.perf_counter() - t_start
            if args.partial:  # progress snapshot, so a run cut short still leaves its curves
                args.partial.write_text(json.dumps({"step": step + 1, "elapsed_s": el, "curves": {
                    r.kind: {"train": r.train, "val": r.val, "opt_ms": [1e3 * t for t in r.opt_times],
                             "train_ms": [1e3 * t for t in r.step_times]} for r in runs}}))
            print(f"step {step + 1}/{args.steps}  {el:.0f} s  " + "  ".join(
                f"{r.kind}={r.val[-1][1]:.4f}" for r in runs), flush=True)
    return runs


def _updates(init: list[Tensor], grads: list[list[Tensor]], **kw) -> list[list[Tensor]]:
    """Per-step updates of a QMuon (lr 1, no weight decay) fed ``grads`` from parameters ``init``."""
    ps = [nn.Parameter(p.clone()) for p in init]
    opt = QMuon(ps, lr=1.0, weight_decay=0.0, **kw)
    out = []
    for step_grads in grads:
        before = [p.detach().clone() for p in ps]
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
        out.append([b - p.detach() for b, p in zip(before, ps)])
    return out


def lm_update_cosine(model: DecoderLM, train_ds, args, variants: list[str]) -> dict[str, float]:
    """Mean over Muon layers and steps (first 3 skipped) of the cosine between each variant's update
    and the fp32-state, bf16-input update, on ``cos_steps`` real gradients of the trained ``model``.
    Variants are ``"<format>"`` or ``"<format>:mxfp8"``."""
    decisions = route_parameters(model)
    names = [d.name for d in decisions if d.target == "muon"]
    params = dict(model.named_parameters())
    mats = [params[n] for n in names]
    grads = []
    for step in range(args.cos_steps):
        batch = [train_ds[10**6 + step * args.batch + i] for i in range(args.batch)]
        x = torch.stack([b[0] for b in batch]).to(args.device)
        y = torch.stack([b[1] for b in batch]).to(args.device)
        model.zero_grad(set_to_none=True)
        model.loss(x, y).backward()
        grads.append([p.grad.detach().reshape(p.shape[0], -1).float().clone() for p in mats])
    init = [p.detach().reshape(p.shape[0], -1).float() for p in mats]
    kw = {"state": {"rank": args.rank, "grid_block": args.grid_block}}
    ref = _updates(init, grads, state_format="fp32", **kw)
    skip = min(3, args.cos_steps - 1)
    out = {}
    for v in variants:
        fmt, _, carrier = v.partition(":")
        upd = _updates(init, grads, state_format=fmt, newton_schulz={"input": carrier or "bf16"}, **kw)
        vals = [cosine(upd[t][i], ref[t][i]) for t in range(skip, len(grads)) for i in range(len(init))]
        out[v] = sum(vals) / len(vals)
    return out


def render(cfg: dict, rows: list[dict], train_bytes: int, extra: dict | None = None) -> str:
    """The markdown report (also used by ``--render-only`` to redo it from fidelity.json)."""
    extra = extra or {}
    fmt_f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    q32 = next((r["final_val_loss"] for r in rows if r["optimizer"] == "qmuon:fp32"), None)
    lines = [
        "# Training fidelity of the momentum formats",
        "",
        f"Byte-level DecoderLM (d_model {cfg['d_model']}, {cfg['layers']} layers, {cfg['heads']} heads, seq "
        f"{cfg['seq_len']}, batch {cfg['batch']}) on the Python stdlib sources ({train_bytes:,} train bytes), "
        f"{cfg['steps']} steps, seed {cfg['seed']}, Muon lr {cfg['lr']}, AdamW lr {cfg['adamw_lr']}, cosine decay "
        f"to 10 %, grasp4 rank {cfg.get('rank', 4)} / grid {cfg.get('grid_block', 32)}, device {cfg.get('device', 'cpu')}, "
        f"{cfg['threads']} threads. Produced by `python benchmarks/bench_fidelity.py` "
        f"(scale `{cfg.get('scale', 'cpu')}`; all arguments in fidelity.json).",
        "",
    ]
    if extra:
        lines += [f"Machine: {extra.get('machine', '?')}; wall time of the training loop "
                  f"{extra.get('train_wall_s', 0):.0f} s, whole script {extra.get('total_wall_s', 0):.0f} s; "
                  f"load average at start / end {extra.get('load_start', '?')} / {extra.get('load_end', '?')}.", ""]
    lines += [
        "| optimizer | final val loss | gap vs torch Muon | gap vs QMuon fp32 | state B / Muon param | opt step ms "
        "| opt step vs QMuon fp32 | train step ms | train step vs QMuon fp32 | update cosine vs fp32 state |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        gap32 = None if q32 is None else 100.0 * (r["final_val_loss"] - q32) / q32
        lines.append(
            f"| {r['optimizer']} | {r['final_val_loss']:.4f} | {r['gap_vs_fp32_muon_pct']:+.2f} % | "
            f"{fmt_f(gap32, '+.2f')} % | {fmt_f(r['state_bytes_per_muon_param'], '.4f')} | {r['opt_step_ms']:.1f} | "
            f"{r['opt_step_ratio_vs_qmuon_fp32']:.2f} | {fmt_f(r.get('train_step_ms'), '.1f')} | "
            f"{fmt_f(r.get('train_step_ratio_vs_qmuon_fp32'), '.2f')} | {fmt_f(r['update_cosine_vs_fp32'], '.4f')} |")
    carrier = extra.get("carrier_cosine")
    lines += [
        "",
        "Gaps are of the final validation loss (mean over "
        f"{cfg['val_windows']} fixed held-out windows). Step times are medians over all steps of the interleaved "
        "run (every optimizer steps on the same batch right after the others, in a rotating order), so they share "
        "the machine's load; `opt step` is `optimizer.step()` alone, `train step` adds zero_grad, forward and "
        "backward. State bytes count every momentum tensor of the Muon-managed matrices (step counters excluded); "
        f"on this model's small matrices ({cfg['d_model']} x {cfg['d_model']} .. {6 * cfg['d_model']} x "
        f"{cfg['d_model']}) grasp4's factors and grid maxima weigh more than on GPT-small shapes (<= 0.578 there). "
        "The torch.optim.Muon run is not like-for-like: it orthogonalizes the fused qkv / gate_up matrices whole "
        "(and scales their lr by sqrt(rows / cols) as one matrix) where QMuon works part by part, and its AdamW "
        "group decays the norm gains too; QMuon fp32 is the reference for the quantized formats. Update cosine: "
        + ("mean over Muon layers of the per-layer cosine between the variant's update and the fp32-state, bf16-input "
           f"Muon update, on {cfg['cos_steps']} gradient steps of the trained torch-Muon model (first 3 skipped). "
           if cfg["cos_steps"] > 0 else "not computed in this run (--cos-steps 0). ") +
        "Momentum updates and codecs go through `torch.ops.qmuon` (compiled kernels when the extension is built); "
        "GRASP's power iteration / QR and the MXFP8 codec are pure PyTorch.",
    ]
    if carrier:
        lines += ["", "MXFP8 carrier alone (same gradients, fp32 momentum, NS input MXFP8 vs bf16): update cosine vs "
                  f"fp32-state bf16-input Muon {carrier['fp32:mxfp8']:.4f} (bf16 state, bf16 input: "
                  f"{carrier['bf16']:.4f})."]
    return "\n".join(lines) + "\n"


def plot(out: Path, curves: dict[str, dict], cfg: dict, name: str = "fidelity") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss-curve PNG")
        return
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(17, 4.8))
    ref = curves.get("qmuon:fp32")
    colors = {kind: f"C{i % 10}" for i, kind in enumerate(curves)}
    for kind, c in curves.items():
        k = 25
        tr = c["train"]
        sm = [sum(tr[max(0, i - k + 1): i + 1]) / len(tr[max(0, i - k + 1): i + 1]) for i in range(len(tr))]
        style = "--" if kind.endswith(":mxfp8") else "-"
        a1.plot(sm, style, label=kind, lw=1.2, color=colors[kind])
        steps, vals = zip(*c["val"])
        a2.plot(steps, vals, style, marker="o", ms=3, label=kind, color=colors[kind])
        if ref and kind not in ("adamw", "torch-muon"):
            rv = dict(map(tuple, ref["val"]))
            a3.plot(steps, [100 * (v - rv[s]) / rv[s] for s, v in zip(steps, vals)], style, marker="o", ms=3,
                    label=kind, color=colors[kind])
    a1.set(title=f"train loss ({25}-step mean)", xlabel="step", ylabel="loss (nats / byte)")
    finals = [c["val"][-1][1] for c in curves.values()]
    lo, hi = min(min(v for _, v in c["val"]) for c in curves.values()), max(finals)
    if len(next(iter(curves.values()))["val"]) > 2:  # zoom on the later part of training
        a2.set_ylim(lo - 0.05 * (hi - lo + 0.1), hi + 0.5 * (hi - lo + 0.1))
    a2.set(title="validation loss", xlabel="step")
    a3.axhline(0, color="k", lw=0.6)
    for y in (0.5, 1.5):
        a3.axhline(y, color="grey", lw=0.6, ls=":")
    a3.set(title="validation gap vs QMuon fp32 (%)", xlabel="step")
    a1.legend(fontsize=7)
    a3.legend(fontsize=7)
    fig.suptitle(f"DecoderLM d{cfg['d_model']} x {cfg['layers']} on stdlib bytes, {cfg['steps']} steps", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / f"{name}_loss.png", dpi=110)
    print(f"wrote {out / f'{name}_loss.png'}")


def merge(out: Path, names: list[str]) -> None:
    """Combine runs made as concurrent processes (each interleaving its own optimizers, each with
    ``qmuon:fp32`` as its in-process step-time reference) into ``fidelity.{json,md,png}``.

    Losses do not depend on the split (same seed, data order and step budget; one thread, so the
    runs are deterministic): the ``qmuon:fp32`` curves of all parts must agree exactly, which is
    checked. Step-time ratios stay within their part (same process, same load)."""
    parts = [json.loads((out / f"{n}.json").read_text()) for n in names]
    keys = ("steps", "d_model", "layers", "heads", "seq_len", "batch", "lr", "adamw_lr", "seed", "max_bytes",
            "val_windows", "rank", "grid_block", "device", "threads")
    for n, d in zip(names[1:], parts[1:]):
        diff = {k: (parts[0]["config"].get(k), d["config"].get(k)) for k in keys
                if parts[0]["config"].get(k) != d["config"].get(k)}
        if diff:
            raise SystemExit(f"--merge: {n} was run with a different configuration than {names[0]}: {diff}")
    curves: dict[str, dict] = {}
    rows: list[dict] = []
    step_times: dict[str, dict] = {}
    fp32_identical = []
    for d in parts:
        for r in d["rows"]:
            k = r["optimizer"]
            if k in curves:
                fp32_identical.append(curves[k]["val"] == d["curves"][k]["val"] and curves[k]["train"] == d["curves"][k]["train"])
                continue
            curves[k] = d["curves"][k]
            step_times[k] = d.get("step_times_ms", {}).get(k)
            rows.append(dict(r))
    if not all(fp32_identical):
        raise SystemExit("--merge: the parts' shared runs differ; they are not the same training run")
    ref = next((r for r in rows if r["optimizer"] == "torch-muon"), rows[0])
    cos: dict[str, float] = {"fp32": 1.0}
    carrier: dict[str, float] = {}
    for d in parts:
        cos.update(d.get("extra", {}).get("update_cosine", {}))
        carrier.update(d.get("extra", {}).get("carrier_cosine", {}))
    for r in rows:
        r["gap_vs_fp32_muon_pct"] = 100.0 * (r["final_val_loss"] - ref["final_val_loss"]) / ref["final_val_loss"]
        if r["optimizer"].startswith("qmuon:"):
            r["update_cosine_vs_fp32"] = cos.get(r["optimizer"].split(":", 1)[1])
    ex = [d.get("extra", {}) for d in parts]
    extra = {
        "machine": ex[0].get("machine", "?") + f"; {len(parts)} concurrent processes ({', '.join(names)}), "
                   "step-time ratios within each",
        "train_wall_s": max(e.get("train_wall_s", 0) for e in ex),
        "train_cpu_s": sum(e.get("train_cpu_s", 0) for e in ex),
        "total_wall_s": max(e.get("total_wall_s", 0) for e in ex),
        "load_start": "/".join(str(e.get("load_start", "?")) for e in ex),
        "load_end": "/".join(str(e.get("load_end", "?")) for e in ex),
        "carrier_cosine": carrier, "update_cosine": cos, "parts": names,
        "parts_wall_s": [e.get("train_wall_s") for e in ex], "parts_cpu_s": [e.get("train_cpu_s") for e in ex],
        "shared_runs_identical": bool(fp32_identical) and all(fp32_identical),
    }
    cfg = dict(parts[0]["config"], optimizers=",".join(curves))
    (out / "fidelity.json").write_text(json.dumps(
        {"config": cfg, "rows": rows, "train_bytes": parts[0].get("train_bytes", 0), "extra": extra,
         "curves": curves, "step_times_ms": step_times}, indent=1))
    text = render(cfg, rows, parts[0].get("train_bytes", 0), extra)
    (out / "fidelity.md").write_text(text)
    print(text)
    plot(out, curves, cfg, "fidelity")


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", choices=sorted(SCALES), default="cpu",
                    help="preset for the model size / steps / device (explicit flags override it)")
    for name, typ in (("steps", int), ("d-model", int), ("layers", int), ("heads", int), ("seq-len", int),
                      ("batch", int), ("eval-every", int), ("val-windows", int), ("max-bytes", int), ("device", str)):
        ap.add_argument(f"--{name}", type=typ, default=None, help="default: from --scale")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--rank", type=int, default=4, help="grasp4 factor rank")
    ap.add_argument("--grid-block", type=int, default=32, help="grasp4 residual grid tile side")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cos-steps", type=int, default=8, help="gradient steps for the update cosine (0: skip it)")
    ap.add_argument("--cos-variants", default=None,
                    help="comma list of <format>[:mxfp8] for the update cosine (default: this run's QMuon kinds)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--optimizers", default=DEFAULT_OPTIMIZERS,
                    help="comma list of adamw, torch-muon, qmuon:<format>[:mxfp8]")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--name", default="fidelity", help="output file stem (fidelity.json / .md)")
    ap.add_argument("--render-only", action="store_true", help="rewrite the .md / .png from an existing .json")
    ap.add_argument("--merge", default=None, metavar="NAME,NAME",
                    help="combine runs made as concurrent processes (--name ... with disjoint --optimizers, each "
                         "including qmuon:fp32) into fidelity.{json,md,png}")
    args = ap.parse_args()
    out = Path(args.out)
    if args.merge:
        merge(out, args.merge.split(","))
        return
    if args.render_only:
        data = json.loads((out / f"{args.name}.json").read_text())
        text = render(data["config"], data["rows"], data.get("train_bytes", 0), data.get("extra"))
        (out / f"{args.name}.md").write_text(text)
        plot(out, data["curves"], data["config"], args.name)
        print(text)
        return
    for k, v in SCALES[args.scale].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--scale {args.scale} / --device {args.device} needs a CUDA device; none is available "
                         "(use --scale cpu or --device cpu)")
    kinds = args.optimizers.split(",")
    for kind in kinds:
        parse_kind(kind)
    t_script = time.perf_counter()
    load_start = _loadavg()
    torch.set_num_threads(args.threads)
    print(f"torch.ops.qmuon backend: {ensure_backend()}", flush=True)  # builds the extension outside the timing
    out.mkdir(parents=True, exist_ok=True)
    corpus = build_stdlib_corpus(max_bytes=args.max_bytes)
    print(corpus.describe(), flush=True)
    train_ds = RandomWindowDataset(corpus.train, args.seq_len, 10**7, seed=args.seed)
    val = tuple(t.to(args.device) for t in fixed_windows(corpus.val, args.seq_len, args.val_windows, seed=args.seed + 1))
    args.partial = out / f"{args.name}.partial.json"
    t0, c0 = time.perf_counter(), time.process_time()
    runs = train_interleaved(kinds, args, train_ds, val)
    train_wall, train_cpu = time.perf_counter() - t0, time.process_time() - c0
    by_kind = {r.kind: r for r in runs}
    ref = by_kind.get("torch-muon", runs[0])
    med = lambda xs: statistics.median(xs)  # noqa: E731
    base = by_kind.get("qmuon:fp32", ref)
    qvariants = [k.split(":", 1)[1] for k in kinds if k.startswith("qmuon:") and k != "qmuon:fp32" and "@" not in k]
    if args.cos_variants:
        qvariants = args.cos_variants.split(",")
    carrier_variants = ["fp32:mxfp8", "bf16"]
    cos_variants = list(dict.fromkeys(qvariants + carrier_variants))
    cos = lm_update_cosine(ref.model, train_ds, args, cos_variants) if qvariants and args.cos_steps > 0 else {}
    cos["fp32"] = 1.0
    rows = []
    for r in runs:
        variant = r.kind.split(":", 1)[1] if r.kind.startswith("qmuon:") else None
        rows.append({
            "optimizer": r.kind, "final_val_loss": r.val[-1][1],
            "gap_vs_fp32_muon_pct": 100.0 * (r.val[-1][1] - ref.val[-1][1]) / ref.val[-1][1],
            "state_bytes_per_muon_param": muon_state_bytes_per_param(r.opts),
            "opt_step_ms": 1e3 * med(r.opt_times), "opt_step_ratio_vs_qmuon_fp32": med(r.opt_times) / med(base.opt_times),
            "train_step_ms": 1e3 * med(r.step_times),
            "train_step_ratio_vs_qmuon_fp32": med(r.step_times) / med(base.step_times),
            "opt_step_ms_mean": 1e3 * sum(r.opt_times) / len(r.opt_times),
            "update_cosine_vs_fp32": cos.get(variant) if variant else None,
            **qk_clip_figures(r.opts),
        })
    extra = {"machine": f"{cpu_name()}, {default_threads()} CPU(s) available" if args.device == "cpu"
             else torch.cuda.get_device_name(), "train_wall_s": train_wall, "train_cpu_s": train_cpu,
             "total_wall_s": time.perf_counter() - t_script, "load_start": load_start, "load_end": _loadavg(),
             "carrier_cosine": {k: cos[k] for k in carrier_variants if k in cos},
             "update_cosine": {k: v for k, v in cos.items()}}
    args.partial.unlink(missing_ok=True)
    cfg = {k: v for k, v in vars(args).items() if k not in ("out", "render_only", "name", "partial", "merge")}
    (out / f"{args.name}.json").write_text(json.dumps(
        {"config": cfg, "rows": rows, "train_bytes": corpus.train.numel(), "extra": extra,
         "curves": {r.kind: {"train": r.train, "val": r.val} for r in runs},
         "step_times_ms": {r.kind: {"opt": [round(1e3 * t, 3) for t in r.opt_times],
                                    "train": [round(1e3 * t, 3) for t in r.step_times]} for r in runs}}, indent=1))
    text = render(cfg, rows, corpus.train.numel(), extra)
    (out / f"{args.name}.md").write_text(text)
    print(text)
    plot(out, {r.kind: {"train": r.train, "val": r.val} for r in runs}, cfg, args.name)


if __name__ == "__main__":
    main()
