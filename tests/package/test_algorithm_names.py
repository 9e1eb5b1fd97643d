"""An algorithm is one file (issue 25): no code outside an algorithm's own file(s) and the
registry (``flowgrpo/algorithms/__init__.py``) names it — neither by its registry name
(``flow_grpo``, ``mix_grpo``, ``grpo_guard``, ``nft``) nor by its classes.

What counts as naming: an identifier (a name, an attribute, an argument, a definition), a
module in an import path, or — for the registry names — a word of a string constant (words are
runs of letters, digits and ``_``, so ``flowgrpo``, the package, and ``flow_grpo_loss``, the
shared loss, are not ``flow_grpo``); ``"algorithm=nft"`` or ``cfg.nft`` is knowledge of an
algorithm, whereas the methods' paper names in prose ("MixGRPO", "DiffusionNFT") are not code.
Docstrings and comments may name anything. An algorithm's own files are ``algorithms/<name>.py``
and siblings ``algorithms/<name>_*.py``; an algorithm that builds on another (a subclass) may
name the one it builds on. Not scanned: the presets (YAML data that choose an algorithm by name,
as users do) and the tests.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from flowgrpo.algorithms import ALGORITHMS, algorithm_class

SRC = Path(__file__).resolve().parents[2] / "src" / "flowgrpo"
REGISTRY = SRC / "algorithms" / "__init__.py"
WORD = re.compile(r"[A-Za-z0-9_]+")
#: known offences awaiting another change (each must still occur, so its entry goes when the
#: change lands); none today
PENDING: set[str] = set()


def _names_of(name: str) -> set[str]:
    """The identifiers that name algorithm ``name``: its registry name, its class, its
    settings class."""
    cls = algorithm_class(name)
    return {name, cls.__name__, cls.settings_class.__name__}


NAMES = {name: _names_of(name) for name in ALGORITHMS}


def _owner(path: Path) -> str | None:
    """The algorithm whose own file ``path`` is, if any."""
    if path.parent != SRC / "algorithms":
        return None
    return next((n for n in ALGORITHMS if path.stem == n or path.stem.startswith(f"{n}_")), None)


def _allowed(owner: str | None) -> set[str]:
    """Words the file of ``owner`` may use: its own names and those of what it builds on."""
    if owner is None:
        return set()
    bases = {c.name for c in algorithm_class(owner).__mro__ if "name" in vars(c)}
    return set().union(*(NAMES[b] for b in bases if b in NAMES))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _identifiers(node: ast.AST) -> list[str]:
    """The identifiers ``node`` itself names: a name, an attribute, an argument, a keyword, a
    definition, or the parts of an import."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.arg | ast.keyword):
        return [node.arg] if node.arg else []
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.ImportFrom):
        path = node.module.split(".") if node.module else []
        return path + [w for a in node.names for w in (a.name, a.asname) if w]
    if isinstance(node, ast.Import):
        return [w for a in node.names for w in (*a.name.split("."), a.asname) if w]
    return []


def offences(root: Path = SRC) -> list[tuple[str, int, str]]:
    """(file, line, word) for each algorithm name used outside its own files and the registry:
    any of ``NAMES`` as an identifier, a registry name as a word of a string (not a docstring)."""
    identifiers = set().union(*NAMES.values())
    out = set()
    for path in sorted(root.rglob("*.py")):
        if path == REGISTRY:
            continue
        allowed, where = _allowed(_owner(path)), str(path.relative_to(root.parent))
        tree = ast.parse(path.read_text())
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            line = getattr(node, "lineno", 0)
            words = [w for w in _identifiers(node) if w in identifiers]
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if id(node) not in docstrings:
                    words = [w for w in WORD.findall(node.value) if w in ALGORITHMS]
            out |= {(where, line, w) for w in words if w not in allowed}
    return sorted(out)


def test_no_algorithm_is_named_outside_its_own_files() -> None:
    found = offences()
    bad = [f"{f}:{line}: {w}" for f, line, w in found if f"{f}: {w}" not in PENDING]
    assert not bad, "algorithm names outside their own files:\n" + "\n".join(bad)
    gone = PENDING - {f"{f}: {w}" for f, _, w in found}
    assert not gone, f"no longer found, remove from PENDING: {sorted(gone)}"


def test_the_scan_sees_each_kind_of_naming(tmp_path: Path) -> None:
    """The scan is not blind: each way of naming an algorithm is caught, and the package name,
    longer words and docstrings are not."""
    pkg = tmp_path / "flowgrpo"
    pkg.mkdir()
    caught = {
        "a.py": "from flowgrpo.algorithms.nft import x\n",
        "b.py": "import flowgrpo.algorithms.mix_grpo\n",
        "c.py": "x = cfg.grpo_guard.clip_range\n",
        "d.py": "if cfg.algorithm == 'nft':\n    pass\n",
        "e.py": "raise ValueError(f'needs algorithm=mix_grpo, got {x}')\n",
        "f.py": "class A(FlowGRPO):\n    pass\n",
        "g.py": "def f(nft=1):\n    return dict(flow_grpo=2)\n",
    }
    clean = {
        "h.py": '"""flow_grpo and nft in a docstring."""\nimport flowgrpo\n',
        "i.py": "from flowgrpo.functional.losses import flow_grpo_loss  # nft in a comment\n",
        "j.py": "x = 'flowgrpo nft_old mix_grpo_x'\n",
        "k.py": "HELP = 'Online RL (Flow-GRPO, MixGRPO, DiffusionNFT)'\n",
    }
    for name, text in {**caught, **clean}.items():
        (pkg / name).write_text(text)
    found = {Path(f).name for f, _, _ in offences(pkg)}
    assert found == set(caught)
