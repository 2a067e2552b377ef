"""One kernel build per machine, and never a wait on a build that is gone.

``torch.utils.cpp_extension.load`` guards a build directory with a ``lock`` file (its ``FileBaton``)
and waits, without a limit, for that file to disappear. A build killed before it could delete it
(an OOM kill, a scheduler's time limit, Ctrl-C twice: pytorch#189245) therefore leaves every later
build of those sources waiting forever, on every rank, silently.

:func:`build_lock` puts an OS lock in front of it: ``flock`` on ``<build dir>/qmuon_build.lock``,
which the kernel releases when its holder dies, however it dies. The holder writes its pid, host and
start time into the file, so a process that waits says what it waits for, and gives up after
``QMUON_BUILD_WAIT_S`` seconds (default 1800) with an error naming the holder. While a process holds
it no other qmuon build runs in that directory, so a ``lock`` file found there is stale: it is
removed, with a message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from typing import Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: torch's own lock only
    fcntl = None  # type: ignore[assignment]

__all__ = ["build_lock"]

#: WARNING, so the notices show without a logging set-up (Python's last-resort handler prints them to stderr).
_log = logging.getLogger("qmuon.ops")

LOCK_NAME = "qmuon_build.lock"
#: The file torch's FileBaton creates in a build directory and deletes when the build ends.
TORCH_LOCK_NAME = "lock"
WAIT_ENV = "QMUON_BUILD_WAIT_S"


def _holder(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "another process"
    except OSError:
        return "another process"


@contextlib.contextmanager
def build_lock(directory: str, wait_s: float | None = None) -> Iterator[int | None]:
    """Hold the build lock of ``directory`` (see the module docstring) for the ``with`` block. Yields the
    lock file's descriptor: a child process that inherits it (``pass_fds``) holds the lock with the
    parent, so a build that outlives a killed parent still keeps the others waiting."""
    os.makedirs(directory, exist_ok=True)
    if fcntl is None:  # pragma: no cover
        yield None
        return
    if wait_s is None:
        wait_s = float(os.environ.get(WAIT_ENV, "1800"))
    path = os.path.join(directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start, announced = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _holder(path)
                if time.monotonic() - start > wait_s:
                    raise TimeoutError(
                        f"qmuon: waited {wait_s:.0f} s for the kernel build in {directory}, held by {holder}. If that "
                        f"process is stuck, stop it; to wait longer set {WAIT_ENV}") from None
                if not announced:
                    _log.warning("qmuon: waiting for the kernel build in %s, held by %s (up to %.0f s)", directory,
                                 holder, wait_s)
                    announced = True
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%H:%M:%S')}".encode(), 0)
        stale = os.path.join(directory, TORCH_LOCK_NAME)
        if os.path.exists(stale):
            os.remove(stale)
            _log.warning("qmuon: removed a stale build lock (%s) left by a build that was killed; building again",
                         stale)
        yield fd
    finally:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
