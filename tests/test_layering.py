"""The package's layers import one way, with no cycles (imports inside functions count).

``csrc -> ops -> quant -> core -> optim / distributed / integrations -> strategies / callbacks ->
cli``; modules at the top of the package (``demo``, ``plotting``, ``models``, ``data``) sit where
the table below puts them. The test reads every module's source with ``ast`` (no import needed), so
a lazy ``from ..distributed import x`` inside a function is an edge like any other; only imports
under ``if TYPE_CHECKING:`` (annotations) are not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import qmuon_lightning

PKG = Path(qmuon_lightning.__file__).parent

#: Layer of each subpackage / top-level module; a module may import its own layer or lower ones.
LAYERS = {
    "ops": 0,
    "quant": 1,
    "core": 2,
    "optim": 3, "distributed": 3, "integrations": 3, "models": 3, "data": 3,
    "strategies": 4, "callbacks": 4, "plotting": 4, "demo": 4, "memory": 4,
    "cli": 5, "doctor": 5, "cli_litgpt": 5, "estimate": 5,
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the ``qmuon_lightning`` modules ``path`` imports (anywhere in the file)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = set()  # imports under `if TYPE_CHECKING:` exist for annotations, not at run time
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("qmuon_lightning"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("qmuon_lightning"):
                continue
            out.add(mod)
            for a in node.names:  # `from . import ops` names a module
                if (PKG.parent / (mod + "." + a.name).replace(".", "/")).with_suffix(".py").exists() or (
                        PKG.parent / (mod + "." + a.name).replace(".", "/")).is_dir():
                    out.add(mod + "." + a.name)
    return out


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package root re-exports its public API
    top = parts[1]
    if top.startswith("_"):
        return None
    return LAYERS.get(top)


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for p in PKG.rglob("*.py")}


def test_every_subpackage_has_a_layer():
    tops = {p.name if p.is_dir() else p.stem for p in PKG.iterdir()
            if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    missing = sorted(t for t in tops if not t.startswith("_") and t not in LAYERS)
    assert not missing, f"add {missing} to LAYERS in this test"


def test_imports_flow_one_way():
    back = []
    for mod, deps in _graph().items():
        lm = _layer(mod)
        if lm is None:
            continue
        for dep in deps:
            ld = _layer(dep)
            if ld is not None and ld > lm:
                back.append(f"{mod} (layer {lm}) imports {dep} (layer {ld})")
    assert not back, "imports against the layer order:\n" + "\n".join(sorted(back))


def test_no_import_cycles_between_modules():
    graph = _graph()
    known = set(graph)

    def resolve(dep: str) -> str | None:
        while dep and dep not in known:
            dep = dep.rpartition(".")[0]
        return dep or None

    edges = {m: {d for d in (resolve(x) for x in deps) if d and d != m} for m, deps in graph.items()}
    # A package's __init__ importing its own submodules (re-exports) is not a cycle of the design.
    for m in edges:
        edges[m] = {d for d in edges[m] if not d.startswith(m + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)
