"""Small, dependency-free datasets for demos and tests."""

from .bytes_corpus import RandomWindowDataset, StdlibCorpus, build_stdlib_corpus, fixed_windows

__all__ = ["StdlibCorpus", "build_stdlib_corpus", "RandomWindowDataset", "fixed_windows"]
