"""Small, dependency-free datasets for demos and tests."""

from .bytes_corpus import RandomWindowDataset, StdlibCorpus, build_stdlib_corpus, fixed_windows
from .datamodule import ByteLMDataModule, ResumableWindowLoader, TokenWindowDataset, WindowSampler

__all__ = ["StdlibCorpus", "build_stdlib_corpus", "RandomWindowDataset", "fixed_windows", "ByteLMDataModule",
           "TokenWindowDataset", "ResumableWindowLoader", "WindowSampler"]
