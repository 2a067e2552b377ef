"""Datasets for demos, tests and recipes: dependency-free byte corpora, and tokenized corpora that
``qmuon-prepare`` (:mod:`qmuon_lightning.data.prepare`, needs the ``data`` extra) writes."""

from .bytes_corpus import RandomWindowDataset, build_stdlib_corpus, fixed_windows
from .datamodule import ByteLMDataModule, ResumableWindowLoader, WindowSampler

__all__ = ["build_stdlib_corpus", "RandomWindowDataset", "fixed_windows", "ByteLMDataModule", "ResumableWindowLoader",
           "WindowSampler"]
