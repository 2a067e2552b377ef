"""End-to-end check of ``python -m qmuon_lightning.demo`` with a tiny budget (CPU, well under 30 s)."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from qmuon_lightning.data import build_stdlib_corpus, fixed_windows
from qmuon_lightning.demo import main

TINY = [
    "--max-steps", "30", "--batch-size", "8", "--seq-len", "64",
    "--d-model", "64", "--layers", "2", "--heads", "2",
    "--warmup-steps", "3", "--corpus-mb", "0.5", "--val-windows", "16", "--val-every", "15",
    # One thread: the model is tiny, and two OpenMP threads on a busy 2-core runner stall each other.
    "--threads", "1",
]


# Lightning 2.6 calls a pytree API that torch 2.13 deprecates; not ours to fix.
@pytest.mark.filterwarnings("ignore:.*LeafSpec")
@pytest.mark.parametrize("state_format", ["int8"])
def test_demo_loss_falls_and_logs(tmp_path, state_format):
    threads = torch.get_num_threads()
    r = main(TINY + ["--state-format", state_format, "--out-dir", str(tmp_path), "--seed", "0"])

    assert r.steps == 30
    assert torch.get_num_threads() == threads  # the demo restores the caller's thread count
    # Untrained byte LM: close to uniform over 256 bytes.
    assert abs(r.initial_val_loss - math.log(256)) < 0.3
    assert math.isfinite(r.final_val_loss)
    # 30 QMuon steps reach at least the byte-unigram level of Python source (~3.2 nats).
    assert r.final_val_loss < r.initial_val_loss - 1.5, (r.initial_val_loss, r.final_val_loss)

    # 8-bit momentum: 1 byte per element + fp32 scales per 256-column block, far below fp32's 4 bytes.
    assert r.muon_params > 0
    assert r.fp32_momentum_bytes == 4 * r.muon_params
    assert 0 < r.muon_state_bytes < 0.4 * r.fp32_momentum_bytes
    assert r.tokens_per_s > 0

    assert r.metrics_csv.startswith(str(tmp_path))
    with open(r.metrics_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    train = [float(row["train_loss"]) for row in rows if row.get("train_loss")]
    val = [float(row["val_loss"]) for row in rows if row.get("val_loss")]
    assert train and val
    assert val[-1] == pytest.approx(r.final_val_loss, abs=1e-3)


def test_stdlib_corpus_is_deterministic():
    a = build_stdlib_corpus(max_bytes=1 << 20)
    b = build_stdlib_corpus(max_bytes=1 << 20)
    assert a.train.numel() + a.val.numel() == 1 << 20
    assert a.train.equal(b.train) and a.val.equal(b.val)
    assert a.train_files > 0 and a.val_files > 0
    x1, y1 = fixed_windows(a.val, 32, 4, seed=1)
    x2, _ = fixed_windows(a.val, 32, 4, seed=1)
    assert x1.equal(x2) and x1.shape == (4, 32)
    assert x1[:, 1:].equal(y1[:, :-1])
