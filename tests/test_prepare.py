"""``qmuon-prepare`` (``qmuon_lightning.data.prepare``) and ``data.source=tokens``.

Everything is local: the text is generated here and the tokenizer is a byte-level BPE trained here
with ``tokenizers`` and saved as a ``PreTrainedTokenizerFast`` directory, which
``AutoTokenizer.from_pretrained`` loads as it would ``gpt2``.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from qmuon_lightning.data import ByteLMDataModule
from qmuon_lightning.data.prepare import CorpusExistsError, is_validation_document, main, prepare_corpus
from qmuon_lightning.data.token_corpus import CORPUS_FORMAT, CORPUS_VERSION, read_token_corpus_meta, token_dtype

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*LeafSpec", "ignore:.*does not have many workers", "ignore:.*GPU available but not used",
    "ignore:.*smaller than the logging interval", "ignore:.*os.fork")

WORDS = ("the quick brown fox jumps over a lazy dog while muon orthogonalizes the momentum of every hidden "
         "matrix in eight bits and four bits").split()
N_FILES = 8


@pytest.fixture(scope="module")
def corpus_src(tmp_path_factory) -> Path:
    """``N_FILES`` text files of pseudo-random sentences and a BPE tokenizer (vocabulary 320) trained on them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("src")
    rnd = random.Random(0)
    for i in range(N_FILES):
        lines = (" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(5, 15))) for _ in range(120))
        (root / f"doc{i}.txt").write_text("\n".join(lines) + "\n")
    (root / "empty.txt").write_text("")  # an empty document is dropped, not written as a lone EOS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in sorted(root.glob("doc*.txt"))], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(root / "tok")
    return root


def _prepare(src: Path, out: Path, *extra: str) -> None:
    main(["--tokenizer", str(src / "tok"), "--out", str(out), "--text", str(src / "*.txt"),
          "--cache-dir", str(out.parent / "hf-cache"), "--no-progress", *extra])


def _expected_splits(src: Path, val_fraction: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray, int]:
    """train / val ids built without datasets: each file tokenized by AutoTokenizer, EOS appended,
    split by the documented rule (keyed BLAKE2b of the text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src / "tok")
    train: list[int] = []
    val: list[int] = []
    for f in sorted(src.glob("*.txt")):
        text = f.read_text()
        if not text:
            continue
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        (val if is_validation_document(text, val_fraction, seed) else train).extend(ids)
    return np.array(train), np.array(val), len(tok)


def test_prepare_writes_the_documented_corpus(corpus_src, tmp_path):
    out = tmp_path / "corpus"
    _prepare(corpus_src, out, "--val-fraction", "0.25")
    meta = read_token_corpus_meta(out)
    train_ref, val_ref, vocab = _expected_splits(corpus_src, 0.25)
    assert len(val_ref) and len(train_ref), "the fixture must put documents on both sides at this fraction"
    train = np.fromfile(out / "train.bin", dtype=meta["dtype"])
    val = np.fromfile(out / "val.bin", dtype=meta["dtype"])
    np.testing.assert_array_equal(train, train_ref)
    np.testing.assert_array_equal(val, val_ref)
    assert meta["format"] == CORPUS_FORMAT and meta["version"] == CORPUS_VERSION
    assert meta["vocab_size"] == vocab == 320 and meta["dtype"] == "uint16"
    assert meta["tokens"] == {"train": train.size, "val": val.size}
    assert meta["documents"]["train"] + meta["documents"]["val"] == N_FILES  # empty.txt dropped
    assert meta["eos"]["appended"] and meta["eos"]["token"] == "<|endoftext|>"
    assert meta["tokenizer"]["name_or_path"] == str(corpus_src / "tok")
    for split in ("train", "val"):
        assert meta["sha256"][split] == hashlib.sha256((out / f"{split}.bin").read_bytes()).hexdigest()
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]


def test_prepare_is_deterministic_and_never_overwrites_another_corpus(corpus_src, tmp_path, capsys):
    one, two = tmp_path / "one", tmp_path / "two"
    _prepare(corpus_src, one, "--val-fraction", "0.25")
    _prepare(corpus_src, two, "--val-fraction", "0.25", "--workers", "2", "--batch-size", "3")
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name

    # The same request again: nothing is rewritten.
    before = {p.name: p.stat().st_mtime_ns for p in one.iterdir()}
    capsys.readouterr()
    _prepare(corpus_src, one, "--val-fraction", "0.25")
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in one.iterdir()} == before

    # A different request into the same directory is refused, naming what differs.
    with pytest.raises(SystemExit) as exc:
        _prepare(corpus_src, one, "--val-fraction", "0.5")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "different corpus" in err and "val_fraction: 0.25 -> 0.5" in err
    assert {p.name: p.stat().st_mtime_ns for p in one.iterdir()} == before

    # .bin files some other program wrote (no meta.json, no marker of an interrupted run) are kept.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "train.bin").write_bytes(b"\x01\x02")
    with pytest.raises(CorpusExistsError, match="another program"):
        prepare_corpus(tokenizer=str(corpus_src / "tok"), out=foreign, text=[str(corpus_src / "*.txt")],
                       cache_dir=str(tmp_path / "hf-cache"), progress=False)
    assert (foreign / "train.bin").read_bytes() == b"\x01\x02"


def test_interrupted_prepare_never_looks_complete(corpus_src, tmp_path, monkeypatch):
    """A crash after the .bin files are in place but before meta.json: the directory is refused by
    the reader and the datamodule, and the next qmuon-prepare replaces it."""
    import qmuon_lightning.data.prepare as prep

    out = tmp_path / "corpus"

    def crash(path, obj):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(prep, "_write_json_atomic", crash)
    with pytest.raises(OSError, match="simulated"):
        prepare_corpus(tokenizer=str(corpus_src / "tok"), out=out, text=[str(corpus_src / "*.txt")],
                       val_fraction=0.25, cache_dir=str(tmp_path / "hf-cache"), progress=False)
    assert (out / "train.bin").exists() and not (out / "meta.json").exists()
    assert not list(out.glob("*.partial"))
    with pytest.raises(FileNotFoundError, match="not a finished qmuon-prepare corpus"):
        ByteLMDataModule(source="tokens", paths=[str(out)])
    monkeypatch.undo()
    _prepare(corpus_src, out, "--val-fraction", "0.25")
    meta = read_token_corpus_meta(out)
    assert (out / "train.bin").stat().st_size == 2 * meta["tokens"]["train"]
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "train.bin", "val.bin"]

    # A truncated copy is caught by the size check.
    with open(out / "val.bin", "r+b") as f:
        f.truncate(2 * meta["tokens"]["val"] - 2)
    with pytest.raises(ValueError, match="truncated or from another corpus"):
        ByteLMDataModule(source="tokens", paths=[str(out)])


def test_prepare_from_a_local_dataset_with_a_text_field_and_a_slice(corpus_src, tmp_path):
    """``--dataset`` goes through ``datasets.load_dataset`` (here a local JSON-lines directory, as the
    Hub path would for a hub id), reads ``--text-field`` and keeps the first ``--max-documents``,
    also when streamed."""
    data_dir = tmp_path / "jsonl"
    data_dir.mkdir()
    docs = [f.read_text() for f in sorted(corpus_src.glob("doc*.txt"))]
    with open(data_dir / "part-0.jsonl", "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "content": d}) + "\n")
    out = tmp_path / "corpus"
    meta = prepare_corpus(tokenizer=str(corpus_src / "tok"), out=out, dataset=str(data_dir), text_field="content",
                          max_documents=5, val_fraction=0.25, cache_dir=str(tmp_path / "hf-cache"), progress=False)
    assert meta["documents"]["train"] + meta["documents"]["val"] == 5
    assert meta["documents"]["val"] >= 1  # the last document is moved to validation if no hash selects one
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(corpus_src / "tok")
    assert meta["tokens"]["train"] + meta["tokens"]["val"] == sum(
        len(tok(d, add_special_tokens=False)["input_ids"]) + 1 for d in docs[:5])
    with pytest.raises(ValueError, match="--text-field"):
        prepare_corpus(tokenizer=str(corpus_src / "tok"), out=tmp_path / "other", dataset=str(data_dir),
                       cache_dir=str(tmp_path / "hf-cache"), progress=False)

    # --streaming reads the same first documents through an IterableDataset: the same bytes.
    streamed = tmp_path / "streamed"
    prepare_corpus(tokenizer=str(corpus_src / "tok"), out=streamed, dataset=str(data_dir), text_field="content",
                   max_documents=5, streaming=True, val_fraction=0.25, cache_dir=str(tmp_path / "hf-cache"),
                   progress=False)
    for name in ("train.bin", "val.bin"):
        assert (streamed / name).read_bytes() == (out / name).read_bytes()


def test_missing_data_extra_names_the_install_command(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(SystemExit) as exc:
        main(["--tokenizer", "gpt2", "--out", str(tmp_path / "c"), "--text", str(tmp_path)])
    assert exc.value.code == 2
    assert 'pip install "qmuon-lightning[data]"' in capsys.readouterr().err


def test_package_does_not_import_the_data_extra_at_import_time():
    """No module of the package imports datasets / transformers / tokenizers at module level (only
    inside functions, when qmuon-prepare runs). Checked on the source because Lightning itself
    (torchmetrics) imports transformers whenever it is installed, so sys.modules cannot tell."""
    import ast

    import qmuon_lightning

    extra = {"datasets", "transformers", "tokenizers"}
    offenders = []
    for path in Path(qmuon_lightning.__file__).parent.rglob("*.py"):
        tree = ast.parse(path.read_text())
        stack = list(tree.body)
        while stack:  # module-level statements, including those under if / try / with
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                stack.extend(c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt))
                continue
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in extra]
    assert not offenders, offenders


def test_token_dtype_and_a_uint32_corpus(tmp_path):
    assert token_dtype(50257) == "uint16" and token_dtype(65535) == "uint16"
    assert token_dtype(65536) == "uint32" and token_dtype(151_936) == "uint32"
    # A hand-written uint32 corpus (vocabulary over 65,535) reads back through the datamodule.
    rng = np.random.default_rng(0)
    train = rng.integers(0, 100_000, 5000, dtype=np.uint32)
    val = rng.integers(0, 100_000, 500, dtype=np.uint32)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    meta = {"format": CORPUS_FORMAT, "version": CORPUS_VERSION, "dtype": "uint32", "vocab_size": 100_000,
            "tokens": {"train": 5000, "val": 500}, "tokenizer": {"name_or_path": "hand-made"}}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    dm = ByteLMDataModule(source="tokens", paths=[str(tmp_path)], seq_len=64, batch_size=2, val_windows=3)
    assert dm.vocab_size == 100_000 and dm.dtype == "uint32"
    dm.setup("fit")
    x, y = next(iter(dm.train_dataloader()))
    s = dm.train_dataloader().dataset.window_start(0)
    assert torch.equal(x[0], torch.from_numpy(train[s: s + 64].astype(np.int64)))
    vx, _ = dm.val_dataloader().dataset[0]
    vs = [i for i in range(500 - 64) if np.array_equal(val[i: i + 64], vx.numpy())]
    assert vs, "validation windows come from val.bin"
    with pytest.raises(ValueError, match="smaller than the corpus' vocabulary"):
        ByteLMDataModule(source="tokens", paths=[str(tmp_path)], vocab_size=50_000)
    with pytest.raises(ValueError, match="meta.json says 'uint32'"):
        ByteLMDataModule(source="tokens", paths=[str(tmp_path)], dtype="uint16")
    assert ByteLMDataModule(source="tokens", paths=[str(tmp_path)], vocab_size=100_032).vocab_size == 100_032


@pytest.mark.qmuon_train
def test_smoke_recipe_trains_on_a_prepared_corpus_with_its_vocabulary(corpus_src, tmp_path):
    """The issue's target: qmuon-prepare, then the smoke recipe with --data.source=tokens
    --data.paths=[DIR]; the model's vocabulary is meta.json's (linked, not configured)."""
    from qmuon_lightning.cli import QMuonCLI

    from _dist import REPO

    out = tmp_path / "corpus"
    _prepare(corpus_src, out, "--val-fraction", "0.25")
    vocab = read_token_corpus_meta(out)["vocab_size"]
    cli = QMuonCLI(args=[
        "fit", "--config", str(REPO / "recipes/cpu/smoke.yaml"), "--data.source=tokens", f"--data.paths=[{out}]",
        "--trainer.max_steps=3", f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--data.seq_len=32", "--data.batch_size=4", "--data.val_windows=4",
        "--trainer.val_check_interval=3",
    ])
    assert cli.trainer.global_step == 3
    assert vocab == 320 and cli.model.config.vocab_size == vocab
    assert cli.model.model.embed.num_embeddings == vocab and cli.model.model.lm_head.out_features == vocab
    assert torch.isfinite(cli.trainer.callback_metrics["val_loss"])
    assert cli.model.hparams["vocab_size"] == vocab  # a checkpoint rebuilds the same model

    # The smoke summary (printed and written) carries the run telemetry: tokens/s, MFU (n/a on
    # CPU), peak memory, grad norm; the same numbers are in summary.json.
    table = next((tmp_path / "run").glob("csv/version_*/summary.md")).read_text()
    summary = json.loads(next((tmp_path / "run").glob("csv/version_*/summary.json")).read_text())
    assert f"{summary['tokens_per_s']:,.0f} tokens/s" in table
    assert "MFU                n/a (cpu" in table and summary["mfu"] is None
    assert "peak memory" in table and summary["peak_memory_rss_bytes"] > 0
    assert summary["grad_norm_steps"] == 3 and f"{summary['grad_norm_final']:.4g} final" in table
    assert summary["flops_per_token"] > 6 * (summary["parameters"] - vocab * 128)  # attention term included
