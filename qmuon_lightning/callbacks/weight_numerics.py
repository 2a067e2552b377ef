""":class:`BF16StallMonitor`: every N optimizer steps, which bf16 weights would lose their updates to
nearest rounding (the numerics check of ``bf16_update``; see :mod:`qmuon.optim.weight_numerics`)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from qmuon.core.apply import record_stalls
from qmuon.optim.weight_numerics import stall_shares
from ._common import log_to_loggers

__all__ = ["BF16StallMonitor"]


class BF16StallMonitor(pl.Callback):
    """Count, on every ``every_n_steps``-th optimizer step, the elements of each bf16 parameter whose
    update nearest rounding would drop (``|update| < ulp(w) / 2``), whatever ``bf16_update`` the
    optimizer uses.

    Logs ``bf16_stalled/<param>`` (share of updated elements) for the parameters above
    ``log_above`` and ``bf16_stalled/max``; warns once per check naming the parameters above
    ``warn_above`` (with ``bf16_update="nearest"`` their training stalls: switch to
    ``"stochastic"`` or ``"ecc8"``, or keep them fp32). :attr:`last_report` keeps the last
    check's rows (:func:`~qmuon.optim.stall_shares`). This rank's rows for sharded
    parameters. fp32 weights never appear.
    """

    def __init__(self, every_n_steps: int = 100, warn_above: float = 0.5, log_above: float = 0.0) -> None:
        if every_n_steps < 1:
            raise ValueError(f"BF16StallMonitor: every_n_steps must be >= 1, got {every_n_steps}")
        if not 0.0 <= warn_above <= 1.0 or not 0.0 <= log_above <= 1.0:
            raise ValueError("BF16StallMonitor: warn_above and log_above are shares in [0, 1]")
        self.every_n_steps = every_n_steps
        self.warn_above = warn_above
        self.log_above = log_above
        self.last_report: list[dict[str, Any]] = []
        self._cm: Any = None
        self._counts: Any = None

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step % self.every_n_steps == 0 and self._cm is None:
            self._cm = record_stalls()
            self._counts = self._cm.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._cm is None:
            return
        self._cm.__exit__(None, None, None)
        counts, self._cm, self._counts = self._counts, None, None
        rows = stall_shares(counts, pl_module.named_parameters())
        self.last_report = rows
        if not rows:
            return
        metrics = {f"bf16_stalled/{r['param']}": r["share"] for r in rows if r["share"] > self.log_above}
        metrics["bf16_stalled/max"] = rows[0]["share"]
        log_to_loggers(trainer, metrics)
        bad = [f"{r['param']} ({100 * r['share']:.0f}%)" for r in rows if r["share"] > self.warn_above]
        if bad:
            rank_zero_warn(
                f"BF16StallMonitor: under nearest rounding these bf16 weights would lose more than "
                f"{100 * self.warn_above:.0f}% of their updates: {', '.join(bad)}. With bf16_update='nearest' they "
                "stop training; use bf16_update='stochastic' or 'ecc8' (or keep them in fp32)")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
            self._cm = self._counts = None
