"""Training fidelity of the momentum formats: a small byte-level decoder LM on the Python stdlib.

Every optimizer trains the same model (same init seed) on the same batches for the same number of
steps: AdamW, ``torch.optim.Muon`` (+ AdamW for embeddings / head / norms), and QMuon with
``state_format`` fp32 / bf16 / int8 / int4 / e0m3 / grasp4. Reported: final validation loss, gap
vs fp32 ``torch.optim.Muon`` (%), momentum state bytes per Muon-managed parameter, optimizer step
time relative to QMuon fp32, and the per-layer update cosine vs fp32-state Muon on gradients of
the trained model (:func:`qmuon_lightning.quant.fidelity.per_layer_update_cosine`). Loss curves go
to ``benchmarks/results/fidelity_loss.png``.

    python benchmarks/bench_fidelity.py                 # default: d_model 128, 2 layers, 300 steps
    python benchmarks/bench_fidelity.py --steps 1000 --d-model 256 --layers 4
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from qmuon_lightning import QMuon, build_optimizer
from qmuon_lightning.data import RandomWindowDataset, build_stdlib_corpus, fixed_windows
from qmuon_lightning.models import DecoderLM
from qmuon_lightning.optim.routing import route_parameters
from qmuon_lightning.quant.fidelity import per_layer_update_cosine

RESULTS = Path(__file__).resolve().parent / "results"
QFORMATS = ("fp32", "bf16", "int8", "int4", "e0m3", "grasp4")


def make_model(args) -> DecoderLM:
    torch.manual_seed(args.seed)
    return DecoderLM(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq_len)


def make_optimizer(kind: str, model: nn.Module, args):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=0.1)
    if kind == "torch-muon":
        decisions = route_parameters(model)
        muon = [d.param for d in decisions if d.target == "muon"]
        other = [d.param for d in decisions if d.target != "muon"]
        return [torch.optim.Muon(muon, lr=args.lr, weight_decay=0.1),
                torch.optim.AdamW(other, lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=0.1)]
    fmt = kind.split(":", 1)[1]
    return build_optimizer(model, lr=args.lr, weight_decay=0.1, state_format=fmt, adamw_lr=args.adamw_lr,
                           seed=args.seed, verbose=False)


def muon_state_bytes_per_param(opt) -> float | None:
    if isinstance(opt, QMuon):
        n = sum(p.numel() for g in opt.param_groups if g["use_muon"] for p in g["params"])
        return (opt.state_nbytes() - 4 * sum(len(g["params"]) for g in opt.param_groups if g["use_muon"])) / n
    if isinstance(opt, list):  # torch Muon: one fp32 buffer per element
        return 4.0
    return None


@torch.no_grad()
def evaluate(model, val) -> float:
    xs, ys = val
    losses = [model.loss(xs[i: i + 16], ys[i: i + 16]).item() for i in range(0, xs.shape[0], 16)]
    return sum(losses) / len(losses)


def run(kind: str, args, train_ds, val) -> dict:
    model = make_model(args)
    opt = make_optimizer(kind, model, args)
    opts = opt if isinstance(opt, list) else [opt]
    curve, val_curve, t_opt = [], [], 0.0
    for step in range(args.steps):
        # cosine lr decay to 10 %
        f = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for o in opts:
            for g in o.param_groups:
                g.setdefault("base_lr", g["lr"])
                g["lr"] = g["base_lr"] * f
        batch = [train_ds[step * args.batch + i] for i in range(args.batch)]
        x = torch.stack([b[0] for b in batch])
        y = torch.stack([b[1] for b in batch])
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        t0 = time.perf_counter()
        for o in opts:
            o.step()
        t_opt += time.perf_counter() - t0
        curve.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            val_curve.append((step + 1, evaluate(model, val)))
    return {"kind": kind, "train": curve, "val": val_curve, "final_val": val_curve[-1][1],
            "opt_time_per_step": t_opt / args.steps, "bytes_per_param": muon_state_bytes_per_param(opts[0]),
            "model": model}


def lm_update_cosine(model, train_ds, args) -> dict[str, float]:
    """Per-layer update cosine vs fp32 state on real gradients of ``model`` (mean over Muon layers)."""
    decisions = route_parameters(model)
    names = [d.name for d in decisions if d.target == "muon"]
    params = dict(model.named_parameters())
    mats = [params[n] for n in names]
    grads = []
    for step in range(args.cos_steps):
        batch = [train_ds[10**6 + step * args.batch + i] for i in range(args.batch)]
        x = torch.stack([b[0] for b in batch])
        y = torch.stack([b[1] for b in batch])
        model.zero_grad(set_to_none=True)
        model.loss(x, y).backward()
        grads.append([p.grad.detach().reshape(p.shape[0], -1).clone() for p in mats])
    init = [p.detach().reshape(p.shape[0], -1) for p in mats]
    res = per_layer_update_cosine(init, grads, ("bf16", "int8", "int4", "e0m3", "grasp4"), skip=min(3, args.cos_steps - 1))
    return {k: sum(v) / len(v) for k, v in res.items()} | {"fp32": 1.0}


def render(cfg: dict, rows: list[dict], train_bytes: int) -> str:
    """The markdown report (also used by ``--render-only`` to redo it from fidelity.json)."""
    fmt_f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    q32 = next((r["final_val_loss"] for r in rows if r["optimizer"] == "qmuon:fp32"), None)
    lines = [
        "# Training fidelity of the momentum formats",
        "",
        f"Byte-level DecoderLM (d_model {cfg['d_model']}, {cfg['layers']} layers, {cfg['heads']} heads, seq "
        f"{cfg['seq_len']}, batch {cfg['batch']}) on the Python stdlib sources ({train_bytes:,} train bytes), "
        f"{cfg['steps']} steps, seed {cfg['seed']}, Muon lr {cfg['lr']}, AdamW lr {cfg['adamw_lr']}, cosine decay "
        f"to 10 %, CPU, {cfg['threads']} threads. Produced by `python benchmarks/bench_fidelity.py` (arguments in "
        "fidelity.json).",
        "",
        "| optimizer | final val loss | gap vs torch Muon | gap vs QMuon fp32 | state B / Muon param | opt step ms "
        "| step time vs QMuon fp32 | update cosine vs fp32 state |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        gap32 = None if q32 is None else 100.0 * (r["final_val_loss"] - q32) / q32
        lines.append(
            f"| {r['optimizer']} | {r['final_val_loss']:.4f} | {r['gap_vs_fp32_muon_pct']:+.2f} % | "
            f"{fmt_f(gap32, '+.2f')} % | {fmt_f(r['state_bytes_per_muon_param'], '.4f')} | {r['opt_step_ms']:.1f} | "
            f"{r['opt_step_ratio_vs_qmuon_fp32']:.2f} | {fmt_f(r['update_cosine_vs_fp32'], '.4f')} |")
    lines += [
        "",
        "State bytes count every momentum tensor of the Muon-managed matrices (step counters excluded); on this "
        "small model's matrices (128 x 128 .. 768 x 128) grasp4's factors and grid maxima weigh more than on "
        "GPT-small shapes (<= 0.578 there). The torch.optim.Muon run is not like-for-like: it orthogonalizes the "
        "fused qkv / gate_up matrices whole (and scales their lr by sqrt(rows / cols) as one matrix) where QMuon "
        "works part by part, and its AdamW group decays the norm gains too; QMuon fp32 is the reference for the "
        "quantized formats. Update cosine: mean over Muon layers of the per-layer "
        "cosine between the quantized-state and the fp32-state Muon update, on "
        f"{cfg['cos_steps']} gradient steps of the trained torch-Muon model (first 3 skipped). Step times on a "
        "shared, loaded CPU are noisy; the 4-bit formats run pure-PyTorch reference ops (no compiled kernels).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--adamw-lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-bytes", type=int, default=2 << 20)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--val-windows", type=int, default=64)
    ap.add_argument("--cos-steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--optimizers", default="adamw,torch-muon," + ",".join(f"qmuon:{f}" for f in QFORMATS))
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--render-only", action="store_true", help="rewrite fidelity.md from an existing fidelity.json")
    args = ap.parse_args()
    if args.render_only:
        data = json.loads((Path(args.out) / "fidelity.json").read_text())
        text = render(data["config"], data["rows"], data.get("train_bytes", 0))
        (Path(args.out) / "fidelity.md").write_text(text)
        print(text)
        return
    torch.set_num_threads(args.threads)
    from qmuon_lightning import ops

    print(f"torch.ops.qmuon backend: {ops.backend()}", flush=True)  # builds the extension outside the timing
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = build_stdlib_corpus(max_bytes=args.max_bytes)
    print(corpus.describe(), flush=True)
    train_ds = RandomWindowDataset(corpus.train, args.seq_len, 10**7, seed=args.seed)
    val = fixed_windows(corpus.val, args.seq_len, args.val_windows, seed=args.seed + 1)
    results = []
    for kind in args.optimizers.split(","):
        t0 = time.perf_counter()
        r = run(kind, args, train_ds, val)
        print(f"{kind:14s} final val {r['final_val']:.4f}  opt step {1e3 * r['opt_time_per_step']:.1f} ms  "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        results.append(r)
    ref = next((r for r in results if r["kind"] == "torch-muon"), results[0])
    base_t = next((r["opt_time_per_step"] for r in results if r["kind"] == "qmuon:fp32"), ref["opt_time_per_step"])
    cos = lm_update_cosine(ref["model"], train_ds, args) if any(r["kind"].startswith("qmuon:") for r in results) else {}
    rows = []
    for r in results:
        fmt = r["kind"].split(":", 1)[1] if r["kind"].startswith("qmuon:") else None
        rows.append({
            "optimizer": r["kind"], "final_val_loss": r["final_val"],
            "gap_vs_fp32_muon_pct": 100.0 * (r["final_val"] - ref["final_val"]) / ref["final_val"],
            "state_bytes_per_muon_param": r["bytes_per_param"],
            "opt_step_ms": 1e3 * r["opt_time_per_step"], "opt_step_ratio_vs_qmuon_fp32": r["opt_time_per_step"] / base_t,
            "update_cosine_vs_fp32": cos.get(fmt) if fmt else None,
        })
    cfg = {k: v for k, v in vars(args).items() if k != "out"}
    (out / "fidelity.json").write_text(json.dumps({"config": cfg, "rows": rows, "train_bytes": corpus.train.numel(),
                                                  "curves": {r["kind"]: {"train": r["train"], "val": r["val"]}
                                                             for r in results}}, indent=1))
    (out / "fidelity.md").write_text(render(cfg, rows, corpus.train.numel()))
    print((out / "fidelity.md").read_text())
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in results:
            k = 20
            sm = [sum(r["train"][max(0, i - k + 1): i + 1]) / len(r["train"][max(0, i - k + 1): i + 1])
                  for i in range(len(r["train"]))]
            a1.plot(sm, label=r["kind"])
            a2.plot(*zip(*r["val"]), marker="o", label=r["kind"])
        a1.set(title="train loss (20-step mean)", xlabel="step", ylabel="loss")
        a2.set(title="validation loss", xlabel="step")
        a1.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "fidelity_loss.png", dpi=110)
        print(f"wrote {out / 'fidelity_loss.png'}")
    except ImportError:
        print("matplotlib not installed: no loss-curve PNG")


if __name__ == "__main__":
    main()
