"""Build, load and register the compiled kernels in ``csrc/`` behind ``torch.ops.qmuon.*``.

Layers
------
``csrc/qmuon/block_math.h``  per-element / per-block maths (dequantize, momentum lerp, absmax,
                             requantize, stochastic-rounding hash), ``__host__ __device__``
``csrc/qmuon/kernels.h``     C ABI of the kernels: raw pointers, row strides, a ``cudaStream_t``
``csrc/qmuon/block_math_4bit.h``  the same for the 4-bit formats (nibbles, UE4M3, int4 / e0m3 / grid
                             scales and codes) and the dense update's FMA lerp
``csrc/cpu/q8_cpu.cpp``, ``csrc/cpu/q4_cpu.cpp``  CPU kernels (``at::parallel_for``, loops g++ vectorizes)
``csrc/cuda/q8_cuda.cu``, ``csrc/cuda/q4_cuda.cu``  CUDA kernels (no torch headers; compile-checked
                             with plain nvcc)
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
(:mod:`._library`, one ``torch.library.Library``) with the pure-PyTorch reference as their default.
:func:`register_compiled_kernels` adds ``CPU`` (and ``CUDA`` when torch has CUDA) implementations
that call ``torch.ops.qmuon_C.*``. The extension is built and loaded lazily,
on the first call of one of those kernels (or of :func:`status` / ``qmuon_lightning.ops.backend()``);
if it cannot be built or loaded, the kernels run the reference and a warning says why, once.
Arguments the compiled kernels do not support (e.g. float64 grads, ``block_size`` > 4096, an odd
int4 block) also run the reference; so does the dense update when this torch build's ``lerp`` does
not round like the kernel (see :func:`_dense_matches_torch`). docs/kernels.md has the full list.

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

_CPU_SOURCES = ("binding.cpp", "cpu/q8_cpu.cpp", "cpu/q4_cpu.cpp")
_CUDA_SOURCES = ("binding_cuda.cpp", "cuda/q8_cuda.cu", "cuda/q4_cuda.cu")
_HEADERS = ("binding_common.h", "binding_4bit.h", "cpu/block_reduce_cpu.h", "qmuon/block_math.h", "qmuon/block_math_4bit.h", "qmuon/kernels.h")


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
    # The source directory is part of the key: torch's build.ninja names absolute paths, so two
    # checkouts with identical sources sharing one build directory would make ninja rebuild
    # whenever the other one had built last (a silent 20 s stall in a first training step).
    h.update(str(src.resolve()).encode())
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


def _build_and_load(with_cuda: bool, verbose: bool) -> str:
    from torch.utils.cpp_extension import load

    spec = _build_spec(with_cuda)
    inputs = spec.pop("inputs")
    os.makedirs(spec["build_directory"], exist_ok=True)
    so = os.path.join(spec["build_directory"], spec["name"] + ".so")
    reason = _build_reason(so, inputs)
    if reason:
        what = "CPU and CUDA" if with_cuda else "CPU"
        print(f"qmuon_lightning: compiling the {what} kernels (csrc/) into {spec['build_directory']}: "
              f"{reason} ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    path = load(is_python_module=False, verbose=verbose, **spec)
    if reason:
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


def cpu_vector_isa() -> str | None:
    """The vector loops the compiled CPU kernels were built with: ``"avx512"`` (hand-written AVX-512
    forms of the hot loops, chosen at compile time by ``-march``, see ``QMUON_CPU_ARCH``) or
    ``"portable"`` (compiler-vectorized C++ only); None when the reference runs."""
    if not status().cpu:
        return None
    return str(torch.ops.qmuon_C.cpu_vector_isa())


# ---------------------------------------------------------------------------------------------
# Kernels registered on the torch.ops.qmuon ops (CPU / CUDA keys)
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

    kernels = {
        "q8_momentum_update_multi_": q8_momentum_update_multi_,
        "quantize_rows": quantize_rows,
        "dequantize_rows": dequantize_rows,
    }
    kernels.update(_make_4bit_kernels(device_type, defaults))
    return kernels


# ---------------------------------------------------------------------------------------------
# 4-bit and dense-format kernels: "supported?" guards (anything else runs the reference)
# ---------------------------------------------------------------------------------------------
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_DENSE_BUF_DTYPES = (torch.float32, torch.bfloat16)


def _packed_cols(cols: int) -> int:
    return (cols + 1) // 2


def _int4_block_ok(block_size: int) -> bool:
    # Two codes per byte: an odd block would split a byte between two blocks (two writers).
    return 2 <= block_size <= MAX_BLOCK_SIZE and block_size % 2 == 0


def _e0m3_block_ok(block_size: int) -> bool:
    # block_size only sets the sums-of-squares granularity; the kernels walk units of max(block_size, 16)
    # that hold whole 16-element scale blocks and whole sum blocks.
    return 1 <= block_size <= MAX_BLOCK_SIZE and (block_size % 16 == 0 or 16 % block_size == 0)


def _mats_ok(ts, dtypes) -> bool:
    return all(t.dim() == 2 and t.dtype in dtypes for t in ts)


def _lists_ok(n: int, *lists) -> bool:
    return all(len(x) == n for x in lists)


_lerp_fused: dict[str, bool] = {}


def _dense_matches_torch(device: torch.device) -> bool:
    """Whether the compiled dense update reproduces torch's ``lerp`` on this device, bit for bit.

    The fp32 dense format must stay identical to ``torch.optim.Muon`` (``buf.lerp_(grad, 1 - beta)``).
    torch's CPU lerp kernel computes ``base + coeff * (end - start)`` with one fused multiply-add
    (vectorized ``fmadd``; its scalar tail is contracted the same way) and its CUDA kernel is
    contracted by nvcc, and the compiled kernel uses an explicit FMA. A torch build without FMA
    (an old CPU, ``ATEN_CPU_CAPABILITY=default``) rounds twice; this probe, run once per device type,
    compares the kernel with the reference on values where the two roundings differ, and the dense
    ops stay on the reference if they do not agree.
    """
    key = device.type
    if key not in _lerp_fused:
        from . import reference as ref

        gen = torch.Generator().manual_seed(1234)
        ok = True
        for buf_dtype in _DENSE_BUF_DTYPES:
            buf = torch.randn(5, 333, generator=gen).to(buf_dtype).to(device)
            grad = torch.randn(5, 333, generator=gen).to(device)
            r_buf, r_grad = buf.clone(), grad.clone()
            sums = [torch.empty(5, 2, device=device)]
            torch.ops.qmuon_C.dense_momentum_update_multi_([buf], [grad], sums, 0.95, True, 256, [-1], [0])
            ref.dense_momentum_update_(r_buf, r_grad, beta=0.95, nesterov=True, block_size=256)
            ok = ok and torch.equal(buf.view(torch.int16 if buf_dtype == torch.bfloat16 else torch.int32),
                                    r_buf.view(torch.int16 if buf_dtype == torch.bfloat16 else torch.int32))
            ok = ok and torch.equal(grad.view(torch.int32), r_grad.view(torch.int32))
        _lerp_fused[key] = ok
        if not ok:
            warnings.warn(f"qmuon_lightning: this torch build's {key} lerp does not round like the compiled dense "
                          "update (no FMA); fp32/bf16 momentum uses the pure-PyTorch reference.",
                          RuntimeWarning, stacklevel=3)
    return _lerp_fused[key]


def _make_4bit_kernels(device_type: str, defaults: dict[str, Callable]) -> dict[str, Callable]:
    def compiled() -> bool:
        return _compiled_for(device_type)

    def int4_momentum_update_multi_(packed, absmax, grads, block_sumsq, beta, nesterov, block_size, streams,
                                    row_offsets):
        args = (packed, absmax, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets)
        if (compiled() and _int4_block_ok(block_size) and _lists_ok(len(packed), absmax, grads, block_sumsq)
                and _mats_ok(packed, (torch.uint8,)) and _mats_ok(absmax, (torch.float32,))
                and _mats_ok(grads, _GRAD_DTYPES) and _mats_ok(block_sumsq, (torch.float32,))):
            torch.ops.qmuon_C.int4_momentum_update_multi_(*args)
        else:
            defaults["int4_momentum_update_multi_"](*args)

    def e0m3_momentum_update_multi_(packed, scales, tensor_scales, grads, block_sumsq, beta, nesterov, block_size,
                                    streams, row_offsets):
        args = (packed, scales, tensor_scales, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets)
        if (compiled() and _e0m3_block_ok(block_size)
                and _lists_ok(len(packed), scales, tensor_scales, grads, block_sumsq)
                and _mats_ok(packed, (torch.uint8,)) and _mats_ok(scales, (torch.uint8,))
                and all(t.dtype == torch.float32 and t.numel() == 1 and t.device == g.device
                        for t, g in zip(tensor_scales, grads))
                and _mats_ok(grads, _GRAD_DTYPES) and _mats_ok(block_sumsq, (torch.float32,))):
            torch.ops.qmuon_C.e0m3_momentum_update_multi_(*args)
        else:
            defaults["e0m3_momentum_update_multi_"](*args)

    def dense_momentum_update_multi_(bufs, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets):
        args = (bufs, grads, block_sumsq, beta, nesterov, block_size, streams, row_offsets)
        if (compiled() and 1 <= block_size <= MAX_BLOCK_SIZE and _lists_ok(len(bufs), grads, block_sumsq)
                and _mats_ok(bufs, _DENSE_BUF_DTYPES) and _mats_ok(grads, _GRAD_DTYPES)
                and _mats_ok(block_sumsq, (torch.float32,))
                and (not bufs or _dense_matches_torch(bufs[0].device))):
            torch.ops.qmuon_C.dense_momentum_update_multi_(*args)
        else:
            defaults["dense_momentum_update_multi_"](*args)

    def pack_int4(codes):
        if compiled() and codes.dim() == 2 and codes.dtype == torch.int8:
            return torch.ops.qmuon_C.pack_int4(codes)
        return defaults["pack_int4"](codes)

    def unpack_int4(packed, cols):
        if compiled() and packed.dim() == 2 and packed.dtype == torch.uint8 and cols >= 0 \
                and _packed_cols(cols) == packed.shape[1]:
            return torch.ops.qmuon_C.unpack_int4(packed, cols)
        return defaults["unpack_int4"](packed, cols)

    def ue4m3_encode(x, round_up):
        if compiled() and x.dtype in _FLOAT_DTYPES:
            return torch.ops.qmuon_C.ue4m3_encode(x, round_up)
        return defaults["ue4m3_encode"](x, round_up)

    def ue4m3_decode(bits):
        if compiled() and bits.dtype == torch.uint8:
            return torch.ops.qmuon_C.ue4m3_decode(bits)
        return defaults["ue4m3_decode"](bits)

    def int4_quantize(x, block_size, stream, row_offset):
        if compiled() and x.dim() == 2 and x.dtype in _FLOAT_DTYPES and _int4_block_ok(block_size):
            return torch.ops.qmuon_C.int4_quantize(x, block_size, stream, row_offset)
        return defaults["int4_quantize"](x, block_size, stream, row_offset)

    def int4_dequantize(packed, absmax, block_size, cols):
        if (compiled() and packed.dim() == 2 and packed.dtype == torch.uint8 and absmax.dim() == 2
                and absmax.dtype == torch.float32 and block_size >= 1 and cols >= 0
                and _packed_cols(cols) == packed.shape[1]):
            return torch.ops.qmuon_C.int4_dequantize(packed, absmax, block_size, cols)
        return defaults["int4_dequantize"](packed, absmax, block_size, cols)

    def e0m3_quantize(x, two_level, stream, row_offset):
        if compiled() and x.dim() == 2 and x.dtype in _FLOAT_DTYPES:
            return torch.ops.qmuon_C.e0m3_quantize(x, two_level, stream, row_offset)
        return defaults["e0m3_quantize"](x, two_level, stream, row_offset)

    def e0m3_dequantize(packed, scales, tensor_scale, cols):
        if (compiled() and packed.dim() == 2 and packed.dtype == torch.uint8 and scales.dim() == 2
                and scales.dtype == torch.uint8 and tensor_scale.numel() == 1
                and tensor_scale.dtype in _FLOAT_DTYPES and tensor_scale.device == packed.device and cols >= 0
                and _packed_cols(cols) == packed.shape[1]):
            return torch.ops.qmuon_C.e0m3_dequantize(packed, scales, tensor_scale, cols)
        return defaults["e0m3_dequantize"](packed, scales, tensor_scale, cols)

    def grid_quantize4(x, grid_block, stream, row_offset):
        if compiled() and x.dim() == 2 and x.dtype in _FLOAT_DTYPES and grid_block >= 1:
            return torch.ops.qmuon_C.grid_quantize4(x, grid_block, stream, row_offset)
        return defaults["grid_quantize4"](x, grid_block, stream, row_offset)

    def grid_dequantize4(packed, row_max, col_max, scale, grid_block, cols):
        if (compiled() and packed.dim() == 2 and packed.dtype == torch.uint8 and row_max.dtype == torch.uint8
                and col_max.dtype == torch.uint8 and scale.numel() == 1 and scale.dtype in _FLOAT_DTYPES
                and scale.device == packed.device and grid_block >= 1 and cols >= 0
                and _packed_cols(cols) == packed.shape[1]):
            return torch.ops.qmuon_C.grid_dequantize4(packed, row_max, col_max, scale, grid_block, cols)
        return defaults["grid_dequantize4"](packed, row_max, col_max, scale, grid_block, cols)

    return {
        "int4_momentum_update_multi_": int4_momentum_update_multi_,
        "e0m3_momentum_update_multi_": e0m3_momentum_update_multi_,
        "dense_momentum_update_multi_": dense_momentum_update_multi_,
        "pack_int4": pack_int4,
        "unpack_int4": unpack_int4,
        "ue4m3_encode": ue4m3_encode,
        "ue4m3_decode": ue4m3_decode,
        "int4_quantize": int4_quantize,
        "int4_dequantize": int4_dequantize,
        "e0m3_quantize": e0m3_quantize,
        "e0m3_dequantize": e0m3_dequantize,
        "grid_quantize4": grid_quantize4,
        "grid_dequantize4": grid_dequantize4,
    }


_registered = False


def register_compiled_kernels(ops: dict[str, Any]) -> None:
    """Register the compiled kernels on the ``torch.ops.qmuon`` ops (``name -> QmuonOp``, from
    :mod:`._library`) for the ``CPU`` key (and ``CUDA`` when torch has CUDA). Nothing is built here:
    the kernels load the extension on first call."""
    global _registered
    if _registered or os.environ.get("QMUON_BACKEND", "").strip().lower() == "reference":
        return
    # The default (reference) implementation of each op, to fall back on.
    defaults = {name: op.reference for name, op in ops.items()}
    device_types = ["cpu"] + (["cuda"] if torch.version.cuda is not None else [])
    for device_type in device_types:
        kernels = _make_kernels(device_type, defaults)
        for name, op in ops.items():
            if name in kernels:
                op.register_kernel(device_type.upper(), kernels[name])
    _registered = True


def _main(argv: list[str] | None = None) -> int:
    """``python -m qmuon_lightning.ops._extension``, kept for old scripts; use
    ``python -m qmuon_lightning.ops.build`` (this module is imported by the package, so running it
    with ``-m`` draws runpy's "found in sys.modules" warning)."""
    from qmuon_lightning.ops.build import main

    return main(argv)


if __name__ == "__main__":
    raise SystemExit(_main())
