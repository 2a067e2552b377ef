"""Build, load and register the compiled kernels in ``csrc/`` behind ``torch.ops.qmuon.*``.

Layers
------
``csrc/qmuon/block_math.h``  per-element / per-block maths (dequantize, momentum lerp, absmax,
                             requantize, stochastic-rounding hash), ``__host__ __device__``
``csrc/qmuon/kernels.h``     C ABI of the kernels: raw pointers, row strides, a ``cudaStream_t``
``csrc/cpu/q8_cpu.cpp``      CPU kernels (``at::parallel_for``, loops g++ vectorizes)
``csrc/cuda/q8_cuda.cu``     CUDA kernels (no torch headers; compile-checked with plain nvcc)
``csrc/binding*.cpp``        the ``qmuon_C`` operator library: schemas, argument checks, CPU
                             implementations, and (``binding_cuda.cpp``, only when torch has CUDA)
                             CUDA implementations. ``qmuon_C`` is internal: its
                             ``q8_momentum_update_multi_`` writes the block sums of squares into the
                             caller's ``block_sumsq`` outputs like the public op, and also takes
                             ``compute_sumsq=True`` (the benchmark turns it off, with an empty
                             ``block_sumsq``, to price the fused sums of squares).

Registration
------------
``torch.ops.qmuon.*`` stays the single entry point: those ops are declared in Python
(:mod:`._library`, ``torch.library.custom_op``) with the pure-PyTorch reference as their default.
:func:`register_compiled_kernels` adds ``register_kernel("cpu")`` (and ``"cuda"`` when torch has
CUDA) implementations that call ``torch.ops.qmuon_C.*``. The extension is built and loaded lazily,
on the first call of one of those kernels (or of :func:`status` / ``qmuon_lightning.ops.backend()``);
if it cannot be built or loaded, the kernels run the reference and a warning says why, once.
Arguments the compiled kernels do not support (e.g. float64 grads, ``block_size`` > 4096) also run
the reference.

Sources
-------
An installed wheel ships ``csrc/`` as ``qmuon_lightning/_csrc`` (pyproject.toml maps it into the
package); a source checkout / editable install uses the repository's ``csrc/``. See :func:`csrc_dir`.

Build
-----
Just in time with ``torch.utils.cpp_extension.load`` (ninja), into
``<torch extensions dir>/qmuon/<name>`` where the name carries a hash of the sources, the flags,
the torch / Python / CUDA versions and the CPU (the CPU kernels are built with ``-march=native``).
Prebuild with ``python -m qmuon_lightning.ops.build``. CPU code is compiled with
``-ffp-contract=off`` and CUDA code with ``--fmad=false`` (plus explicit ``__f*_rn`` intrinsics) so
that results equal the reference bit for bit.

Environment
-----------
``QMUON_BACKEND``      ``auto`` (default): compiled kernels when they build, else the reference with
                       a warning; ``reference``: never build, always the reference; ``extension``:
                       raise if the extension cannot be built.
``QMUON_CPU_ARCH``     value of ``-march`` (``-mcpu`` on arm64) for the CPU kernels; default
                       ``native``; empty for the compiler's default.
``QMUON_BUILD_CUDA``   ``0`` to build the CPU kernels only even when torch has CUDA.
``QMUON_BUILD_VERBOSE`` ``1`` to show the compiler commands.
``TORCH_EXTENSIONS_DIR``, ``MAX_JOBS``, ``TORCH_CUDA_ARCH_LIST``, ``CUDA_HOME``: as for
``torch.utils.cpp_extension``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["ExtensionStatus", "status", "backend", "register_compiled_kernels", "csrc_dir", "MAX_BLOCK_SIZE"]

MAX_BLOCK_SIZE = 4096  # csrc/qmuon/block_math.h: kMaxBlockSize
_LIB = "qmuon_C"
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CODE_DTYPES = (torch.int8, torch.uint8)

_CPU_SOURCES = ("binding.cpp", "cpu/q8_cpu.cpp")
_CUDA_SOURCES = ("binding_cuda.cpp", "cuda/q8_cuda.cu")
_HEADERS = ("binding_common.h", "qmuon/block_math.h", "qmuon/kernels.h")


@dataclass(frozen=True)
class ExtensionStatus:
    """What ``torch.ops.qmuon`` runs. ``backend``: ``"reference"``, ``"cpu-extension"`` or
    ``"cpu+cuda-extension"``; ``reason``: why the reference (or no CUDA kernel) is used, if so;
    ``library``: path of the loaded shared library."""

    backend: str
    reason: str | None = None
    library: str | None = None

    @property
    def cpu(self) -> bool:
        return self.backend != "reference"

    @property
    def cuda(self) -> bool:
        return self.backend == "cpu+cuda-extension"


_lock = threading.RLock()
_status: ExtensionStatus | None = None


def _source_dirs() -> tuple[Path, Path]:
    """Where the kernel sources may be: ``qmuon_lightning/_csrc`` of an installed wheel (the
    repository's ``csrc/`` mapped into the package, see pyproject.toml), then ``csrc/`` next to the
    package in a source checkout / editable install."""
    pkg = Path(__file__).resolve().parents[1]
    return pkg / "_csrc", pkg.parent / "csrc"


def csrc_dir() -> Path:
    """The directory of the kernel sources (``binding.cpp``, ``cpu/``, ``cuda/``, ``qmuon/``): the
    installed package's ``_csrc`` if present, else the source tree's ``csrc/``. When neither has
    them, the installed location (what the "not found" message names)."""
    dirs = _source_dirs()
    for d in dirs:
        if (d / "binding.cpp").is_file():
            return d
    return dirs[0]


def _mode() -> str:
    mode = os.environ.get("QMUON_BACKEND", "auto").strip().lower() or "auto"
    if mode not in ("auto", "reference", "extension"):
        raise ValueError(f"QMUON_BACKEND must be 'auto', 'reference' or 'extension', got {mode!r}")
    return mode


def _cpu_arch_flags() -> list[str]:
    arch = os.environ.get("QMUON_CPU_ARCH", "native").strip()
    if not arch or sys.platform == "win32":
        return []
    if platform.machine().lower() in ("arm64", "aarch64"):
        return [f"-mcpu={arch}"]
    return [f"-march={arch}"]


def _cpu_fingerprint() -> str:
    """Identifies the CPU a ``-march=native`` build is for (so a shared cache never hands one
    machine's binary to another kind of CPU)."""
    parts = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part", "CPU implementer"):
                    parts.append(line.strip())
                if line.strip() == "":  # first processor is enough
                    break
    except OSError:
        pass
    return "\n".join(parts)


def _cuda_wanted() -> tuple[bool, str | None]:
    """Whether to compile the CUDA kernels, and if not, why (None when torch has no CUDA)."""
    if torch.version.cuda is None:
        return False, None
    if os.environ.get("QMUON_BUILD_CUDA", "1").strip() == "0":
        return False, "QMUON_BUILD_CUDA=0"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return False, "no CUDA toolkit (nvcc) found; set CUDA_HOME"
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return False, "no CUDA device visible and TORCH_CUDA_ARCH_LIST unset"
    return True, None


def _build_spec(with_cuda: bool) -> dict[str, Any]:
    src = csrc_dir()
    files = list(_CPU_SOURCES) + (list(_CUDA_SOURCES) if with_cuda else [])
    cflags = ["-O3", "-ffp-contract=off", "-fopenmp", *_cpu_arch_flags()]
    cuda_cflags = ["-O3", "--fmad=false", "-lineinfo"]
    ldflags = ["-fopenmp"]
    h = hashlib.sha256()
    for rel in files + list(_HEADERS):
        h.update(rel.encode())
        h.update((src / rel).read_bytes())
    for item in (cflags, cuda_cflags, ldflags, torch.__version__, torch.version.cuda, sys.version_info[:2],
                 _cpu_fingerprint() if _cpu_arch_flags() else "", os.environ.get("TORCH_CUDA_ARCH_LIST", "")):
        h.update(repr(item).encode())
    name = f"{_LIB}_{'cuda' if with_cuda else 'cpu'}_{h.hexdigest()[:12]}"
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return dict(
        name=name,
        sources=[str(src / f) for f in files],
        extra_cflags=cflags,
        extra_cuda_cflags=cuda_cflags,
        extra_ldflags=ldflags,
        extra_include_paths=[str(src)],
        build_directory=os.path.join(root, "qmuon", name),
        with_cuda=with_cuda,
    )


def _build_and_load(with_cuda: bool, verbose: bool) -> str:
    from torch.utils.cpp_extension import load

    spec = _build_spec(with_cuda)
    os.makedirs(spec["build_directory"], exist_ok=True)
    so = os.path.join(spec["build_directory"], spec["name"] + ".so")
    fresh = not os.path.exists(so)
    if fresh:
        what = "CPU and CUDA" if with_cuda else "CPU"
        print(f"qmuon_lightning: compiling the {what} kernels (csrc/) into {spec['build_directory']}; "
              "the first build takes a minute or more ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    path = load(is_python_module=False, verbose=verbose, **spec)
    if fresh:
        print(f"qmuon_lightning: kernels built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return str(path) if path else so


def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{_LIB}::q8_momentum_update_multi_", "CUDA")


def _short(err: BaseException, limit: int = 1500) -> str:
    text = f"{type(err).__name__}: {err}".strip().rstrip(".")
    return text if len(text) <= limit else "... " + text[-limit:]


def _load(verbose: bool) -> ExtensionStatus:
    mode = _mode()
    if mode == "reference":
        return ExtensionStatus("reference", "QMUON_BACKEND=reference")
    if not (csrc_dir() / "binding.cpp").is_file():
        reason = (f"kernel sources not found at {csrc_dir()} (reinstall qmuon-lightning, whose wheel ships "
                  "them as qmuon_lightning/_csrc, or use a source checkout)")
        return _fail(mode, reason)
    verbose = verbose or os.environ.get("QMUON_BUILD_VERBOSE", "") == "1"
    want_cuda, cuda_reason = _cuda_wanted()
    if want_cuda:
        try:
            path = _build_and_load(True, verbose)
            if _has_cuda_kernels():
                return ExtensionStatus("cpu+cuda-extension", None, path)
            cuda_reason = "the extension loaded but registered no CUDA kernels"
            return _partial(mode, ExtensionStatus("cpu-extension", cuda_reason, path))
        except Exception as err:  # noqa: BLE001 - any build failure falls back to the CPU build
            cuda_reason = f"building the CUDA kernels failed: {_short(err)}"
    try:
        path = _build_and_load(False, verbose)
    except Exception as err:  # noqa: BLE001
        return _fail(mode, f"building/loading the compiled kernels failed: {_short(err)}")
    st = ExtensionStatus("cpu-extension", cuda_reason, path)
    return _partial(mode, st) if cuda_reason else st


def _fail(mode: str, reason: str) -> ExtensionStatus:
    if mode == "extension":
        raise RuntimeError(f"qmuon_lightning: QMUON_BACKEND=extension but {reason}")
    warnings.warn(
        f"qmuon_lightning: using the pure-PyTorch reference kernels because {reason}. "
        "Set QMUON_BACKEND=reference to skip the build (and this warning).",
        RuntimeWarning,
        stacklevel=4,
    )
    return ExtensionStatus("reference", reason)


def _partial(mode: str, st: ExtensionStatus) -> ExtensionStatus:
    if mode == "extension" and torch.cuda.is_available():
        raise RuntimeError(f"qmuon_lightning: QMUON_BACKEND=extension but no CUDA kernels: {st.reason}")
    warnings.warn(
        f"qmuon_lightning: CUDA tensors use the pure-PyTorch reference kernels because {st.reason}.",
        RuntimeWarning,
        stacklevel=4,
    )
    return st


def status(verbose: bool = False) -> ExtensionStatus:
    """Load the compiled kernels (building them on first use) and say what ``torch.ops.qmuon`` runs."""
    global _status
    if _status is None:
        with _lock:
            if _status is None:
                _status = _load(verbose)
    return _status


def backend() -> str:
    """``"reference"``, ``"cpu-extension"`` or ``"cpu+cuda-extension"``."""
    return status().backend


# ---------------------------------------------------------------------------------------------
# Kernels registered on the torch.ops.qmuon custom ops
# ---------------------------------------------------------------------------------------------
def _compiled_for(device_type: str) -> bool:
    st = status()
    return st.cuda if device_type == "cuda" else st.cpu


def _q8_supported(codes, absmax, grads, block_sumsq, block_size: int) -> bool:
    if not 1 <= block_size <= MAX_BLOCK_SIZE:
        return False
    return all(
        c.dtype in _CODE_DTYPES and a.dtype == torch.float32 and g.dtype in _GRAD_DTYPES
        and s.dtype == torch.float32 and c.dim() == 2 and a.dim() == 2 and g.dim() == 2 and s.dim() == 2
        for c, a, g, s in zip(codes, absmax, grads, block_sumsq)
    )


def _make_kernels(device_type: str, defaults: dict[str, Callable]) -> dict[str, Callable]:
    # torch.ops.qmuon_C exists only once status() has loaded the library (first call).
    def q8_momentum_update_multi_(codes, absmax, grads, block_sumsq, beta, nesterov, block_size, streams,
                                  row_offsets):
        if _compiled_for(device_type) and _q8_supported(codes, absmax, grads, block_sumsq, block_size):
            torch.ops.qmuon_C.q8_momentum_update_multi_(
                codes, absmax, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets)
        else:
            defaults["q8_momentum_update_multi_"](
                codes, absmax, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets)

    def quantize_rows(x, block_size, signed, stream, row_offset):
        if (_compiled_for(device_type) and 1 <= block_size <= MAX_BLOCK_SIZE and x.dim() == 2
                and x.dtype in _GRAD_DTYPES):
            return torch.ops.qmuon_C.quantize_rows(x, block_size, signed, stream, row_offset)
        return defaults["quantize_rows"](x, block_size, signed, stream, row_offset)

    def dequantize_rows(codes, absmax, block_size):
        if (_compiled_for(device_type) and 1 <= block_size <= MAX_BLOCK_SIZE and codes.dim() == 2
                and codes.dtype in _CODE_DTYPES and absmax.dtype == torch.float32):
            return torch.ops.qmuon_C.dequantize_rows(codes, absmax, block_size)
        return defaults["dequantize_rows"](codes, absmax, block_size)

    return {
        "q8_momentum_update_multi_": q8_momentum_update_multi_,
        "quantize_rows": quantize_rows,
        "dequantize_rows": dequantize_rows,
    }


_registered = False


def register_compiled_kernels(ops: dict[str, Any]) -> None:
    """Register the compiled kernels on the ``torch.ops.qmuon`` custom ops (``name -> CustomOpDef``,
    from :mod:`._library`). Nothing is built here: the kernels load the extension on first call."""
    global _registered
    if _registered or os.environ.get("QMUON_BACKEND", "").strip().lower() == "reference":
        return
    # The default (reference) implementation of each op, to fall back on.
    defaults = {name: getattr(op, "_init_fn", None) for name, op in ops.items()}
    if any(fn is None for fn in defaults.values()):
        warnings.warn("qmuon_lightning: this torch version's custom_op has no default-implementation hook; "
                      "the compiled kernels are not registered and torch.ops.qmuon runs the reference.",
                      RuntimeWarning, stacklevel=2)
        return
    device_types = ["cpu"] + (["cuda"] if torch.version.cuda is not None else [])
    for device_type in device_types:
        kernels = _make_kernels(device_type, defaults)
        for name, op in ops.items():
            op.register_kernel(device_type, kernels[name])
    _registered = True


def _main(argv: list[str] | None = None) -> int:
    """``python -m qmuon_lightning.ops._extension``, kept for old scripts; use
    ``python -m qmuon_lightning.ops.build`` (this module is imported by the package, so running it
    with ``-m`` draws runpy's "found in sys.modules" warning)."""
    from qmuon_lightning.ops.build import main

    return main(argv)


if __name__ == "__main__":
    raise SystemExit(_main())
