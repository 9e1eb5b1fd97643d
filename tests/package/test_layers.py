"""The package's layers (issue 14): a module imports only from its own layer or below, and
modules import each other in no circle — counting imports inside functions too.

Layers from the bottom: settings and errors; functional (the shared tensor math) and data; models and rollout; rewards; the
toy (a model and a reward, above what it uses); engine; algorithms; config and the memory
planner beside it; trainer; cli. Registries name
what sits above them by import path strings ("flowgrpo.toy.pipeline:ToyAdapter"), which is not
an import.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "flowgrpo"
LAYERS = [
    {"settings", "errors", "__init__", "__main__"},
    {"functional", "algo", "data"},  # algo: the old name of functional, a re-export
    {"models", "rollout"},
    {"rewards"},
    {"toy"},
    {"engine"},
    {"algorithms"},
    {"config", "planner"},  # the planner: config's leaf tool (config.memory re-exports it)
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


# -- no model family outside models/ ---------------------------------------------------------------
#: the layers that must work for any family: they ask the adapter, they never name one
FAMILY_FREE = ("engine", "rollout", "trainer", "config", "planner")


def _words(text: str) -> list[str]:
    """``text`` as lowercase words: split at camel case, between letters and digits and at
    anything else (``SD3Transformer2DModel`` -> sd 3 transformer 2 d model)."""
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", text)
    text = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1 \2", text)
    return re.findall(r"[a-z]+|[0-9]+", text.lower())


def family_names() -> set[tuple[str, ...]]:
    """Every name of every family ``flowgrpo.models.registry`` registers under
    ``flowgrpo.models`` (the toy is a layer of its own), as word sequences: the adapter module
    (``qwen_image`` and its first word ``qwen``), the adapter class less ``Adapter``, the
    pipeline class less ``Pipeline`` (``StableDiffusion3``)."""
    from flowgrpo.models.registry import SUPPORTED_PIPELINES

    names: set[tuple[str, ...]] = set()
    for pipeline, path in SUPPORTED_PIPELINES.items():
        module, _, cls = path.partition(":")
        if not module.startswith("flowgrpo.models."):
            continue
        base = module.rsplit(".", 1)[1]
        for name in (base, cls.removesuffix("Adapter"), pipeline.removesuffix("Pipeline")):
            names.add(tuple(_words(name)))
        names.add(tuple(_words(base.split("_")[0])))
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _help_texts(tree: ast.AST) -> set[int]:
    """The help text of ``setting(default, "help", ...)`` (documentation, e.g. "Wan: 81")."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setting":
            args = node.args[1:2] + [k.value for k in node.keywords if k.arg == "help"]
            for arg in args:
                out |= {id(n) for n in ast.walk(arg) if isinstance(n, ast.Constant)}
    return out


def named_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every name in the code of ``path``: identifiers, attribute names,
    arguments, keywords, imported modules and names, and string constants other than
    docstrings and settings help."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree) | _help_texts(tree)
    out = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Name):
            out.append((line, node.id))
        elif isinstance(node, ast.Attribute):
            out.append((line, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append((line, node.name))
        elif isinstance(node, ast.arg):
            out.append((line, node.arg))
        elif isinstance(node, ast.keyword) and node.arg:
            out.append((line, node.arg))
        elif isinstance(node, ast.ImportFrom):
            out += [(line, node.module or "")] + [(line, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(line, a.name) for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in skip:
                out.append((line, node.value))
    return out


def family_mentions(root: Path = SRC) -> list[str]:
    """``file:line: text`` for every name of a family in the code of the family-free layers."""
    names = family_names()
    found = []
    for layer in FAMILY_FREE:
        for path in sorted((root / layer).rglob("*.py")):
            for line, text in named_texts(path):
                words = _words(text)
                hit = any(
                    tuple(words[i : i + len(n)]) == n for n in names for i in range(len(words))
                )
                if hit:
                    found.append(f"{path.relative_to(root)}:{line}: {text[:80]!r}")
    return found


def test_family_names_come_from_the_registry() -> None:
    names = family_names()
    for family in [("sd", "3"), ("flux",), ("qwen",), ("qwen", "image"), ("wan",)]:
        assert family in names
    assert ("stable", "diffusion", "3") in names
    assert ("sd",) not in names and ("image",) not in names
    assert ("toy",) not in names  # a layer of its own, named by the CLI


def test_the_family_check_finds_a_family_in_code(tmp_path) -> None:
    layer = tmp_path / "engine"
    layer.mkdir()
    (layer / "x.py").write_text(
        '"""A docstring may say SD3 or Qwen-Image."""\n'
        "from diffusers import FluxTransformer2DModel\n"
        "def f(m):\n"
        '    """Wan too."""\n'
        '    return m.startswith("QwenImage") or m.wan_expert or want\n'
    )
    found = family_mentions(tmp_path)
    texts = sorted(f.split(": ", 1)[1] for f in found)
    assert texts == ["'FluxTransformer2DModel'", "'QwenImage'", "'wan_expert'"], found


def test_engine_rollout_trainer_and_config_name_no_model_family() -> None:
    found = family_mentions()
    assert not found, "ask the adapter instead of naming its family:\n" + "\n".join(found)


def test_the_engine_imports_no_adapter() -> None:
    """The engine gets a family's declarations as inputs (``EngineDeclarations``): none of its
    modules imports the registry (which imports every adapter) or an adapter module."""
    from flowgrpo.models.registry import SUPPORTED_PIPELINES

    adapters = {path.partition(":")[0] for path in SUPPORTED_PIPELINES.values()}
    banned = adapters | {"flowgrpo.models.registry", "flowgrpo.models"}
    bad = sorted(
        f"{mod} imports {dep}"
        for mod, deps in graph().items()
        if mod == "flowgrpo.engine" or mod.startswith("flowgrpo.engine.")
        for dep in deps
        if dep in banned
    )
    assert not bad, "\n".join(bad)
