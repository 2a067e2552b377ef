"""Shared pytest configuration for the qmuon_lightning test suite.

The ``cuda`` and ``slow`` markers are declared in pyproject.toml; nothing is re-registered here.
"""

from __future__ import annotations

import pytest
import torch

# The suite uses small matrices. With intra-op parallelism on a small shared machine every op
# pays an OpenMP barrier: measured on the 2-core CI box under load, torch.floor on a 32x640
# tensor took 16 ms with 2 threads and 0.01 ms with 1. Results are compared only between runs
# in the same process, so the thread count never enters a tolerance.
torch.set_num_threads(1)

#: Decorator for tests that need a GPU: ``@requires_cuda``. Skips (never passes) without CUDA.
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``@pytest.mark.cuda`` are skipped (reported as skips) when no GPU is present,
    so GPU tests only need the marker and cannot silently run on CPU."""
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(requires_cuda)
