"""The Newton-Schulz batching rule of core.pipeline.orthogonalize: same-shape matrices of a small
model batch (up to a share of the step's elements), a large model's stay one matrix per batch."""

from __future__ import annotations

import torch

from qmuon_lightning.core import pipeline
from qmuon_lightning.core.newton_schulz import resolve_schedule


def _chunks(shapes, monkeypatch, batch_budget=1.0):
    sizes = []
    monkeypatch.setattr(pipeline, "_orthogonalize_chunk", lambda chunk, r, c, s: sizes.append((r, c, len(chunk))))
    settings = pipeline.NSSettings(resolve_schedule("muon", 5), 5, torch.float32, "bf16")
    items = [pipeline.NSItem(rows=r, cols=c, sumsq=torch.ones(()), eps=1e-7, settings=settings, apply=lambda o: None,
                             source=torch.empty(0)) for r, c in shapes]
    pipeline.orthogonalize(items, batch_budget)
    return sizes


def _gpt(d, layers):
    return [s for _ in range(layers) for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]


def test_small_model_batches_within_share(monkeypatch):
    # the share is off by default (bit-exact parity of sharded and single-process steps); opted in here
    monkeypatch.setattr(pipeline, "BATCH_STEP_SHARE", 0.5)
    shapes = _gpt(256, 4)
    total = sum(r * c for r, c in shapes)
    cap = min(max(1024 * 256, int(pipeline.BATCH_STEP_SHARE * total)), pipeline.CPU_BATCH_MAX_ELEMENTS)
    sizes = _chunks(shapes, monkeypatch)
    assert sum(n for _, _, n in sizes) == len(shapes)
    for r, c, n in sizes:
        assert n * r * c <= cap or n == 1
    # the 1024 x 256 MLP matrices now share batches (the largest-matrix cap alone gave 1 each)
    assert max(n for r, c, n in sizes if (r, c) == (1024, 256)) > 1


def test_large_model_stays_one_matrix(monkeypatch):
    sizes = _chunks(_gpt(768, 12), monkeypatch)
    big = [n for r, c, n in sizes if r * c > pipeline.CPU_BATCH_MAX_ELEMENTS // 2]
    assert big and max(big) == 1  # 3072 x 768 matrices (2.4M elements) are never stacked on CPU
