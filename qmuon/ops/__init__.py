"""The quantized-momentum ops.

Everything dispatches through ``torch.ops.qmuon.*`` (each op declared once in :mod:`._library`, with
its pure-PyTorch reference in :mod:`.reference` / :mod:`.reference_4bit` and, where it builds, a
compiled CPU / CUDA kernel from ``csrc/``; :func:`backend` says which runs). The multi-tensor update
ops write per-row-block sums of squares into a caller-allocated list: :func:`empty_block_sumsq`.
"""

from __future__ import annotations

from . import _library  # noqa: F401  (registers torch.ops.qmuon.*)
from . import reference, reference_4bit
from ._library_multi import empty_block_sumsq

__all__ = ["backend", "empty_block_sumsq", "loading_order", "reference", "reference_4bit"]


def backend() -> str:
    """Which implementation ``torch.ops.qmuon`` runs: ``"reference"`` (pure PyTorch),
    ``"cpu-extension"``, ``"cpu+cuda-extension"`` or ``"cuda-extension"`` (compiled kernels from
    ``csrc/``; arguments a kernel does not support, and an op that failed its first-use canary, still
    run the reference). The CUDA kernels come from the prebuilt GPU library when it serves, else from
    the JIT build (``qmuon.ops._extension.status()`` has the loading order). Builds the CPU kernels if
    they are not built yet (``QMUON_BACKEND=reference`` skips it)."""
    from ._extension import backend as _backend

    return _backend()


def loading_order() -> tuple[str, ...]:
    """The steps :func:`backend` went through, one line each, as ``qmuon-doctor`` shows them and the
    ``qmuon.ops`` logger logged them: ``"1. prebuilt GPU library: ..."`` (which file, or why none
    serves), ``"2. JIT build ..."`` (the compiled CPU kernels, and the CUDA ones where nvcc built
    them), and ``"3. ..."`` for whatever runs on the pure-PyTorch reference. Loads the kernels first,
    as :func:`backend` does."""
    from ._extension import status

    return status().steps
