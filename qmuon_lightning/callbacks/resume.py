"""``EpochBoundaryResume``: count the epoch that follows a restart at an epoch's last batch.

Lightning 2.6 restores a checkpoint saved after the last batch of epoch ``e`` by closing epoch
``e`` in ``FitLoop.reset`` (it marks it processed and completed) but keeps its restart stage
"restarted mid-epoch", so ``FitLoop.on_advance_start`` then skips, for epoch ``e + 1``, what it does
at the start of every other epoch: ``epoch_progress.increment_ready()`` / ``increment_started()``
and the ``on_train_epoch_start`` hooks. The run goes on correctly, but the next checkpoint saved
at the end of epoch ``e + 1`` records that epoch as never started; restoring *that* checkpoint,
Lightning does not close the epoch and trains it a second time under the same number, one epoch
behind the data loader's own position (seen as a lost epoch in checkpoint names and a different
data stream after two restarts on consecutive epoch ends).

The callback clears the restart stage in ``on_train_start`` (after ``FitLoop.reset``, before the
first ``on_advance_start``) exactly in that case, so the new epoch starts as in an uninterrupted
run. ``qmuon-train`` always adds it; add it to your own ``Trainer`` when resuming mid-run with
:class:`~qmuon_lightning.data.ByteLMDataModule` (whose loader refuses a restore where the two
epoch counts disagree).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback

__all__ = ["EpochBoundaryResume"]


class EpochBoundaryResume(Callback):
    """Start the epoch after a restart at an epoch's last batch as Lightning starts any epoch."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        fit_loop = trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        if (fit_loop.restarted_mid_epoch and epoch_loop.restarted_on_train_batch_end
                and epoch_loop.batch_progress.is_last_batch):
            # FitLoop.reset has just closed the restored epoch (the same condition); what follows
            # is a new epoch, which on_advance_start counts and announces only without the stage.
            fit_loop.reset_restart_stage()
