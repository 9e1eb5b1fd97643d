"""One module per registered family (``flowgrpo.models.registry.families()``), named as the
family: its tiny pipeline builder and its ``Family`` lines (``DOUBLES``: the test doubles and
their conformance entries, one per pipeline class or variant, e.g. Wan2.1 and Wan2.2).

Every per-family list of the tests comes from here, and so from the registry: a family added
to the registry with its module here is covered by every test of what it declares, without
editing a test. ``params`` and ``core`` are the one place a family's cost tier picks a CI
subset (``cross`` for a second axis).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from flowgrpo.testing.family import Family


@functools.cache
def doubles() -> tuple[Family, ...]:
    """Every family's test doubles, in registry order (imports each family's module; a
    registered family without one is an error naming the module to write)."""
    from flowgrpo.models.registry import families

    out: list[Family] = []
    for name, pipelines in families().items():
        module_name = f"{__name__}.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name != module_name:
                raise
            raise ModuleNotFoundError(
                f"family {name!r} ({', '.join(pipelines)}) has no test double: write "
                f"src/flowgrpo/testing/families/{name}.py with its DOUBLES"
            ) from None
        out += module.DOUBLES
    return tuple(out)


def double(kind: str) -> Family:
    """The test double of ``kind`` (ValueError naming the known kinds)."""
    for fam in doubles():
        if fam.kind == kind:
            return fam
    raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {kinds()}")


def kinds(where: Callable[[Family], Any] | None = None) -> tuple[str, ...]:
    """The kinds of every test double, or of those for which ``where(family)`` is true (a
    capability: ``lambda f: f.num_frames`` for the video families)."""
    return tuple(f.kind for f in doubles() if where is None or where(f))


def of(family: str) -> tuple[str, ...]:
    """The kinds of one registered family's test doubles (``"wan"`` -> Wan2.1 and Wan2.2),
    for the tests of that family's own module."""
    from flowgrpo.models.registry import families

    if family not in families():
        raise ValueError(f"unknown family {family!r}; registered: {', '.join(families())}")
    return kinds(lambda f: f.pipeline_class in families()[family])


def sequence_parallel_spec(fam: Family | str) -> Any:
    """The ``SequenceParallelSpec`` ``fam``'s adapter declares (its class attribute, read
    through the registry without building a pipeline), or None."""
    from flowgrpo.models.registry import SUPPORTED_PIPELINES, import_adapter

    f = double(fam) if isinstance(fam, str) else fam
    return import_adapter(SUPPORTED_PIPELINES[f.pipeline_class]).sequence_parallel


def sequence_parallel(fam: Family | str) -> bool:
    """Whether ``fam`` (a family or a kind) runs under sequence parallelism, as the engine
    decides it (``flowgrpo.engine.sp``): its adapter declares a ``SequenceParallelSpec``, or
    its pipeline's transformer class carries diffusers' context-parallel plan (``_cp_plan``).
    The toy (not a diffusers pipeline, ``stock`` False) is left out: SP is for the models
    that need it, and the toy's SD3 transformer is SD3's case."""
    import inspect
    import typing

    f = double(fam) if isinstance(fam, str) else fam
    if not f.stock:
        return False
    if sequence_parallel_spec(f) is not None:
        return True
    import diffusers

    hint = (
        inspect.signature(getattr(diffusers, f.pipeline_class).__init__)
        .parameters["transformer"]
        .annotation
    )
    return any(getattr(c, "_cp_plan", None) for c in typing.get_args(hint) or (hint,))


def rows_setting() -> str:
    """``FLOWGRPO_TEST_ROWS``, the one setting of how many family rows the tests run: "all"
    (every family in every cross-product, once, when a family or an algorithm is added),
    "core" (``make test-fast``: the per-family tests on the "core" tier only, the other tiers'
    rows marked ``slow``), or "" (``make test``, CI: as the tiers say)."""
    value = os.environ.get("FLOWGRPO_TEST_ROWS", "")
    if value not in ("", "all", "core"):
        raise ValueError(f"FLOWGRPO_TEST_ROWS must be all, core or unset, got {value!r}")
    return value


def core(fam: Family | str) -> bool:
    """Whether ``fam`` (a family or a kind) runs the cross-products CI time cannot afford for
    every family (every algorithm x LoRA/full): its tier is "core"."""
    return (double(fam) if isinstance(fam, str) else fam).tier == "core"


def cross(fams: Iterable[Family | str], values: Sequence[Any]) -> list[tuple[Any, Any]]:
    """``fams`` x ``values`` (a second axis: LoRA/full, the SDE kind) as CI time affords it: a
    family of the "core" tier with every value, any other with one, taken in turn along
    ``fams`` (so every value meets several families); every pair with
    ``FLOWGRPO_TEST_ROWS=all``. What a value changes (LoRA or full weights, the sampler's
    noise rule) is the same code for every family: the core families cover it, the others
    their own part once."""
    every = rows_setting() == "all"
    out = []
    for j, fam in enumerate(fams):
        for i, value in enumerate(values):
            if every or core(fam) or i == j % len(values):
                out.append((fam, value))
    return out


def cross_params(
    fams: Iterable[Family | str], values: Sequence[Any], marks: Iterable[Any] = ()
) -> list[Any]:
    """``cross(fams, values)`` as pytest parameters ``(fam, value)`` with ids ``kind-value``,
    marked as ``params`` marks each family."""
    import pytest

    out = []
    for fam, value in cross(fams, values):
        (row,) = params([fam], marks)
        out.append(pytest.param(fam, value, id=f"{row.id}-{value}", marks=row.marks))
    return out


def params(fams: Iterable[Family | str], marks: Iterable[Any] = ()) -> list[Any]:
    """``fams`` (families or kinds) as pytest parameters with the kind as id; the families of
    the "slow" tier carry ``pytest.mark.slow`` (``make test-fast`` skips them, ``make test``
    runs them), and with ``FLOWGRPO_TEST_ROWS=core`` (``make test-fast``) every family but the
    "core" tier's. With ``core``, the one place a cost tier chooses a CI subset."""
    import pytest

    only_core = rows_setting() == "core"
    out = []
    for fam in fams:
        f = double(fam) if isinstance(fam, str) else fam
        slow = f.tier == "slow" or (only_core and f.tier != "core")
        tier = [pytest.mark.slow] if slow else []
        out.append(pytest.param(fam, id=f.kind, marks=[*tier, *marks]))
    return out
