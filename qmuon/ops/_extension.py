"""Build and load the compiled kernels in ``csrc/`` (the ``qmuon_C`` operator library).

This module only builds and loads; :mod:`._kernels` registers the loaded kernels on the
``torch.ops.qmuon`` ops (declared in :mod:`._library`), and ``python -m qmuon.ops.build``
(:mod:`.build`) is the command-line front end. Nothing is built at import: the first call of a
compiled kernel, :func:`status` or ``qmuon.ops.backend()`` builds (or loads the cached
build); if that fails the ops run the pure-PyTorch reference and a warning says why, once.

Sources (``csrc/``)
-------------------
``qmuon/block_math.h``, ``qmuon/block_math_4bit.h``  per-element / per-block maths, ``__host__ __device__``
``qmuon/kernels.h``          the kernels' C ABI: raw pointers, row strides, a ``cudaStream_t``
``cpu/*.cpp``, ``cuda/*.cu`` the kernels (the ``.cu`` files see no torch header)
``binding*.cpp``, ``binding*.h``  the ``qmuon_C`` schemas, argument checks and CPU / CUDA implementations

An installed wheel ships ``csrc/`` as ``qmuon/_csrc`` (pyproject.toml maps it into the
package); a source checkout uses the repository's ``csrc/`` (:func:`csrc_dir`).

Loading order (:func:`status`; ``status().steps`` says how it went)
-----------------------------------------------------------------
CUDA kernels: the prebuilt GPU library shipped in the wheel (:mod:`._prebuilt`, built by
:mod:`.build_gpu`, called through :mod:`._cabi`), else the JIT build below where nvcc exists, else
the reference (on a GPU with a warning that names the fix). CPU kernels: the JIT build, else the
reference.

Build
-----
Just in time with ``torch.utils.cpp_extension.load`` (ninja), in a child process with a time limit, into
``<torch extensions dir>/qmuon/<name>``; the name hashes the sources, the flags, the torch / Python /
CUDA versions and the CPU (the CPU kernels are built with ``-march=native``). CPU code is compiled
with ``-ffp-contract=off`` and CUDA code with ``--fmad=false`` (plus explicit ``__f*_rn``
intrinsics) so that results equal the reference bit for bit. ``-fno-math-errno`` only stops ``sqrtf``
from setting ``errno`` on negative inputs (its result is the same correctly rounded IEEE square root):
with errno, g++ puts a branch to the libm call in every loop with a square root (the AdamW kernel's),
and such a loop is not vectorized.

Environment
-----------
``QMUON_BACKEND``      ``auto`` (default): compiled kernels when they build, else the reference with
                       a warning; ``reference``: never build, always the reference; ``extension``:
                       raise if the extension cannot be built.
``QMUON_CPU_ARCH``     value of ``-march`` (``-mcpu`` on arm64) for the CPU kernels; default
                       ``native``; empty for the compiler's default.
``QMUON_BUILD_CUDA``   ``0`` to build the CPU kernels only even when torch has CUDA.
``QMUON_BUILD_VERBOSE`` ``1`` to show the compiler commands.
``QMUON_CSRC_DIR``     build from this copy of ``csrc/`` instead of the package's.
``QMUON_BUILD_WAIT_S`` how long a process waits for another one's build of the same sources
                       (default 1800; :mod:`.build_lock`).
``QMUON_BUILD_TIMEOUT_S`` how long a build may take before it is stopped with an error (default 1200):
                       the compilers run in a child process group that is killed at the limit.
``QMUON_GPU_LIB``      ``0``: do not use the prebuilt GPU library; a path: use that file (:mod:`._prebuilt`).
``QMUON_CANARY``       ``0``: skip the first-use check of each compiled op (:mod:`._canary`).
``TORCH_EXTENSIONS_DIR``, ``MAX_JOBS``, ``TORCH_CUDA_ARCH_LIST``, ``CUDA_HOME``: as for
``torch.utils.cpp_extension``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .build_lock import build_lock

__all__ = ["status", "cpu_vector_isa"]

_LIB = "qmuon_C"

_CPU_SOURCES = ("binding.cpp", "cpu/q8_cpu.cpp", "cpu/q4_cpu.cpp", "binding_weight.cpp", "cpu/weight_cpu.cpp",
                "binding_adamw.cpp", "cpu/adamw_cpu.cpp")
_CUDA_SOURCES = ("binding_cuda.cpp", "cuda/q8_cuda.cu", "cuda/q4_cuda.cu", "binding_weight_cuda.cpp", "cuda/weight_cuda.cu",
                 "binding_adamw_cuda.cpp", "cuda/adamw_cuda.cu")
_HEADERS = ("binding_common.h", "binding_4bit.h", "cpu/block_reduce_cpu.h", "qmuon/block_math.h",
            "qmuon/block_math_4bit.h", "qmuon/kernels.h", "qmuon/validate.h", "binding_weight.h",
            "qmuon/weight_kernels.h", "qmuon/weight_math.h", "binding_adamw.h", "qmuon/adamw_math.h",
            "qmuon/adamw_kernels.h", "cpu/vector_width.h", "qmuon/abi_layout.h")


@dataclass(frozen=True)
class ExtensionStatus:
    """What ``torch.ops.qmuon`` runs. ``backend``: ``"reference"``, ``"cpu-extension"``,
    ``"cpu+cuda-extension"`` or ``"cuda-extension"`` (CUDA kernels only: the CPU build failed);
    ``reason``: why the reference (or no CUDA kernel) is used, if so; ``library``: path of the loaded
    JIT-built library; ``cuda_source``: where the CUDA kernels come from, ``"prebuilt"`` (the GPU library
    shipped in the wheel, :mod:`._prebuilt`) or ``"jit"`` (compiled here with nvcc), None without them;
    ``gpu_library``: what was found of the prebuilt GPU library (also when it cannot serve, e.g. no
    device); ``steps``: the loading order as it went, one line per step (logged once, shown by
    ``qmuon-doctor`` and ``python -m qmuon.ops.build``)."""

    backend: str
    reason: str | None = None
    library: str | None = None
    cuda_source: str | None = None
    gpu_library: Any = None
    steps: tuple[str, ...] = ()

    @property
    def cpu(self) -> bool:
        return self.backend in ("cpu-extension", "cpu+cuda-extension")

    @property
    def cuda(self) -> bool:
        return self.backend in ("cpu+cuda-extension", "cuda-extension")


_log = logging.getLogger("qmuon.ops")
_lock = threading.RLock()
_status: ExtensionStatus | None = None


def _source_dirs() -> tuple[Path, ...]:
    """Where the kernel sources may be: ``$QMUON_CSRC_DIR`` when set (a patched copy; qmuon-doctor's
    tests point it at a broken one), else ``qmuon/_csrc`` of an installed wheel (the
    repository's ``csrc/`` mapped into the package, see pyproject.toml), then ``csrc/`` next to the
    package in a source checkout / editable install."""
    override = os.environ.get("QMUON_CSRC_DIR", "").strip()
    if override:
        return (Path(override).resolve(),)
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
    cflags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", *_cpu_arch_flags()]
    cuda_cflags = ["-O3", "--fmad=false", "-lineinfo"]
    ldflags = ["-fopenmp"]
    h = hashlib.sha256()
    # The source directory is part of the key: torch's build.ninja names absolute paths, so two
    # checkouts with identical sources sharing one build directory would make ninja rebuild
    # whenever the other one had built last (a silent 20 s stall in a first training step).
    h.update(str(src.resolve()).encode())
    # So is torch's install directory (build.ninja names its include paths): two venvs with the same
    # torch and sources otherwise rebuild in turn, each one's first step waiting minutes for the other's.
    h.update(os.path.realpath(os.path.dirname(torch.__file__)).encode())
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
        inputs=[str(src / f) for f in files + list(_HEADERS)],
    )


def _build_reason(so: str, inputs: list[str]) -> str | None:
    """Why ``torch.utils.cpp_extension.load`` is about to compile (None: it will only load).

    ninja rebuilds when an input is newer than its output, so a checkout that rewrote files with
    unchanged contents (the build key hashes contents) still costs a rebuild; say so up front."""
    if not os.path.exists(so):
        return "first build for these sources; it takes a minute or more"
    built = os.path.getmtime(so)
    newer = [p for p in inputs if os.path.getmtime(p) > built]
    if newer:
        return (f"{len(newer)} source file(s) are newer than the cached build (e.g. {os.path.basename(newer[0])}); "
                "rebuilding takes up to a minute")
    return None


TIMEOUT_ENV = "QMUON_BUILD_TIMEOUT_S"


def _build_timeout_s() -> float:
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    try:
        return float(raw) if raw else 1200.0
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None


def _compile_in_child(with_cuda: bool, verbose: bool, directory: str, lock_fd: int | None) -> None:
    """Compile in a child process (its own process group) that is killed, compilers and all, when it
    runs past ``QMUON_BUILD_TIMEOUT_S`` (default 1200 s): torch's ``load`` has no time limit, and a
    compiler that hangs (a stuck NFS mount, a machine swapping) would otherwise hang the first training
    step silently. The parent then loads the finished build (ninja finds nothing left to do).

    The child inherits the build lock's descriptor: if this process is killed, the child finishes the
    build still holding the lock, and the next process waits for it instead of building alongside it."""
    import signal
    import subprocess

    limit = _build_timeout_s()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = ("import sys\nfrom torch.utils.cpp_extension import load\nfrom qmuon.ops._extension import _build_spec\n"
            f"spec = _build_spec({with_cuda!r}); spec.pop('inputs')\n"
            f"try:\n    load(is_python_module=False, verbose={verbose!r}, **spec)\n"
            "except Exception as err:\n    print(f'{type(err).__name__}: {err}'); sys.exit(1)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, pass_fds=(lock_fd,) if lock_fd is not None else ())
    if lock_fd is not None:  # what a waiting process prints: the holder, and the compiler process
        holder = os.pread(lock_fd, 4096, 0).decode(errors="replace").strip()
        os.pwrite(lock_fd, f"{holder}, compiler process {proc.pid}".encode(), 0)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: ninja and every compiler it started
        proc.communicate()
        raise TimeoutError(
            f"qmuon: the kernel build in {directory} did not finish within {limit:.0f} s and was stopped. A loaded "
            f"or swapping machine builds slowly: set {TIMEOUT_ENV} higher (or MAX_JOBS lower), or build ahead with "
            "`python -m qmuon.ops.build`; QMUON_BACKEND=reference runs without compiled kernels") from None
    if verbose and out:
        print(out, file=sys.stderr, end="", flush=True)
    if proc.returncode != 0:  # the child printed load()'s error last (the compiler's output is in it)
        raise RuntimeError(out.strip() or f"the build process exited with {proc.returncode}")


def _build_and_load(with_cuda: bool, verbose: bool) -> str:
    from torch.utils.cpp_extension import load

    spec = _build_spec(with_cuda)
    inputs = spec.pop("inputs")
    so = os.path.join(spec["build_directory"], spec["name"] + ".so")
    # One process builds per machine; the others wait, then load its result (build_lock).
    with build_lock(spec["build_directory"]) as lock_fd:
        reason = _build_reason(so, inputs)
        if reason:
            what = "CPU and CUDA" if with_cuda else "CPU"
            _log.warning("qmuon: compiling the %s kernels (csrc/) into %s: %s (time limit %.0f s, %s) ...", what,
                         spec["build_directory"], reason, _build_timeout_s(), TIMEOUT_ENV)
            t0 = time.perf_counter()
            _compile_in_child(with_cuda, verbose, spec["build_directory"], lock_fd)
            _log.warning("qmuon: kernels built in %.0f s", time.perf_counter() - t0)
        path = load(is_python_module=False, verbose=verbose, **spec)
    return str(path) if path else so


def _has_cuda_kernels() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"{_LIB}::q8_momentum_update_multi_", "CUDA")


def _short(err: BaseException, limit: int = 1500) -> str:
    text = f"{type(err).__name__}: {err}".strip().rstrip(".")
    return text if len(text) <= limit else "... " + text[-limit:]


def _step(steps: list[str], line: str) -> None:
    steps.append(line)
    _log.info("qmuon: %s", line)


def _load(verbose: bool) -> ExtensionStatus:
    """The loading order: CUDA kernels from the prebuilt GPU library, else the JIT build where nvcc
    exists, else the reference; CPU kernels from the JIT build (g++), else the reference."""
    mode = _mode()
    if mode == "reference":
        return ExtensionStatus("reference", "QMUON_BACKEND=reference", steps=("QMUON_BACKEND=reference: the "
                                                                              "pure-PyTorch reference serves every op",))
    steps: list[str] = []
    from . import _prebuilt

    gpu = _prebuilt.load()
    cuda_source = "prebuilt" if gpu.usable else None
    _step(steps, f"1. prebuilt GPU library: {gpu.summary()}")
    want_cuda, cuda_reason = _cuda_wanted()
    if cuda_source:
        want_cuda, cuda_reason = False, None  # nothing to compile for CUDA
    elif torch.version.cuda is not None and not want_cuda:
        cuda_reason = f"no usable prebuilt GPU library ({gpu.reason}), and no JIT build: {cuda_reason}"
    if not (csrc_dir() / "binding.cpp").is_file():
        reason = (f"kernel sources not found at {csrc_dir()} (reinstall qmuon, whose wheel ships "
                  "them as qmuon/_csrc, or use a source checkout)")
        _step(steps, f"2. JIT build: {reason}")
        if cuda_source:
            return _partial_cpu(mode, ExtensionStatus("cuda-extension", reason, None, cuda_source, gpu, tuple(steps)))
        return _fail(mode, reason, gpu, steps)
    verbose = verbose or os.environ.get("QMUON_BUILD_VERBOSE", "") == "1"
    if want_cuda:
        try:
            path = _build_and_load(True, verbose)
            if _has_cuda_kernels():
                _step(steps, f"2. JIT build (CPU and CUDA kernels, nvcc): {path}")
                return ExtensionStatus("cpu+cuda-extension", None, path, "jit", gpu, tuple(steps))
            cuda_reason = "the extension loaded but registered no CUDA kernels"
            _step(steps, f"2. JIT build: {cuda_reason} ({path})")
            return _partial(mode, ExtensionStatus("cpu-extension", cuda_reason, path, None, gpu, tuple(steps)))
        except Exception as err:  # noqa: BLE001 - any build failure falls back to the CPU build
            cuda_reason = (f"no usable prebuilt GPU library ({gpu.reason}), and building the CUDA kernels "
                           f"failed: {_short(err)}")
            _step(steps, f"2. JIT build of the CUDA kernels failed: {_short(err, 300)}")
    try:
        path = _build_and_load(False, verbose)
    except Exception as err:  # noqa: BLE001
        reason = f"building/loading the compiled kernels failed: {_short(err)}"
        _step(steps, f"2. JIT build of the CPU kernels failed: {_short(err, 300)}")
        if cuda_source:
            return _partial_cpu(mode, ExtensionStatus("cuda-extension", reason, None, cuda_source, gpu, tuple(steps)))
        return _fail(mode, reason, gpu, steps)
    _step(steps, f"2. JIT build (CPU kernels, g++): {path}")
    if cuda_source:
        return ExtensionStatus("cpu+cuda-extension", None, path, cuda_source, gpu, tuple(steps))
    if cuda_reason:
        _step(steps, f"3. CUDA tensors: the pure-PyTorch reference ({cuda_reason})")
    st = ExtensionStatus("cpu-extension", cuda_reason, path, None, gpu, tuple(steps))
    return _partial(mode, st) if cuda_reason else st


def _fail(mode: str, reason: str, gpu: Any = None, steps: list[str] | None = None) -> ExtensionStatus:
    if mode == "extension":
        raise RuntimeError(f"qmuon: QMUON_BACKEND=extension but {reason}")
    warnings.warn(
        f"qmuon: using the pure-PyTorch reference kernels because {reason}. "
        "Set QMUON_BACKEND=reference to skip the build (and this warning).",
        RuntimeWarning,
        stacklevel=4,
    )
    steps = list(steps or [])
    _step(steps, f"3. every op: the pure-PyTorch reference ({reason})")
    return ExtensionStatus("reference", reason, gpu_library=gpu, steps=tuple(steps))


def _gpu_fix() -> str:
    major = torch.version.cuda.split(".")[0] if torch.version.cuda else "<major>"
    return (f"install a qmuon wheel that ships qmuon/_lib/libqmuon_cuda{major}.so (or build it: "
            f"python -m qmuon.ops.build_gpu), or install a CUDA {major} toolkit (nvcc) and set CUDA_HOME")


def _partial(mode: str, st: ExtensionStatus) -> ExtensionStatus:
    if mode == "extension" and torch.cuda.is_available():
        raise RuntimeError(f"qmuon: QMUON_BACKEND=extension but no CUDA kernels: {st.reason}")
    if torch.cuda.is_available():
        # Loud: a GPU run on the reference is unfused and slower, and nothing else says so.
        msg = (f"qmuon: CUDA tensors use the pure-PyTorch reference kernels (unfused, slower, more memory) "
               f"because {st.reason}. Fix: {_gpu_fix()}.")
        _log.warning(msg)
    else:
        msg = f"qmuon: CUDA tensors use the pure-PyTorch reference kernels because {st.reason}."
    warnings.warn(msg, RuntimeWarning, stacklevel=4)
    return st


def _partial_cpu(mode: str, st: ExtensionStatus) -> ExtensionStatus:
    """CUDA kernels from the prebuilt library, CPU tensors on the reference (the CPU build failed)."""
    if mode == "extension":
        raise RuntimeError(f"qmuon: QMUON_BACKEND=extension but no CPU kernels: {st.reason}")
    warnings.warn(f"qmuon: CPU tensors use the pure-PyTorch reference kernels because {st.reason}.",
                  RuntimeWarning, stacklevel=4)
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
    """``"reference"``, ``"cpu-extension"``, ``"cpu+cuda-extension"`` or ``"cuda-extension"``."""
    return status().backend


def cpu_vector_isa() -> str | None:
    """The vector loops the compiled CPU kernels were built with: ``"avx512"`` (hand-written AVX-512
    forms of the hot loops, chosen at compile time by ``-march``, see ``QMUON_CPU_ARCH``) or
    ``"portable"`` (compiler-vectorized C++ only); None when the reference runs."""
    if not status().cpu:
        return None
    return str(torch.ops.qmuon_C.cpu_vector_isa())
