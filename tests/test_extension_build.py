"""When the kernel build runs, and that it says so (qmuon.ops._extension)."""

from __future__ import annotations

import os
import shutil

from qmuon.ops import _extension as ext


def test_build_key_differs_between_checkouts_with_identical_sources(tmp_path, monkeypatch):
    # torch's build.ninja holds absolute paths: two checkouts sharing one build directory would
    # rebuild each time the other had built last.
    here = ext._build_spec(False)
    copy = tmp_path / "csrc"
    shutil.copytree(ext.csrc_dir(), copy)
    monkeypatch.setattr(ext, "csrc_dir", lambda: copy)
    there = ext._build_spec(False)
    assert here["name"] != there["name"] and here["build_directory"] != there["build_directory"]
    assert all(s.startswith(str(copy)) for s in there["sources"])
    assert len(there["inputs"]) == len(ext._CPU_SOURCES) + len(ext._HEADERS)


def test_build_key_differs_between_torch_installs(monkeypatch):
    # build.ninja also names torch's include directories: two venvs with the same torch version and the
    # same sources sharing one build directory would rebuild in turn (each first step waiting for the other).
    import torch

    here = ext._build_spec(False)
    monkeypatch.setattr(torch, "__file__", "/elsewhere/venv/lib/python3.11/site-packages/torch/__init__.py")
    there = ext._build_spec(False)
    assert here["name"] != there["name"] and here["build_directory"] != there["build_directory"]


def test_build_reason_first_build_stale_and_fresh(tmp_path):
    src = tmp_path / "a.cpp"
    hdr = tmp_path / "b.h"
    so = tmp_path / "lib.so"
    for f in (src, hdr):
        f.write_text("x")
    inputs = [str(src), str(hdr)]
    assert "first build" in ext._build_reason(str(so), inputs)
    so.write_text("binary")
    t = os.path.getmtime(so)
    os.utime(src, (t - 10, t - 10))
    os.utime(hdr, (t - 10, t - 10))
    assert ext._build_reason(str(so), inputs) is None
    os.utime(hdr, (t + 10, t + 10))  # e.g. a checkout rewrote the header with the same contents
    reason = ext._build_reason(str(so), inputs)
    assert reason is not None and "b.h" in reason and "newer" in reason
