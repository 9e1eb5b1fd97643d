"""Published GPU memory figures of runs like ours, each with its source (file and commit) and
the settings that plan it (``assets/published_memory.json``: data, so that the planner's code
names no model family); ``check(figure)`` plans one and says how far the prediction is.
docs/memory.md's table and tests/planner/test_published_figures.py come from ``FIGURES``.

A figure's settings are the source's own (resolution, rank, LoRA targets, precision, batch,
checkpointing, what sits on the GPU), translated to flowgrpo's keys; what a source leaves
open is said in ``assumed``. No planner constant is tuned to any of these figures."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowgrpo.planner.plan import CUDA_OVERHEAD_MIB, GIB, Plan, plan_memory


@dataclass(frozen=True)
class Figure:
    """One published figure: ``gib`` per GPU within ``band`` (a share), or, with ``fits`` set,
    an outcome on a ``gpu_gb`` card (True: it ran, False: out of memory). ``part``: what the
    source measured, "total" (the plan's peak), "run" (the rollout and training phases: the
    source computed its text embeddings in a separate process beforehand) or "text encoders"
    (the encoders' weights and the CUDA context alone: an embedding pass holds nothing
    else)."""

    name: str
    source: str
    quote: str
    preset: str
    overrides: tuple[str, ...]
    gpus: int
    assumed: str
    gib: float = 0.0
    band: float = 0.10
    fits: bool | None = None
    gpu_gb: float = 80.0
    part: str = "total"
    check: bool = True  # False: shown in docs/memory.md, not one of the checks


def _load() -> list[Figure]:
    """The figures of ``assets/published_memory.json``."""
    import json
    from importlib import resources

    text = (resources.files("flowgrpo") / "assets" / "published_memory.json").read_text()
    return [Figure(**dict(f, overrides=tuple(f["overrides"]))) for f in json.loads(text)["figures"]]


FIGURES = _load()


def plan_figure(figure: Figure) -> Plan:
    """The plan of ``figure``'s configuration."""
    from flowgrpo.config import load_config

    cfg = load_config(figure.preset, list(figure.overrides), check_paths=False)
    return plan_memory(cfg, figure.gpus, figure.gpu_gb)


def predicted_gib(figure: Figure, plan: Plan | None = None) -> float:
    """The planner's figure for what ``figure`` measured (GiB per GPU)."""
    plan = plan or plan_figure(figure)
    if figure.part == "text encoders":
        context = CUDA_OVERHEAD_MIB["context"] * 2**20
        return (plan.parts["frozen text encoders"] + context) / GIB
    if figure.part == "run":
        return max(plan.phases["rollout"], plan.phases["training"]) / GIB
    return plan.total / GIB


def check(figure: Figure, plan: Plan | None = None) -> tuple[bool, str]:
    """(whether the prediction meets the figure, one line saying so); ``plan``: its plan, if
    already made."""
    plan = plan or plan_figure(figure)
    got = predicted_gib(figure, plan)
    if figure.fits is None:
        off = got / figure.gib - 1
        ok = abs(off) <= figure.band
        return ok, (
            f"{figure.name}: published {figure.gib:g}, planned {got:.1f} GiB "
            f"({off:+.0%}, band ±{figure.band:.0%})"
        )
    ok = (got <= figure.gpu_gb) == figure.fits
    said = "fits" if got <= figure.gpu_gb else "does not fit"
    return ok, (
        f"{figure.name}: {'ran' if figure.fits else 'out of memory'} on {figure.gpu_gb:g} GB; "
        f"planned {got:.1f} GiB at its peak ({plan.peak_phase}): {said}"
    )


def docs_rows() -> list[str]:
    """docs/memory.md's published-vs-planned table, one markdown row per figure."""
    rows = [
        "| run | published | planned (GiB/GPU) | verdict | source | settings assumed |",
        "|---|---|---|---|---|---|",
    ]
    for f in FIGURES:
        plan = plan_figure(f)
        ok, _ = check(f, plan)
        got = predicted_gib(f, plan)
        if f.fits is None:
            pub = f"{f.gib:g} GB"
            verdict = f"{got / f.gib - 1:+.0%} (band ±{f.band:.0%})"
        else:
            pub = ("ran" if f.fits else "out of memory") + f" on {f.gpu_gb:g} GB"
            verdict = "fits" if got <= f.gpu_gb else "does not fit"
        verdict += "" if ok else " **outside**"
        verdict += "" if f.check else " (shown, not checked)"
        rows.append(f"| {f.name} | {pub} | {got:.1f} | {verdict} | {f.source} | {f.assumed} |")
    return rows


__all__ = ["FIGURES", "Figure", "check", "docs_rows", "plan_figure", "predicted_gib"]


def _main(argv: Any = None) -> None:  # python -m flowgrpo.planner.published
    for f in FIGURES:
        ok, line = check(f)
        print(("ok   " if ok else "GAP  ") + line)


if __name__ == "__main__":
    _main()
