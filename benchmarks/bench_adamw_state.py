"""The auxiliary AdamW step of QMuon: whole-step memory (MemTracker) and step time, by AdamW state format.

Compared, on one DecoderLM (untied embedding and head: the AdamW parameters), in one process:

* ``main``: QMuon int8 with main's AdamW step (before issue 19): ``torch.optim.adam.adam`` over the
  whole AdamW group (fp32 moments; the foreach path on CUDA, the single-tensor path on CPU), whose
  temporaries are whole tensors (``sqrt(v)`` and its quotient for the largest tensor at once);
* ``fp32`` / ``bf16`` / ``int8`` / ``int4``: QMuon int8 with ``adamw_state_format=...``, stepped per
  tensor in bounded row blocks (:mod:`qmuon.core.adamw`).

Memory: PyTorch's ``MemTracker`` over whole training steps (forward, backward, ``optimizer.step()``,
``zero_grad``); the peak's live bytes split into weights / grads / optimizer state / step
temporaries / activations, and bytes per parameter without activations. The largest tensor's
working set (what the step's transient should stay under) is printed beside it.

Step time: ``optimizer.step()`` of each variant on the same gradients, interleaved (each round steps
every variant once, in a rotating order), medians and the ratio to ``main``.

    python benchmarks/bench_adamw_state.py                 # d_model 384, 2 layers, vocab 32768
    python benchmarks/bench_adamw_state.py --vocab 50257 --d-model 768 --layers 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
from _common import cpu_name, ensure_backend, header_lines, md_table  # noqa: E402

from qmuon_lightning import QMuon, build_optimizer  # noqa: E402
from qmuon_lightning.models.decoder_lm import DecoderLM  # noqa: E402

MiB = 2**20
RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("main", "fp32", "bf16", "int8", "int4")


class MainQMuon(QMuon):
    """QMuon with main's AdamW step (before issue 19), verbatim: torch's functional ``adam`` over the
    whole group, fp32 ``exp_avg`` / ``exp_avg_sq``."""

    def _adamw_step(self, gi: int, group: dict[str, Any], idx: list[int]) -> None:
        from torch.optim.adam import adam

        params = [group["params"][i] for i in idx]
        grads = [p.grad for p in params]
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for p in params:
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            exp_avgs.append(st["exp_avg"])
            exp_avg_sqs.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not params:
            return
        b1, b2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None, capturable=False, differentiable=False,
             fused=None, grad_scale=None, found_inf=None, has_complex=False, decoupled_weight_decay=True,
             amsgrad=False, beta1=b1, beta2=b2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=False)


def make_model(args) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                     max_seq_len=args.seq)


def make_opt(variant: str, model) -> QMuon:
    if variant == "main":
        ref = build_optimizer(model, state_format="int8", adamw_state_format="fp32", verbose=False)
        return MainQMuon.from_config(ref.param_groups, ref.config)
    return build_optimizer(model, state_format="int8", adamw_state_format=variant, verbose=False)


def measure_memory(variant: str, args) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker

    model = make_model(args)
    opt = make_opt(variant, model)
    g = torch.Generator().manual_seed(1)
    tok = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for _ in range(args.mem_steps):
            tracker.reset_mod_stats()
            model.loss(x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    split = {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
    total = split.pop("Total")
    seen: set[int] = set()
    state = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                state += v.untyped_storage().nbytes()
    opt_cat = split.pop("Optstate", 0)
    persistent = min(state, opt_cat)
    n = sum(p.numel() for p in model.parameters())
    out = {"variant": variant, "n_params": n, "peak_live": total, "weights": split.get("Parameter", 0),
           "grads": split.get("Gradient", 0), "state": persistent,
           "step_temporaries": opt_cat - persistent + split.get("Temp", 0),
           "activations": split.get("Activation", 0), "other": split.get("Other", 0) + split.get("Buffer", 0),
           "state_total": state}
    out["no_act"] = total - out["activations"]
    out["b_per_param"] = out["no_act"] / n
    return out


def measure_time(args) -> dict[str, list[float]]:
    """``optimizer.step()`` times per variant, interleaved on the same gradients."""
    variants = args.time_variants.split(",")
    runs = {}
    for v in variants:
        model = make_model(args)
        runs[v] = (model, make_opt(v, model))
    g = torch.Generator().manual_seed(2)
    tok = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    ref_model = make_model(args)
    ref_model.loss(tok[:, :-1], tok[:, 1:]).backward()
    grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    del ref_model
    times: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    for r in range(args.time_rounds):
        k = r % len(order)
        for v in order[k:] + order[:k]:
            model, opt = runs[v]
            for n, p in model.named_parameters():
                p.grad = grads[n].clone()
            t0 = time.perf_counter()
            opt.step()
            dt = time.perf_counter() - t0
            if r >= 1:  # the first round creates the state
                times[v].append(dt)
            opt.zero_grad(set_to_none=True)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--mem-steps", type=int, default=2)
    ap.add_argument("--time-rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--time-variants", default=",".join(VARIANTS), help="variants timed (main first)")
    ap.add_argument("--name", default="adamw_state")
    ap.add_argument("--reuse-memory", action="store_true",
                    help="take the memory rows from results/<name>_memory.json (same arguments) and time only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch.ops.qmuon backend: {ensure_backend()}", flush=True)
    import json

    mem_json = RESULTS / f"{args.name}_memory.json"
    if args.reuse_memory:
        mem = json.loads(mem_json.read_text())["rows"]
    else:
        mem = []
        for v in VARIANTS:
            mem.append(measure_memory(v, args))
            print({k: (round(x / MiB, 1) if isinstance(x, int) and k not in ("n_params",) else x)
                   for k, x in mem[-1].items()}, flush=True)
        RESULTS.mkdir(exist_ok=True)
        mem_json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "reuse_memory"},
                                        "rows": mem}, indent=1))
    model = make_model(args)
    largest = max(model.parameters(), key=lambda p: p.numel())
    # the largest tensor's working set in the new step: its fp32 update block and sqrt(v) block
    # (dense moments), bounded by core.adamw.DEFAULT_CHUNK_ELEMENTS elements per block
    from qmuon.core.adamw import DEFAULT_CHUNK_ELEMENTS, chunk_rows

    rows, cols = largest.shape[0], largest.numel() // largest.shape[0]
    block = chunk_rows(rows, cols) * cols * 4
    times = measure_time(args)
    med = {v: statistics.median(t) for v, t in times.items()}
    fastest = {v: min(t) for v, t in times.items()}
    n = mem[0]["n_params"]
    lines = header_lines("QMuon's AdamW step by AdamW state format: whole-step memory and step time")
    lines += [
        f"DecoderLM vocab {args.vocab} (untied embedding and head), d_model {args.d_model}, {args.layers} layers, "
        f"batch {args.batch} x seq {args.seq}: {n / 1e6:.2f} M parameters; Muon momentum int8 in every run. "
        f"Largest tensor {tuple(largest.shape)} = {largest.numel() * 4 / MiB:.1f} MiB fp32; one row block of the "
        f"chunked step: {block / MiB:.1f} MiB fp32 (blocks of at most {DEFAULT_CHUNK_ELEMENTS:,} elements). "
        f"Machine: {cpu_name()}, {args.threads} threads. `python benchmarks/bench_adamw_state.py "
        + " ".join(sys.argv[1:]) + "`.",
        "",
        "Memory: PyTorch's MemTracker, live tensors at the peak of whole training steps; `no act.` = peak minus "
        "activations; step temporaries = tensors allocated by `optimizer.step()` that are not persistent state.",
        "",
    ]
    rows_md = []
    for m in mem:
        rows_md.append([m["variant"], f"{m['peak_live'] / MiB:.1f}", f"{m['weights'] / MiB:.1f}",
                        f"{m['grads'] / MiB:.1f}", f"{m['state'] / MiB:.1f}", f"{m['step_temporaries'] / MiB:.1f}",
                        f"{m['activations'] / MiB:.1f}", f"{m['no_act'] / MiB:.1f}", f"{m['b_per_param']:.2f}",
                        f"{1e3 * med[m['variant']]:.1f}" if m["variant"] in med else "-",
                        f"{med[m['variant']] / med['main']:.3f}" if m["variant"] in med else "-",
                        f"{fastest[m['variant']] / fastest['main']:.3f}" if m["variant"] in med else "-"])
    lines.append(md_table(["AdamW step", "peak MiB", "weights", "grads", "state", "step temporaries", "activations",
                           "no act.", "B / param (no act.)", "opt.step ms (median)", "median vs main",
                           "fastest vs main"], rows_md))
    lines += ["", f"Step times: {args.time_rounds - 1} interleaved rounds (same gradients, rotating order; the first "
              "round, which creates the state, is not counted): the median and the ratio of the fastest rounds "
              "(less sensitive to a shared machine's load bursts). Load average at the end: "
              f"{open('/proc/loadavg').read().split()[:3]}."]
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
