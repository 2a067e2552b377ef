"""Datasets for demos, tests and recipes: dependency-free byte corpora, and tokenized corpora that
``qmuon-prepare`` (:mod:`qmuon_lightning.data.prepare`, needs the ``data`` extra) writes."""

from .bytes_corpus import RandomWindowDataset, StdlibCorpus, build_stdlib_corpus, fixed_windows
from .datamodule import ByteLMDataModule, TokenWindowDataset
from .token_corpus import read_token_corpus_meta

__all__ = ["StdlibCorpus", "build_stdlib_corpus", "RandomWindowDataset", "fixed_windows", "ByteLMDataModule",
           "TokenWindowDataset", "read_token_corpus_meta"]
