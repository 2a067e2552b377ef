"""Packaging: two distributions from one repository. ``qmuon`` (pyproject.toml at the root) ships the
optimizer package; the kernel sources (top-level csrc/) ship in its wheel as qmuon/_csrc, and an installed
(non-editable) package finds them there. ``qmuon-lightning`` (kit/pyproject.toml) ships the kit package
qmuon_lightning, at the same version, requiring that ``qmuon`` and no other."""

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
KIT = "qmuon_lightning"
PACKAGES = (PKG, KIT)
SOURCE_SUFFIXES = {".h", ".cpp", ".cu"}

tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")


def _pyproject(kit: bool = False) -> dict:
    return tomllib.loads((REPO / ("kit" if kit else ".") / "pyproject.toml").read_text())


def _setuptools_config(kit: bool = False) -> dict:
    return _pyproject(kit)["tool"]["setuptools"]


def _packages_on_disk(pkg: str) -> set[str]:
    return {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / pkg).rglob("__init__.py")
            if "__pycache__" not in p.parts}


def _kernel_sources() -> set[str]:
    return {p.relative_to(REPO / "csrc").as_posix() for p in (REPO / "csrc").rglob("*")
            if p.is_file() and p.suffix in SOURCE_SUFFIXES}


def test_pyproject_lists_every_package():
    # The lists are explicit (automatic discovery cannot be combined with the csrc -> _csrc mapping, nor
    # with the kit's package living outside kit/), so a new subpackage must be added to its distribution's.
    lib, kit = _setuptools_config(), _setuptools_config(kit=True)
    assert set(lib["packages"]) == _packages_on_disk(PKG) | {f"{PKG}._csrc"}
    assert lib["package-dir"] == {f"{PKG}._csrc": "csrc"}
    assert set(kit["packages"]) == _packages_on_disk(KIT)
    assert kit["package-dir"] == {KIT: f"../{KIT}"}


def test_the_two_distributions_are_one_release():
    """The kit requires the library at exactly its own version (it reaches into the library's
    internals), and the library requires no framework: Lightning and its CLI parsers come with the kit."""
    lib, kit = _pyproject()["project"], _pyproject(kit=True)["project"]
    assert (lib["name"], kit["name"]) == ("qmuon", "qmuon-lightning")
    assert lib["version"] == kit["version"]
    assert f"qmuon=={lib['version']}" in kit["dependencies"]
    names = {d.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip() for d in lib["dependencies"]}
    assert names == {"torch", "numpy", "ninja"}, names
    assert not {"lightning", "jsonargparse", "omegaconf"} & {e.split("[")[0].split(">")[0].split("<")[0].split("=")[0]
                                                             for extra in ("hf", "accelerate", "deepspeed")
                                                             for e in lib["optional-dependencies"][extra]}
    assert set(kit["scripts"]) >= {"qmuon-train", "qmuon-doctor", "qmuon-prepare", "qmuon-estimate"}


def test_kit_refuses_a_library_of_another_version():
    """A mismatched pair fails at import with both versions and the command that fixes it."""
    import qmuon_lightning

    qmuon_lightning.check_library_version("0.1.0", "0.1.0")
    qmuon_lightning.check_library_version("0.0.0+source", "0.3.0")  # a source tree has no versions
    with pytest.raises(ImportError, match=r"qmuon-lightning 0\.2\.0 needs qmuon 0\.2\.0, but qmuon 0\.1\.0 .*"
                                          r"pip install 'qmuon==0\.2\.0'"):
        qmuon_lightning.check_library_version("0.2.0", "0.1.0")
    # at import, in a fresh interpreter whose qmuon claims another version
    code = ("import qmuon; qmuon.__version__ = '9.9.9'\n"
            "import importlib.metadata as md; real = md.version\n"
            "md.version = lambda n: '1.0.0' if n == 'qmuon-lightning' else real(n)\n"
            "import qmuon_lightning")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode != 0 and "qmuon-lightning 1.0.0 needs qmuon 1.0.0, but qmuon 9.9.9" in r.stderr, r.stderr[-2000:]


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
    for name in ("pyproject.toml", "README.md", "kit/pyproject.toml", "kit/README.md"):
        (src / name).parent.mkdir(exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    for name in (*PACKAGES, "csrc"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    dist = tmp_path / "dist"
    for project in (src, src / "kit"):
        res = subprocess.run([sys.executable, "-m", "pip", "wheel", str(project), "-w", str(dist), "--no-deps",
                              "--no-build-isolation", "--no-index", "-q"], capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout + res.stderr
    (lib_whl,) = dist.glob("qmuon-*.whl")
    (kit_whl,) = dist.glob("qmuon_lightning-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(lib_whl) as zf:
        names = set(zf.namelist())
        shipped = {n[len(f"{PKG}/_csrc/"):] for n in names if n.startswith(f"{PKG}/_csrc/")}
        assert shipped == _kernel_sources()
        assert not any(n.startswith(("csrc/", f"{KIT}/")) for n in names), "the library's wheel holds the kit"
        zf.extractall(site)
    with zipfile.ZipFile(kit_whl) as zf:
        names = set(zf.namelist())
        assert not any(n.startswith((f"{PKG}/", "csrc/")) for n in names), "the kit's wheel holds the library"
        assert f"{KIT}/strategies/__init__.py" in names
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
