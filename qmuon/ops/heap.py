"""Give heap memory that freed CPU tensors leave behind back to the operating system.

glibc serves allocations below its (dynamic) mmap threshold from the heap and keeps the pages of
freed blocks in the process's resident set. After its first large ``free`` it raises that threshold,
so the fp32 temporaries of an optimizer step (Newton-Schulz batches, dequantized momentum) come from
the heap and their pages stay resident after the step: the next forward and backward then stack
their own memory on top of pages that hold nothing. ``malloc_trim(0)`` releases every whole free page
(glibc >= 2.8 madvises the middle of the heap too), so resident memory follows what is live.

Released pages are faulted in again when the heap grows back, so this pays only where the freed
memory is not about to be reused: grasp4's update calls it (no measurable step-time cost); a trim
around every QMuon step doubled the step time of a d_model 512 model on a 2-core CPU and is not done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable

__all__ = ["release_freed_heap", "heap_release_available"]

_trim: Callable[[int], int] | None | bool = None


def _load_trim() -> Callable[[int], int] | bool:
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS, Windows): nothing to do
        return False
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def heap_release_available() -> bool:
    """Whether :func:`release_freed_heap` does anything here (glibc's ``malloc_trim`` found)."""
    global _trim
    if _trim is None:
        _trim = _load_trim()
    return bool(_trim)


def release_freed_heap() -> None:
    """Return the free pages of the C heap to the OS; a no-op where glibc is not the allocator."""
    if heap_release_available():
        _trim(0)  # type: ignore[operator]
