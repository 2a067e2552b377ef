"""Prebuild the compiled kernels and report which backend ``torch.ops.qmuon`` uses.

    python -m qmuon.ops.build [--verbose]

Builds the extension from ``csrc/`` (or loads the cached build; see :mod:`._extension` for where
the sources and the build live and for the environment variables), then prints ``backend: ...``
(``reference``, ``cpu-extension`` or ``cpu+cuda-extension``), the library path, which vector loops
the CPU kernels have (``avx512`` or ``portable``) and, if any, why the reference (or no CUDA kernel)
is used.

Exit status: 0 when the compiled kernels load (or ``QMUON_BACKEND=reference`` asks for none); 1 when
they cannot be built or loaded: under ``QMUON_BACKEND=extension`` the error is printed, under
``auto`` the fallback to the reference is reported.

Nothing in the package imports this module, so ``python -m`` runs it without runpy's "found in
sys.modules" warning.
"""

from __future__ import annotations

import argparse
import sys

from qmuon.ops import _extension

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qmuon.ops.build",
        description="Build (or load the cached build of) the qmuon compiled kernels and report "
                    "which backend torch.ops.qmuon uses.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands")
    args = parser.parse_args(argv)
    try:
        mode = _extension._mode()
        st = _extension.status(verbose=args.verbose)
    except (RuntimeError, ValueError) as err:  # QMUON_BACKEND=extension and no build, or a bad QMUON_BACKEND
        print(f"backend: unavailable\nerror: {err}", file=sys.stderr)
        return 1
    print(f"backend: {st.backend}")
    if st.library:
        print(f"library: {st.library}")
    isa = _extension.cpu_vector_isa()
    if isa:
        flags = " ".join(_extension._cpu_arch_flags()) or "the compiler's default target"
        print(f"cpu loops: {isa} (built with {flags}; QMUON_CPU_ARCH sets it)")
    if st.cuda_source:
        print(f"cuda kernels: {st.cuda_source}")
    if st.reason:
        print(f"note: {st.reason}")
    for line in st.steps:
        print(f"loading order: {line}")
    return 0 if st.backend != "reference" or mode == "reference" else 1


if __name__ == "__main__":
    sys.exit(main())
