"""Progress bars that show the number of epochs a run will reach.

Lightning's :class:`~lightning.pytorch.callbacks.RichProgressBar` describes the training bar as
``Epoch {current}/{max_epochs - 1}``, which reads ``Epoch 0/-2`` for the usual step-bounded run
(``max_epochs: -1``, ``max_steps: N``, epochs as long as the corpus makes them), and
:class:`~lightning.pytorch.callbacks.TQDMProgressBar` shows no total at all. The subclasses here
change only that description (Lightning draws the bars): the last epoch index the run reaches,
from whichever of ``max_epochs`` and ``max_steps`` ends it first, or no total when neither bounds
it or the epoch length is unknown.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

__all__ = ["RichEpochProgressBar", "TQDMEpochProgressBar", "default_progress_bar"]


def epoch_count(max_epochs: Optional[int], max_steps: int, batches_per_epoch: float,
                accumulate_grad_batches: int = 1) -> Optional[int]:
    """Epochs a fit runs: ``max_epochs`` when set (not ``None`` / ``-1``), ``max_steps`` over the
    optimizer steps of one epoch when ``max_steps`` is set (not ``-1``) and the epoch length is
    finite, the smaller of the two when both are; ``None`` when neither bounds the run.

    An epoch of ``b`` batches accumulating ``a`` of them per optimizer step makes ``ceil(b / a)``
    steps (Lightning steps on an epoch's last batch even when the accumulation is short), so
    ``max_steps`` ends the fit in epoch ``ceil(max_steps / ceil(b / a))``.
    """
    bounds = []
    if max_epochs is not None and max_epochs != -1:
        bounds.append(int(max_epochs))
    if max_steps != -1 and math.isfinite(batches_per_epoch) and batches_per_epoch > 0:
        steps_per_epoch = math.ceil(batches_per_epoch / max(1, accumulate_grad_batches))
        bounds.append(math.ceil(max_steps / steps_per_epoch))
    return min(bounds) if bounds else None


def epoch_description(trainer: Any, current_epoch: int) -> str:
    """``Epoch {current}/{last}`` (``last``: the index of the run's last epoch, as Lightning's bar
    counts), or ``Epoch {current}`` when the run's length in epochs is unknown. Manual
    optimization steps the optimizer at will, so only ``max_epochs`` bounds it there."""
    automatic = getattr(trainer.lightning_module, "automatic_optimization", True)
    count = epoch_count(trainer.max_epochs, trainer.max_steps if automatic else -1,
                        float(trainer.num_training_batches), trainer.accumulate_grad_batches)
    return f"Epoch {current_epoch}" if count is None else f"Epoch {current_epoch}/{count - 1}"


class RichEpochProgressBar(RichProgressBar):
    """:class:`~lightning.pytorch.callbacks.RichProgressBar` with :func:`epoch_description`."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = epoch_description(self.trainer, current_epoch)
        if len(self.validation_description) > len(description):
            # as Lightning: pad to the validation bar's description so the columns do not shift
            description = f"{description:{len(self.validation_description)}}"
        return description


class TQDMEpochProgressBar(TQDMProgressBar):
    """:class:`~lightning.pytorch.callbacks.TQDMProgressBar` with :func:`epoch_description`."""

    def on_train_epoch_start(self, trainer: Any, *args: Any) -> None:
        super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(epoch_description(trainer, trainer.current_epoch))


def default_progress_bar() -> ProgressBar:
    """The bar Lightning would pick (Rich when ``rich`` is installed, else tqdm), with the epoch count."""
    return RichEpochProgressBar() if _RICH_AVAILABLE else TQDMEpochProgressBar()
