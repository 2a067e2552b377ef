"""Every public function, class, method and property of ``qmuon`` is referenced somewhere: in the
library, the kit, the tests, the benchmarks or the docs. Code nothing calls is untested code that
still has to be read, kept and shipped; delete it instead of keeping it "in case".

A name counts as referenced when the identifier occurs anywhere outside its own definition (a
call, an import, an attribute access, a ``getattr`` string, a doc page). Methods that override a
base class's (``step``, ``forward``, ``find_class``, Lightning / torch hooks) are called by that
base and are not checked; neither are names starting with ``_``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: Where a reference may be: sources, tests, benchmarks, CI scripts and docs.
SEARCHED = ("qmuon", "qmuon_lightning", "tests", "benchmarks", "docs", "recipes", ".ci", "README.md")
SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".sh", ".txt", ".cfg", ".ini", ""}
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _files():
    for entry in SEARCHED:
        p = ROOT / entry
        if p.is_file():
            yield p
        elif p.is_dir():
            for f in p.rglob("*"):
                if f.is_file() and f.suffix in SUFFIXES and "__pycache__" not in f.parts:
                    yield f


def _occurrences() -> dict[str, list[tuple[Path, int]]]:
    where: dict[str, list[tuple[Path, int]]] = defaultdict(list)
    for f in _files():
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            for name in set(IDENT.findall(line)):
                where[name].append((f, i))
    return where


def _module_name(f: Path) -> str:
    parts = f.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_override(module: str, cls: str, name: str) -> bool:
    """Whether ``module.cls.name`` overrides a base class attribute (called by the base, not by name
    here). A module that cannot be imported here (an optional dependency) counts every method of
    a class with bases as an override."""
    try:
        obj = getattr(importlib.import_module(module), cls)
    except Exception:  # noqa: BLE001 - optional dependencies
        return True
    if not inspect.isclass(obj):
        return True
    return any(name in vars(base) for base in obj.__mro__[1:])


def _span(node: ast.AST) -> tuple[int, int]:
    """First line (its first decorator's) and last line of a definition."""
    return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]), node.end_lineno


def _definitions():
    """(name, file, first line, last line, what) of each public def / class / method in qmuon/."""
    for f in sorted((ROOT / "qmuon").rglob("*.py")):
        tree = ast.parse(f.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                yield node.name, f, *_span(node), "class" if isinstance(node, ast.ClassDef) else "function"
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                        if node.bases and _is_override(_module_name(f), node.name, item.name):
                            continue
                        yield item.name, f, *_span(item), f"method of {node.name}"


def test_every_public_function_of_qmuon_is_referenced():
    where = _occurrences()
    unused = []
    for name, f, first, last, what in _definitions():
        refs = [(g, i) for g, i in where.get(name, []) if not (g == f and first <= i <= last)]
        if not refs:
            unused.append(f"{f.relative_to(ROOT)}:{first}: {what} {name!r}")
    assert not unused, ("referenced nowhere (library, kit, tests, benchmarks, docs): remove it, or use it:\n"
                        + "\n".join(unused))


def test_the_check_finds_an_unreferenced_function(tmp_path, monkeypatch):
    """The check itself: a function whose name occurs only in its own definition is reported."""
    pkg = tmp_path / "qmuon"
    pkg.mkdir()
    (pkg / "mod.py").write_text("def used():\n    return 1\n\n\ndef never_called_anywhere_xyz():\n"
                                "    '''never_called_anywhere_xyz mentions itself'''\n    return used()\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "SEARCHED", ("qmuon",))
    try:
        test_every_public_function_of_qmuon_is_referenced()
    except AssertionError as err:
        assert "never_called_anywhere_xyz" in str(err) and "'used'" not in str(err), str(err)
    else:
        raise AssertionError("an unreferenced function was not reported")
