"""A LightningDataModule of next-token windows over byte-level or pre-tokenized corpora.

Four sources, one sampling scheme:

``source="stdlib"`` (default)
    The Python standard library's own ``*.py`` sources as bytes
    (:func:`~qmuon_lightning.data.bytes_corpus.build_stdlib_corpus`): present on every machine,
    no download. A file goes to validation when the SHA-1 of its relative path falls in the first
    ``val_fraction`` of the hash range, so the split is the same on every machine with the same
    Python and does not depend on ``max_bytes``.
``source="text"``
    Local text files (``paths``: files, directories or glob patterns), read as raw bytes (the
    byte-level "tokenizer": token = byte value, vocabulary 256), sorted by path and concatenated with
    a NUL byte after each file.
``source="bin"``
    A pre-tokenized flat array of ``uint8``, ``uint16`` or ``uint32`` token ids (``paths``: one
    ``.bin`` file, e.g. written by ``np.array(ids, np.uint16).tofile(path)``), opened as a read-only
    ``numpy.memmap`` so it is never loaded whole.
``source="tokens"``
    A corpus directory written by ``qmuon-prepare`` (``paths``: that one directory): ``train.bin``
    and ``val.bin`` memory-mapped with the dtype, and the vocabulary taken from its ``meta.json``
    (:mod:`~qmuon_lightning.data.token_corpus`). The split is the one ``qmuon-prepare`` made (by
    document), so ``val_fraction``, ``split_chunk`` and ``max_bytes`` do not apply.

For ``text`` and ``bin`` the token stream is cut into chunks of ``split_chunk`` tokens and a chunk
goes to validation when a hash of ``(seed, chunk index)`` falls below ``val_fraction`` (at least one
chunk each way): a deterministic split that works for a single large file too.

Training windows of ``seq_len + 1`` tokens are drawn at pseudo-random positions inside the training
ranges: window number ``j`` is a pure function of ``(seed, j)`` (SplitMix64), so the data order is
the same with any number of workers. An epoch is ``train_samples`` consecutive window numbers
(epoch ``e`` holds windows ``e * train_samples ...``), split between data-parallel replicas by a
:class:`WindowSampler`; the epoch length depends on the corpus and ``train_samples`` only, never on
``max_steps``.

Resuming mid-epoch uses Lightning's own mechanism for resumable data loaders: the training loader
(:class:`ResumableWindowLoader`) has ``state_dict`` / ``load_state_dict``, Lightning stores its
state (epoch, batches served in that epoch) in the fit loop's part of every checkpoint and gives it
back before the first batch of a restored run, and the sampler then continues at the next batch.
Lightning counts the restored epoch's batches from the same position, so epoch boundaries,
checkpoint names and the data stream of a restarted run are those of an uninterrupted one.
Validation uses ``val_windows`` fixed windows from the validation ranges.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Sequence

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

import lightning as L

from .bytes_corpus import SEPARATOR, build_stdlib_corpus
from .token_corpus import open_token_split, read_token_corpus_meta

__all__ = ["ByteLMDataModule", "ResumableWindowLoader", "WindowSampler"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64 finalizer: a cheap, well-mixed 64-bit hash of an integer (Steele et al. 2014)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def split_ranges(n_tokens: int, chunk: int, val_fraction: float, seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Cut ``[0, n_tokens)`` into ``chunk``-sized pieces and assign each to train or validation.

    A chunk is validation when ``splitmix64(seed, index) < val_fraction * 2**64``; if that leaves
    one side empty, the last chunk goes to validation (or the first to training). Adjacent chunks of
    the same split are merged. Returns ``(train_ranges, val_ranges)`` as half-open intervals.
    """
    if chunk <= 0:
        raise ValueError(f"split_chunk must be positive, got {chunk}")
    n_chunks = max(1, -(-n_tokens // chunk))
    if n_chunks < 2:
        raise ValueError(
            f"the corpus has {n_tokens:,} tokens, one split_chunk ({chunk:,}); it cannot be split into train and "
            "validation. Lower split_chunk or add data.")
    is_val = [_splitmix64((seed << 32) ^ i) < val_fraction * 2**64 for i in range(n_chunks)]
    if not any(is_val):
        is_val[-1] = True
    if all(is_val):
        is_val[0] = False
    train: list[tuple[int, int]] = []
    val: list[tuple[int, int]] = []
    for i, v in enumerate(is_val):
        lo, hi = i * chunk, min(n_tokens, (i + 1) * chunk)
        out = val if v else train
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return train, val


class TokenWindowDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens from ``ranges`` of a 1-D token array; ``length`` per epoch.

    Item ``i`` is window number ``offset + i``: its start is drawn uniformly over every valid start
    in every range (a window never crosses a range end) from ``splitmix64(seed, offset + i)``.
    ``len()`` is ``length`` (one epoch); any ``i >= 0`` is a valid index, so a sampler can address
    later epochs' windows as ``epoch * length + i``. Returns ``(input, target)`` int64 tensors of
    length ``seq_len``.
    """

    def __init__(self, data: np.ndarray | Tensor, ranges: Sequence[tuple[int, int]], seq_len: int, length: int,
                 seed: int = 0, offset: int = 0) -> None:
        self.data, self.seq_len, self.length, self.seed, self.offset = data, seq_len, length, seed, offset
        usable = [(lo, hi) for lo, hi in ranges if hi - lo >= seq_len + 1]
        if not usable:
            longest = max((hi - lo for lo, hi in ranges), default=0)
            raise ValueError(
                f"no range holds a window of seq_len + 1 = {seq_len + 1} tokens (longest range: {longest}); "
                "lower seq_len, raise split_chunk, or add data")
        self._starts = np.array([lo for lo, _ in usable], dtype=np.int64)
        counts = np.array([hi - lo - seq_len for lo, hi in usable], dtype=np.int64)  # valid starts per range
        self._cum = np.cumsum(counts)
        self.total_starts = int(self._cum[-1])

    def __getstate__(self) -> dict:
        # A memmap would pickle as a full in-memory copy (one per DataLoader worker): reopen it instead.
        st = dict(self.__dict__)
        if isinstance(self.data, np.memmap):
            st["data"] = ("memmap", self.data.filename, self.data.dtype.str)
        return st

    def __setstate__(self, st: dict) -> None:
        if isinstance(st["data"], tuple) and st["data"][0] == "memmap":
            _, path, dt = st["data"]
            st["data"] = np.memmap(path, dtype=np.dtype(dt), mode="r")
        self.__dict__.update(st)

    def __len__(self) -> int:
        return self.length

    def window_start(self, j: int) -> int:
        """Start token of window number ``j`` (independent of ``offset``)."""
        u = _splitmix64((self.seed * 1_000_003 + j) & _MASK64) % self.total_starts
        r = int(np.searchsorted(self._cum, u, side="right"))
        before = int(self._cum[r - 1]) if r else 0
        return int(self._starts[r]) + (u - before)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if i < 0:
            raise IndexError(i)
        s = self.window_start(self.offset + i)
        w = torch.as_tensor(np.asarray(self.data[s: s + self.seq_len + 1]).astype(np.int64))
        return w[:-1], w[1:]


class WindowSampler(DistributedSampler):
    """One data-parallel replica's window numbers for one epoch, resumable at a batch boundary.

    Epoch ``e`` covers window numbers ``e * len(dataset) ... (e + 1) * len(dataset) - 1``; replica
    ``rank`` of ``num_replicas`` takes every ``num_replicas``-th of them (as
    ``DistributedSampler(shuffle=False)`` does), cut to whole batches of ``batch_size`` so every
    replica runs the same number of batches. The window positions are already pseudo-random
    (:class:`TokenWindowDataset`), so no shuffling is needed.

    It is a ``DistributedSampler`` so that Lightning neither replaces nor wraps it under a
    distributed strategy (it would otherwise inject its own sampler, which cannot resume), and
    Lightning's ``set_epoch`` calls reach it. :meth:`resume_at` makes the next iteration start at a
    given batch of a given epoch; :class:`ResumableWindowLoader` keeps the position.
    """

    def __init__(self, dataset: TokenWindowDataset, batch_size: int, num_replicas: int = 1, rank: int = 0,
                 epoch: int = 0) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=True)
        self.batch_size = int(batch_size)
        #: batches per epoch and replica
        self.num_batches = self.num_samples // self.batch_size
        if self.num_batches < 1:
            raise ValueError(
                f"an epoch of {len(dataset)} windows gives each of the {num_replicas} data-parallel replica(s) fewer "
                f"than one batch of {batch_size}; raise data.train_samples (or lower data.batch_size)")
        self.num_samples = self.num_batches * self.batch_size
        self.epoch = int(epoch)
        self._start_batch = 0
        self._restored_epoch: int | None = None  # checked against the trainer's next set_epoch
        #: (epoch, batch) of the iteration in progress: the next batch it yields is ``batch``
        self.position = (self.epoch, 0)

    def set_epoch(self, epoch: int) -> None:
        restored, self._restored_epoch = self._restored_epoch, None
        if restored is not None and epoch != restored:
            raise RuntimeError(
                f"the training data loader was restored at epoch {restored} (batch {self._start_batch}), but the trainer "
                f"continues with epoch {epoch}: the checkpoint's loop state and data position disagree, so the data "
                "stream would not continue where it stopped. Train with the qmuon_lightning.callbacks.EpochBoundaryResume "
                "callback (qmuon-train adds it), which keeps Lightning's epoch count right after a restart at an "
                "epoch's end, and resume from a checkpoint written with it")
        super().set_epoch(epoch)

    def resume_at(self, epoch: int, batch: int) -> None:
        """Start the next iteration at batch ``batch`` of epoch ``epoch`` (a batch past the end
        of an epoch is the start of the next one)."""
        epoch, batch = int(epoch), int(batch)
        if batch < 0 or epoch < 0:
            raise ValueError(f"cannot resume at epoch {epoch}, batch {batch}")
        epoch, batch = epoch + batch // self.num_batches, batch % self.num_batches
        self.epoch, self._start_batch, self.position = epoch, batch, (epoch, batch)
        self._restored_epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        epoch, first = self.epoch, self._start_batch
        self._start_batch = 0
        self.position = (epoch, first)
        base = epoch * len(self.dataset) + self.rank
        for k in range(first * self.batch_size, self.num_samples):
            yield base + k * self.num_replicas


class ResumableWindowLoader(DataLoader):
    """The training ``DataLoader`` of :class:`ByteLMDataModule`: a loader Lightning can resume.

    Lightning saves the ``state_dict()`` of every training loader that has one in each checkpoint
    (``loops.fit_loop.state_dict.combined_loader``) and calls ``load_state_dict`` on a restored
    run before its first batch. The state is ``{"epoch", "batch"}``: the next batch this loader
    yields. Counting happens here, on the batches handed to the training loop, not in the
    sampler, whose indices worker processes fetch ahead of use.
    """

    sampler: WindowSampler

    def __init__(self, dataset: TokenWindowDataset, sampler: WindowSampler, num_workers: int = 0) -> None:
        if not isinstance(sampler, WindowSampler):
            raise TypeError(f"ResumableWindowLoader needs a WindowSampler, got {type(sampler).__name__}")
        super().__init__(dataset, batch_size=sampler.batch_size, sampler=sampler, shuffle=False, drop_last=True,
                         num_workers=num_workers, persistent_workers=num_workers > 0)

    def __iter__(self) -> Iterator[Any]:
        return self._count(super().__iter__())

    def _count(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            epoch, done = self.sampler.position
            self.sampler.position = (epoch, done + 1)
            yield batch

    def state_dict(self) -> dict[str, int]:
        epoch, batch = self.sampler.position
        if self.sampler._start_batch:  # restored, not iterated yet
            epoch, batch = self.sampler.epoch, self.sampler._start_batch
        epoch, batch = epoch + batch // self.sampler.num_batches, batch % self.sampler.num_batches
        return {"epoch": epoch, "batch": batch, "batches_per_epoch": self.sampler.num_batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = int(state.get("batches_per_epoch", self.sampler.num_batches))
        if saved != self.sampler.num_batches:
            raise ValueError(
                f"the checkpoint's training data had {saved} batches per epoch and replica, this run has "
                f"{self.sampler.num_batches}: data.train_samples, data.batch_size, the corpus or the number of "
                "data-parallel processes changed, so the data stream cannot continue where it stopped. Resume with "
                "the settings of the interrupted run (or start a new run from the checkpoint's weights)")
        self.sampler.resume_at(int(state["epoch"]), int(state["batch"]))


@dataclass
class _Corpus:
    data: np.ndarray
    train: list[tuple[int, int]]
    val: list[tuple[int, int]]
    description: str
    val_data: np.ndarray | None = None  # validation ranges index this array instead of ``data``


def _expand_paths(paths: Sequence[str]) -> list[Path]:
    out: set[Path] = set()
    for spec in paths:
        spec = os.path.expanduser(spec)
        hits = glob.glob(spec, recursive=True) if glob.has_magic(spec) else [spec]
        if not hits:
            raise FileNotFoundError(f"data.paths: {spec!r} matches no file")
        for h in hits:
            p = Path(h)
            if p.is_dir():
                out.update(q for q in p.rglob("*") if q.is_file())
            elif p.is_file():
                out.add(p)
            else:
                raise FileNotFoundError(f"data.paths: {h!r} does not exist")
    return sorted(out)


class ByteLMDataModule(L.LightningDataModule):
    """Next-token windows over the stdlib's sources, local text files, a ``.bin`` token array or a
    ``qmuon-prepare`` corpus.

    Args:
        source: ``"stdlib"``, ``"text"``, ``"bin"`` or ``"tokens"`` (see the module docstring).
        paths: ``text``: files, directories or glob patterns; ``bin``: exactly one ``.bin`` file;
            ``tokens``: exactly one directory written by ``qmuon-prepare``.
        dtype: token dtype of a ``bin`` file: ``"uint8"`` (``None``), ``"uint16"`` or ``"uint32"``.
            ``tokens``: read from meta.json (a value given here must agree).
        vocab_size: vocabulary of the token ids; after construction the attribute holds the
            resolved value, which ``qmuon-train`` links to the model's ``vocab_size``. ``None``: 256
            for byte sources and ``uint8`` bins, meta.json's for ``tokens``; required for wider bins
            (e.g. 50257 for GPT-2 ids). For ``tokens`` a larger value pads the model's vocabulary
            (e.g. 50304, a multiple of 64); a smaller one is an error.
        seq_len: tokens per training window (the model sees ``seq_len`` inputs, predicts
            ``seq_len`` targets).
        batch_size: windows per batch and device.
        val_fraction: share of files (``stdlib``) or chunks (``text``/``bin``) held out (``tokens``: the
            split qmuon-prepare wrote is used; this, ``max_bytes`` and ``split_chunk`` do not apply).
        seed: seeds the split of ``text``/``bin`` and the window positions.
        max_bytes: ``stdlib`` / ``text``: read at most this many bytes (``None``: no limit for text,
            16 MiB for stdlib).
        split_chunk: ``text`` / ``bin``: tokens per split chunk.
        val_windows: fixed validation windows (validation runs ``ceil(val_windows / batch_size)``
            batches).
        train_samples: training windows per epoch, all data-parallel replicas together. ``None``:
            ``train tokens // seq_len`` (an epoch predicts about as many tokens as the training
            split holds), at least one batch per replica. Never derived from ``max_steps``, so
            changing ``max_steps`` between an interrupted run and its resume keeps the data stream.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        source: Literal["stdlib", "text", "bin", "tokens"] = "stdlib",
        paths: list[str] | None = None,
        dtype: Literal["uint8", "uint16", "uint32"] | None = None,
        vocab_size: int | None = None,
        seq_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.1,
        seed: int = 0,
        max_bytes: int | None = None,
        split_chunk: int = 1 << 16,
        val_windows: int = 64,
        train_samples: int | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if source not in ("stdlib", "text", "bin", "tokens"):
            raise ValueError(f"data.source must be 'stdlib', 'text', 'bin' or 'tokens', got {source!r}")
        if source in ("text", "bin", "tokens") and not paths:
            raise ValueError(f"data.source={source!r} needs data.paths (files or glob patterns; for 'tokens' the "
                             "directory qmuon-prepare wrote)")
        if source == "bin" and len(paths or []) != 1:
            raise ValueError(f"data.source='bin' reads exactly one .bin file; got paths={paths}")
        if source == "tokens" and len(paths or []) != 1:
            raise ValueError(f"data.source='tokens' reads exactly one qmuon-prepare directory; got paths={paths}")
        if dtype not in (None, "uint8", "uint16", "uint32"):
            raise ValueError(f"data.dtype must be 'uint8', 'uint16' or 'uint32', got {dtype!r}")
        self.meta: dict | None = None  # meta.json of a ``tokens`` corpus
        if source == "tokens":
            # Read here, not in setup(): the model's vocabulary is linked to this attribute and is
            # needed before the model is built.
            self.meta = read_token_corpus_meta(paths[0])  # type: ignore[index]
            if dtype is not None and dtype != self.meta["dtype"]:
                raise ValueError(f"data.dtype={dtype!r} but {paths[0]}/meta.json says {self.meta['dtype']!r}; "
                                 "leave data.dtype unset for data.source='tokens'")
            dtype = self.meta["dtype"]
            corpus_vocab = int(self.meta["vocab_size"])
            if vocab_size is not None and vocab_size < corpus_vocab:
                raise ValueError(f"data.vocab_size={vocab_size} is smaller than the corpus' vocabulary {corpus_vocab} "
                                 f"({paths[0]}/meta.json); leave data.vocab_size unset to use it")
            vocab_size = corpus_vocab if vocab_size is None else vocab_size
        dtype = dtype or "uint8"
        if vocab_size is None:
            if source == "bin" and dtype != "uint8":
                raise ValueError(f"data.vocab_size is required for a {dtype} .bin (the tokenizer's vocabulary, e.g. 50257)")
            vocab_size = 256
        if source in ("stdlib", "text") and vocab_size != 256:
            raise ValueError(f"data.source={source!r} is byte-level: vocab_size must be 256, got {vocab_size}")
        if seq_len < 1 or batch_size < 1 or val_windows < 1:
            raise ValueError("data.seq_len, data.batch_size and data.val_windows must be positive")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        self.source, self.paths, self.dtype = source, list(paths or []), dtype
        self.vocab_size, self.seq_len, self.batch_size = int(vocab_size), seq_len, batch_size
        self.val_fraction, self.seed, self.max_bytes, self.split_chunk = val_fraction, seed, max_bytes, split_chunk
        self.val_windows, self.train_samples, self.num_workers = val_windows, train_samples, num_workers
        self.corpus: _Corpus | None = None
        self._val: tuple[Tensor, Tensor] | None = None

    # ------------------------------------------------------------------ loading
    def _load(self) -> _Corpus:
        if self.source == "stdlib":
            c = build_stdlib_corpus(max_bytes=self.max_bytes or (16 << 20), val_fraction=self.val_fraction)
            data = np.concatenate([c.train.numpy(), c.val.numpy()])
            n = c.train.numel()
            return _Corpus(data, [(0, n)], [(n, data.size)], c.describe())
        if self.source == "tokens":
            assert self.meta is not None
            train = open_token_split(self.paths[0], "train", self.meta)
            val = open_token_split(self.paths[0], "val", self.meta)
            desc = (f"tokens corpus {self.paths[0]} ({self.meta['tokenizer']['name_or_path']}, vocabulary "
                    f"{self.meta['vocab_size']:,}, {self.dtype}): train {train.size:,} / val {val.size:,} tokens")
            return _Corpus(train, [(0, int(train.size))], [(0, int(val.size))], desc, val_data=val)
        if self.source == "text":
            files = _expand_paths(self.paths)
            buf = bytearray()
            for f in files:
                if self.max_bytes is not None and len(buf) >= self.max_bytes:
                    break
                buf += f.read_bytes() + bytes([SEPARATOR])
            if self.max_bytes is not None:
                del buf[self.max_bytes:]
            data = np.frombuffer(bytes(buf), dtype=np.uint8)
            desc = f"text corpus: {len(files)} file(s), {data.size:,} bytes"
        else:
            path = Path(os.path.expanduser(self.paths[0]))
            if not path.is_file():
                raise FileNotFoundError(f"data.paths: {str(path)!r} is not a file")
            itemsize = np.dtype(self.dtype).itemsize
            if path.stat().st_size % itemsize:
                raise ValueError(f"{path} has {path.stat().st_size} bytes, not a multiple of {itemsize} ({self.dtype}); wrong data.dtype?")
            data = np.memmap(path, dtype=self.dtype, mode="r")
            desc = f"bin corpus {path}: {data.size:,} {self.dtype} tokens"
        train, val = split_ranges(int(data.size), self.split_chunk, self.val_fraction, self.seed)
        n_val = sum(hi - lo for lo, hi in val)
        return _Corpus(data, train, val, f"{desc}; train {data.size - n_val:,} / val {n_val:,} tokens")

    def setup(self, stage: str | None = None) -> None:
        if self.corpus is None:
            self.corpus = self._load()
            val_data = self.corpus.val_data if self.corpus.val_data is not None else self.corpus.data
            val = TokenWindowDataset(val_data, self.corpus.val, self.seq_len, self.val_windows,
                                     seed=10_000 + self.seed)
            xs, ys = zip(*(val[i] for i in range(self.val_windows)))
            self._val = torch.stack(xs), torch.stack(ys)
            if self.trainer is None or self.trainer.is_global_zero:
                print(self.corpus.description)

    # ------------------------------------------------------------------ loaders
    def _replicas(self) -> tuple[int, int]:
        """(data-parallel replicas, this process's replica index) of the attached trainer."""
        t = self.trainer
        if t is None or t.world_size <= 1:
            return 1, 0
        kw = t.strategy.distributed_sampler_kwargs
        return int(kw.get("num_replicas", 1)), int(kw.get("rank", 0))

    def windows_per_epoch(self) -> int:
        """Training windows per epoch (all replicas): ``train_samples`` or the corpus default."""
        assert self.corpus is not None, "call setup() first"
        if self.train_samples is not None:
            if self.train_samples < 1:
                raise ValueError(f"data.train_samples must be positive, got {self.train_samples}")
            return int(self.train_samples)
        train_tokens = sum(hi - lo for lo, hi in self.corpus.train)
        return max(train_tokens // self.seq_len, self.batch_size * self._replicas()[0])

    def train_dataloader(self) -> ResumableWindowLoader:
        assert self.corpus is not None, "call setup() first"
        replicas, rank = self._replicas()
        ds = TokenWindowDataset(self.corpus.data, self.corpus.train, self.seq_len, self.windows_per_epoch(),
                                seed=self.seed)
        # Start at the trainer's epoch (a run restored at an epoch end); a mid-epoch position comes
        # from Lightning through ResumableWindowLoader.load_state_dict.
        epoch = int(self.trainer.current_epoch) if self.trainer is not None else 0
        sampler = WindowSampler(ds, self.batch_size, num_replicas=replicas, rank=rank, epoch=epoch)
        return ResumableWindowLoader(ds, sampler, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self._val is not None, "call setup() first"
        return DataLoader(TensorDataset(*self._val), batch_size=self.batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
