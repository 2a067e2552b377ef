"""Offline LitGPT fixtures for tests/test_litgpt.py (and the tiny setup of docs/litgpt.md): a text
corpus written here, a byte-level BPE tokenizer trained on it with Hugging Face ``tokenizers``, a
LitGPT ``DataModule`` over a local text file, and a tiny GQA Llama config. Nothing is downloaded.

``LocalTextData`` is importable by LitGPT's CLI as ``--data _litgpt_support.LocalTextData`` when
tests/ is on ``PYTHONPATH``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

try:
    from litgpt.data import DataModule
except ImportError:  # the module is imported by test_litgpt.py, which skips without litgpt
    DataModule = object  # type: ignore[assignment,misc]

VOCAB = 320  # trained vocabulary (bytes + merges + 2 specials); the model pads it to 384
SEQ = 32

#: A tiny GQA Llama (LitGPT field names): 4 query heads sharing 2 key/value groups, head size 16.
TINY_CONFIG: dict[str, Any] = dict(
    name="tiny-qmuon-llama", block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=384, padding_multiple=64,
    n_layer=2, n_head=4, n_query_groups=2, n_embd=64, head_size=16, rotary_percentage=1.0,
    parallel_residual=False, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
    intermediate_size=128,
)


def write_corpus(path: Path, n_lines: int = 600, seed: int = 0) -> Path:
    """Sentences from a small grammar (learnable, so the loss falls within a few steps)."""
    rng = random.Random(seed)
    subjects = ["the cat", "a dog", "the model", "my friend", "the river", "a teacher", "the old man", "our team"]
    verbs = ["sees", "likes", "follows", "builds", "finds", "paints", "carries", "remembers"]
    objects = ["the house", "a small boat", "the red ball", "an idea", "the long road", "a quiet song", "the garden"]
    tails = ["today.", "in the morning.", "again and again.", "with care.", "before dinner.", "near the sea."]
    lines = [f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(tails)}"
             for _ in range(n_lines)]
    path.write_text("\n".join(lines) + "\n")
    return path


def train_tokenizer(corpus: Path, out_dir: Path, vocab_size: int = VOCAB) -> Path:
    """A byte-level BPE tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` naming bos/eos),
    the files LitGPT's ``Tokenizer`` reads from a checkpoint directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(corpus)], trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return out_dir


class _Chunks(torch.utils.data.Dataset):
    def __init__(self, chunks: torch.Tensor) -> None:
        self.chunks = chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.chunks[i]


@dataclass
class LocalTextData(DataModule):
    """Pretraining data from one local text file: tokenized once, cut into ``max_seq_length + 1``
    token windows (input and shifted target), 10% of them held out for validation."""

    path: Path = Path("corpus.txt")
    seed: int = 42
    num_workers: int = 0
    tokenizer: Any = field(default=None, init=False, repr=False)
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=-1, init=False, repr=False)

    def connect(self, tokenizer: Any = None, batch_size: int = 1, max_seq_length: int | None = -1) -> None:
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_seq_length = SEQ if max_seq_length in (None, -1) else int(max_seq_length)

    def setup(self, stage: str = "") -> None:
        if self.tokenizer is None:
            raise ValueError("LocalTextData needs a tokenizer: pass --tokenizer_dir to litgpt pretrain")
        ids = self.tokenizer.encode(Path(self.path).read_text(), eos=False).long()
        n = self.max_seq_length + 1
        chunks = ids[: len(ids) // n * n].view(-1, n)
        n_val = max(1, len(chunks) // 10)
        self._train, self._val = chunks[n_val:], chunks[:n_val]

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(self.seed)
        return DataLoader(_Chunks(self._train), batch_size=self.batch_size, shuffle=True, generator=g,
                          num_workers=self.num_workers, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Chunks(self._val), batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
