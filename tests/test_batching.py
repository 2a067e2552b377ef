"""The Newton-Schulz batching rule of core.pipeline.orthogonalize: same-shape matrices of a small
model batch (up to a share of the step's elements), a large model's stay one matrix per batch, and
a call holding only some of the matrices (a sharded owner, an expert-bank shard, one call of a
gradient-release step) runs batches of the same size as the whole step, so its bits match."""

from __future__ import annotations

import dataclasses

import torch

from qmuon.core import pipeline
from qmuon.core.newton_schulz import resolve_schedule


def _chunks(shapes, monkeypatch, batch_budget=1.0):
    sizes = []
    monkeypatch.setattr(pipeline, "_orthogonalize_chunk", lambda chunk, r, c, s, size=0: sizes.append((r, c, len(chunk))))
    settings = pipeline.NSSettings(resolve_schedule("muon", 5), 5, torch.float32, "bf16")
    items = [pipeline.NSItem(rows=r, cols=c, sumsq=torch.ones(()), eps=1e-7, settings=settings, apply=lambda o: None,
                             source=torch.empty(0)) for r, c in shapes]
    pipeline.orthogonalize(items, batch_budget)
    return sizes


def _gpt(d, layers):
    return [s for _ in range(layers) for s in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))]


def test_small_model_batches_within_share(monkeypatch):
    shapes = _gpt(256, 4)
    total = sum(r * c for r, c in shapes)
    cap = min(max(1024 * 256, int(pipeline.BATCH_STEP_SHARE * total)), pipeline.CPU_BATCH_MAX_ELEMENTS)
    sizes = _chunks(shapes, monkeypatch)
    assert sum(n for _, _, n in sizes) == len(shapes)
    for r, c, n in sizes:
        assert n * r * c <= cap or n == 1
        assert n <= pipeline.MAX_BATCH_MATRICES
    # the 1024 x 256 MLP matrices now share batches (the largest-matrix cap alone gave 1 each)
    assert max(n for r, c, n in sizes if (r, c) == (1024, 256)) > 1


def test_large_model_stays_one_matrix(monkeypatch):
    sizes = _chunks(_gpt(768, 12), monkeypatch)
    big = [n for r, c, n in sizes if r * c > pipeline.CPU_BATCH_MAX_ELEMENTS // 2]
    assert big and max(big) == 1  # 3072 x 768 matrices (2.4M elements) are never stacked on CPU


def _items(mats, settings, out):
    return [pipeline.NSItem(rows=m.shape[0], cols=m.shape[1], sumsq=m.square().sum(), eps=1e-7, settings=settings,
                            apply=lambda o, j=j: out.__setitem__(j, o.clone()), source=m) for j, m in mats]


def test_a_subset_batches_like_the_whole_step(monkeypatch):
    """A call holding 1, 2 or 3 of 6 same-shape matrices (what a sharded rank holds) runs NS batches
    of the whole step's size (padded), and each result equals the whole step's bit for bit. The
    16 x 32 shape is the one whose bf16 ``baddbmm`` differed between a batch of one and of two."""
    g = torch.Generator().manual_seed(0)
    mats = [(j, torch.randn(16, 32, generator=g) * (1e-4 if j == 3 else 1.0)) for j in range(6)]
    mats += [(6 + j, torch.randn(64, 48, generator=g)) for j in range(3)]
    settings = pipeline.NSSettings(resolve_schedule("muon", 5), 5, torch.bfloat16, "bf16")
    sizes = pipeline.BatchSizes.of([tuple(m.shape) for _, m in mats], 1.0, share=0.5)
    seen = []
    real = pipeline.newton_schulz_folded
    monkeypatch.setattr(pipeline, "newton_schulz_folded", lambda b, *a, **k: (seen.append(tuple(b.shape)), real(b, *a, **k))[1])
    whole: dict = {}
    pipeline.orthogonalize(_items(mats, settings, whole), sizes)
    full_batches = set(seen)
    # 6 of 16 x 32 under the matrix cap (4): 2 batches of 3; 3 of 64 x 48 under a limit of 2: 2 of 2, one padded
    assert full_batches == {(3, 16, 32), (2, 64, 48)}
    for subset in ([mats[3]], [mats[0], mats[3]], [mats[1], mats[3], mats[5]], mats[:5], [mats[7]]):
        seen.clear()
        part: dict = {}
        pipeline.orthogonalize(_items(subset, settings, part), sizes)
        assert set(seen) <= full_batches, (seen, full_batches)
        for j, o in part.items():
            assert torch.equal(o, whole[j]), j


def test_a_release_call_does_not_pad(monkeypatch):
    """A call for a subset on purpose (``pad=False``: one parameter under gradient release) runs
    what it holds without padding: padding would multiply its NS work by the step's batch size."""
    g = torch.Generator().manual_seed(1)
    mats = [(j, torch.randn(16, 32, generator=g)) for j in range(4)]
    settings = pipeline.NSSettings(resolve_schedule("muon", 5), 5, torch.bfloat16, "bf16")
    sizes = pipeline.BatchSizes.of([tuple(m.shape) for _, m in mats], 1.0, share=0.5)
    seen = []
    real = pipeline.newton_schulz_folded
    monkeypatch.setattr(pipeline, "newton_schulz_folded", lambda b, *a, **k: (seen.append(b.shape[0]), real(b, *a, **k))[1])
    pipeline.orthogonalize(_items(mats[:1], settings, {}), sizes)
    pipeline.orthogonalize(_items(mats[:1], settings, {}), dataclasses.replace(sizes, pad=False))
    assert sizes.per_batch(16, 32, "cpu") == 2 and seen == [2, 1]  # share 0.5 of 4 x 512 elements: 2 per batch
