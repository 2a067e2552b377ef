"""The byte-level stdlib corpus (``qmuon_lightning.data.bytes_corpus``): deterministic, split by file."""

from __future__ import annotations

from qmuon_lightning.data import build_stdlib_corpus, fixed_windows


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
