"""A byte-level corpus made from the Python standard library's own ``*.py`` sources.

It needs no download and is the same on every machine with the same Python version: files are
taken from ``sysconfig.get_paths()["stdlib"]`` (``site-packages`` / ``dist-packages`` excluded),
sorted by their path relative to that directory, and concatenated (each followed by a NUL byte as a
document separator) until ``max_bytes`` is reached. A file goes to the validation split when the
SHA-1 of its relative path falls in the first ``val_fraction`` of the hash range, so the split does
not depend on how many files fit in the budget.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["build_stdlib_corpus", "RandomWindowDataset", "fixed_windows"]

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}
SEPARATOR = 0  # byte written after every file


@dataclass
class StdlibCorpus:
    """``train`` / ``val``: 1-D uint8 tensors of concatenated file bytes."""

    train: Tensor
    val: Tensor
    root: str
    train_files: int
    val_files: int

    def describe(self) -> str:
        return (
            f"stdlib corpus from {self.root}: train {self.train.numel():,} bytes ({self.train_files} files), "
            f"val {self.val.numel():,} bytes ({self.val_files} files)"
        )


def _stdlib_py_files(root: Path) -> list[str]:
    """Relative POSIX paths of every ``*.py`` under ``root``, sorted, site-packages excluded."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for fn in filenames:
            if fn.endswith(".py"):
                out.append(Path(dirpath, fn).relative_to(root).as_posix())
    return sorted(out)


def _is_val(rel_path: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.sha1(rel_path.encode()).digest()[:8], "big")
    return h < val_fraction * 2**64


def build_stdlib_corpus(
    max_bytes: int = 4 << 20,
    val_fraction: float = 0.1,
    root: str | os.PathLike | None = None,
) -> StdlibCorpus:
    """Concatenate the stdlib's ``*.py`` files (sorted by path) into train / val byte tensors.

    ``max_bytes`` bounds the total of both splits; the file that crosses the budget is truncated,
    so the total is exactly ``max_bytes`` when the library is large enough.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    files = _stdlib_py_files(base)
    if not files:
        raise FileNotFoundError(f"no *.py files under {base}")
    train, val = bytearray(), bytearray()
    n_train = n_val = 0
    total = 0
    for rel in files:
        if total >= max_bytes:
            break
        try:
            data = (base / rel).read_bytes()
        except OSError:  # unreadable file: skip it (same result on every identical install)
            continue
        data = data[: max_bytes - total - 1] + bytes([SEPARATOR])
        total += len(data)
        if _is_val(rel, val_fraction):
            val += data
            n_val += 1
        else:
            train += data
            n_train += 1
    if not val or not train:
        raise ValueError(f"corpus too small to split (train {len(train)} bytes, val {len(val)} bytes); raise max_bytes")
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).clone()  # noqa: E731
    return StdlibCorpus(as_tensor(train), as_tensor(val), str(base), n_train, n_val)


class RandomWindowDataset(Dataset):
    """``length`` windows of ``seq_len + 1`` bytes at random offsets of ``data``.

    Item ``i`` is the same for a given ``seed`` whatever the order of access (its offset comes
    from a generator seeded with ``(seed, i)``), so runs are reproducible with any number of
    workers. Returns ``(input, target)`` as int64 tensors of length ``seq_len``.
    """

    def __init__(self, data: Tensor, seq_len: int, length: int, seed: int = 0) -> None:
        if data.ndim != 1 or data.dtype != torch.uint8:
            raise ValueError("data must be a 1-D uint8 tensor")
        if data.numel() <= seq_len + 1:
            raise ValueError(f"data has {data.numel()} bytes, need more than seq_len + 1 = {seq_len + 1}")
        self.data, self.seq_len, self.length, self.seed = data, seq_len, length, seed
        self._high = data.numel() - seq_len - 1

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.length:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(0, self._high + 1, (1,), generator=g))
        w = self.data[start: start + self.seq_len + 1].long()
        return w[:-1], w[1:]


def fixed_windows(data: Tensor, seq_len: int, count: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``count`` evaluation windows at seeded offsets: ``(inputs, targets)`` of shape ``(count, seq_len)``."""
    ds = RandomWindowDataset(data, seq_len, count, seed)
    xs, ys = zip(*(ds[i] for i in range(count)))
    return torch.stack(xs), torch.stack(ys)
