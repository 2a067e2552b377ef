"""``qmuon-doctor``: what a user runs first on a new machine (about a minute).

    qmuon-doctor                      # the first CUDA device if there is one, else the CPU
    qmuon-doctor --device cpu         # the CPU path only
    python -m qmuon_lightning.doctor --numel 67108864 --json report.json

It prints one table and exits 0 when every check passed, 1 otherwise; each failure it knows comes with
its fix. The checks, in order:

* **versions**: torch, its CUDA, ``nvcc`` (the toolkit the kernels build with), Python, the CPU;
* **build**: which backend serves ``torch.ops.qmuon`` (``cpu+cuda-extension``, ``cpu-extension`` or
  ``reference``) and why: loaded from the cache, built now (with the time), or fell back (the error);
* **device**: the GPU's compute capability and whether the build targets it (an ``sm_XY`` image or PTX
  that the driver can JIT; ``TORCH_CUDA_ARCH_LIST`` sets the targets), and the ``ns_dtype="auto"``
  choice there;
* **ops**: every ``torch.ops.qmuon`` op with a compiled twin, run once on the device through the
  dispatcher (the guarded kernel, which counts whether the compiled kernel or the reference served it)
  and compared with its pure-PyTorch reference on the same device: bit for bit, the per-block sums of
  squares within fp32 summation-order tolerance (``2 * block_size * 2**-24`` relative);
* **bandwidth**: the fused momentum update of every format against ``copy_`` of the same bytes, in the
  same run (a ratio, so a loaded machine still gives a meaningful number; reported, not a pass/fail);
* **nccl**: with two or more GPUs, an all-to-all of the uint8 carrier the sharded optimizer sends
  (one process per GPU), checked element for element.

The CPU path skips what needs a GPU and still finishes in well under a minute once the kernels are
built (the first build takes a minute or more and is reported as such).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = ["Check", "main", "run_checks"]

PASS, FAIL, WARN, SKIP, INFO = "PASS", "FAIL", "WARN", "SKIP", "info"


@dataclass
class Check:
    """One row of the doctor's table."""

    name: str
    result: str  # PASS / FAIL / WARN / SKIP / info
    detail: str = ""
    fix: str = ""


# ---------------------------------------------------------------------------------------------
# versions, build, device
# ---------------------------------------------------------------------------------------------
def _nvcc_version() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return None
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release ([0-9.]+)", out)
    return m.group(1) if m else out.strip().splitlines()[-1] if out.strip() else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def version_checks() -> list[Check]:
    nvcc = _nvcc_version()
    rows = [Check("python", INFO, sys.version.split()[0]),
            Check("torch", INFO, f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"),
            Check("cpu", INFO, f"{_cpu_model()}, {os.cpu_count()} logical cores")]
    if torch.version.cuda is None:
        rows.append(Check("nvcc", INFO, nvcc or "not found (CPU-only torch: not needed)"))
    elif nvcc is None:
        from qmuon.ops import _prebuilt

        if _prebuilt._candidates():  # the wheel's compiled CUDA kernels need no toolkit (row `gpu library`)
            rows.append(Check("nvcc", INFO, "not found; not needed while the prebuilt GPU library serves"))
        else:
            rows.append(Check("nvcc", WARN, "not found, and no prebuilt GPU library: the CUDA kernels cannot be built",
                              "install a qmuon-lightning wheel with qmuon/_lib/libqmuon_cuda*.so, or the CUDA "
                              "toolkit matching torch's CUDA (CUDA_HOME)"))
    else:
        major = lambda v: v.split(".")[0]  # noqa: E731
        same = major(nvcc) == major(torch.version.cuda)
        rows.append(Check("nvcc", INFO if same else WARN, f"{nvcc} (torch built with {torch.version.cuda})",
                          "" if same else "use a toolkit with the same major version as torch's CUDA "
                          "(CUDA_HOME), or install the torch build for this toolkit"))
    return rows


def build_check() -> tuple[Check, Any]:
    """Load (or build) the extension; say which backend serves the ops and why."""
    from qmuon.ops import _extension

    cached = None
    try:
        want_cuda, _ = _extension._cuda_wanted()
        spec = _extension._build_spec(want_cuda)
        cached = os.path.exists(os.path.join(spec["build_directory"], spec["name"] + ".so"))
    except Exception:  # noqa: BLE001 - only the "cached" wording depends on it
        pass
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            st = _extension.status()
    except (RuntimeError, ValueError) as err:  # QMUON_BACKEND=extension and no build, or a bad value
        return Check("build", FAIL, str(err), _build_fix(str(err))), None
    dt = time.perf_counter() - t0
    how = "loaded from the cache" if cached else f"built now in {dt:.0f} s"
    if st.backend == "reference":
        if st.reason == "QMUON_BACKEND=reference":
            return Check("build", WARN, "reference: QMUON_BACKEND=reference (no compiled kernels)",
                         "unset QMUON_BACKEND to use the compiled kernels"), st
        return Check("build", FAIL, f"reference (fell back): {st.reason}", _build_fix(st.reason or "")), st
    detail = f"{st.backend}, {how} ({st.library})"
    if st.cuda_source:
        detail += f"; CUDA kernels: {st.cuda_source}"
    if torch.cuda.is_available() and not st.cuda:
        return Check("build", FAIL, f"{detail}; no CUDA kernels: {st.reason}", _build_fix(st.reason or "")), st
    if st.reason:
        detail += f"; note: {st.reason}"
    return Check("build", PASS, detail), st


def gpu_library_checks(st: Any) -> list[Check]:
    """The prebuilt GPU library (qmuon/_lib/libqmuon_cuda<major>.so) as the loader found it, and the
    loading order it went through."""
    if st is None:
        return []
    rows = []
    lib = st.gpu_library
    if lib is not None:
        if lib.usable:
            rows.append(Check("gpu library", PASS, lib.summary()))
        elif lib.path is None:
            rows.append(Check("gpu library", INFO, lib.summary()))
        elif "no device" in (lib.reason or "") or "has no CUDA" in (lib.reason or ""):
            # present and loadable (struct layout and sources checked), nothing to run it on
            rows.append(Check("gpu library", INFO, f"present; {lib.summary()}"))
        else:
            rows.append(Check("gpu library", WARN, lib.summary(),
                              "python -m qmuon.ops.build_gpu rebuilds it; reinstalling qmuon-lightning restores it"))
    from qmuon.ops import _prebuilt

    shipped = sorted(p.name for p in _prebuilt.lib_dir().glob("libqmuon_cuda*.so"))
    if shipped:  # one per CUDA major; the loader tries torch's major first
        rows.append(Check("gpu libraries shipped", INFO, ", ".join(shipped)))
    if st.steps:
        rows.append(Check("loading order", INFO, "; ".join(st.steps)))
    return rows


def _build_fix(reason: str) -> str:
    r = reason.lower()
    if "not found" in r and "source" in r:
        return "reinstall qmuon-lightning (the wheel ships csrc/ as qmuon_lightning/_csrc) or use a source checkout"
    if "nvcc" in r or "cuda_home" in r or "toolkit" in r:
        return "install the CUDA toolkit matching torch.version.cuda and set CUDA_HOME"
    if "ninja" in r:
        return "pip install ninja"
    return ("see the compiler error above; `python -m qmuon.ops.build --verbose` shows the commands "
            "(QMUON_BACKEND=reference runs the pure-PyTorch kernels meanwhile)")


def _parse_arch_list(text: str) -> list[tuple[int, int, bool]]:
    """``"9.0 10.0;12.1+PTX"`` -> [(9, 0, False), (10, 0, False), (12, 1, True)]."""
    out = []
    for item in re.split(r"[;\s,]+", text.strip()):
        m = re.fullmatch(r"(\d+)\.(\d+)([a-z]?)(\+PTX)?", item.strip(), flags=re.I)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), m.group(4) is not None))
    return out


def arch_targets_device(arch_list: str | None, capability: tuple[int, int]) -> tuple[bool, str]:
    """Whether a build for ``TORCH_CUDA_ARCH_LIST=arch_list`` runs on a device of ``capability``:
    an ``sm_XY`` image of the same major version and a minor <= the device's (binary compatibility
    within a major version), or PTX of a lower or equal version (JIT-compiled by the driver). An unset
    list builds for the visible devices (torch's default), which targets them."""
    if not arch_list:
        return True, "TORCH_CUDA_ARCH_LIST unset: built for the visible devices"
    major, minor = capability
    for a_major, a_minor, ptx in _parse_arch_list(arch_list):
        if a_major == major and a_minor <= minor:
            return True, f"sm_{a_major}{a_minor} image in TORCH_CUDA_ARCH_LIST={arch_list!r}"
        if ptx and (a_major, a_minor) <= (major, minor):
            return True, f"PTX {a_major}.{a_minor} (JIT) in TORCH_CUDA_ARCH_LIST={arch_list!r}"
    return False, f"TORCH_CUDA_ARCH_LIST={arch_list!r} has no image or PTX for {major}.{minor}"


def _lib_arch_list(lib: Any) -> str:
    """The prebuilt library's targets as a TORCH_CUDA_ARCH_LIST: sm_80 -> "8.0", compute_120 -> "12.0+PTX"."""
    def ver(code: str) -> str:
        n = int(code.split("_")[1])
        return f"{n // 10}.{n % 10}"

    return " ".join([ver(a) for a in lib.sass] + [ver(a) + "+PTX" for a in lib.ptx])


def device_checks(device: torch.device, st: Any = None) -> list[Check]:
    rows = []
    if device.type == "cuda":
        idx = device.index or 0
        cap = torch.cuda.get_device_capability(idx)
        name = torch.cuda.get_device_name(idx)
        if st is not None and st.cuda_source == "prebuilt":
            ok, why = arch_targets_device(_lib_arch_list(st.gpu_library), cap)
            why = why.replace("TORCH_CUDA_ARCH_LIST=", "the prebuilt library's targets ")
        else:
            ok, why = arch_targets_device(os.environ.get("TORCH_CUDA_ARCH_LIST"), cap)
        rows.append(Check("device", PASS if ok else FAIL,
                          f"{device}: {name}, compute capability {cap[0]}.{cap[1]}, "
                          f"{torch.cuda.device_count()} GPU(s); {why}",
                          "" if ok else f"export TORCH_CUDA_ARCH_LIST='{cap[0]}.{cap[1]}+PTX' and rebuild "
                          "(python -m qmuon.ops.build)"))
    else:
        rows.append(Check("device", INFO, "cpu (no CUDA device visible)" if not torch.cuda.is_available()
                          else "cpu (asked for with --device cpu)"))
    try:
        from qmuon.core.newton_schulz import resolve_ns_dtype

        dt = resolve_ns_dtype("auto", device)
        env = os.environ.get("QMUON_NS_DTYPE")
        rows.append(Check("ns_dtype='auto'", INFO, f"{str(dt).replace('torch.', '')} on {device}"
                          + (f" (QMUON_NS_DTYPE={env} overrides)" if env else "")))
    except Exception as err:  # noqa: BLE001
        rows.append(Check("ns_dtype='auto'", FAIL, f"{type(err).__name__}: {err}",
                          "set QMUON_NS_DTYPE=bf16 or fp32"))
    return rows


# ---------------------------------------------------------------------------------------------
# ops: every compiled op once against its reference
# ---------------------------------------------------------------------------------------------
def _samples(device: torch.device) -> dict[str, Callable[[], tuple]]:
    """Arguments of one call of each op (built fresh per call: the updates mutate them): the first-use
    canary's sample calls (qmuon/ops/_canary_samples.py) at a larger size, a partial last block and an odd
    number of rows."""
    from qmuon.ops import _canary_samples

    return _canary_samples.samples(device, rows=37, cols=300, bs=64, grid=32)


def _compare_call(op: Any, args_a: tuple, args_b: tuple) -> str | None:
    """Run the dispatcher (compiled kernel where supported) on ``args_a`` and the reference on
    ``args_b``; None when outputs and mutated arguments agree, else what differs."""
    from qmuon.ops import _canary

    out_a = getattr(torch.ops.qmuon, op.name)(*args_a)
    out_b = op.reference(*args_b)
    return _canary.compare(op, out_a, out_b, args_a, args_b)


def op_checks(device: torch.device, status: Any) -> list[Check]:
    from qmuon.ops import _canary, _kernels
    from qmuon.ops._library import OPS

    compiled = status is not None and (status.cuda if device.type == "cuda" else status.cpu)
    samples = _samples(device)
    rows: list[Check] = []
    for name, op in OPS.items():
        if op.supported is None:
            continue  # reference-only op: nothing to compare
        make = samples.get(name)
        if make is None:
            rows.append(Check(f"op {name}", WARN, "no sample call in qmuon_lightning/doctor.py; not checked",
                              "add one to _samples()"))
            continue
        before = _kernels.served[(name, "compiled")]
        try:
            args_a = make()
            args_b = _canary.clone_args(args_a)
            problem = _compare_call(op, args_a, args_b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        except Exception as err:  # noqa: BLE001 - every failure is a row, with its fix
            text = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            rows.append(Check(f"op {name}", FAIL, text, _op_fix(text)))
            continue
        served = "compiled" if _kernels.served[(name, "compiled")] > before else "reference"
        if problem:
            rows.append(Check(f"op {name}", FAIL, f"{served} kernel: {problem}",
                              "a kernel bug: report this table; QMUON_BACKEND=reference is the workaround"))
        elif compiled and served != "compiled" and (name, device.type) in _canary.failures():
            rows.append(Check(f"op {name}", FAIL, f"its first-use canary failed on {device.type}, so the reference "
                              f"serves it: {_canary.failures()[(name, device.type)]}",
                              "a kernel bug on this machine: report this table; the reference keeps results right"))
        elif compiled and served != "compiled":
            rows.append(Check(f"op {name}", FAIL, "the reference served this call although the kernels loaded",
                              "the op's compiled_when predicate rejected the sample; report this table"))
        else:
            rows.append(Check(f"op {name}", PASS, f"{served} == reference on {device}"))
    spent = {k: v for k, v in _canary.timings().items() if k[1] == device.type}
    if spent:
        bad = sorted(n for (n, d) in _canary.failures() if d == device.type)
        rows.append(Check("first-use canary", FAIL if bad else PASS,
                          f"{len(spent)} op(s) checked on {device.type} in {1e3 * sum(spent.values()):.1f} ms"
                          + (f"; failed: {', '.join(bad)}" if bad else ""),
                          "report this table; the failed ops run the reference" if bad else ""))
    return rows


def _op_fix(text: str) -> str:
    if "no kernel image" in text:
        cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else ("X", "Y")
        return f"export TORCH_CUDA_ARCH_LIST='{cap[0]}.{cap[1]}+PTX' and rebuild (python -m qmuon.ops.build)"
    if "out of memory" in text:
        return "free GPU memory (another process holds it) and rerun"
    return "a kernel error: report this table; QMUON_BACKEND=reference is the workaround"


# ---------------------------------------------------------------------------------------------
# bandwidth: the fused update vs copy_ of the same bytes
# ---------------------------------------------------------------------------------------------
def _time_once(device: torch.device, fn: Callable[[], Any]) -> float:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timed_pair(device: torch.device, fn: Callable[[], Any], other: Callable[[], Any], reps: int,
                warmup: int = 2) -> tuple[float, float]:
    """Median seconds of ``fn`` and of ``other``, timed alternately (so a machine whose load changes
    during the run slows both alike and their ratio stays meaningful)."""
    for _ in range(warmup):
        fn()
        other()
    a, b = [], []
    for _ in range(reps):
        a.append(_time_once(device, fn))
        b.append(_time_once(device, other))
    a.sort()
    b.sort()
    return a[len(a) // 2], b[len(b) // 2]


def bandwidth_checks(device: torch.device, numel: int, reps: int) -> list[Check]:
    """Each format's fused update (bf16 grad, nearest rounding, sums of squares) on one matrix of
    ``numel`` elements, in GB/s of the bytes it must move, and as a fraction of ``copy_`` moving the
    same number of bytes in the same run."""
    from qmuon.ops import reference as ref
    from qmuon.ops import reference_4bit as ref4
    from qmuon.ops import empty_block_sumsq

    cols = 4096
    rows = max(1, numel // cols)
    bs = 256
    gen = torch.Generator().manual_seed(1)
    m = (torch.randn(rows, cols, generator=gen) * 0.02).to(device)
    grad = (torch.randn(rows, cols, generator=gen) * 0.1).to(device, torch.bfloat16)
    n = rows * cols
    nb = ref.num_blocks(cols, bs)
    g_bytes = 2 * 2 * n  # bf16 read + write
    sums_bytes = 4 * rows * nb
    q8 = [t.to(device) for t in ref.quantize_rows(m.cpu(), bs, signed=True)]
    i4 = [t.to(device) for t in ref4.int4_quantize(m.cpu(), bs)]
    e3 = [t.to(device) for t in ref4.e0m3_quantize(m.cpu())]
    e3[2] = e3[2].reshape(1)
    buf = m.clone()
    sums = empty_block_sumsq([grad], bs)
    q = torch.ops.qmuon
    cases: dict[str, tuple[Callable[[], Any], int]] = {
        "q8": (lambda: q.q8_momentum_update_multi_([q8[0]], [q8[1]], [grad], sums, 0.95, True, bs, [-1], [0]),
               g_bytes + 2 * n + 2 * 4 * rows * nb + sums_bytes),
        "int4": (lambda: q.int4_momentum_update_multi_([i4[0]], [i4[1]], [grad], sums, 0.95, True, bs, [-1], [0]),
                 g_bytes + 2 * (n // 2) + 2 * 4 * rows * nb + sums_bytes),
        # e0m3 reads the state and the grad twice (pass 1 finds the new tensor scale)
        "e0m3": (lambda: q.e0m3_momentum_update_multi_([e3[0]], [e3[1]], [e3[2]], [grad], sums, 0.95, True, bs,
                                                       [-1], [0]),
                 g_bytes + 2 * n + 3 * (n // 2) + 3 * (n // 16) + sums_bytes),
        "dense fp32": (lambda: q.dense_momentum_update_multi_([buf], [grad], sums, 0.95, True, bs, [-1], [0]),
                       g_bytes + 2 * 4 * n + sums_bytes),
    }
    rows_out = []
    src = torch.empty(max(cases[k][1] for k in cases) // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for name, (fn, nbytes) in cases.items():
        half = nbytes // 2
        s, d = src[:half], dst[:half]
        try:
            t_op, t_copy = _timed_pair(device, fn, lambda: d.copy_(s), reps)
        except Exception as err:  # noqa: BLE001
            rows_out.append(Check(f"bandwidth {name}", FAIL, f"{type(err).__name__}: {err}", _op_fix(str(err))))
            continue
        gbs, copy_gbs = nbytes / t_op / 1e9, nbytes / t_copy / 1e9
        rows_out.append(Check(f"bandwidth {name}", INFO,
                              f"{gbs:.1f} GB/s = {gbs / copy_gbs:.2f}x copy_ ({copy_gbs:.1f} GB/s), "
                              f"{rows}x{cols} bf16 grad, medians of {reps} alternating runs"))
    return rows_out


# ---------------------------------------------------------------------------------------------
# NCCL all-to-all of the carrier (several GPUs)
# ---------------------------------------------------------------------------------------------
def _all_to_all_worker(rank: int, world: int, init_file: str, numel: int) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # the carrier: uint8 bytes, rank r sends chunk j filled with (r * 16 + j) % 251 to rank j
        send = torch.cat([torch.full((numel,), (rank * 16 + j) % 251, dtype=torch.uint8, device="cuda")
                          for j in range(world)])
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        torch.cuda.synchronize()
        want = torch.cat([torch.full((numel,), (j * 16 + rank) % 251, dtype=torch.uint8, device="cuda")
                          for j in range(world)])
        if not torch.equal(recv, want):
            raise RuntimeError(f"rank {rank}: all-to-all delivered wrong bytes")
    finally:
        dist.destroy_process_group()


def nccl_check(timeout_s: float = 120.0) -> Check:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        return Check("nccl all-to-all", SKIP, f"{n} GPU(s): needs two or more")
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        try:
            ctx = mp.start_processes(_all_to_all_worker, args=(n, os.path.join(tmp, "init"), 1 << 20), nprocs=n,
                                     join=False, start_method="spawn")
            while not ctx.join(timeout=timeout_s):
                if time.perf_counter() - t0 > timeout_s:
                    for p in ctx.processes:
                        p.kill()
                    return Check("nccl all-to-all", FAIL, f"timed out after {timeout_s:.0f} s",
                                 "check NCCL_DEBUG=INFO output; P2P / network settings (NCCL_P2P_DISABLE=1)")
        except Exception as err:  # noqa: BLE001
            return Check("nccl all-to-all", FAIL, f"{type(err).__name__}: {str(err).splitlines()[0][:300]}",
                         "run with NCCL_DEBUG=INFO; check the driver / NCCL install and P2P (NCCL_P2P_DISABLE=1)")
        return Check("nccl all-to-all", PASS, f"{n} GPUs, 1 MiB uint8 carrier per pair, {time.perf_counter() - t0:.1f} s")


# ---------------------------------------------------------------------------------------------
# table, entry point
# ---------------------------------------------------------------------------------------------
def run_checks(device: str | None = None, numel: int | None = None, reps: int = 7,
               bandwidth: bool = True) -> list[Check]:
    """Every check above, in order (stops after the build when nothing can run)."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = version_checks()
    build, st = build_check()
    rows.append(build)
    rows.extend(gpu_library_checks(st))
    rows.extend(device_checks(dev, st))
    rows.extend(op_checks(dev, st))
    if bandwidth:
        n = numel or ((1 << 26) if dev.type == "cuda" else (1 << 21))
        rows.extend(bandwidth_checks(dev, n, reps))
    if dev.type == "cuda":
        rows.append(nccl_check())
    return rows


def format_table(rows: Sequence[Check]) -> str:
    lines = ["| check | result | detail | fix |", "| --- | --- | --- | --- |"]
    for r in rows:
        cells = [c.replace("|", "/").replace("\n", " ") for c in (r.name, r.result, r.detail, r.fix)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="qmuon-doctor",
        description="Check this machine for qmuon_lightning: versions, kernel build, device, every op against "
                    "its reference, update bandwidth, NCCL. Exit status 0 when every check passed.")
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if available)")
    parser.add_argument("--numel", type=int, default=None,
                        help="elements of the bandwidth matrix (default 2**26 on CUDA, 2**21 on CPU)")
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per bandwidth case")
    parser.add_argument("--no-bandwidth", action="store_true", help="skip the bandwidth rows")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows = run_checks(args.device, args.numel, args.reps, not args.no_bandwidth)
    failed = [r for r in rows if r.result == FAIL]
    print(f"## qmuon-doctor ({time.perf_counter() - t0:.0f} s)\n")
    print(format_table(rows))
    print()
    print(f"{len(failed)} failure(s)" + (": " + ", ".join(r.name for r in failed) if failed else "; all good"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
