"""The on-disk layout of a tokenized corpus written by ``qmuon-prepare``, and its reader.

A corpus directory holds::

    train.bin   flat token ids of the training documents, in order (numpy ``dtype`` from meta.json)
    val.bin     the same for the validation documents
    meta.json   what they are (tokenizer, vocabulary, dtype, counts, source, content hashes)

``meta.json`` is written last (temporary file, then ``os.replace``), so a directory with
``meta.json`` is a finished corpus; :func:`read_token_corpus_meta` also checks that each ``.bin``
has exactly the number of tokens meta.json records, which catches a truncated copy.

This module needs nothing beyond numpy and the standard library: the datamodule reads corpora
without the ``data`` extra (``datasets`` / ``transformers``) that only writing them needs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["token_dtype"]

CORPUS_FORMAT = "qmuon-lightning tokenized corpus"
CORPUS_VERSION = 1
META_NAME = "meta.json"
SPLIT_FILES = {"train": "train.bin", "val": "val.bin"}
_DTYPES = ("uint16", "uint32")


def token_dtype(vocab_size: int) -> str:
    """Smallest unsigned dtype for ids ``< vocab_size``: ``uint16`` up to 65,535 entries, else ``uint32``."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return "uint16" if vocab_size <= 65_535 else "uint32"


def read_token_corpus_meta(directory: str | os.PathLike) -> dict[str, Any]:
    """Read and check ``directory/meta.json`` of a prepared corpus; return its contents.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the problem and the fix when the directory
    is not a finished corpus (no meta.json: never prepared, or ``qmuon-prepare`` did not finish),
    the format is unknown, or a ``.bin`` file's size disagrees with meta.json's token count.
    """
    d = Path(os.path.expanduser(str(directory)))
    meta_path = d / META_NAME
    if not d.is_dir():
        raise FileNotFoundError(f"tokenized corpus directory {str(d)!r} does not exist; write it with "
                                f"qmuon-prepare --tokenizer NAME --out {d} --text FILES (or --dataset NAME)")
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{d} has no {META_NAME}: it is not a finished qmuon-prepare corpus (never prepared, or the "
            "preparation was interrupted). Run qmuon-prepare again with --out pointing there.")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{meta_path} is not valid JSON ({err}); prepare the corpus again") from err
    if meta.get("format") != CORPUS_FORMAT or meta.get("version") != CORPUS_VERSION:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')!r}; this "
                         f"version reads {CORPUS_FORMAT!r} version {CORPUS_VERSION}. Prepare the corpus again.")
    if meta.get("dtype") not in _DTYPES:
        raise ValueError(f"{meta_path}: dtype {meta.get('dtype')!r} is not one of {_DTYPES}")
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split, name in SPLIT_FILES.items():
        f = d / name
        expected = int(meta["tokens"][split])
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing (meta.json lists {expected:,} {split} tokens); prepare the corpus again")
        if f.stat().st_size != expected * itemsize:
            raise ValueError(f"{f} has {f.stat().st_size:,} bytes; meta.json records {expected:,} {meta['dtype']} "
                             f"tokens ({expected * itemsize:,} bytes). The file is truncated or from another "
                             "corpus: prepare the corpus again.")
    return meta


def open_token_split(directory: str | os.PathLike, split: str, meta: dict[str, Any]) -> np.ndarray:
    """Memory-map ``split`` (``"train"`` / ``"val"``) of a corpus read-only (never loaded whole)."""
    path = Path(os.path.expanduser(str(directory))) / SPLIT_FILES[split]
    if int(meta["tokens"][split]) == 0:
        return np.zeros(0, dtype=meta["dtype"])  # numpy cannot map an empty file
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
