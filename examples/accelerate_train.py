"""Train a small byte-level language model with int8 QMuon under Hugging Face Accelerate.

The model is :class:`qmuon_lightning.models.DecoderLM` (vocabulary: the 256 byte values), the data
the Python standard library's own ``*.py`` sources (:mod:`qmuon_lightning.data.bytes_corpus`, no
download), the optimizer QMuon with 8-bit momentum built by
:func:`qmuon.integrations.accelerate.prepare_qmuon`. It logs the training loss (printed,
and to TensorBoard under ``--output-dir`` with ``--log-with tensorboard``), saves
``accelerator.save_state`` checkpoints every ``--save-every`` steps and at the end, and continues
from one with ``--resume latest`` (or a checkpoint path) bit-exactly.

One process (CPU or one GPU)::

    python examples/accelerate_train.py

Two CPU processes (DDP over gloo)::

    torchrun --nproc_per_node 2 examples/accelerate_train.py --cpu

GPUs, DDP / FSDP2::

    accelerate launch --num_processes 8 examples/accelerate_train.py
    accelerate launch --num_processes 8 --use_fsdp --fsdp_version 2 \\
        --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP --fsdp_transformer_layer_cls_to_wrap Block \\
        examples/accelerate_train.py

See docs/accelerate.md for what was measured.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader

from accelerate import Accelerator
from accelerate.utils import set_seed

from qmuon_lightning.data.bytes_corpus import RandomWindowDataset, build_stdlib_corpus, fixed_windows
from qmuon.integrations.accelerate import check_state_keys, prepare_qmuon, unwrap_qmuon
from qmuon_lightning.models import DecoderLM, mean_window_loss
from qmuon.quant.state import STATE_FORMATS

VOCAB = 256



class TrainProgress:
    """Optimizer steps taken; checkpointed with ``accelerator.register_for_checkpointing``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


@dataclass
class TrainResult:
    start_step: int
    end_step: int
    num_processes: int
    distributed_type: str
    mixed_precision: str
    last_train_loss: float
    initial_val_loss: float
    final_val_loss: float
    tokens_per_s: float
    muon_state_bytes: int
    fp32_momentum_bytes: int
    last_checkpoint: str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Byte-level DecoderLM on the Python stdlib's sources with int8 QMuon under Accelerate.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=300, help="total optimizer steps (keep it when resuming)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per process per step")
    p.add_argument("--seq-len", type=int, default=128, help="context length in bytes")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--state-format", default="int8", choices=list(STATE_FORMATS), help="Muon momentum storage")
    p.add_argument("--rounding", default="nearest", choices=["nearest", "stochastic"])
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW lr (embedding, head, norms)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--output-dir", default="runs/accelerate", help="checkpoints and logs")
    p.add_argument("--resume", default=None, help="'latest' (newest checkpoint in --output-dir) or a checkpoint dir")
    p.add_argument("--cpu", action="store_true", help="force CPU (with torchrun: DDP over gloo)")
    p.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16"],
                   help="default: the launcher's / accelerate config's setting")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--log-with", default="tensorboard", choices=["tensorboard", "none"])
    p.add_argument("--corpus-mb", type=float, default=2.0, help="MiB of stdlib source (train + val)")
    p.add_argument("--val-windows", type=int, default=32, help="fixed held-out windows for the val loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per process (0: torch's default)")
    return p


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warmup, flat, then linear decay to 10% over the last 40% of the run (as the demo)."""
    if step < warmup:
        return (step + 1) / warmup
    cooldown = int(0.6 * total)
    if step < cooldown:
        return 1.0
    return 1.0 - 0.9 * (step - cooldown) / max(1, total - cooldown)


def checkpoint_dir(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "checkpoints", f"step_{step:06d}")


def resolve_resume(resume: str, output_dir: str) -> str:
    if resume != "latest":
        if not os.path.isdir(resume):
            raise SystemExit(f"--resume {resume}: no such checkpoint directory")
        return resume
    found = sorted(glob.glob(os.path.join(output_dir, "checkpoints", "step_*")))
    if not found:
        raise SystemExit(f"--resume latest: no checkpoint under {output_dir}/checkpoints; train without --resume first")
    return found[-1]


def _local(t: Tensor) -> Tensor:
    """What this process holds: an FSDP2 DTensor's local shard (``numel()`` of a DTensor is global)."""
    return t.to_local() if hasattr(t, "to_local") else t


def main(argv: Sequence[str] | None = None) -> TrainResult:
    args = build_parser().parse_args(argv)
    if args.steps <= 0 or args.batch_size <= 0 or args.seq_len < 2:
        raise SystemExit("--steps and --batch-size must be positive and --seq-len at least 2")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # step_scheduler_with_optimizer=False: the scheduler advances once per optimizer step (by default
    # Accelerate steps it num_processes times per step).
    accelerator = Accelerator(
        cpu=args.cpu, mixed_precision=args.mixed_precision, step_scheduler_with_optimizer=False,
        log_with=None if args.log_with == "none" else args.log_with, project_dir=args.output_dir,
    )
    set_seed(args.seed)
    if args.log_with != "none":
        accelerator.init_trackers("accelerate_train", config={k: v for k, v in vars(args).items() if v is not None})

    corpus = build_stdlib_corpus(max_bytes=int(args.corpus_mb * (1 << 20)))
    accelerator.print(corpus.describe())
    n = accelerator.num_processes
    # Item i is a window at a seeded random offset, so the order is fixed (shuffle=False) and the
    # prepared loader deals batch b to process b % n; skip_first_batches resumes it exactly.
    train_ds = RandomWindowDataset(corpus.train, args.seq_len, args.steps * args.batch_size * n, seed=args.seed)
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=False, drop_last=True)
    val_x, val_y = fixed_windows(corpus.val, args.seq_len, args.val_windows, seed=10_000 + args.seed)
    val_x, val_y = val_x.to(accelerator.device), val_y.to(accelerator.device)

    model = DecoderLM(vocab_size=VOCAB, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads,
                      max_seq_len=args.seq_len)
    model._no_split_modules = ["Block"]  # FSDP2 transformer-based auto-wrap: shard per block

    model, optimizer, loader, scheduler = prepare_qmuon(
        accelerator, model, loader,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: lr_factor(s, args.warmup_steps, args.steps)),
        lr=args.lr, weight_decay=args.weight_decay, state_format=args.state_format,
        state={"rounding": args.rounding, "seed": args.seed}, adamw_lr=args.adamw_lr, adamw_weight_decay=args.weight_decay,
    )
    progress = TrainProgress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        path = resolve_resume(args.resume, args.output_dir)
        accelerator.load_state(path)
        check_state_keys(model, optimizer)  # the loaded state is keyed by the live parameters
        accelerator.print(f"resumed from {path} at step {progress.step}")
    start = progress.step
    if start >= args.steps:
        raise SystemExit(f"the checkpoint is at step {start}, not before --steps {args.steps}; raise --steps")

    initial_val = mean_window_loss(model, val_x, val_y, batch_size=16)
    accelerator.print(f"val loss at step {start}: {initial_val:.4f} nats/byte (ln 256 = {math.log(VOCAB):.4f})")
    batches = accelerator.skip_first_batches(loader, start) if start else loader
    train_seconds, tokens, last_loss, last_ckpt = 0.0, 0, float("nan"), ""
    model.train()
    step = start
    for x, y in batches:
        if step >= args.steps:
            break
        t0 = time.perf_counter()
        logits = model(x)  # through the DDP / FSDP2 wrapper, so gradients are synchronized
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        train_seconds += time.perf_counter() - t0
        tokens += x.numel() * n
        step += 1
        progress.step = step
        if step % args.log_every == 0 or step == args.steps:
            last_loss = float(accelerator.reduce(loss.detach(), reduction="mean"))
            accelerator.log({"train_loss": last_loss, "lr": scheduler.get_last_lr()[0]}, step=step)
            accelerator.print(f"step {step:5d}  loss {last_loss:.4f}  lr {scheduler.get_last_lr()[0]:.5f}")
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            last_ckpt = checkpoint_dir(args.output_dir, step)
            accelerator.save_state(last_ckpt)
    final_val = mean_window_loss(model, val_x, val_y, batch_size=16)
    qm = unwrap_qmuon(optimizer)
    muon_elems = sum(_local(p).numel() for g in qm.param_groups if g["use_muon"] for p in g["params"])
    state_bytes = sum(_local(v).numel() * v.element_size() for g in qm.param_groups if g["use_muon"]
                      for p in g["params"] for v in qm.state.get(p, {}).values() if torch.is_tensor(v))
    result = TrainResult(
        start_step=start, end_step=step, num_processes=n, distributed_type=str(accelerator.distributed_type),
        mixed_precision=str(accelerator.mixed_precision), last_train_loss=last_loss,
        initial_val_loss=initial_val, final_val_loss=final_val,
        tokens_per_s=tokens / max(train_seconds, 1e-9),
        muon_state_bytes=state_bytes, fp32_momentum_bytes=4 * muon_elems, last_checkpoint=last_ckpt,
    )
    accelerator.print(
        f"done: steps {start} -> {step} on {n} process(es) ({result.distributed_type}, mixed precision "
        f"{result.mixed_precision}); val loss {initial_val:.4f} -> {final_val:.4f} nats/byte; "
        f"{result.tokens_per_s:,.0f} tokens/s in training steps; Muon state on this process {result.muon_state_bytes:,} bytes = "
        f"{result.muon_state_bytes / max(1, result.fp32_momentum_bytes):.3f}x fp32 momentum; checkpoint {last_ckpt}"
    )
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
