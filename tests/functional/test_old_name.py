"""Old import paths keep working: ``flowgrpo.algo`` (this package's old name) gives the very
same objects as ``flowgrpo.functional`` (one class, not a copy that ``isinstance`` would tell
apart), and ``flowgrpo.models.tiny`` re-exports the test kit's tiny pipelines (DESIGN.md
contract 4)."""

import importlib
import pkgutil

import flowgrpo.functional as functional


def test_the_old_import_paths_are_the_same_modules() -> None:
    import flowgrpo.algo as old
    from flowgrpo.algo.tree import BranchSpec

    assert BranchSpec is functional.tree.BranchSpec
    assert set(old.__all__) == set(functional.__all__)
    for name in functional.__all__:
        assert getattr(old, name) is getattr(functional, name), name
    modules = [m.name for m in pkgutil.iter_modules(functional.__path__)]
    assert {"sde", "advantages", "losses", "tree"} <= set(modules)
    for module in modules:
        assert importlib.import_module(f"flowgrpo.algo.{module}") is importlib.import_module(
            f"flowgrpo.functional.{module}"
        ), module


def test_tiny_pipeline_keeps_its_old_import_path() -> None:
    import subprocess
    import sys

    import flowgrpo.testing as testing
    from flowgrpo.models.tiny import tiny_pipeline, tiny_size

    assert tiny_pipeline is testing.tiny_pipeline and tiny_size is testing.tiny_size
    # importing the model package does not load the test kit
    code = "import sys, flowgrpo.models; print('flowgrpo.testing' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
