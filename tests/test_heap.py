"""``ops.heap.release_freed_heap``: freed CPU tensor memory that glibc keeps resident is returned."""

from __future__ import annotations

import platform

import pytest
import torch

from qmuon.ops.heap import heap_release_available, release_freed_heap


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                    reason="malloc_trim is glibc's; elsewhere release_freed_heap is a documented no-op")
def test_release_returns_freed_heap_pages() -> None:
    assert heap_release_available()
    # 64 KiB blocks sit below glibc's mmap threshold, so they come from the heap; keeping every 8th
    # one pins the heap top, so free() alone cannot shrink it and the freed pages stay resident.
    blocks = [torch.ones(16 * 1024) for _ in range(3200)]  # 200 MiB
    keep = blocks[::8]
    freed_bytes = sum(b.numel() * 4 for i, b in enumerate(blocks) if i % 8)
    del blocks
    before = _rss()
    release_freed_heap()
    after = _rss()
    # Whole free pages between the kept blocks go back; allow half for partial pages and glibc's
    # own bookkeeping (the release is all or nothing per page).
    assert before - after >= freed_bytes // 2, (before, after, freed_bytes)
    assert all(float(k[0]) == 1.0 for k in keep)  # live blocks untouched


def test_release_is_safe_to_call_repeatedly() -> None:
    for _ in range(3):
        release_freed_heap()
