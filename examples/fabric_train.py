"""Train a small byte-level language model with QMuon under Lightning Fabric (``strategy="qmuon_fsdp"``).

A plain Fabric loop: ``fabric.setup_module`` shards the model (FSDP2, one unit per block, then the
model) with no ``parallelize_fn``, ``fabric.setup_optimizers(qmuon.build_optimizer(model, ...))``
trains it with 8-bit (or 4-bit) Muon momentum, and ``fabric.save`` / ``fabric.load`` write and read
sharded checkpoint directories (or, with ``--consolidated``, single files) that resume bit-exactly
on the same number of processes and reshard to another. The data: the Python standard library's
``*.py`` sources as bytes (:mod:`qmuon_lightning.data.bytes_corpus`, no download).

Two CPU processes (Fabric starts the second by re-running this command)::

    python examples/fabric_train.py --devices 2 --max-steps 40 --out runs/fabric

Continue from the newest complete checkpoint under ``--out`` (or start fresh if there is none)::

    python examples/fabric_train.py --devices 2 --max-steps 80 --out runs/fabric --resume auto

GPUs: ``--accelerator gpu --devices 8 --precision bf16-mixed``. See docs/fabric.md.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset

import lightning as L
from lightning.fabric.strategies import STRATEGY_REGISTRY

import qmuon
from qmuon_lightning.data.bytes_corpus import RandomWindowDataset, build_stdlib_corpus, fixed_windows
from qmuon.distributed.resume import find_resumable_checkpoint
from qmuon_lightning.models import DecoderLM, mean_window_loss

VOCAB = 256



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Byte-level DecoderLM on the Python stdlib's sources with QMuon under Lightning Fabric.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--devices", type=int, default=1, help="processes (one per device)")
    p.add_argument("--accelerator", default="cpu", help="cpu, gpu, auto")
    p.add_argument("--strategy", default="qmuon_fsdp", help="qmuon_fsdp or a preset (qmuon_fsdp_grasp4, ...)")
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, bf16-true")
    p.add_argument("--max-steps", type=int, default=40, help="total optimizer steps (raise it to train on after a resume)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per process per step")
    p.add_argument("--seq-len", type=int, default=128, help="context length in bytes")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--state-format", default=None,
                   help="Muon momentum storage (int8, grasp4, ...); default: the strategy preset's, else int8")
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW lr (embedding, head, norms)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (and at the end)")
    p.add_argument("--consolidated", action="store_true", help="single-file checkpoints instead of sharded directories")
    p.add_argument("--out", default="runs/fabric", help="checkpoints go to OUT/checkpoints")
    p.add_argument("--resume", default=None, help="'auto' (newest complete checkpoint under OUT, or none) or a path")
    p.add_argument("--corpus-mb", type=float, default=1.0, help="MiB of stdlib source (train + val)")
    p.add_argument("--val-windows", type=int, default=16)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    return p


def save(fabric: L.Fabric, directory: Path, step: int, state: dict[str, Any], consolidated: bool) -> Path:
    """``fabric.save`` to ``directory/step-NNNNNN`` (``.ckpt`` when consolidated). The strategy writes
    under a ``.partial`` name and renames once every rank is done, so a run killed while saving
    leaves a ``.partial`` that ``find_resumable_checkpoint`` ignores, never a half-written checkpoint."""
    final = directory / (f"step-{step:06d}" + (".ckpt" if consolidated else ""))
    fabric.save(final, state)  # every rank
    return final


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.max_steps <= 0 or args.batch_size <= 0 or args.seq_len < 2 or args.save_every <= 0:
        raise SystemExit("--max-steps, --batch-size and --save-every must be positive and --seq-len at least 2")
    strategy: Any = args.strategy
    if args.consolidated:  # the named preset's arguments, with single-file checkpoints
        preset = STRATEGY_REGISTRY[args.strategy]
        strategy = preset["strategy"](**preset["init_params"], save_distributed_checkpoint=False)
    fabric = L.Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(args.seed)
    world = fabric.world_size
    ckpt_dir = Path(args.out) / "checkpoints"
    corpus = build_stdlib_corpus(max_bytes=int(args.corpus_mb * (1 << 20)))
    fabric.print(corpus.describe())

    model = DecoderLM(vocab_size=VOCAB, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                      max_seq_len=args.seq_len)
    model = fabric.setup_module(model)  # the strategy shards it: blocks, then the model
    state_format = args.state_format or fabric.strategy.optimizer_kwargs.get("state_format", "int8")
    optimizer = fabric.setup_optimizers(qmuon.build_optimizer(
        model, lr=args.lr, weight_decay=args.weight_decay, state_format=state_format,
        adamw_lr=args.adamw_lr, adamw_weight_decay=args.weight_decay, verbose=fabric.global_rank == 0,
    ))
    # "global_step" is what find_resumable_checkpoint orders checkpoints by (as in Lightning's own)
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "global_step": 0}

    resume = None
    if args.resume == "auto":
        resume = find_resumable_checkpoint(ckpt_dir)
        fabric.print(f"--resume auto: {'resuming from ' + str(resume) if resume else 'no checkpoint yet, starting fresh'}")
    elif args.resume:
        resume = Path(args.resume)
    if resume is not None:
        fabric.load(resume, state)  # model, optimizer (resharded to this run's processes) and "global_step"
        fabric.print(f"resumed from {resume} at step {state['global_step']}")
    start = int(state["global_step"])
    if start >= args.max_steps:
        raise SystemExit(f"the checkpoint is at step {start}, not before --max-steps {args.max_steps}; raise --max-steps")

    # Window i is fixed by (seed, i); the global batch of step s is windows [s*B*W, (s+1)*B*W), dealt
    # round-robin to the processes by Fabric's DistributedSampler. Starting the range at the resumed
    # step gives every process the same windows as in an uninterrupted run.
    per_step = args.batch_size * world
    windows = RandomWindowDataset(corpus.train, args.seq_len, args.max_steps * per_step, seed=args.seed)
    loader = DataLoader(Subset(windows, range(start * per_step, args.max_steps * per_step)),
                        batch_size=args.batch_size, shuffle=False, drop_last=True)
    loader = fabric.setup_dataloaders(loader)
    val_x, val_y = fixed_windows(corpus.val, args.seq_len, args.val_windows, seed=10_000 + args.seed)
    val_x, val_y = fabric.to_device((val_x, val_y))

    initial_val = mean_window_loss(model, val_x, val_y, batch_size=16)
    fabric.print(f"val loss at step {start}: {initial_val:.4f} nats/byte (ln 256 = {math.log(VOCAB):.4f})")
    step, seconds, last_loss, last_ckpt = start, 0.0, float("nan"), None
    model.train()
    for x, y in loader:
        t0 = time.perf_counter()
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds += time.perf_counter() - t0
        step += 1
        state["global_step"] = step
        if step % args.log_every == 0 or step == args.max_steps:
            last_loss = float(fabric.all_reduce(loss.detach(), reduce_op="mean"))
            fabric.print(f"step {step:5d}  loss {last_loss:.4f}")
        if step % args.save_every == 0 or step == args.max_steps:
            last_ckpt = save(fabric, ckpt_dir, step, state, args.consolidated)
            fabric.print(f"saved {last_ckpt}")
    final_val = mean_window_loss(model, val_x, val_y, batch_size=16)
    tokens = (step - start) * per_step * args.seq_len
    fabric.print(
        f"done: steps {start} -> {step} on {world} process(es); val loss {initial_val:.4f} -> {final_val:.4f} "
        f"nats/byte; {tokens / max(seconds, 1e-9):,.0f} tokens/s in training steps; last checkpoint {last_ckpt}"
    )
    return {"start": start, "end": step, "world": world, "initial_val": initial_val, "final_val": final_val,
            "last_train_loss": last_loss, "last_checkpoint": str(last_ckpt)}


if __name__ == "__main__":
    main(sys.argv[1:])
    # Tear the process group down before the interpreter exits: left to static destructors, gloo's
    # threads can abort a finished run ("terminate called without an active exception", exit -6).
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
