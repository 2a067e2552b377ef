"""The prebuilt GPU library (qmuon/_lib/libqmuon_cuda<major>.so, python -m qmuon.ops.build_gpu) on a
machine without a GPU: what it holds (SASS / PTX, exports), that it loads with ctypes without a driver,
that the loader reports it as present with no device, and that a call through the ctypes path ends in
a clean error, not a crash.

The library is a build output (not in git): ``.ci/run`` builds it before the tests where nvcc exists.
Without it these tests skip, with the reason; the GPU execution itself is benchmarks/gpu_check.sh's.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qmuon.ops import _cabi, _prebuilt, build_gpu

REPO = Path(__file__).resolve().parents[1]


def _libraries() -> list[Path]:
    env = os.environ.get("QMUON_GPU_LIB", "").strip()
    if env and env != "0":
        return [Path(env)]
    return sorted(_prebuilt.lib_dir().glob("libqmuon_cuda*.so"))


@pytest.fixture(scope="module", params=_libraries() or [None], ids=lambda p: p.name if p else "none")
def lib_path(request) -> Path:
    if request.param is None:
        pytest.skip(f"no prebuilt GPU library in {_prebuilt.lib_dir()} (python -m qmuon.ops.build_gpu builds it; "
                    ".ci/run does where nvcc exists)")
    return request.param


def _info(path: Path) -> dict:
    lib = ctypes.CDLL(str(path))
    lib.qmuon_cuda_build_info.restype = ctypes.c_char_p
    return json.loads(lib.qmuon_cuda_build_info().decode())


def test_exports_the_c_abi_and_nothing_else(lib_path):
    names = build_gpu.exported_symbols(lib_path)
    assert set(build_gpu.EXPORTS) <= set(names)
    assert all(n.startswith("qmuon_cuda_") for n in names), [n for n in names if not n.startswith("qmuon_cuda_")]
    if shutil.which("nm"):  # the same list as binutils reads it
        out = subprocess.run(["nm", "-D", "--defined-only", str(lib_path)], capture_output=True, text=True).stdout
        assert sorted(line.split()[-1] for line in out.splitlines() if " T " in line) == names


def test_needs_no_cuda_library_at_load_time(lib_path):
    """-cudart static: the only dynamic dependencies are the C / C++ runtimes (libcuda.so.1 is opened
    by the runtime when it initializes, so a machine without a driver can load it)."""
    needed = subprocess.run(["readelf", "-d", str(lib_path)], capture_output=True, text=True).stdout
    libs = sorted(line.split("[")[1].rstrip("]") for line in needed.splitlines() if "(NEEDED)" in line)
    assert not [x for x in libs if "cuda" in x], libs


def _cuobjdump() -> str | None:
    """cuobjdump on PATH, else the one of the ``nvidia-cuda-cuobjdump`` wheel (the test extra's; its
    ``nvidia/cu<major>/bin`` is on no PATH)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    return next((str(p) for base in nvidia.__path__ for p in sorted(Path(base).glob("*/bin/cuobjdump"))), None)


needs_cuobjdump = pytest.mark.skipif(_cuobjdump() is None,
                                     reason="no cuobjdump (pip install nvidia-cuda-cuobjdump; the test extra has it)")


def test_holds_the_architectures_it_was_built_for(lib_path):
    """The fatbin holds SASS for every asked-for sm and PTX for the asked-for compute arch (read from the
    ELF; the build record says what was asked). A default build: SASS sm_80/90/100/120 (from a CUDA 12 nvcc
    older than 12.8, sm_100/120 by the newer ptxas) and PTX compute_120, or the newest that nvcc has."""
    info = _info(lib_path)
    d = build_gpu.describe(lib_path)
    assert d["sass"] == info["sass"] and d["ptx"] == info["ptx"]
    if info["sass"] == [f"sm_{a}" for a in build_gpu.DEFAULT_ARCHS]:
        expected_ptx = [f"compute_{a}" for a in build_gpu.DEFAULT_PTX]
        if "ptxas" in info:  # nvcc lacked sm_100 / sm_120, and so compute_120: PTX of its newest arch
            expected_ptx = ["compute_90"]
            assert info["ptxas"]["sass"] == ["sm_100", "sm_120"], info
        assert d["ptx"] == expected_ptx


@needs_cuobjdump
def test_fatbin_reader_agrees_with_cuobjdump(lib_path):
    out = subprocess.run([_cuobjdump(), "--list-elf", "--list-ptx", str(lib_path)], capture_output=True, text=True,
                         check=True).stdout
    elf = {line.rsplit(".", 2)[-2] for line in out.splitlines() if line.startswith("ELF file")}
    ptx = {line.rsplit(".", 2)[-2].replace("sm_", "compute_") for line in out.splitlines() if line.startswith("PTX")}
    d = build_gpu.describe(lib_path)
    assert elf == set(d["sass"]) and ptx == set(d["ptx"])


@needs_cuobjdump
def test_every_architecture_holds_every_kernel(lib_path):
    """Each SASS architecture defines the same kernels (cuobjdump's resource listing, per function), so
    no GPU generation falls back to JIT-compiling PTX, or finds a kernel missing, for part of the ops. The
    sm_100 / sm_120 cubins that a newer ptxas adds to a CUDA 12.4 build are checked the same way."""
    out = subprocess.run([_cuobjdump(), "-res-usage", str(lib_path)], capture_output=True, text=True,
                         check=True).stdout
    kernels: dict[str, set[str]] = {}
    arch = None
    for line in out.splitlines():
        if "arch = " in line:
            arch = line.split("arch = ")[1].split()[0]
        elif line.strip().startswith("Function ") and arch:
            kernels.setdefault(arch, set()).add(line.split()[1].rstrip(":"))
    info = _info(lib_path)
    assert sorted(kernels, key=lambda a: int(a.split("_")[1])) == info["sass"]
    first = kernels[info["sass"][0]]
    assert len(first) >= 20, sorted(first)  # the q8 / 4-bit / AdamW / weight kernels, each per dtype
    assert all(k == first for k in kernels.values()), {a: len(k) for a, k in kernels.items()}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device report; this machine has a GPU")
def test_loads_without_a_driver_and_reports_no_device(lib_path, monkeypatch):
    monkeypatch.setenv("QMUON_GPU_LIB", str(lib_path))
    lib = _prebuilt.load()
    assert lib.path == str(lib_path) and not lib.usable
    assert "no device" in lib.reason, lib.reason
    assert lib.sass and lib.cuda
    raw = ctypes.CDLL(str(lib_path))
    assert _cabi.library_layout(raw, "cuda") == _cabi.layout()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-device error; this machine has a GPU")
def test_a_call_without_a_device_is_a_clean_error(lib_path, monkeypatch):
    """The ctypes call path all the way into the library's launcher: argument structs, the stream, the
    error code (cudaErrorInsufficientDriver without a driver, cudaErrorNoDevice without a GPU) and its
    text come back as a RuntimeError. torch's CUDA hooks are stubbed (this torch has no CUDA); the
    pointers are never dereferenced because the runtime fails to initialize first."""
    ops = _cabi.CAbiOps(ctypes.CDLL(str(lib_path)), "cuda")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(ops, "_raw_stream", lambda idx: 0)
    with pytest.raises(RuntimeError, match=r"CUDA kernel quantize_rows failed: .*(driver|device).*\(code (35|100)\)"):
        ops._run(ops._quant, "quantize_rows", torch.device("cuda", 0), None, 8, None, _cabi.I8, None, 1, 8, 8, -1, 0)


def test_a_library_from_other_sources_is_not_used(lib_path, tmp_path, monkeypatch):
    """Sources edited after the build (a source checkout): the loader says so and does not use it."""
    src = tmp_path / "csrc"
    shutil.copytree(REPO / "csrc", src)
    (src / "cuda" / "q8_cuda.cu").write_text((src / "cuda" / "q8_cuda.cu").read_text() + "\n// edited\n")
    monkeypatch.setenv("QMUON_GPU_LIB", str(lib_path))
    monkeypatch.setenv("QMUON_CSRC_DIR", str(src))
    lib = _prebuilt.load()
    assert not lib.usable and "other sources" in lib.reason


def test_loader_without_any_library(tmp_path, monkeypatch):
    monkeypatch.setenv("QMUON_GPU_LIB", "0")
    assert _prebuilt.load().reason == "QMUON_GPU_LIB=0"
    monkeypatch.setenv("QMUON_GPU_LIB", str(tmp_path / "libqmuon_cuda13.so"))
    lib = _prebuilt.load()
    assert not lib.usable and "cannot be loaded" in lib.reason


def test_status_names_each_loading_step(ext, lib_path):
    """In a fresh process: the loading order's steps, with the prebuilt library's line first."""
    code = ("import warnings; warnings.simplefilter('ignore'); import qmuon.ops; from qmuon.ops import _extension as e; "
            "print('\\n'.join(qmuon.ops.loading_order())); print('cuda_source', e.status().cuda_source)")
    env = dict(os.environ, PYTHONPATH=str(REPO), QMUON_GPU_LIB=str(lib_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("1. prebuilt GPU library: " + lib_path.name)
    assert any(line.startswith("2. JIT build (CPU kernels") for line in lines)
    if not torch.cuda.is_available():
        assert "no device" in lines[0] and lines[-1] == "cuda_source None"


def test_extra_sass_steps_join_nvccs_own_fatbinary_step(tmp_path):
    """--ptxas-archs: the newer ptxas compiles the newest PTX of nvcc's command list (compute_90 here, not
    compute_80) before the fatbinary step, and each cubin becomes one more ELF image of that step."""
    commands = [
        'cicc -arch compute_80 -o "/t/a.compute_80.ptx"',
        'ptxas -arch=sm_80 -m64 --fmad false "/t/a.compute_80.ptx" -o "/t/a.sm_80.cubin"',
        'cicc -arch compute_90 -o "/t/a.compute_90.ptx"',
        'fatbinary -64 "--image3=kind=elf,sm=80,file=/t/a.sm_80.cubin" "--image3=kind=ptx,sm=80,file=/t/a.compute_80.ptx" '
        '"--image3=kind=ptx,sm=90,file=/t/a.compute_90.ptx" --embedded-fatbin="/t/a.fatbin.c"',
        'gcc -c a.cudafe1.cpp -o a.o',
    ]
    out = build_gpu._with_extra_sass(commands, "/opt/ptxas 12.9/ptxas", (100, 120), str(tmp_path))
    assert out[:3] == commands[:3] and out[-1] == commands[-1]
    assert out[3] == f"'/opt/ptxas 12.9/ptxas' -arch=sm_100 -m64 --fmad false /t/a.compute_90.ptx -o {tmp_path}/extra_sm_100.cubin"
    assert " -arch=sm_120 " in out[4]
    assert out[5].startswith(commands[3]) and out[5].endswith(
        f'"--image3=kind=elf,sm=100,file={tmp_path}/extra_sm_100.cubin" '
        f'"--image3=kind=elf,sm=120,file={tmp_path}/extra_sm_120.cubin"')
    with pytest.raises(RuntimeError, match="needs PTX"):
        build_gpu._with_extra_sass([c for c in commands if "kind=ptx" not in c] + ["fatbinary -64"], "ptxas", (100,),
                                   str(tmp_path))
    with pytest.raises(RuntimeError, match="one fatbinary step"):
        build_gpu._with_extra_sass(commands[:3], "ptxas", (100,), str(tmp_path))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc")
def test_abi_probe_reads_what_the_loader_reads(lib_path, tmp_path):
    """.ci/abi_probe.c (which runs the aarch64 library under qemu in CI) reports the same layout, build
    record and probe result as the Python loader does for this machine's library."""
    exe = tmp_path / "abi_probe"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(REPO / ".ci" / "abi_probe.c"), "-ldl"], check=True)
    got = json.loads(subprocess.run([str(exe), str(lib_path)], capture_output=True, text=True, check=True).stdout)
    assert got["layout"] == _cabi.layout()
    assert got["build_info"] == _info(lib_path)
    if not torch.cuda.is_available():
        assert got["probe"] in (35, 100) and got["devices"] == 0


def test_cross_host_is_checked_before_compiling(tmp_path):
    nvcc = build_gpu.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    with pytest.raises(RuntimeError, match="aarch64 only"):
        build_gpu.build(nvcc, host="riscv64", out_dir=tmp_path, log=lambda *a: None)
    if shutil.which("aarch64-linux-gnu-g++"):
        # PATH's nvcc toolkit has no aarch64 runtime: the error names the script that assembles one.
        with pytest.raises(RuntimeError, match="cuda13_aarch64.sh"):
            build_gpu.build(nvcc, host="aarch64", out_dir=tmp_path, log=lambda *a: None)


def test_a_library_of_torchs_major_is_not_probed_before_torch_initializes_cuda(lib_path, monkeypatch):
    """With a CUDA torch that has not initialized CUDA, the library of torch's own CUDA major is used
    without its driver probe (cudaGetDeviceCount would initialize the driver in this process, under a
    CPU-only run that later forks); the device count is torch's. Here the probe would report no driver,
    so a usable library shows that it did not run. A library of another major is still probed."""
    major = _info(lib_path)["cuda"].split(".")[0]
    monkeypatch.setenv("QMUON_GPU_LIB", str(lib_path))
    monkeypatch.setattr(torch.version, "cuda", f"{major}.8")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    lib = _prebuilt.load()
    assert lib.usable and lib.device_count == 2 and lib.ops is not None, lib
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    lib = _prebuilt.load()
    assert not lib.usable and "torch sees no CUDA device" in lib.reason
    monkeypatch.setattr(torch.version, "cuda", "11.8")  # another major: probed, and this machine has no driver
    lib = _prebuilt.load()
    if not torch.cuda.is_available():
        assert not lib.usable and "no device" in lib.reason and "torch sees" not in lib.reason
