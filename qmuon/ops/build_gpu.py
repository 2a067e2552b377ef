"""Build the prebuilt GPU library: ``csrc/cuda/*.cu`` -> ``qmuon/_lib/libqmuon_cuda<major>.so``.

    python -m qmuon.ops.build_gpu                       # nvcc from CUDA_HOME or PATH, the default archs
    python -m qmuon.ops.build_gpu --nvcc /usr/local/cuda-12.9/bin/nvcc --cache /tmp/qmuon-nvcc
    NVCC=$(.ci/cuda12_toolkit.sh)                        # the CUDA 12 library from Debian's nvcc 12.4
    python -m qmuon.ops.build_gpu --nvcc $NVCC --ptxas $(dirname $NVCC)/../ptxas-12.9/ptxas
    python -m qmuon.ops.build_gpu --list qmuon/_lib/libqmuon_cuda13.so   # its SASS / PTX and symbols

The ``.cu`` kernels include no torch header and export a C ABI (``csrc/qmuon/kernels.h``), so they
are compiled ahead of time into a plain shared library that needs neither nvcc nor a torch C++ ABI
on the user's machine: the CUDA runtime is linked statically (``-cudart static``; it opens the
driver's ``libcuda.so.1`` only when it initializes), and only the ``qmuon_cuda_*`` functions are
exported (a linker version script). :mod:`._prebuilt` loads it with ctypes; :mod:`._cabi` calls it.
One library serves every torch version built for the same CUDA major.

Architectures (``--archs``, ``--ptx``): SASS for sm_80, sm_90, sm_100 and sm_120 (a cubin runs on
every GPU of its major with an equal or higher minor: sm_86/89, sm_103, GB10's sm_121) plus PTX for
compute_120, which the driver compiles for a newer GPU. sm_100 and sm_120 need nvcc 12.8 or newer;
an nvcc that lacks an asked-for architecture is an error, not a silent omission. An older nvcc (the
CUDA 12 library is built with Debian's 12.4, ``.ci/cuda12_toolkit.sh``) gets them from a newer
``ptxas`` (``--ptxas``, ``--ptxas-archs``): that ptxas compiles the newest PTX nvcc generates into
SASS for those architectures, and the cubins join nvcc's own fatbinary step (nvcc's ``-dryrun``
command list, run with that one step extended).

Each ``.cu`` file is compiled once per (sources, flags, architectures, nvcc) into ``--cache``
(default ``$QMUON_NVCC_CACHE``, else ``~/.cache/qmuon/nvcc``), so CI's compile check and the wheel build share the objects
and a second build only links. The library embeds a JSON build record (``qmuon_cuda_build_info``:
the hash of the sources it was built from, the architectures, the nvcc version); the loader refuses a
library built from other sources than the ones next to it.

Nothing here imports torch: the script runs in a build environment with nvcc only.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["build", "source_hash", "fatbin_entries", "exported_symbols", "DEFAULT_ARCHS", "DEFAULT_PTX"]

DEFAULT_ARCHS = (80, 90, 100, 120)
#: ``--host`` values that cross-compile the host side: (the g++ to use, the CUDA toolkit's target directory).
CROSS_HOSTS = {"aarch64": ("aarch64-linux-gnu-g++", "sbsa-linux")}
DEFAULT_PTX = (120,)
#: The C ABI a library must export (csrc/qmuon/kernels.h, adamw_kernels.h, weight_kernels.h, lib_info.cu).
EXPORTS = (
    "qmuon_cuda_q8_momentum_update", "qmuon_cuda_quantize_rows", "qmuon_cuda_dequantize_rows",
    "qmuon_cuda_error_string", "qmuon_cuda_int4_momentum_update", "qmuon_cuda_e0m3_momentum_update",
    "qmuon_cuda_e0m3_momentum_amax", "qmuon_cuda_dense_momentum_update", "qmuon_cuda_codec",
    "qmuon_cuda_adamw_q_update", "qmuon_cuda_bf16_weight_update", "qmuon_cuda_fp32_weight_update",
    "qmuon_cuda_abi_layout", "qmuon_cuda_build_info", "qmuon_cuda_runtime_version", "qmuon_cuda_probe",
)
# Same numerics as the JIT build (qmuon/ops/_extension.py): no FMA contraction, explicit __f*_rn.
NVCC_FLAGS = ("-std=c++17", "-O3", "--fmad=false", "-Xcompiler", "-fPIC")


def library_name(cuda_major: int) -> str:
    return f"libqmuon_cuda{cuda_major}.so"


def default_csrc() -> Path:
    """``$QMUON_CSRC_DIR`` when set (as for the JIT build), else ``qmuon/_csrc`` of an installed wheel,
    else the source checkout's ``csrc/``."""
    override = os.environ.get("QMUON_CSRC_DIR", "").strip()
    if override:
        return Path(override).resolve()
    pkg = Path(__file__).resolve().parents[1]
    for d in (pkg / "_csrc", pkg.parent / "csrc"):
        if (d / "cuda").is_dir():
            return d
    return pkg.parent / "csrc"


def default_out_dir() -> Path:
    return Path(__file__).resolve().parents[1] / "_lib"


def cu_sources(csrc: Path) -> list[Path]:
    return sorted((csrc / "cuda").glob("*.cu"))


def source_hash(csrc: Path) -> str:
    """sha256 (16 hex digits) of what the library is built from: every ``cuda/*.cu`` and ``qmuon/*.h``."""
    h = hashlib.sha256()
    for p in cu_sources(csrc) + sorted((csrc / "qmuon").glob("*.h")):
        h.update(p.relative_to(csrc).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def default_cache() -> Path:
    """``$QMUON_NVCC_CACHE``, else ``~/.cache/qmuon/nvcc`` (``.ci/run`` uses the same default)."""
    env = os.environ.get("QMUON_NVCC_CACHE", "").strip()
    return Path(env) if env else Path.home() / ".cache" / "qmuon" / "nvcc"


def find_nvcc(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_release(tool: str) -> str:
    """The CUDA release (``"12.4"``) an nvcc or ptxas belongs to, from its ``--version``."""
    out = subprocess.run([tool, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the CUDA release from `{tool} --version`:\n{out}")
    return m.group(1)


def nvcc_root(nvcc: str) -> Path:
    """The toolkit directory nvcc works from (``$(_HERE_)/..`` of its dry run: nvcc may be a wrapper script)."""
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "e.cu").write_text("")
        out = subprocess.run([nvcc, "-dryrun", "-c", "e.cu", "-o", "e.o"], capture_output=True, text=True, cwd=d,
                             timeout=60).stderr
    here = next((line[len("#$ _HERE_="):] for line in out.splitlines() if line.startswith("#$ _HERE_=")), None)
    return Path(here).parent if here else Path(nvcc).resolve().parent.parent


def supported_codes(nvcc: str) -> set[str]:
    """``sm_XY`` / ``compute_XY`` names this nvcc can generate."""
    codes: set[str] = set()
    for flag in ("--list-gpu-code", "--list-gpu-arch"):
        out = subprocess.run([nvcc, flag], capture_output=True, text=True, timeout=60).stdout
        codes.update(out.split())
    return codes


def gencode_flags(archs: tuple[int, ...], ptx: tuple[int, ...]) -> list[str]:
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    for a in ptx:
        flags += ["-gencode", f"arch=compute_{a},code=compute_{a}"]
    return flags


def _run(cmd: list[str], what: str) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {p.returncode}):\n$ {' '.join(cmd)}\n{p.stdout}{p.stderr}")


def _with_extra_sass(commands: list[str], ptxas: str, archs: tuple[int, ...], workdir: str) -> list[str]:
    """nvcc's command list (``-dryrun``) with SASS for ``archs`` compiled by ``ptxas`` from the newest PTX
    the list generates, each cubin added to its fatbinary step as one more ELF image."""
    fat = [i for i, c in enumerate(commands) if c.startswith("fatbinary ")]
    if len(fat) != 1:
        raise RuntimeError(f"expected one fatbinary step in nvcc's command list, found {len(fat)}")
    ptx = re.findall(r'--image3=kind=ptx,sm=(\d+),file=([^"\s]+)', commands[fat[0]])
    if not ptx:
        raise RuntimeError("--ptxas-archs needs PTX in the library (--ptx): the newer ptxas compiles that PTX")
    _sm, ptx_file = max(ptx, key=lambda m: int(m[0]))
    steps, images = [], []
    for a in archs:
        cubin = os.path.join(workdir, f"extra_sm_{a}.cubin")
        # nvcc's own ptxas flags for these sources (-m64 --fmad false), with the other compiler and target.
        steps.append(f"{shlex.quote(ptxas)} -arch=sm_{a} -m64 --fmad false {shlex.quote(ptx_file)} -o {shlex.quote(cubin)}")
        images.append(f'"--image3=kind=elf,sm={a},file={cubin}"')
    out = list(commands)
    out[fat[0]] = commands[fat[0]] + " " + " ".join(images)
    return out[:fat[0]] + steps + out[fat[0]:]


def _compile_with_extra_sass(nvcc: str, args: list[str], ptxas: str, archs: tuple[int, ...]) -> None:
    """``nvcc args``, run step by step from its ``-dryrun`` list with :func:`_with_extra_sass` applied."""
    with tempfile.TemporaryDirectory(prefix="qmuon-nvcc-") as workdir:
        env = {**os.environ, "TMPDIR": workdir}  # nvcc's intermediate files: private to this compile
        p = subprocess.run([nvcc, "-dryrun", *args], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"nvcc -dryrun failed (exit {p.returncode}):\n{p.stdout}{p.stderr}")
        commands = []
        for line in p.stderr.splitlines():
            if not line.startswith("#$ "):
                continue
            m = re.match(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line[3:])
            if m:  # nvcc's environment for its steps (PATH to cicc, ...), not shell syntax
                env[m.group(1)] = m.group(2).strip()
            else:
                commands.append(line[3:])
        # nvcc ignores a failed clean-up of an intermediate file that a step did not write; so does this.
        commands = [("rm -f " + c[3:]) if c.startswith("rm ") else c for c in commands]
        script = "\n".join(["set -e", *_with_extra_sass(commands, ptxas, archs, workdir)])
        p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"nvcc {args[-3]} with SASS from {ptxas} failed (exit {p.returncode}):\n"
                               f"{script}\n{p.stdout}{p.stderr}")


def build(nvcc: str | None = None, archs: tuple[int, ...] | None = None, ptx: tuple[int, ...] | None = None,
          out_dir: Path | None = None, cache: Path | None = None, csrc: Path | None = None, jobs: int = 0,
          ptxas: str | None = None, ptxas_archs: tuple[int, ...] = (), host: str | None = None, log=print) -> Path:
    """Compile (or take from ``cache``) every ``csrc/cuda/*.cu`` and link the library; return its path.

    ``archs`` / ``ptx`` default to the shipped targets (:data:`DEFAULT_ARCHS`, :data:`DEFAULT_PTX`); with an
    nvcc that lacks some of them (CUDA < 12.8), to the SASS it has, PTX for its newest architecture, and
    the rest of :data:`DEFAULT_ARCHS` as ``ptxas_archs`` (which then need ``ptxas``). ``ptxas_archs``:
    more SASS, compiled by ``ptxas`` from the newest PTX. ``host``: cross-compile the host side for another
    CPU (:data:`CROSS_HOSTS`: ``"aarch64"``, for GB10 / Grace); the nvcc's toolkit needs that target's
    runtime (``targets/sbsa-linux``, which ``.ci/cuda13_aarch64.sh`` adds to a copy of the toolkit)."""
    nvcc = find_nvcc(nvcc)
    if nvcc is None:
        raise RuntimeError("nvcc not found: pass --nvcc, set CUDA_HOME, or put nvcc on PATH")
    csrc = csrc or default_csrc()
    out_dir = out_dir or default_out_dir()
    cache = cache or default_cache()
    version = cuda_release(nvcc)
    major = int(version.split(".")[0])
    have = supported_codes(nvcc)
    if archs is None and ptx is None and not ptxas_archs:
        archs = tuple(a for a in DEFAULT_ARCHS if f"sm_{a}" in have)
        native_ptx = [a for a in DEFAULT_PTX if f"compute_{a}" in have]
        ptx = tuple(native_ptx) or (max(archs),)
        ptxas_archs = tuple(a for a in DEFAULT_ARCHS if a not in archs)
        if ptxas_archs and not ptxas:
            raise RuntimeError(
                f"nvcc {version} ({nvcc}) cannot generate {', '.join(f'sm_{a}' for a in ptxas_archs)}: pass a ptxas "
                "that can (--ptxas; .ci/cuda12_toolkit.sh puts ptxas 12.9 next to its nvcc 12.4), an nvcc 12.8 or "
                "newer, or --archs / --ptx this nvcc supports")
    archs = DEFAULT_ARCHS if archs is None else archs
    ptx = DEFAULT_PTX if ptx is None else ptx
    missing = [f"sm_{a}" for a in archs if f"sm_{a}" not in have] + \
              [f"compute_{a}" for a in ptx if f"compute_{a}" not in have]
    if missing:
        raise RuntimeError(f"nvcc {version} ({nvcc}) cannot generate {', '.join(missing)} "
                           "(sm_100 and sm_120 need CUDA 12.8 or newer); pass --archs / --ptx it supports, "
                           "or --ptxas-archs with a newer --ptxas")
    extra = tuple(a for a in ptxas_archs if a not in archs)
    ptxas_release = None
    if extra:
        if not ptxas:
            raise RuntimeError("--ptxas-archs needs --ptxas (the ptxas that compiles the PTX for them)")
        ptxas_release = cuda_release(ptxas)
    cross: list[str] = []
    if host and host != platform.machine():
        if host not in CROSS_HOSTS:
            raise RuntimeError(f"--host {host}: cross-compiling is set up for {', '.join(CROSS_HOSTS)} only")
        cxx, target_dir = CROSS_HOSTS[host]
        if shutil.which(cxx) is None:
            raise RuntimeError(f"--host {host} needs the cross compiler {cxx} (Debian: apt-get install g++-{host}-linux-gnu)")
        if not (nvcc_root(nvcc) / "targets" / target_dir / "lib").is_dir():
            raise RuntimeError(f"--host {host}: {nvcc}'s toolkit has no targets/{target_dir}/lib (the {host} CUDA "
                               "runtime); .ci/cuda13_aarch64.sh assembles one")
        cross = ["-ccbin", cxx, "--target-directory", target_dir]
    sources = cu_sources(csrc)
    if not sources:
        raise RuntimeError(f"no .cu files under {csrc / 'cuda'}")
    record = {"sources": source_hash(csrc), "cuda": version, "host": host or platform.machine(), "sass": [f"sm_{a}" for a in sorted(archs + extra)],
              "ptx": [f"compute_{a}" for a in ptx]}
    if extra:
        record["ptxas"] = {"release": ptxas_release, "sass": [f"sm_{a}" for a in extra]}
    info = json.dumps(record, separators=(",", ":"))
    gencode = gencode_flags(archs, ptx)
    headers = b"".join(p.read_bytes() for p in sorted((csrc / "qmuon").glob("*.h")))
    cache.mkdir(parents=True, exist_ok=True)

    # The build record reaches lib_info.cu as a generated header (a -D string would lose its quotes to
    # nvcc's own argument splitting).
    info_dir = cache / f"info-{hashlib.sha256(info.encode()).hexdigest()[:16]}"
    info_dir.mkdir(parents=True, exist_ok=True)
    (info_dir / "qmuon_build_info.h").write_text(f"#define QMUON_BUILD_INFO {json.dumps(info)}\n")

    def obj_for(src: Path) -> tuple[Path, list[str]]:
        defs = ["-DQMUON_HAVE_BUILD_INFO", "-I", str(info_dir)] if src.name == "lib_info.cu" else []
        flags = [*NVCC_FLAGS, *cross, *gencode, *defs, "-I", str(csrc)]
        key = hashlib.sha256(repr((version, flags[:-1], src.name, info if defs else "", extra, ptxas_release)).encode()
                             + src.read_bytes() + headers)
        return cache / f"{src.stem}-{key.hexdigest()[:16]}.o", flags

    def compile_one(src: Path) -> tuple[str, float, bool]:
        obj, flags = obj_for(src)
        if obj.exists():
            return src.name, 0.0, True
        t0 = time.perf_counter()
        tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
        if extra:
            _compile_with_extra_sass(nvcc, ["-c", *flags, str(src), "-o", str(tmp)], str(ptxas), extra)
        else:
            _run([nvcc, "-c", *flags, str(src), "-o", str(tmp)], f"nvcc {src.name}")
        os.replace(tmp, obj)  # atomic: a concurrent build never links a half-written object
        return src.name, time.perf_counter() - t0, False

    by_ptxas = f" + {' '.join(f'sm_{a}' for a in extra)} by ptxas {ptxas_release}" if extra else ""
    log(f"qmuon: building {library_name(major)} ({record['host']}) with nvcc {version}: SASS {' '.join(f'sm_{a}' for a in archs)}"
        f"{by_ptxas}, PTX {' '.join(f'compute_{a}' for a in ptx) or 'none'} ({len(sources)} files; cache {cache})")
    t0 = time.perf_counter()
    workers = jobs or max(1, min(len(sources), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for name, dt, cached in pool.map(compile_one, sources):
            log(f"  {name}: {'cached' if cached else f'compiled in {dt:.1f} s'}")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / library_name(major)
    with tempfile.TemporaryDirectory() as tmpdir:
        script = Path(tmpdir) / "exports.map"
        # Only the C ABI is exported: the static CUDA runtime's symbols stay private to the library.
        script.write_text("{\n  global:\n    qmuon_cuda_*;\n  local:\n    *;\n};\n")
        tmp_out = out.with_suffix(f".{os.getpid()}.tmp")
        _run([nvcc, "-shared", "-cudart", "static", *cross, *gencode, "-o", str(tmp_out),
              *[str(obj_for(s)[0]) for s in sources], "-Xlinker", f"--version-script={script}",
              "-Xlinker", "--strip-all"], "linking")  # no static symbol table: 0.35 MB less, exports kept
        os.replace(tmp_out, out)
    missing_syms = sorted(set(EXPORTS) - set(exported_symbols(out)))
    if missing_syms:
        raise RuntimeError(f"{out} does not export {', '.join(missing_syms)}")
    log(f"qmuon: wrote {out} ({out.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s")
    return out


# ---------------------------------------------------------------------------------------------
# inspecting a library without CUDA tools: its exported symbols and its fatbin's SASS / PTX
# ---------------------------------------------------------------------------------------------
def _elf_sections(data: bytes) -> dict[str, tuple[int, int]]:
    """name -> (file offset, size) of every section of a little-endian ELF64 file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    str_off = heads[shstrndx][4]
    out = {}
    for h in heads:
        end = data.index(b"\0", str_off + h[0])
        out[data[str_off + h[0]:end].decode()] = (h[4], h[5])
    return out


def fatbin_entries(path: str | os.PathLike[str]) -> list[tuple[str, str]]:
    """``[("sass", "sm_90"), ("ptx", "compute_120"), ...]`` in the library's ``.nv_fatbin`` section.

    The fatbin layout (not documented by NVIDIA; the same reading as cuobjdump's listing, checked
    against it in tests/test_prebuilt_gpu.py): blobs with a 16-byte header (magic 0xBA55ED50, version,
    header size, payload size), each holding entries with a header of ``kind`` (u16: 1 PTX, 2 ELF),
    version (u16), header size (u32), payload size (u64), ..., and the sm version at byte 28.
    """
    data = Path(path).read_bytes()
    secs = _elf_sections(data)
    if ".nv_fatbin" not in secs:
        return []
    off, size = secs[".nv_fatbin"]
    pos, end, out = off, off + size, []
    while pos + 16 <= end:
        magic, _version, hsize, fsize = struct.unpack_from("<IHHQ", data, pos)
        if magic != 0xBA55ED50:
            pos += 8  # blobs are 8-byte aligned; skip padding
            continue
        e, blob_end = pos + hsize, pos + hsize + fsize
        while e + 32 <= blob_end:
            kind, _v, ehsize, esize = struct.unpack_from("<HHIQ", data, e)
            sm, = struct.unpack_from("<I", data, e + 28)
            if kind in (1, 2):
                out.append(("ptx" if kind == 1 else "sass", f"{'compute' if kind == 1 else 'sm'}_{sm}"))
            e += ehsize + esize
        pos = blob_end
    return out


def exported_symbols(path: str | os.PathLike[str]) -> list[str]:
    """Defined, global function symbols of the library's dynamic symbol table."""
    data = Path(path).read_bytes()
    secs = _elf_sections(data)
    sym_off, sym_size = secs[".dynsym"]
    str_off, _ = secs[".dynstr"]
    names = []
    for i in range(sym_size // 24):
        name, info, _other, shndx, _value, _size = struct.unpack_from("<IBBHQQ", data, sym_off + i * 24)
        if shndx != 0 and (info >> 4) == 1 and (info & 0xF) == 2:  # defined, GLOBAL, FUNC
            names.append(data[str_off + name:data.index(b"\0", str_off + name)].decode())
    return sorted(names)


def describe(path: str | os.PathLike[str]) -> dict[str, object]:
    entries = fatbin_entries(path)
    return {"path": str(path), "bytes": os.path.getsize(path),
            "sass": sorted({a for k, a in entries if k == "sass"}, key=lambda s: int(s.split("_")[1])),
            "ptx": sorted({a for k, a in entries if k == "ptx"}, key=lambda s: int(s.split("_")[1])),
            "exports": exported_symbols(path)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qmuon.ops.build_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvcc", default=None, help="the nvcc to build with (default: $CUDA_HOME/bin/nvcc, PATH)")
    parser.add_argument("--archs", default=None, help="SASS targets (default: 80,90,100,120, what nvcc can)")
    parser.add_argument("--ptx", default=None, help="PTX targets (default: 120, else nvcc's newest SASS target)")
    parser.add_argument("--ptxas", default=None, help="a newer ptxas for --ptxas-archs")
    parser.add_argument("--ptxas-archs", default="", help="SASS targets compiled by --ptxas from the newest PTX "
                        "(for an nvcc that lacks them), e.g. 100,120")
    parser.add_argument("--host", default=None, choices=sorted(CROSS_HOSTS),
                        help="cross-compile the host side for this CPU (default: this machine's)")
    parser.add_argument("--out", default=None, help="output directory (default: the package's qmuon/_lib)")
    parser.add_argument("--cache", default=None, help="object cache (default: $QMUON_NVCC_CACHE or ~/.cache/qmuon/nvcc)")
    parser.add_argument("--jobs", type=int, default=0, help="parallel nvcc processes (default: one per core)")
    parser.add_argument("--list", default=None, metavar="LIB", help="print a built library's SASS / PTX / exports")
    args = parser.parse_args(argv)
    if args.list:
        print(json.dumps(describe(args.list), indent=1))
        return 0
    ints = lambda s: tuple(int(x) for x in s.replace(";", ",").split(",") if x.strip())  # noqa: E731
    try:
        build(args.nvcc, None if args.archs is None else ints(args.archs), None if args.ptx is None else ints(args.ptx),
              Path(args.out) if args.out else None,
              Path(args.cache) if args.cache else None, jobs=args.jobs, ptxas=args.ptxas,
              ptxas_archs=ints(args.ptxas_archs), host=args.host)
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        print(f"qmuon: GPU library build failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
