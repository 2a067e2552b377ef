"""Find, load and probe the prebuilt GPU library (``qmuon/_lib/libqmuon_cuda<major>.so``).

The library (built by :mod:`.build_gpu`, shipped in the wheel) holds the CUDA kernels of ``csrc/cuda``
with the CUDA runtime linked in statically, and no torch: it is loaded with ctypes and called through
:class:`._cabi.CAbiOps` with raw pointers and torch's current stream. :func:`load` picks it:

1. ``QMUON_GPU_LIB``: ``0`` turns the prebuilt library off (the JIT build or the reference serve CUDA),
   a path picks that file;
2. else ``libqmuon_cuda<M>.so`` for torch's CUDA major ``M``, then the other majors shipped: the CUDA
   runtime inside the library only needs a driver that supports it, not torch's runtime, so a CUDA 13
   library serves a CUDA 12 torch on an r580+ driver. A library of another major is probed first
   (driver version, device count); one of torch's major is not, while torch has not initialized CUDA:
   the driver that runs torch runs it, and the probe would initialize the driver before torch does.

A library is used only when its C-ABI struct layout equals the ctypes mirror's, it was built from the
sources next to it (when they are there: a source checkout edited after the build falls back to
the JIT build, with the reason), and the driver reports a device. Each outcome is one
:class:`GpuLibrary` with the reason when it cannot serve.
"""

from __future__ import annotations

import ctypes
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import _cabi
from .build_gpu import default_csrc, library_name, source_hash

__all__ = ["GpuLibrary", "load", "lib_dir"]

ENV = "QMUON_GPU_LIB"
#: cudaError_t values the probe reports without a usable device.
_CUDA_ERRORS = {35: "cudaErrorInsufficientDriver (no NVIDIA driver, or one older than the library's CUDA runtime)",
                100: "cudaErrorNoDevice (no CUDA device visible)", 3: "cudaErrorInitializationError"}


@dataclass(frozen=True)
class GpuLibrary:
    """One prebuilt GPU library, as found: ``usable`` when it serves CUDA tensors in this process."""

    path: str | None
    usable: bool = False
    reason: str | None = None
    cuda: str | None = None            # CUDA release it was built with ("13.0")
    sass: tuple[str, ...] = ()
    ptx: tuple[str, ...] = ()
    driver_version: int = 0            # the driver's CUDA version (12080 = 12.8), 0 without a driver
    device_count: int = 0
    ops: _cabi.CAbiOps | None = field(default=None, repr=False, compare=False)

    def summary(self) -> str:
        if self.path is None:
            return f"no prebuilt GPU library: {self.reason}"
        archs = " ".join(self.sass) + (f" + PTX {' '.join(self.ptx)}" if self.ptx else "")
        head = f"{os.path.basename(self.path)} (CUDA {self.cuda or '?'}; {archs or 'archs unknown'})"
        return f"{head}: {'serves CUDA tensors' if self.usable else self.reason}"


def lib_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "_lib"


def _candidates() -> list[Path]:
    env = os.environ.get(ENV, "").strip()
    if env and env != "0":
        return [Path(env)]
    majors = [13, 12]  # newest first for a torch without CUDA (what the doctor reports)
    if torch.version.cuda:
        own = int(torch.version.cuda.split(".")[0])
        majors = [own] + [m for m in majors if m != own]
    return [lib_dir() / library_name(m) for m in majors if (lib_dir() / library_name(m)).is_file()]


def _csrc() -> Path | None:
    d = default_csrc()
    return d if (d / "cuda").is_dir() and (d / "qmuon").is_dir() else None


def _open(path: Path) -> GpuLibrary:
    try:
        lib = ctypes.CDLL(str(path), mode=getattr(os, "RTLD_LOCAL", 0))
    except OSError as err:
        return GpuLibrary(str(path), reason=f"cannot be loaded: {err}")
    try:
        info_fn = lib.qmuon_cuda_build_info
        info_fn.restype = ctypes.c_char_p
        info = json.loads(info_fn().decode() or "{}")
        probe = lib.qmuon_cuda_probe
        probe.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        probe.restype = ctypes.c_int
        c_layout = _cabi.library_layout(lib, "cuda")
    except (AttributeError, ValueError) as err:
        return GpuLibrary(str(path), reason=f"is not a qmuon GPU library of this version ({err})")
    base = dict(path=str(path), cuda=info.get("cuda"), sass=tuple(info.get("sass", ())), ptx=tuple(info.get("ptx", ())))
    if c_layout != _cabi.layout():
        return GpuLibrary(**base, reason="its C-ABI struct layout differs from qmuon/ops/_cabi.py's; rebuild it "
                                         "(python -m qmuon.ops.build_gpu) or reinstall qmuon")
    src = _csrc()
    if src is not None and info.get("sources") != source_hash(src):
        return GpuLibrary(**base, reason=f"was built from other sources than {src}; rebuild it "
                                         "(python -m qmuon.ops.build_gpu)")
    lib_major = str(info.get("cuda", "")).split(".")[0]
    if torch.version.cuda is not None and lib_major == torch.version.cuda.split(".")[0] \
            and not torch.cuda.is_initialized():
        # A driver that runs torch's CUDA runs a library of the same major (minor-version compatibility),
        # so nothing needs probing here, and the library's cudaGetDeviceCount would initialize the driver
        # in this process before torch does: a CPU-only run would then fork workers that cannot use CUDA.
        # torch's device count reads NVML where it can, initializing nothing.
        count = torch.cuda.device_count()
        if count == 0:
            return GpuLibrary(**base, reason="loaded, no device: torch sees no CUDA device")
        return GpuLibrary(**base, usable=True, device_count=count, ops=_cabi.CAbiOps(lib, "cuda"))
    drv, n = ctypes.c_int(0), ctypes.c_int(0)
    err = probe(ctypes.byref(drv), ctypes.byref(n))
    base.update(driver_version=drv.value, device_count=n.value)
    if err != 0 or n.value == 0:
        what = _CUDA_ERRORS.get(err, f"CUDA error {err}") if err else "no CUDA device"
        return GpuLibrary(**base, reason=f"loaded, no device: {what}")
    if torch.version.cuda is None:
        return GpuLibrary(**base, reason=f"loaded, {n.value} device(s), but this torch has no CUDA "
                                         f"({torch.__version__}): install a CUDA build of torch")
    return GpuLibrary(**base, usable=True, ops=_cabi.CAbiOps(lib, "cuda"))


def load() -> GpuLibrary:
    """The first usable prebuilt library of :func:`_candidates`, else the first one's reason (or why
    there is none)."""
    if os.environ.get(ENV, "").strip() == "0":
        return GpuLibrary(None, reason=f"{ENV}=0")
    found = _candidates()
    if not found:
        want = f"libqmuon_cuda{torch.version.cuda.split('.')[0]}.so" if torch.version.cuda else "libqmuon_cuda*.so"
        return GpuLibrary(None, reason=f"{want} not in {lib_dir()} (a source checkout builds it with "
                                       "python -m qmuon.ops.build_gpu; the wheel ships it)")
    first = None
    for path in found:
        lib = _open(path)
        if lib.usable:
            return lib
        first = first or lib
    return first  # type: ignore[return-value]
