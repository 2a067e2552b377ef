"""Activation checkpointing: whole-step peak memory with and without it, measured side by side in one
run by PyTorch's ``MemTracker``, against the estimate of :mod:`qmuon_lightning.models.activations`.

Model: the smoke recipe's ``DecoderLM`` (recipes/cpu/smoke.yaml: d_model 128, 4 layers, 4 heads,
byte vocabulary 256), with the batch x sequence raised until activations dominate the step; one
grouped-query variant (2 KV heads). Optimizer: the recipe's, QMuon int8 momentum (the
``"QMuon int8"`` setup of :data:`qmuon_lightning.memory.STANDARD_SETUPS`), or its bf16-weight
stack for ``bf16`` rows. Precision: ``fp32`` (the recipe's ``32-true``), ``bf16-mixed`` (bf16
autocast on CPU over fp32 weights), ``bf16`` (bf16 weights, ``bf16_update="stochastic"``).

Each row runs ``--steps`` training steps twice in this process, the same seed and tokens, once
without and once with ``DecoderLM(activation_checkpointing=True)``, each tracked by
``qmuon_lightning.memory.measure_step`` (MemTracker's peak snapshot: every live tensor, activations
included). Columns:

* *peak off / on*: the whole step's most live bytes; *drop*: ``1 - on / off``;
* *activations measured*: the most bytes of MemTracker's ``Activation`` + ``Temp`` at once
  (``Measurement.peak_act``); *estimated*:
  :func:`~qmuon_lightning.memory.decoder_activations` ``.peak``; *error*: (estimate - measured) / measured;
* *whole-step estimate*: the larger of :func:`qmuon_lightning.memory.estimate`'s step (weights,
  gradients, state, step temporaries; ``device="cpu"``) and backward's peak: weights + state + the
  activation estimate, plus with checkpointing the gradients (the first block is rebuilt last, when
  the others' gradients exist), against the measured peak;
* *same losses / weights*: the losses of every step and the weights after the last step compared
  bit for bit between the two runs.

    python benchmarks/bench_activation_checkpointing.py                  # writes results/activation_checkpointing.{md,json}
    python benchmarks/bench_activation_checkpointing.py --rows fp32:32x128 --no-write
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from _common import header_lines, md_table

from qmuon_lightning import memory as mem
from qmuon_lightning.models.decoder_lm import DecoderLM, DecoderLMConfig

MiB = 2**20
SMOKE = {"vocab_size": 256, "d_model": 128, "n_layers": 4, "n_heads": 4}
#: precision:batch x seq[:gqa]; the smoke recipe's batch is 32 x 128
DEFAULT_ROWS = ("fp32:4x128", "fp32:32x128", "fp32:32x512", "fp32:32x128:gqa", "bf16-mixed:32x128", "bf16:32x128")
SETUPS = {"fp32": "QMuon int8", "bf16-mixed": "QMuon int8", "bf16": "int8 + int8 AdamW + bf16 stochastic"}
PRECISION = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "bf16": "bf16-true"}


def parse_row(spec: str) -> tuple[str, int, int, bool]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in SETUPS or "x" not in parts[1] or parts[2:] not in ([], ["gqa"]):
        raise SystemExit(f"--rows entry {spec!r}: expected precision:BATCHxSEQ[:gqa], precision one of {list(SETUPS)}")
    b, t = (int(v) for v in parts[1].split("x"))
    return parts[0], b, t, bool(parts[2:])


def run_one(precision: str, batch: int, seq: int, gqa: bool, ckpt: bool, steps: int) -> dict:
    setup = next(s for s in mem.STANDARD_SETUPS if s.label == SETUPS[precision])
    shape = dict(SMOKE, max_seq_len=seq, n_kv_heads=2 if gqa else None, activation_checkpointing=ckpt)
    torch.manual_seed(0)
    model = DecoderLM(DecoderLMConfig(**shape)).to(setup.weight_dtype)
    opts = mem.build_optimizers(model, setup)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, SMOKE["vocab_size"], (batch, seq + 1), generator=g) for _ in range(steps)]
    it = iter(batches)

    def loss_fn() -> torch.Tensor:
        tok = next(it)
        torch.manual_seed(100)  # bf16 stochastic rounding: the same draws in both runs
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
            return model.loss(tok[:, :-1], tok[:, 1:])

    t0 = time.perf_counter()
    m = mem.measure_step(model, opts, loss_fn, steps=steps)
    seconds = time.perf_counter() - t0
    with torch.device("meta"):
        meta = DecoderLM(DecoderLMConfig(**shape))
    rest = mem.estimate(meta, setup, device="cpu")
    act = mem.decoder_activations(meta.cfg, batch, seq, precision=PRECISION[precision])
    measured_act = m.peak_act
    return {"precision": precision, "batch": batch, "seq": seq, "gqa": gqa, "checkpointing": ckpt,
            "setup": setup.label, "peak": m.peak, "split": m.split, "peak_where": m.peak_where,
            "activations_measured": measured_act, "activations_estimate": act.peak, "estimate_where": act.where,
            "rest_estimate": rest.total, "activations_measured_where": m.peak_act_where,
            # the step peaks in backward or in optimizer.step (activations freed); in backward without
            # checkpointing at its start (every activation, no gradient yet), with checkpointing when
            # the first block is rebuilt (the other gradients exist by then: counted whole)
            "whole_step_estimate": max(rest.total, rest.weights + rest.buffers + rest.state + act.peak
                                       + (rest.grads if ckpt else 0)), "losses": m.losses,
            "seconds": seconds, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def step_times(precision: str, batch: int, seq: int, gqa: bool, rounds: int) -> tuple[float, float]:
    """Median ms of one forward + backward without and with checkpointing, interleaved round by
    round (no MemTracker, no optimizer: what checkpointing adds is the blocks' second forward)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    models = {}
    for ckpt in (False, True):
        torch.manual_seed(0)
        models[ckpt] = DecoderLM(DecoderLMConfig(**SMOKE, max_seq_len=seq, n_kv_heads=2 if gqa else None,
                                                 activation_checkpointing=ckpt)).to(dtype)
    tok = torch.randint(0, SMOKE["vocab_size"], (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds + 1):  # round 0 warms up
        for ckpt in ((False, True) if r % 2 else (True, False)):
            m = models[ckpt]
            t0 = time.perf_counter()
            with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16-mixed"):
                loss = m.loss(tok[:, :-1], tok[:, 1:])
            loss.backward()
            m.zero_grad(set_to_none=True)
            if r:
                times[ckpt].append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times[False]), statistics.median(times[True])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma-separated precision:BATCHxSEQ[:gqa]")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: timings on a machine shared with other jobs are steadier)")
    ap.add_argument("--time-rounds", type=int, default=9,
                    help="interleaved forward + backward timings per row, without MemTracker (0: skip)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "activation_checkpointing.md"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [parse_row(s) for s in args.rows.split(",") if s.strip()]
    t_start = time.perf_counter()
    records = []
    table = []
    for precision, batch, seq, gqa in rows:
        off = run_one(precision, batch, seq, gqa, False, args.steps)
        on = run_one(precision, batch, seq, gqa, True, args.steps)
        t_off, t_on = step_times(precision, batch, seq, gqa, args.time_rounds) if args.time_rounds else (0.0, 0.0)
        on["ms_forward_backward"], off["ms_forward_backward"] = t_on, t_off
        same_w = all(torch.equal(off["params"][n], on["params"][n]) for n in off["params"])
        same_l = off["losses"] == on["losses"]
        for r in (off, on):
            r.pop("params")
            records.append(r)
        drop = 1 - on["peak"] / off["peak"]

        def err(r: dict, key: str, ref: str) -> str:
            return f"{(r[key] - r[ref]) / r[ref]:+.1%}"

        table.append([
            f"{precision} {batch} x {seq}{' GQA' if gqa else ''}",
            f"{off['peak'] / MiB:.1f}", f"{on['peak'] / MiB:.1f}", f"**{drop:.0%}**",
            (f"{off['activations_measured'] / MiB:.1f} / {off['activations_estimate'] / MiB:.1f} "
            f"({err(off, 'activations_estimate', 'activations_measured')})"),
            (f"{on['activations_measured'] / MiB:.1f} / {on['activations_estimate'] / MiB:.1f} "
            f"({err(on, 'activations_estimate', 'activations_measured')})"),
            f"{off['whole_step_estimate'] / MiB:.1f} ({err(off, 'whole_step_estimate', 'peak')})",
            f"{on['whole_step_estimate'] / MiB:.1f} ({err(on, 'whole_step_estimate', 'peak')})",
            "yes" if same_l and same_w else f"NO (losses {same_l}, weights {same_w})",
            f"{t_off:.0f} / {t_on:.0f} ({t_on / t_off:.2f}x)" if t_off else "-",
        ])
        print(" | ".join(table[-1]), flush=True)
    header = ["precision, batch x seq", "peak off (MiB)", "peak on (MiB)", "drop",
              "activations off: measured / estimated (MiB)", "activations on: measured / estimated (MiB)",
              "whole-step estimate off (MiB)", "whole-step estimate on (MiB)", "same losses and weights (bits)",
              "forward + backward ms off / on (median)"]
    lines = header_lines("Activation checkpointing: whole-step peak memory, measured (MemTracker) and estimated")
    lines += [
        (f"Model: the smoke recipe's DecoderLM ({SMOKE}); {args.steps} training steps per run on random tokens; "
        "optimizer: QMuon int8 (`QMuon int8`), bf16 rows `int8 + int8 AdamW + bf16 stochastic`. "
        "*off*: without checkpointing, *on*: `DecoderLM(activation_checkpointing=True)`, in the same process one "
        f"after the other. Total {time.perf_counter() - t_start:.0f} s."),
        "",
        md_table(header, table),
        "",
        ("*peak*: MemTracker's whole-step peak (parameters, gradients, optimizer state, activations, autograd "
        "temporaries). *activations*: the most bytes of its `Activation` + `Temp` at once against "
        "`qmuon_lightning.memory.decoder_activations(...).peak`. *whole-step estimate*: "
        "the larger of `qmuon_lightning.memory.estimate(...).total` (the optimizer step's peak) and its weights + "
        "buffers + state + the activation estimate (backward's peak; with checkpointing + its gradients, which exist "
        "when the first block is rebuilt), error against the measured peak. "
        "*same losses and weights*: every step's loss and the weights after the last step, bit for bit. "
        f"*forward + backward ms*: median of {args.time_rounds} interleaved rounds of one forward + backward "
        "without MemTracker or optimizer (what checkpointing adds: the blocks' second forward), on a 2-core machine "
        "shared with other jobs."),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if not args.no_write:
        out = Path(args.out)
        out.write_text(text)
        out.with_suffix(".json").write_text(json.dumps(records, indent=1))
        print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
