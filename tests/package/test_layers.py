"""The package's layers (issue 14): a module imports only from its own layer or below, and
modules import each other in no circle — counting imports inside functions too.

Layers from the bottom: settings and errors; algo and data; models and rollout; rewards; the
toy (a model and a reward, above what it uses); engine; algorithms; config; trainer; cli. Registries name
what sits above them by import path strings ("flowgrpo.toy.pipeline:ToyAdapter"), which is not
an import.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "flowgrpo"
LAYERS = [
    {"settings", "errors", "__init__", "__main__"},
    {"algo", "data"},
    {"models", "rollout"},
    {"rewards"},
    {"toy"},
    {"engine"},
    {"algorithms"},
    {"config"},
    {"trainer"},
    {"cli"},
    {"testing"},  # the test kit: above everything it tests
]
# The package root (__init__, __main__) and the CLI sit on top of everything they start.
TOP = {"__main__": 9, "cli": 9}


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _layer(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top in TOP:
        return TOP[top]
    return next(i for i, names in enumerate(LAYERS) if top in names)


MODULES = {_module_name(p) for p in SRC.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """flowgrpo modules imported anywhere in ``path`` (module level and inside functions);
    ``from pkg import mod`` counts as importing ``pkg.mod``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("flowgrpo"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    out.add(sub if sub in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("flowgrpo")}
    return out


def graph() -> dict[str, set[str]]:
    return {m: _imports(p) - {m} for p in SRC.rglob("*.py") for m in [_module_name(p)]}


def test_no_module_imports_from_a_higher_layer() -> None:
    bad = [
        f"{mod} (layer {_layer(mod)}) imports {dep} (layer {_layer(dep)})"
        for mod, deps in graph().items()
        for dep in deps
        if _layer(dep) > _layer(mod)
    ]
    assert not bad, "\n".join(bad)


def test_no_import_circles() -> None:
    g = graph()
    # a package's __init__ re-exporting its modules is not a circle of its modules
    edges = {m: {d for d in deps if d in g and not m.startswith(d + ".")} for m, deps in g.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in edges.get(m, ()):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d) :] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def test_nothing_below_the_toy_imports_it() -> None:
    toy = _layer("flowgrpo.toy")
    users = sorted(
        m
        for m, deps in graph().items()
        if _layer(m) < toy
        and any(d == "flowgrpo.toy" or d.startswith("flowgrpo.toy.") for d in deps)
    )
    assert users == []
