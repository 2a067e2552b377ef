"""A kernel build never hangs on a build that is gone (qmuon/ops/build_lock.py).

torch's ``cpp_extension.load`` waits without a limit for the ``lock`` file a killed build leaves in
its build directory (pytorch#189245). Here that file is planted in a copy of this machine's cached
build (so nothing is compiled): the next load removes it, says so, and loads. A build directory whose
lock is held by a live process makes the next one wait, naming the holder, and give up after
``QMUON_BUILD_WAIT_S``.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

import pytest

from _dist import subprocess_env

pytestmark = pytest.mark.slow  # subprocesses that load the compiled kernels

LOAD = "from qmuon.ops import _extension as e; s = e.status(); print(s.backend)"


@pytest.fixture()
def build_copy(tmp_path):
    """TORCH_EXTENSIONS_DIR with a copy of the current build (mtimes kept: ninja finds nothing to do)."""
    from qmuon.ops import _extension

    if _extension.status().library is None:
        pytest.skip(f"the compiled kernels did not build here: {_extension.status().reason}")
    spec = _extension._build_spec(False)
    src = spec["build_directory"]
    root = tmp_path / "ext"
    dst = root / "qmuon" / os.path.basename(src)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("lock", "qmuon_build.lock"))
    return root, dst


def _load(root, timeout: float, **extra: str) -> subprocess.CompletedProcess:
    env = subprocess_env(TORCH_EXTENSIONS_DIR=str(root), QMUON_BACKEND="extension", **extra)
    return subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=timeout)


def test_a_stale_lock_from_a_killed_build_is_removed(build_copy):
    root, build = build_copy
    (build / "lock").write_text("")  # what a build killed mid-way leaves behind
    proc = _load(root, timeout=240)  # without the build lock: waits for ever (TimeoutExpired)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "cpu-extension"
    assert "removed a stale build lock" in proc.stderr
    assert not (build / "lock").exists()


def test_a_live_build_is_waited_for_with_its_holder_named(build_copy):
    root, build = build_copy
    fd = os.open(build / "qmuon_build.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a build in progress, in this process
        os.write(fd, f"pid {os.getpid()} on this host".encode())
        proc = _load(root, timeout=120, QMUON_BUILD_WAIT_S="2")
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    assert proc.returncode != 0
    assert f"waiting for the kernel build in {build}, held by pid {os.getpid()}" in proc.stderr
    assert f"waited 2 s for the kernel build in {build}, held by pid {os.getpid()}" in proc.stderr
    assert _load(root, timeout=120).returncode == 0  # released: the next load goes through


def _processes_mentioning(text: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                out.append(f"{pid}: {cmd[:200]}")
    return out


def test_a_build_past_its_time_limit_stops_with_an_error(tmp_path):
    """A fresh build (nothing cached) with QMUON_BUILD_TIMEOUT_S=3: stopped with an error that names
    the limit and the fix, and no compiler of it is left running (its process group is killed)."""
    root = tmp_path / "fresh-ext"
    proc = _load(root, timeout=240, QMUON_BUILD_TIMEOUT_S="3", QMUON_GPU_LIB="0", QMUON_BUILD_CUDA="0", MAX_JOBS="1")
    assert proc.returncode != 0
    assert "did not finish within 3 s and was stopped" in proc.stderr and "QMUON_BUILD_TIMEOUT_S" in proc.stderr
    assert _processes_mentioning(str(root)) == []


def test_a_build_whose_process_is_killed_finishes_and_the_next_one_waits(tmp_path):
    """The issue's case: the first build is killed with SIGKILL 10 s in (as an OOM kill or a scheduler
    would). Its compiler process finishes the build still holding the lock; the next process says what it
    waits for, then loads that build (no second compile alongside it), within a normal build's time."""
    import signal
    import time

    root = tmp_path / "fresh-ext"
    env = subprocess_env(TORCH_EXTENSIONS_DIR=str(root), QMUON_BACKEND="extension", QMUON_GPU_LIB="0",
                         QMUON_BUILD_CUDA="0")
    first = subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    deadline = time.monotonic() + 120
    while not list(root.glob("qmuon/*/build.ninja")):  # torch writes it just before ninja starts
        assert time.monotonic() < deadline and first.poll() is None, "the first build never started compiling"
        time.sleep(0.2)
    time.sleep(10)
    assert first.poll() is None, "the first build finished within 10 s; nothing to kill"
    first.send_signal(signal.SIGKILL)
    first.communicate()
    t0 = time.monotonic()
    second = _load(root, timeout=900)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stdout.strip() == "cpu-extension"
    assert "waiting for the kernel build" in second.stderr and "compiler process" in second.stderr
    assert "compiling the CPU kernels" not in second.stderr  # it waited for the first build, did not redo it
    print(f"second process: {time.monotonic() - t0:.0f} s")
