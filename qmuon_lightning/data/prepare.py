"""``qmuon-prepare``: tokenize a text corpus into ``train.bin`` / ``val.bin`` / ``meta.json``.

::

    qmuon-prepare --tokenizer NAME_OR_DIR --out DIR \\
        (--text FILE_OR_GLOB ... | --dataset NAME_OR_PATH [--dataset-config NAME] [--split S] [--text-field F]) \\
        [--val-fraction X] [--workers N] [--max-documents N] [--streaming] [--eos append|none]

Reading and tokenizing use Hugging Face ``datasets`` (``load_dataset("text", ...)`` for local files,
``load_dataset(NAME)`` for Hub or local datasets, ``.map(batched=True, num_proc=workers)``) and
``transformers.AutoTokenizer``; they are the optional ``data`` extra (``pip install
"qmuon-lightning[data]"``) and are imported only when this command runs.

Output (layout and reader: :mod:`qmuon_lightning.data.token_corpus`): each document's ids, then the
tokenizer's EOS id (``--eos append``, the default), concatenated in the source's order into
``train.bin`` or ``val.bin`` as ``uint16`` (``uint32`` for vocabularies over 65,535).

Why the split is by document content: a document goes to validation when a keyed BLAKE2b hash of
its UTF-8 text (key: ``--seed``) falls in the first ``--val-fraction`` of the hash range. The
decision depends on nothing else, so it is the same with any number of workers, for any
``--max-documents`` slice, and exact duplicates land on the same side (no train/val leakage
through copies). If no document falls in validation the last one is moved there (if all do, the
first goes to training), so both files are never empty.

Determinism: the same request (tokenizer, sources, options; see :func:`prepare_corpus`) writes the
same bytes; ``meta.json`` records SHA-256 hashes of both files. Safety: files are written as
``*.partial`` and renamed; ``meta.json`` comes last, so a directory with ``meta.json`` is complete.
A directory that already holds a corpus from the same request is left as it is (a message says
so); one from a different request, or ``.bin`` files that another program wrote, is never
overwritten.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .token_corpus import (CORPUS_FORMAT, CORPUS_VERSION, META_NAME, SPLIT_FILES, read_token_corpus_meta,
                           token_dtype)

__all__ = ["prepare_corpus", "main", "CorpusExistsError", "is_validation_document"]

_INSTALL_HINT = 'pip install "qmuon-lightning[data]"'
#: Present while finished .bin files are being renamed into place and meta.json is not written yet:
#: it marks the .bin files of an interrupted run as ours (safe to replace).
_INCOMPLETE_MARKER = ".qmuon-prepare-incomplete"


class CorpusExistsError(FileExistsError):
    """The output directory holds a different corpus (or foreign ``.bin`` files)."""


def _require_data_extra() -> tuple[Any, Any]:
    try:
        import datasets
        import transformers
    except ImportError as err:
        raise ImportError(f"qmuon-prepare needs the Hugging Face libraries of the 'data' extra ({err.name} is not "
                          f"installed): {_INSTALL_HINT}") from err
    return datasets, transformers


def is_validation_document(text: str, val_fraction: float, seed: int = 0) -> bool:
    """Whether a document goes to validation: keyed BLAKE2b of its UTF-8 text < ``val_fraction * 2**64``."""
    h = hashlib.blake2b(text.encode("utf-8"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(h, "big") < val_fraction * 2**64


def _tokenize_batch(batch: dict[str, list], *, tokenizer: Any, text_field: str, eos_id: int | None,
                    val_fraction: float, seed: int) -> dict[str, list]:
    texts = batch[text_field]
    enc = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    suffix = [eos_id] if eos_id is not None else []
    return {
        "ids": [list(ids) + suffix for ids in enc],
        "val": [is_validation_document(t, val_fraction, seed) for t in texts],
    }


def _keep_nonempty(batch: dict[str, list], *, text_field: str) -> list[bool]:
    return [isinstance(t, str) and t != "" for t in batch[text_field]]


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _tokenizer_identity(tokenizer: Any, name: str) -> dict[str, Any]:
    """Name, class, size and a SHA-256 of the tokenizer's full serialization (vocabulary, merges,
    normalizer, special tokens): two tokenizers that tokenize differently hash differently."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        blob = backend.to_str()
    else:  # a slow (Python) tokenizer: its vocabulary is the best available identity
        blob = json.dumps(sorted(tokenizer.get_vocab().items()))
    return {"name_or_path": name, "class": type(tokenizer).__name__, "len": len(tokenizer),
            "sha256": hashlib.sha256(blob.encode()).hexdigest()}


def _describe_request(request: dict[str, Any]) -> str:
    src = request["source"]
    if src["kind"] == "text":
        unit = {"document": "file", "paragraph": "paragraph", "line": "line"}[src["sample_by"]]
        what = f"{len(src['files'])} local text file(s), one document per {unit}"
    else:
        what = f"dataset {src['name']}" + (f" ({src['config']})" if src.get("config") else "") + f", split {src['split']}"
        what += f", field {src['text_field']!r}"
    if src.get("max_documents") is not None:
        what += f", first {src['max_documents']:,} documents"
    return what


def _differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            short = lambda v: (json.dumps(v)[:80] + "...") if len(json.dumps(v)) > 80 else json.dumps(v)  # noqa: E731
            out.append(f"{prefix}{k}: {short(a)} -> {short(b)}")
    return out


def _check_out_dir(out: Path, request: dict[str, Any], fingerprint: str) -> dict[str, Any] | None:
    """The existing meta.json if ``out`` holds this request's corpus; ``None`` if ``out`` may be
    written; raises :class:`CorpusExistsError` otherwise."""
    meta_path = out / META_NAME
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            old = {}
        if old.get("request_fingerprint") == fingerprint:
            try:
                return read_token_corpus_meta(out)  # also checks that the .bin files are whole
            except (ValueError, FileNotFoundError) as err:
                raise CorpusExistsError(f"{out} holds this corpus' meta.json but its files are damaged ({err}). "
                                        "Delete the directory and run qmuon-prepare again.") from err
        diff = _differences(old.get("request", {}), request)
        raise CorpusExistsError(
            f"{out} already holds a different corpus ({'; '.join(diff) or 'unreadable meta.json'}). "
            "qmuon-prepare never overwrites one: choose another --out, or delete that directory first.")
    bins = [out / n for n in SPLIT_FILES.values() if (out / n).exists()]
    if bins and not (out / _INCOMPLETE_MARKER).exists():
        raise CorpusExistsError(
            f"{out} has {', '.join(b.name for b in bins)} but no {META_NAME}: files another program wrote, not an "
            "interrupted qmuon-prepare run. Choose another --out, or move those files away.")
    return None


def _load_documents(datasets: Any, args: dict[str, Any]) -> Any:
    """A ``datasets.Dataset`` with the text column, ready for ``map`` with ``num_proc``."""
    src = args["source"]
    if src["kind"] == "text":
        ds = datasets.load_dataset("text", data_files=[f["path"] for f in src["files"]], split="train",
                                   sample_by=src["sample_by"], keep_linebreaks=True, cache_dir=args["cache_dir"])
    else:
        path = Path(os.path.expanduser(src["name"]))
        if path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file()):
            ds = datasets.load_from_disk(str(path))  # a Dataset / DatasetDict written by save_to_disk
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[src["split"]]
        elif args["streaming"]:
            # Stream only the documents asked for (e.g. a slice of a 10B-token dataset), then
            # materialize them in the cache so map() can use worker processes.
            stream = datasets.load_dataset(src["name"], src.get("config"), split=src["split"], revision=src["revision"],
                                           streaming=True)
            if src.get("max_documents") is not None:
                stream = stream.take(src["max_documents"])
            field = src["text_field"]

            def gen():
                for ex in stream:
                    yield {field: ex[field]}

            ds = datasets.Dataset.from_generator(
                gen, features=datasets.Features({field: datasets.Value("string")}), cache_dir=args["cache_dir"],
                fingerprint=hashlib.sha256(json.dumps(src, sort_keys=True).encode()).hexdigest()[:16])
        else:
            ds = datasets.load_dataset(src["name"], src.get("config"), split=src["split"], revision=src["revision"],
                                       cache_dir=args["cache_dir"], num_proc=args["workers"] if args["workers"] > 1 else None)
        if src["text_field"] not in ds.column_names:
            raise ValueError(f"the dataset has no column {src['text_field']!r} (columns: {ds.column_names}); "
                             "name the text column with --text-field")
    if src.get("max_documents") is not None and len(ds) > src["max_documents"]:
        ds = ds.select(range(src["max_documents"]))
    return ds


def prepare_corpus(
    *,
    tokenizer: str,
    out: str | os.PathLike,
    text: Sequence[str] | None = None,
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    text_field: str = "text",
    revision: str | None = None,
    sample_by: str = "document",
    max_documents: int | None = None,
    streaming: bool = False,
    val_fraction: float = 0.005,
    seed: int = 0,
    eos: str = "append",
    workers: int = 1,
    batch_size: int = 1000,
    cache_dir: str | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenize ``text`` files or a ``dataset`` with ``tokenizer`` into ``out``; return the meta.json dict.

    The *request* (what decides the output bytes) is: the tokenizer (name and a hash of its
    serialization), the sources (local files: path, size and SHA-256 of each, and ``sample_by``;
    a dataset: name, config, split, revision, text field, ``max_documents``, ``streaming``), and
    ``val_fraction``, ``seed``, ``eos``. ``workers``, ``batch_size`` and ``cache_dir`` change only the
    speed. Its hash is ``meta.json``'s ``request_fingerprint``: preparing the same request into the
    same directory again does nothing.
    """
    if (text is None) == (dataset is None):
        raise ValueError("give exactly one source: --text FILES... or --dataset NAME_OR_PATH")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    if workers < 1 or batch_size < 1:
        raise ValueError("--workers and --batch-size must be positive")
    if max_documents is not None and max_documents < 2:
        raise ValueError("--max-documents must be at least 2 (one training and one validation document)")
    if eos not in ("append", "none"):
        raise ValueError(f"--eos must be 'append' or 'none', got {eos!r}")
    if sample_by not in ("document", "paragraph", "line"):
        raise ValueError(f"--sample-by must be document, paragraph or line, got {sample_by!r}")
    datasets, transformers = _require_data_extra()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # map() forks workers; they tokenize in parallel

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer)
    vocab_size = len(tok)
    eos_id = None
    if eos == "append":
        eos_id = tok.eos_token_id
        if eos_id is None:
            raise ValueError(f"the tokenizer {tokenizer!r} has no eos_token to append after each document; "
                             "pass --eos none, or use a tokenizer that defines one")
    if text is not None:
        from .datamodule import _expand_paths  # same glob / directory rules as data.source=text

        files = _expand_paths(list(text))
        source = {"kind": "text", "sample_by": sample_by, "max_documents": max_documents,
                  "files": [{"path": str(f.resolve()), "bytes": f.stat().st_size, "sha256": _sha256_file(f)} for f in files]}
    else:
        source = {"kind": "dataset", "name": dataset, "config": dataset_config, "split": split, "revision": revision,
                  "text_field": text_field, "max_documents": max_documents, "streaming": streaming}
    request = {
        "tokenizer": _tokenizer_identity(tok, tokenizer),
        "source": source,
        "val_fraction": val_fraction,
        "seed": seed,
        "eos": eos,
    }
    fingerprint = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()
    out_dir = Path(os.path.expanduser(str(out)))
    existing = _check_out_dir(out_dir, request, fingerprint) if out_dir.exists() else None
    if existing is not None:
        print(f"qmuon-prepare: {out_dir} already holds this corpus ({existing['tokens']['train']:,} train / "
              f"{existing['tokens']['val']:,} val tokens); nothing to do.")
        return existing
    out_dir.mkdir(parents=True, exist_ok=True)

    field = "text" if text is not None else text_field
    ds = _load_documents(datasets, {"source": source, "streaming": streaming, "cache_dir": cache_dir,
                                    "workers": workers})
    num_proc = workers if workers > 1 and len(ds) >= 2 * workers else None
    ds = ds.filter(_keep_nonempty, batched=True, batch_size=batch_size, num_proc=num_proc,
                   fn_kwargs={"text_field": field}, desc="dropping empty documents")
    if len(ds) < 2:
        raise ValueError(f"the source has {len(ds)} non-empty document(s); at least 2 are needed (one for training, "
                         "one for validation). For one large file use --sample-by paragraph or line.")
    # The tokenized ids go to the datasets cache in the output dtype (GPT-2: 2 bytes per token, so the
    # cache holds about as much as train.bin + val.bin), not as Python's int64.
    list_feature = getattr(datasets, "List", None) or datasets.Sequence  # List: datasets >= 4
    features = datasets.Features({"ids": list_feature(datasets.Value(token_dtype(vocab_size))),
                                  "val": datasets.Value("bool")})
    ds = ds.map(_tokenize_batch, batched=True, batch_size=batch_size, num_proc=num_proc, remove_columns=ds.column_names,
                features=features, desc=f"tokenizing with {tokenizer}",
                fn_kwargs={"tokenizer": tok, "text_field": field, "eos_id": eos_id, "val_fraction": val_fraction,
                           "seed": seed})
    meta = _write_corpus(ds, out_dir, vocab_size=vocab_size, progress=progress)
    meta.update({
        "format": CORPUS_FORMAT,
        "version": CORPUS_VERSION,
        "tokenizer": request["tokenizer"],
        "vocab_size": vocab_size,
        "eos": {"appended": eos_id is not None, "token": tok.eos_token if eos_id is not None else None, "id": eos_id},
        "source": _describe_request(request),
        "split_rule": (f"a document is validation when keyed BLAKE2b-64 of its UTF-8 text (key str(seed)={seed!r}) "
                       f"< {val_fraction} * 2**64; if none is, the last document is"),
        "request": request,
        "request_fingerprint": fingerprint,
        "versions": {"datasets": datasets.__version__, "transformers": transformers.__version__,
                     "tokenizers": _version("tokenizers")},
    })
    _write_json_atomic(out_dir / META_NAME, meta)
    (out_dir / _INCOMPLETE_MARKER).unlink(missing_ok=True)
    print(f"qmuon-prepare: wrote {out_dir}: {meta['tokens']['train']:,} train / {meta['tokens']['val']:,} val tokens "
          f"({meta['documents']['train']:,} / {meta['documents']['val']:,} documents), {meta['dtype']}, vocabulary "
          f"{vocab_size:,}")
    return meta


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _write_json_atomic(path: Path, obj: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_corpus(ds: Any, out_dir: Path, *, vocab_size: int, progress: bool) -> dict[str, Any]:
    """Stream the tokenized documents into ``train.bin`` / ``val.bin`` (as ``*.partial``, then renamed)."""
    import pyarrow as pa  # a dependency of datasets

    dtype = np.dtype(token_dtype(vocab_size))
    n_docs = len(ds)
    if ds._indices is not None:  # map() output has none; a select() / filter() view would
        ds = ds.flatten_indices()
    flags = np.asarray(ds.data.column("val").to_numpy(), dtype=bool)
    forced_val = n_docs - 1 if not flags.any() else None
    forced_train = 0 if flags.all() else None
    partial = {s: out_dir / (n + ".partial") for s, n in SPLIT_FILES.items()}
    hashes = {s: hashlib.sha256() for s in SPLIT_FILES}
    tokens = {s: 0 for s in SPLIT_FILES}
    docs = {s: 0 for s in SPLIT_FILES}
    try:
        from tqdm.auto import tqdm  # a dependency of datasets

        bar = tqdm(total=n_docs, unit="doc", desc="writing train.bin / val.bin", disable=not progress)
        with open(partial["train"], "wb") as f_train, open(partial["val"], "wb") as f_val:
            files = {"train": f_train, "val": f_val}
            start = 0
            for batch in ds.with_format("arrow").iter(batch_size=8192):
                n = batch.num_rows
                is_val = flags[start: start + n].copy()
                if forced_val is not None and start <= forced_val < start + n:
                    is_val[forced_val - start] = True
                if forced_train is not None and start <= forced_train < start + n:
                    is_val[forced_train - start] = False
                col = batch.column("ids")
                col = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
                ids = col.flatten().to_numpy(zero_copy_only=False)
                lengths = col.value_lengths().to_numpy(zero_copy_only=False)
                if ids.size and int(ids.max()) >= vocab_size:
                    raise ValueError(f"token id {int(ids.max())} >= vocabulary size {vocab_size}: the tokenizer "
                                     "returned an id outside len(tokenizer)")
                mask = np.repeat(is_val, lengths)
                for split, sel in (("train", ~mask), ("val", mask)):
                    chunk = ids[sel].astype(dtype).tobytes()
                    files[split].write(chunk)
                    hashes[split].update(chunk)
                    tokens[split] += int(sel.sum())
                docs["val"] += int(is_val.sum())
                docs["train"] += int(n - is_val.sum())
                start += n
                bar.update(n)
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
        bar.close()
        # Finished .bin files replace any from an interrupted run; meta.json (written by the caller)
        # is what makes the directory a corpus, and the marker says these files are ours until then.
        (out_dir / _INCOMPLETE_MARKER).touch()
        for split, name in SPLIT_FILES.items():
            os.replace(partial[split], out_dir / name)
    finally:
        for p in partial.values():
            p.unlink(missing_ok=True)
    return {
        "dtype": dtype.name,
        "tokens": tokens,
        "documents": docs,
        "sha256": {s: h.hexdigest() for s, h in hashes.items()},
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qmuon-prepare",
        description="Tokenize local text files or a Hugging Face dataset into DIR/train.bin, DIR/val.bin and "
                    "DIR/meta.json for qmuon-train --data.source=tokens --data.paths=[DIR]. Needs: "
                    f"{_INSTALL_HINT}.")
    p.add_argument("--tokenizer", required=True, help="AutoTokenizer name (e.g. gpt2) or a saved tokenizer directory")
    p.add_argument("--out", required=True, help="output directory (created; an existing different corpus is refused)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", nargs="+", metavar="FILE_OR_GLOB", help="local text files, directories or glob patterns")
    src.add_argument("--dataset", metavar="NAME_OR_PATH", help="Hub dataset id (e.g. HuggingFaceFW/fineweb-edu) or a "
                     "local dataset directory / save_to_disk output")
    p.add_argument("--dataset-config", "--name", dest="dataset_config", help="dataset configuration (e.g. sample-10BT)")
    p.add_argument("--split", default="train", help="dataset split (default: train)")
    p.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    p.add_argument("--revision", help="dataset revision (commit or tag) to pin, so a rerun reads the same data")
    p.add_argument("--streaming", action="store_true", help="stream the dataset instead of downloading it whole "
                   "(use with --max-documents to prepare a slice)")
    p.add_argument("--max-documents", type=int, help="use only the first N documents of the source")
    p.add_argument("--sample-by", default="document", choices=("document", "paragraph", "line"),
                   help="--text: one document per file (default), per blank-line-separated paragraph, or per line")
    p.add_argument("--val-fraction", type=float, default=0.005, help="share of documents held out (default: 0.005)")
    p.add_argument("--seed", type=int, default=0, help="key of the document hash that decides the split (default: 0)")
    p.add_argument("--eos", default="append", choices=("append", "none"),
                   help="append the tokenizer's EOS id after every document (default) or nothing")
    p.add_argument("--workers", type=int, default=1, help="processes for tokenization (datasets.map num_proc)")
    p.add_argument("--batch-size", type=int, default=1000, help="documents per map() batch (default: 1000)")
    p.add_argument("--cache-dir", help="datasets cache directory (default: the datasets library's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar while writing")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``qmuon-prepare``."""
    parser = _parser()
    a = parser.parse_args(argv)
    try:
        prepare_corpus(tokenizer=a.tokenizer, out=a.out, text=a.text, dataset=a.dataset, dataset_config=a.dataset_config,
                       split=a.split, text_field=a.text_field, revision=a.revision, sample_by=a.sample_by,
                       max_documents=a.max_documents, streaming=a.streaming, val_fraction=a.val_fraction, seed=a.seed,
                       eos=a.eos, workers=a.workers, batch_size=a.batch_size, cache_dir=a.cache_dir,
                       progress=not a.no_progress)
    except (ImportError, ValueError, FileNotFoundError, CorpusExistsError) as err:
        parser.exit(2, f"qmuon-prepare: error: {err}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
