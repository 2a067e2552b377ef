"""Train a small byte-level language model with int8 QMuon under the DeepSpeed engine (ZeRO 0-3).

The model is :class:`qmuon_lightning.models.DecoderLM` (vocabulary: the 256 byte values), the data
the Python standard library's own ``*.py`` sources (:mod:`qmuon_lightning.data.bytes_corpus`, no
download), the optimizer QMuon with 8-bit momentum, handed to DeepSpeed by
:func:`qmuon.integrations.deepspeed.initialize`: every Muon matrix is orthogonalized whole,
once per step, on one owner rank; each rank keeps the quantized momentum of its ZeRO slices' rows.

Two CPU processes (DeepSpeed's CPU accelerator, gloo)::

    deepspeed --num_gpus 2 examples/deepspeed_train.py --steps 100

(or ``torchrun --nproc_per_node 2 examples/deepspeed_train.py``). GPUs::

    deepspeed --num_gpus 8 examples/deepspeed_train.py --deepspeed_config examples/ds_config_zero2.json

``--stage`` overrides the config's ZeRO stage (0, 1, 2 or 3). At stage 3 the model is built under
``deepspeed.zero.Init`` (``--no-zero-init``: built whole, partitioned by ``deepspeed.initialize``), so
no rank ever holds all of it; the optimizer is routed by the parameters' full shapes. Two CPU
processes at stage 3::

    deepspeed --num_gpus 2 examples/deepspeed_train.py --stage 3 --steps 100

Checkpoints go to ``--save-dir`` every ``--save-every`` steps and at the end
(``engine.save_checkpoint``, one optimizer file per rank at stages 1-3); ``--resume`` continues from
the latest one (same process count and stage; another process count stops with the fix).
See docs/deepspeed.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import qmuon
from qmuon.distributed import exit_after_distributed_run
from qmuon_lightning.data.bytes_corpus import RandomWindowDataset, build_stdlib_corpus, fixed_windows
from qmuon.integrations import deepspeed as qds
from qmuon_lightning.models import DecoderLM
from qmuon_lightning.models.decoder_lm import DecoderLMConfig
from qmuon.core.plan import true_shape
from qmuon.quant.state import STATE_FORMATS

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--deepspeed_config", default=os.path.join(HERE, "ds_config_zero2.json"), help="DeepSpeed JSON config")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None, help="override zero_optimization.stage")
    p.add_argument("--no-zero-init", action="store_true",
                   help="stage 3: build the model whole (deepspeed.initialize partitions it) instead of under zero.Init")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW learning rate (embeddings, head, norms)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--state-format", default="int8", choices=STATE_FORMATS, help="Muon momentum storage")
    p.add_argument("--corpus-bytes", type=int, default=2 << 20, help="bytes of stdlib source to train on")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--save-dir", default=None, help="checkpoint directory (none: no checkpoints)")
    p.add_argument("--save-every", type=int, default=0, help="also save every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --save-dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.stage
    corpus = build_stdlib_corpus(max_bytes=args.corpus_bytes)  # before DeepSpeed starts: fails fast
    config = qds.check_config(config)
    model_config = DecoderLMConfig(vocab_size=VOCAB, d_model=args.d_model, n_layers=args.layers,
                                   n_heads=args.heads, max_seq_len=args.seq_len)
    if config.get("zero_optimization", {}).get("stage", 0) == 3 and not args.no_zero_init:
        import deepspeed

        qds.avoid_cpu_op_builds()
        deepspeed.init_distributed()
        with deepspeed.zero.Init(config_dict_or_path=config):  # each rank allocates only its pieces
            model = DecoderLM(model_config)
    else:
        model = DecoderLM(model_config)
    opt = qmuon.build_optimizer(model, lr=args.lr, weight_decay=args.weight_decay, state_format=args.state_format,
                             adamw_lr=args.adamw_lr, verbose=False)
    # Full shapes (zero.Init leaves each parameter an empty 1-D tensor with the shape in ds_shape).
    muon_elems = sum(true_shape(p).numel() for g in opt.param_groups if g["use_muon"] for p in g["params"])
    model_matrices = sum(true_shape(p).numel() for p in model.parameters() if len(true_shape(p)) >= 2)
    engine, opt, _, _ = qds.initialize(model, opt, config)
    rank, world = dist.get_rank(), dist.get_world_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    stage = engine.zero_optimization_stage()
    say(f"DeepSpeed ZeRO stage {stage}, {world} process(es) on {engine.device}; {opt}")
    say(f"Muon parameters: {muon_elems:,} of the model's {model_matrices:,} matrix elements (embedding and head: AdamW)")

    micro = engine.train_micro_batch_size_per_gpu()
    gas = engine.gradient_accumulation_steps()
    data = RandomWindowDataset(corpus.train, args.seq_len, length=(args.steps + 1) * gas * micro * world, seed=args.seed)
    val_x, val_y = fixed_windows(corpus.val, args.seq_len, 16, seed=1)

    start = 0
    if args.resume:
        if not args.save_dir:
            raise SystemExit("--resume needs --save-dir")
        path, client = qds.load_checkpoint(engine, args.save_dir)  # another process count: stops with the fix
        if path is None:
            raise SystemExit(f"no checkpoint found in {args.save_dir}")
        start = int(client["step"])
        say(f"resumed from {path} at step {start}")

    def batch(step: int, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Each (step, micro-step, rank) reads its own windows: the global batch is world * gas * micro.
        base = ((step * gas + micro_step) * world + rank) * micro
        xs, ys = zip(*(data[base + i] for i in range(micro)))
        return torch.stack(xs).to(engine.device), torch.stack(ys).to(engine.device)

    def val_loss() -> float:
        with torch.no_grad():
            logits = engine(val_x.to(engine.device))
            return F.cross_entropy(logits.float().reshape(-1, VOCAB), val_y.to(engine.device).reshape(-1)).item()

    first_val = val_loss()
    t0 = time.perf_counter()
    loss = torch.tensor(math.nan)
    for step in range(start, args.steps):
        for m in range(gas):
            x, y = batch(step, m)
            loss = F.cross_entropy(engine(x).float().reshape(-1, VOCAB), y.reshape(-1))
            engine.backward(loss)
            engine.step()
        if (step + 1) % args.log_every == 0 or step == start:
            say(f"step {step + 1:5d}  loss {loss.item():.4f}  ({time.perf_counter() - t0:.1f} s)")
        if args.save_dir and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            engine.save_checkpoint(args.save_dir, tag=f"step{step + 1}", client_state={"step": step + 1})
    elapsed = time.perf_counter() - t0
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, tag=f"step{args.steps}", client_state={"step": args.steps})
    last_val = val_loss()
    muon_bytes = torch.tensor([float(opt.state_nbytes())])
    mine = muon_bytes.item()
    dist.all_reduce(muon_bytes)
    result = {
        "stage": stage, "world": world, "steps": args.steps - start, "seconds": elapsed,
        "val_loss_first": first_val, "val_loss_last": last_val,
        "muon_state_bytes_total": muon_bytes.item(), "muon_state_bytes_rank0": mine if rank == 0 else None,
        "muon_elements": muon_elems, "matrix_elements": model_matrices,
    }
    say(f"val loss {first_val:.3f} -> {last_val:.3f} nats/byte; {args.steps - start} steps in {elapsed:.1f} s")
    say(f"Muon momentum: {muon_bytes.item() / muon_elems:.4f} bytes/param over all ranks "
        f"(fp32 momentum: 4); rank 0 holds {mine / muon_bytes.item():.0%} of it")
    return result


if __name__ == "__main__":
    main()
    exit_after_distributed_run()  # shut the process group down and exit without finalization
