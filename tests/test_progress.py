"""The progress bar shows the epochs a run reaches (issue 20: Lightning's read ``Epoch 0/-2``)."""

from __future__ import annotations

import math

import pytest

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel

from qmuon_lightning.callbacks.progress import (
    RichEpochProgressBar, TQDMEpochProgressBar, default_progress_bar, epoch_count, epoch_description,
)
from qmuon_lightning.cli import QMuonCLI

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec", "ignore:.*does not have many workers",
                                        "ignore:.*GPU available but not used")


def test_epoch_count():
    assert epoch_count(-1, 300, 7) == 43  # the smoke-style run: epoch=42-step=300 is its last checkpoint
    assert epoch_count(None, 300, 7) == 43
    assert epoch_count(10, 300, 7) == 10 and epoch_count(100, 300, 7) == 43  # whichever ends the run first
    assert epoch_count(5, -1, 7) == 5 and epoch_count(5, -1, math.inf) == 5
    assert epoch_count(-1, -1, 7) is None and epoch_count(-1, 300, math.inf) is None and epoch_count(-1, 300, 0) is None
    assert epoch_count(-1, 300, 7, accumulate_grad_batches=2) == 75  # 4 steps an epoch (the short last one steps)


@pytest.mark.parametrize("bar_type", [RichEpochProgressBar, TQDMEpochProgressBar])
def test_bar_description_in_a_step_bounded_fit(bar_type):
    """BoringModel: 64 batches an epoch, max_steps 70 -> epochs 0 and 1; Lightning's Rich bar says
    ``Epoch 0/-2`` for the same trainer."""
    bar = bar_type()
    trainer = L.Trainer(accelerator="cpu", max_steps=70, max_epochs=-1, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[bar], limit_val_batches=0)
    trainer.fit(BoringModel())
    assert trainer.num_training_batches == 64
    if bar_type is RichEpochProgressBar:
        assert bar._get_train_description(0).strip() == "Epoch 0/1"
        assert RichProgressBar._get_train_description(bar, 0).strip() == "Epoch 0/-2"
    else:
        assert bar.train_progress_bar.desc == "Epoch 1/1: "  # tqdm adds ": "
    trainer.fit_loop.epoch_loop.max_steps = -1  # unbounded (max_epochs -1): no total
    assert epoch_description(trainer, 3) == "Epoch 3"


def test_qmuon_train_uses_the_epoch_bar_unless_configured(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"""
trainer:
  accelerator: cpu
  max_steps: 5
  max_epochs: -1
  logger: false
  default_root_dir: {tmp_path}
model:
  d_model: 16
  n_layers: 1
  n_heads: 2
data:
  seq_len: 16
  batch_size: 2
  max_bytes: 600000
""")
    base = ["--config", str(cfg)]
    assert type(QMuonCLI(args=base, run=False).trainer.progress_bar_callback) is type(default_progress_bar())
    assert QMuonCLI(args=[*base, "--trainer.enable_progress_bar=false"], run=False).trainer.progress_bar_callback is None
    own = QMuonCLI(args=[*base, "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"], run=False)
    assert type(own.trainer.progress_bar_callback) is TQDMProgressBar
