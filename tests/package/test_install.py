"""The package installs as users need it: pyproject's torch requirement keeps a cluster's CUDA
build of the tested torch and admits nothing newer than the Makefile's exact pin; every
third-party module the code imports is a core dependency or in an extra; the Makefile installs
every extra the tests need (everything imported without an ImportError guard)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
tomllib = pytest.importorskip("tomllib")  # Python 3.11+
# import name -> distribution, for modules not installed here (packages_distributions() knows
# the installed ones)
NOT_INSTALLED_HERE = {"pyarrow": "pyarrow"}
#: the preference models' reference code, imported only by
#: tests/rewards/test_rewards_prefs_upstream.py from the folder FLOWGRPO_PREF_UPSTREAM names
#: (they import torchvision: never a dependency of this package)
UPSTREAM_REFERENCES = ("hpsv2", "ImageReward", "clip", "torchvision")
#: imported only in a reward server's own environment, installed by its recipe (docs/rewards.md,
#: GenEval's Mask2Former: mmdet and mmcv need an older torch than this package's)
SERVER_ENVIRONMENT = ("mmdet",)


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def makefile_pin() -> Version:
    (pin,) = re.findall(r"^TORCH := torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    return Version(pin)


def makefile_extras() -> set[str]:
    (extras,) = re.findall(r"^EXTRAS := (\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert '-e ".[$(EXTRAS)]"' in (ROOT / "Makefile").read_text()
    return set(extras.split(","))


def requirements(items: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, items)}


def test_torch_requirement_keeps_the_tested_line_and_admits_nothing_newer():
    pin = makefile_pin()
    torch_req = requirements(project()["dependencies"])["torch"]
    spec = SpecifierSet(str(torch_req.specifier))
    ok = [str(pin), f"{pin}+cu128", f"{pin}+cu126", f"{pin}+cpu", f"{pin}a0+git1a2b3c4"]
    assert all(spec.contains(v, prereleases=True) for v in ok), (spec, ok)
    major, minor, micro = pin.release
    newer = [f"{pin}.post1", f"{major}.{minor}.{micro + 1}", f"{major}.{minor + 1}.0"]
    newer += [f"{major + 1}.0.0", f"{major}.{minor}.{micro + 1}+cu128"]
    assert not any(spec.contains(v, prereleases=True) for v in newer), (spec, newer)
    older = f"{major}.{minor - 1}.0"  # an older release line is not tested either
    assert not spec.contains(older, prereleases=True)


def test_the_installed_torch_satisfies_the_package():
    import torch

    spec = requirements(project()["dependencies"])["torch"].specifier
    assert spec.contains(torch.__version__, prereleases=True), (torch.__version__, spec)


def test_the_users_extras_exist_and_the_makefile_names_only_real_ones():
    extras = set(project()["optional-dependencies"])
    assert {"ocr", "clip", "wandb", "parquet", "toy"} <= extras
    assert makefile_extras() <= extras


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, guarded by ``except ImportError``) of every import in ``path``."""
    tree = ast.parse(path.read_text())
    out = []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Try):
            catches = any(
                h.type is not None and "ImportError" in ast.unparse(h.type) for h in node.handlers
            )
            for child in node.body:
                visit(child, guarded or catches)
            for child in [*node.handlers, *node.orelse, *node.finalbody]:
                visit(child, guarded)
            return
        if isinstance(node, ast.Import):
            out.extend((a.name.split(".")[0], guarded) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], guarded))
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(tree, False)
    return out


def _third_party(folders: tuple[str, ...]) -> dict[str, bool]:
    """{module: every import of it is guarded} over the .py files of ``folders``."""
    local = {"flowgrpo", "bench", "tests", "tinymodel", "conftest"}
    local |= {p.stem for p in (ROOT / "tests").rglob("*.py")}
    found: dict[str, bool] = {}
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for module, guarded in _imports(path):
                if module in sys.stdlib_module_names or module in local or module == "__future__":
                    continue
                found[module] = found.get(module, True) and guarded
    return found


def _distribution(module: str) -> str:
    dists = importlib.metadata.packages_distributions().get(module) or [
        NOT_INSTALLED_HERE.get(module, module)
    ]
    return canonicalize_name(dists[0])


def test_every_import_is_a_dependency_or_in_an_extra_the_makefile_installs():
    proj = project()
    core = set(requirements(proj["dependencies"]))
    extras = {k: set(requirements(v)) for k, v in proj["optional-dependencies"].items()}
    installed = core.union(*(extras[e] for e in makefile_extras()))
    declared = core.union(*extras.values())
    test_deps = {"pytest", "packaging"}  # pytest brings packaging
    modules = _third_party(("src", "tests", "bench"))
    for module in (*UPSTREAM_REFERENCES, *SERVER_ENVIRONMENT):  # never installed with pip here
        modules.pop(module, None)
    assert {"sklearn", "wandb", "rapidocr_onnxruntime", "torch"} <= set(modules)
    for module, guarded in sorted(modules.items()):
        dist = _distribution(module)
        if dist in test_deps:
            continue
        assert dist in declared, f"{module} ({dist}) is imported but in no dependency or extra"
        if not guarded:  # the tests need it: `make install` must install it
            assert dist in installed, f"{module} ({dist}): add its extra to the Makefile's EXTRAS"
    src_modules = _third_party(("src",))
    for module in set(src_modules) - set(SERVER_ENVIRONMENT):
        dist = _distribution(module)
        if dist not in core:  # optional for users: say which extra
            assert any(dist in v for v in extras.values()), module


def test_a_missing_extra_names_it(monkeypatch):
    """The toy without scikit-learn, .parquet without pyarrow: one line naming the extra."""
    from flowgrpo.toy import data as toy_data

    for name in ("sklearn", "sklearn.datasets", "sklearn.svm"):
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    toy_data._load.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install 'flowgrpo\[toy\]'"):
            toy_data.load_digits_data("train")
        from flowgrpo.toy.reward import _judge

        _judge.cache_clear()
        with pytest.raises(ImportError, match=r"pip install 'flowgrpo\[toy\]'"):
            _judge()
    finally:
        toy_data._load.cache_clear()
