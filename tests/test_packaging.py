"""Packaging: one distribution ships two packages, qmuon (the optimizer) and qmuon_lightning (the kit); the
kernel sources (top-level csrc/) ship in the wheel as qmuon/_csrc, and an installed (non-editable) package finds
them there."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from _dist import REPO

PKG = "qmuon"  # the library, which holds the kernel sources
PACKAGES = ("qmuon", "qmuon_lightning")
SOURCE_SUFFIXES = {".h", ".cpp", ".cu"}

tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")


def _setuptools_config() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _kernel_sources() -> set[str]:
    return {p.relative_to(REPO / "csrc").as_posix() for p in (REPO / "csrc").rglob("*")
            if p.is_file() and p.suffix in SOURCE_SUFFIXES}


def test_pyproject_lists_every_package():
    # The list is explicit (automatic discovery cannot be combined with the csrc -> _csrc mapping),
    # so a new subpackage must be added to it.
    cfg = _setuptools_config()
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for pkg in PACKAGES for p in (REPO / pkg).rglob("__init__.py")
               if "__pycache__" not in p.parts}
    assert set(cfg["packages"]) == on_disk | {f"{PKG}._csrc"}
    assert cfg["package-dir"] == {f"{PKG}._csrc": "csrc"}


def test_package_data_covers_every_file_in_csrc():
    patterns = _setuptools_config()["package-data"][f"{PKG}._csrc"]
    covered = {p.relative_to(REPO / "csrc").as_posix() for pat in patterns for p in (REPO / "csrc").glob(pat)}
    everything = {p.relative_to(REPO / "csrc").as_posix() for p in (REPO / "csrc").rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".o"}
    assert {"binding.cpp", "binding_common.h", "binding_cuda.cpp"} <= _kernel_sources()
    assert everything - covered == set(), "files in csrc/ that the wheel would leave out"


def _can_build_wheels_offline() -> bool:
    """setuptools builds wheels itself from 70.1 on; older ones need the ``wheel`` package."""
    if importlib.util.find_spec("setuptools") is None:
        return False
    import setuptools

    version = tuple(int(x) for x in setuptools.__version__.split(".")[:2] if x.isdigit())
    return version >= (70, 1) or importlib.util.find_spec("wheel") is not None


@pytest.mark.skipif(not _can_build_wheels_offline(), reason="needs setuptools >= 70.1 (or wheel) installed")
def test_wheel_ships_kernel_sources_and_installed_package_finds_them(tmp_path):
    # Build from a copy, so the checkout gets no build/ directory.
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.o")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in (*PACKAGES, "csrc"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    dist = tmp_path / "dist"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "-w", str(dist), "--no-deps",
                          "--no-build-isolation", "--no-index", "-q"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = dist.glob("*.whl")
    with zipfile.ZipFile(whl) as zf:
        names = set(zf.namelist())
        shipped = {n[len(f"{PKG}/_csrc/"):] for n in names if n.startswith(f"{PKG}/_csrc/")}
        assert shipped == _kernel_sources()
        assert not any(n.startswith("csrc/") for n in names)
        site = tmp_path / "site"
        zf.extractall(site)
    # The unpacked wheel (first on sys.path, before the editable checkout) uses its own sources.
    env = dict(os.environ, PYTHONPATH=str(site), QMUON_BACKEND="reference")
    env.pop("QMUON_CSRC_DIR", None)  # a developer's override of the sources would hide the wheel's
    code = ("import qmuon.ops._extension as e, qmuon, qmuon_lightning as q; "
            "print(qmuon.__file__); print(q.__file__); print(e.csrc_dir())")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    lib_file, kit_file, csrc = out.stdout.split()
    assert Path(lib_file).is_relative_to(site) and Path(kit_file).is_relative_to(site), out.stdout
    assert Path(csrc) == site / PKG / "_csrc" and (Path(csrc) / "binding.cpp").is_file()


def test_source_checkout_falls_back_to_csrc(monkeypatch):
    from qmuon.ops import _extension

    monkeypatch.delenv("QMUON_CSRC_DIR", raising=False)  # the override is exercised by test_doctor

    installed, checkout = _extension._source_dirs()
    assert installed.name == "_csrc" and checkout.name == "csrc"
    if not (installed / "binding.cpp").is_file():  # editable install / source checkout
        assert _extension.csrc_dir() == REPO / "csrc"
