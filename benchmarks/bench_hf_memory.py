"""Whole-step memory of the optimizers a Hugging Face ``Trainer`` builds: ``optim="adamw_torch"``,
``optim="adamw_torch_8bit"`` (torchao's AdamW8bit) and ``QMuonFactory`` (int8 momentum + int8 AdamW,
and the full memory stack: bf16 weights with stochastic rounding and gradient release), measured
side by side in one run.

Each optimizer is the one ``Trainer.create_optimizer`` returns for those ``TrainingArguments`` /
``optimizer_cls_and_kwargs`` on a Hugging Face ``LlamaForCausalLM`` built from a local config (the
56.4M model of bench_train_memory.py). Each configuration runs in its own process: ``--steps``
training steps on random tokens (batch 1 x 64) stepped by ``qmuon_lightning.memory.measure_step``
under PyTorch's ``MemTracker`` (the Trainer's loop adds no tensors of its own to a step). Reported:
the peak of weights + gradients + optimizer state + step temporaries (activations aside) and the
peak of everything, in bytes per parameter.

    python benchmarks/bench_hf_memory.py --out benchmarks/results/hf_memory.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MARKER = "@@HF_MEMORY@@ "
CONFIGS = {
    "Trainer optim=adamw_torch": {"optim": "adamw_torch"},
    "Trainer optim=adamw_torch_8bit (torchao)": {"optim": "adamw_torch_8bit"},
    "QMuonFactory int8 + int8 AdamW": {"factory": {"state_format": "int8", "adamw_state_format": "int8"}},
    "QMuonFactory int8 + int8 AdamW, bf16 weights + stochastic, gradient release": {
        "factory": {"state_format": "int8", "adamw_state_format": "int8", "bf16_update": "stochastic",
                    "gradient_release": True}, "bf16": True},
}


def child(label: str, steps: int) -> dict[str, Any]:
    import torch
    import transformers
    from bench_train_memory import build_model

    import qmuon
    from qmuon.integrations.transformers import QMuonFactory
    from qmuon_lightning import memory as mem

    torch.set_num_threads(1)
    qmuon.ops.backend()
    cfg = CONFIGS[label]
    torch.manual_seed(0)
    model = build_model("llama")
    if cfg.get("bf16"):
        model = model.to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(out, use_cpu=True, report_to=[], learning_rate=3e-4, weight_decay=0.1,
                                              optim=cfg.get("optim", "adamw_torch"), max_grad_norm=0.0)
        hook = (QMuonFactory, {"args": args, "verbose": False, **cfg["factory"]}) if "factory" in cfg else None
        trainer = transformers.Trainer(model=model, args=args, optimizer_cls_and_kwargs=hook)
        opt = trainer.create_optimizer()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 32000, (1, 64), generator=g)
    m = mem.measure_step(model, [opt], lambda: model(input_ids=x, labels=x).loss, steps=steps)
    return {"optimizer": type(opt).__name__, "n_params": sum(p.numel() for p in model.parameters()),
            "peak": m.peak, "peak_no_act": m.peak_no_act, "state_bytes": m.state_bytes, "losses": m.losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        print(MARKER + json.dumps(child(args.child, args.steps)), flush=True)
        return
    from _common import header_lines, md_table

    rows = []
    for label in CONFIGS:
        # torchao compiles its step, and Dynamo does not trace under MemTracker: its step runs eagerly
        env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
        proc = subprocess.run([sys.executable, __file__, "--child", label, "--steps", str(args.steps)],
                              capture_output=True, text=True, env=env)
        res = next((json.loads(line[len(MARKER):]) for line in proc.stdout.splitlines() if line.startswith(MARKER)),
                   None)
        if res is None:
            tail = " | ".join(proc.stderr.strip().splitlines()[-4:])
            rows.append([label, "failed", tail, "", "", ""])
            print(f"{label}: failed: {tail}", flush=True)
            continue
        n = res["n_params"]
        rows.append([label, res["optimizer"], f"{res['peak_no_act'] / n:.2f}", f"{res['peak'] / n:.2f}",
                     f"{res['state_bytes'] / n:.2f}", " ".join(f"{v:.3f}" for v in res["losses"])])
        print(f"{label}: {rows[-1][1:]}", flush=True)
    lines = header_lines("Whole-step memory of the optimizers the Hugging Face Trainer builds") + [
        f"Hugging Face `LlamaForCausalLM` (hidden 512, 8 layers, untied 32k vocabulary, {n / 1e6:.1f}M parameters), "
        f"batch 1 x 64 random tokens, {args.steps} steps, each configuration in its own process; the optimizer is "
        "what `Trainer.create_optimizer` returns for the configuration; PyTorch's MemTracker, bytes per parameter.",
        "",
        md_table(["configuration", "optimizer", "weights+grads+state+temp (B/param)", "all, activations too",
                  "optimizer state", "losses"], rows),
        "",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
