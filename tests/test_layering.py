"""The two packages' layers import one way, with no cycles (imports inside functions count).

``qmuon`` (the optimizer, torch only): ``ops -> quant -> core -> distributed -> optim ->
integrations``. ``qmuon_lightning`` (the kit) sits on top: ``models / data -> memory / strategies
-> callbacks -> cli / doctor / ...``. ``qmuon`` never imports ``qmuon_lightning``. A module may import
its own subpackage or a lower layer; two different subpackages of one layer may not import each
other, except the pairs in :data:`SIBLING_EXCEPTIONS`, each with its reason. The test reads every
module's source with ``ast`` (no import needed), so a lazy ``from ..distributed import x`` inside a
function is an edge like any other; only imports under ``if TYPE_CHECKING:`` (annotations) are not.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import qmuon
import qmuon_lightning

ROOT = Path(qmuon.__file__).parent.parent
PACKAGES = ("qmuon", "qmuon_lightning")
assert Path(qmuon_lightning.__file__).parent.parent == ROOT

#: Layer of each subpackage / top-level module of both packages; the kit's layers are all above the library's.
LAYERS = {
    "qmuon.ops": 0,
    "qmuon.quant": 1,
    "qmuon.core": 2,
    "qmuon.distributed": 3,
    "qmuon.optim": 4,
    "qmuon.integrations": 5,
    "qmuon_lightning.models": 10, "qmuon_lightning.data": 10,
    "qmuon_lightning.memory": 11, "qmuon_lightning.strategies": 11,
    "qmuon_lightning.callbacks": 12, "qmuon_lightning.plotting": 12,
    "qmuon_lightning.estimate": 13, "qmuon_lightning.doctor": 13,
    "qmuon_lightning.cli": 14,
}

#: Imports between two subpackages of one layer that the design allows, and why.
SIBLING_EXCEPTIONS: dict[tuple[str, str], str] = {}

FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "omegaconf", "jsonargparse", "transformers",
              "accelerate", "deepspeed", "trl", "peft")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    path = ROOT / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or path.is_dir()


def _imports(path: Path) -> set[str]:
    """Absolute names of the ``qmuon`` / ``qmuon_lightning`` modules ``path`` imports (anywhere in the file)."""
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
            out.update(a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] not in PACKAGES:
                continue
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if _is_module(f"{mod}.{a.name}"))  # `from . import ops`
    return out


def _unit(module: str) -> str | None:
    """The layered unit of a module (``qmuon.optim``, ``qmuon_lightning.cli``); None for a package
    root (it re-exports its public API) and private top-level modules."""
    parts = module.split(".")
    if len(parts) < 2 or parts[1].startswith("_"):
        return None
    return ".".join(parts[:2])


def _graph() -> dict[str, set[str]]:
    return {_module_name(p): _imports(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_every_subpackage_has_a_layer():
    units = {f"{pkg}.{p.name if p.is_dir() else p.stem}" for pkg in PACKAGES for p in (ROOT / pkg).iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    missing = sorted(u for u in units if _unit(u) and u not in LAYERS)
    assert not missing, f"add {missing} to LAYERS in this test"


def test_imports_flow_one_way():
    back = []
    for mod, deps in _graph().items():
        if mod.split(".")[0] == "qmuon" and any(d.split(".")[0] == "qmuon_lightning" for d in deps):
            back.append(f"{mod} (the library) imports the kit: {sorted(d for d in deps if d.startswith('qmuon_lightning'))}")
        um = _unit(mod)
        if um is None:
            continue
        for dep in deps:
            ud = _unit(dep)
            if ud is None or ud == um:
                continue
            if LAYERS[ud] > LAYERS[um]:
                back.append(f"{mod} (layer {LAYERS[um]}) imports {dep} (layer {LAYERS[ud]})")
            elif LAYERS[ud] == LAYERS[um] and (um, ud) not in SIBLING_EXCEPTIONS:
                back.append(f"{mod} imports {dep}, a sibling of the same layer {LAYERS[um]} (move the shared code "
                            "down a layer, or list the pair in SIBLING_EXCEPTIONS with its reason)")
    assert not back, "imports against the layer order:\n" + "\n".join(sorted(back))


def test_import_qmuon_loads_no_framework():
    """The optimizer library imports torch only: none of the frameworks it integrates with (an
    integration module, ``qmuon.integrations.accelerate`` say, imports its framework when imported)."""
    code = ("import sys, qmuon, qmuon.optim, qmuon.distributed, qmuon.integrations; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({FRAMEWORKS!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


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
