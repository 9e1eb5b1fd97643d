"""No list of model families is written by hand outside the registry (issue 35): every list
of families comes from ``flowgrpo.models.registry`` (and the test doubles of
``flowgrpo.testing.families``, one module per registered family). A capability's tests run
over every family that declares it; where CI time forces a subset, the family's cost tier
picks it (``flowgrpo.testing.families.params`` / ``core``), so a new family is covered
without editing a test.

The check: a list, tuple or set literal, or a dict literal's keys, holding two or more family
names (a test double's kind, a registered family, a registered pipeline class) in the code of
src/ and tests/, outside the registry and each family's own test-double module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: where families are listed by design: the registry, and each family's own module
ALLOWED = ("src/flowgrpo/models/registry.py", "src/flowgrpo/testing/families/")


def family_names() -> set[str]:
    from flowgrpo.models.registry import SUPPORTED_PIPELINES, families
    from flowgrpo.testing.families import kinds

    return set(kinds()) | set(families()) | set(SUPPORTED_PIPELINES)


def _hand_lists(tree: ast.AST, names: set[str]) -> list[tuple[int, list[str]]]:
    """(line, names) of each literal collection in ``tree`` naming two or more ``names``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [k for k in node.keys if k is not None]
        else:
            continue
        hits = [
            n.value
            for n in items
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names
        ]
        if len(set(hits)) >= 2:
            found.append((node.lineno, hits))
    return found


def hand_written_family_lists(root: Path = ROOT) -> list[str]:
    """``file:line: names`` for every hand-written family list under src/ and tests/."""
    names = family_names()
    out = []
    for top in ("src", "tests"):
        for path in sorted((root / top).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if rel.startswith(ALLOWED) or path == Path(__file__).resolve():
                continue
            for line, hits in _hand_lists(ast.parse(path.read_text()), names):
                out.append(f"{rel}:{line}: {', '.join(hits)}")
    return out


def test_the_check_finds_a_hand_written_list(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        'KINDS = ("sd3", "flux")\n'
        'SIZES = {"wan": 1, "qwen_image": 2}\n'
        'ONE = ["sd3"]\n'  # one family: a test of that family, not a list of families
        'OTHER = ("sd3", "a red cat")\n'
        '"""("sd3", "flux") in a docstring"""\n'
    )
    found = hand_written_family_lists(tmp_path)
    assert found == ["tests/test_x.py:1: sd3, flux", "tests/test_x.py:2: wan, qwen_image"]


#: files whose family lists are not converted yet: none since the size tests read each family's
#: published rule from its test double (a file added here makes the check pass over it, and
#: the check fails once it is cleaned, so the set cannot go stale)
PENDING: set[str] = set()


def test_no_family_list_is_written_by_hand_outside_the_registry():
    found = hand_written_family_lists()
    assert {f.split(":")[0] for f in found if f.split(":")[0] in PENDING} == PENDING
    found = [f for f in found if f.split(":")[0] not in PENDING]
    assert not found, (
        "families listed by hand: take them from the registry (flowgrpo.testing.families: "
        "doubles(), kinds(capability), params(), core()):\n" + "\n".join(found)
    )


def test_cross_gives_core_families_every_value_and_the_others_one_in_turn(monkeypatch):
    from flowgrpo.testing.families import core, cross, kinds

    monkeypatch.delenv("FLOWGRPO_TEST_ROWS", raising=False)
    fams = kinds()
    pairs = cross(fams, ["a", "b", "c"])
    for j, kind in enumerate(fams):
        got = [v for k, v in pairs if k == kind]
        assert got == (["a", "b", "c"] if core(kind) else [["a", "b", "c"][j % 3]]), kind
    others = {v for k, v in pairs if not core(k)}
    assert others == {"a", "b", "c"}  # every value meets some non-core family
    monkeypatch.setenv("FLOWGRPO_TEST_ROWS", "all")
    assert len(cross(fams, ["a", "b", "c"])) == 3 * len(fams)


def test_sequence_parallel_families_are_those_the_engine_runs_under_sp():
    """The SP tests' list: a family whose adapter declares a spec or whose transformer class
    has diffusers' plan; Chroma and SANA have neither (the engine refuses them under SP)."""
    from flowgrpo.testing.families import kinds, sequence_parallel

    sp = set(kinds(sequence_parallel))
    assert {"qwen_image", "sd3", "wan22", "z_image", "flux_kontext"} <= sp
    assert not {"chroma", "sana", "toy"} & sp
