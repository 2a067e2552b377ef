"""The smallest honest QMuon training demo: a tiny byte-level LM trained with Lightning on CPU.

Run ``python benchmarks/demo.py`` (about 2-3 minutes on 2 CPU cores). It trains a small
decoder-only transformer (:class:`qmuon_lightning.models.DecoderLM`; vocabulary: the 256 byte
values) on the Python standard library's own ``*.py`` sources with
``qmuon_lightning.build_optimizer`` (8-bit momentum by default), logs to CSV, and prints a summary:
validation loss measured on a fixed set of held-out windows before and after training, training
throughput, and the Muon optimizer state size against fp32 momentum.

Flags: ``--state-format`` (one of ``qmuon.quant.state.STATE_FORMATS``), ``--max-steps``,
``--batch-size``, ``--seq-len``, ``--out-dir``, ``--seed`` (and a few model and learning-rate
knobs, see ``--help``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from lightning.pytorch.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from qmuon import build_optimizer  # noqa: E402
from qmuon.quant.state import STATE_FORMATS  # noqa: E402
from qmuon_lightning.data.bytes_corpus import RandomWindowDataset, build_stdlib_corpus, fixed_windows  # noqa: E402
from qmuon_lightning.models import DecoderLM, mean_window_loss  # noqa: E402

VOCAB = 256


class DemoModule(L.LightningModule):
    def __init__(
        self,
        *,
        d_model: int = 128,
        n_layers: int = 4,
        n_heads: int = 4,
        seq_len: int = 128,
        state_format: str = "int8",
        lr: float = 0.02,
        adamw_lr: float = 3e-3,
        weight_decay: float = 0.01,
        warmup_steps: int = 20,
        max_steps: int = 500,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        # Byte-level: vocabulary = the 256 byte values. Embedding and lm_head go to AdamW, the
        # fused qkv / gate_up matrices to Muon part by part (see the routing table printed at start).
        self.model = DecoderLM(vocab_size=VOCAB, d_model=d_model, n_layers=n_layers, n_heads=n_heads, max_seq_len=seq_len)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        logits = self(x)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        opt = build_optimizer(
            self, state_format=hp.state_format, lr=hp.lr, weight_decay=hp.weight_decay, adamw_lr=hp.adamw_lr, adamw_weight_decay=hp.weight_decay, state={"seed": hp.seed}, verbose=self.trainer is None or self.trainer.is_global_zero,
        )
        warmup, total = max(0, hp.warmup_steps), max(1, hp.max_steps)
        cooldown_start = int(0.6 * total)

        def factor(step: int) -> float:
            # Linear warmup, flat, then linear decay to 10% over the last 40% of the run.
            if step < warmup:
                return (step + 1) / warmup
            if step < cooldown_start:
                return 1.0
            return 1.0 - 0.9 * (step - cooldown_start) / max(1, total - cooldown_start)

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _TrainTimer(L.Callback):
    """Wall time spent in training batches (forward, backward, optimizer step); validation excluded."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.batches = 0
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.seconds += time.perf_counter() - self._t0
        self.batches += 1



@dataclass
class DemoResult:
    state_format: str
    steps: int
    batch_size: int
    seq_len: int
    initial_val_loss: float
    final_val_loss: float
    tokens_per_s: float
    train_seconds: float
    fit_seconds: float
    muon_params: int
    muon_state_bytes: int
    fp32_momentum_bytes: int
    total_params: int
    metrics_csv: str

    def table(self) -> str:
        ratio = self.muon_state_bytes / self.fp32_momentum_bytes if self.fp32_momentum_bytes else float("nan")
        rows = [
            ("state format", self.state_format),
            ("steps", f"{self.steps}"),
            ("batch x seq_len", f"{self.batch_size} x {self.seq_len}"),
            ("model parameters", f"{self.total_params:,} ({self.muon_params:,} in Muon)"),
            ("val loss, initial", f"{self.initial_val_loss:.4f} nats/byte (ln 256 = {math.log(VOCAB):.4f})"),
            ("val loss, final", f"{self.final_val_loss:.4f} nats/byte ({self.final_val_loss / math.log(2):.3f} bits/byte)"),
            ("throughput", f"{self.tokens_per_s:,.0f} tokens/s ({self.train_seconds:.1f} s in training steps)"),
            ("Muon state bytes", f"{self.muon_state_bytes:,} (optimizer.state_nbytes())"),
            ("fp32 momentum bytes", f"{self.fp32_momentum_bytes:,} (4 x {self.muon_params:,} Muon elements)"),
            ("state / fp32", f"{ratio:.3f}"),
            ("metrics", self.metrics_csv),
        ]
        w = max(len(k) for k, _ in rows)
        line = "-" * (w + 2 + max(len(v) for _, v in rows))
        return "\n".join(["QMuon demo summary", line, *(f"{k.ljust(w)}  {v}" for k, v in rows), line])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/demo.py",
        description="Train a tiny byte-level transformer LM on the Python stdlib's sources with QMuon (CPU, Lightning).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--state-format", default="int8", choices=list(STATE_FORMATS),
                   help="Muon momentum storage")
    p.add_argument("--max-steps", type=int, default=500, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128, help="context length in bytes")
    p.add_argument("--out-dir", default="runs/demo", help="CSV logs and checkpoint go here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--adamw-lr", type=float, default=3e-3, help="AdamW learning rate (embeddings, head, norms)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--corpus-mb", type=float, default=4.0, help="bytes of stdlib source to use (train + val), in MiB")
    p.add_argument("--val-windows", type=int, default=64, help="fixed held-out windows for the before/after val loss")
    p.add_argument("--val-every", type=int, default=0,
                   help="also run Lightning's validation loop every N steps (0: 4 times per run)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return p


def run(args: argparse.Namespace) -> DemoResult:
    """Train and evaluate as ``args`` says (see :func:`build_parser`); returns the measured summary."""
    if args.max_steps <= 0 or args.batch_size <= 0 or args.seq_len <= 1:
        raise SystemExit("--max-steps and --batch-size must be positive and --seq-len at least 2")
    threads = torch.get_num_threads()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        with warnings.catch_warnings():  # the filters below stay local to this run
            for pattern in (".*does not have many workers.*", ".*GPU available but not used.*"):
                warnings.filterwarnings("ignore", pattern)
            return _run(args)
    finally:
        torch.set_num_threads(threads)  # callers (tests) keep their thread count


def _run(args: argparse.Namespace) -> DemoResult:
    L.seed_everything(args.seed, verbose=False)

    corpus = build_stdlib_corpus(max_bytes=int(args.corpus_mb * (1 << 20)))
    print(corpus.describe())
    train_ds = RandomWindowDataset(corpus.train, args.seq_len, args.max_steps * args.batch_size, seed=args.seed)
    val_x, val_y = fixed_windows(corpus.val, args.seq_len, args.val_windows, seed=10_000 + args.seed)
    g = torch.Generator().manual_seed(args.seed)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, generator=g, drop_last=True)
    val_loader = DataLoader(TensorDataset(val_x, val_y), batch_size=32)

    module = DemoModule(
        d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len,
        state_format=args.state_format, lr=args.lr, adamw_lr=args.adamw_lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, max_steps=args.max_steps, seed=args.seed,
    )
    initial = mean_window_loss(module.model, val_x, val_y)
    print(f"initial val loss: {initial:.4f} (ln 256 = {math.log(VOCAB):.4f})")

    os.makedirs(args.out_dir, exist_ok=True)
    logger = CSVLogger(save_dir=args.out_dir, name="demo")
    timer = _TrainTimer()
    val_every = args.val_every if args.val_every > 0 else max(1, args.max_steps // 4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=args.max_steps, max_epochs=-1,
        logger=logger, callbacks=[timer], enable_progress_bar=True, enable_model_summary=True,
        log_every_n_steps=max(1, min(10, args.max_steps // 10)),
        val_check_interval=min(val_every, args.max_steps), check_val_every_n_epoch=None,
        num_sanity_val_steps=0, default_root_dir=args.out_dir,
    )
    t0 = time.perf_counter()
    trainer.fit(module, train_loader, val_loader)
    fit_seconds = time.perf_counter() - t0
    final = mean_window_loss(module.model, val_x, val_y)

    opt = trainer.optimizers[0]
    muon_params = sum(p.numel() for grp in opt.param_groups if grp["use_muon"] for p in grp["params"])
    steps = int(trainer.global_step)
    result = DemoResult(
        state_format=args.state_format, steps=steps, batch_size=args.batch_size, seq_len=args.seq_len,
        initial_val_loss=initial, final_val_loss=final,
        tokens_per_s=timer.batches * args.batch_size * args.seq_len / max(timer.seconds, 1e-9),
        train_seconds=timer.seconds, fit_seconds=fit_seconds,
        muon_params=muon_params, muon_state_bytes=opt.state_nbytes(), fp32_momentum_bytes=4 * muon_params,
        total_params=sum(p.numel() for p in module.parameters()),
        metrics_csv=os.path.join(logger.log_dir, "metrics.csv"),
    )
    print(result.table())
    return result


def main(argv: Sequence[str] | None = None) -> DemoResult:
    """Parse ``argv`` (``sys.argv[1:]`` when None), train, print the summary and return it."""
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
