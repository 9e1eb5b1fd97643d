"""Figures and tables of the reward-hacking bench (``bench/hacking.py``) for
docs/reward_hacking.md: judge accuracy (the gold reward) and training reward against step per
variant and seed, the guard's outcomes, pairwise against pointwise."""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

from bench.hacking import DOC, HACK_FALL, INK, ROOT, SEEDS

BEGIN, END = "<!-- BEGIN hacking bench -->", "<!-- END hacking bench -->"
FIGURE = ROOT / "docs" / "reward_hacking_curves.png"
COLORS = {
    "none": "tab:red",
    "stop": "tab:blue",
    "stop_patience2": "tab:cyan",
    "rollback": "tab:green",
    "pairwise": "tab:purple",
    "pairwise_ties": "tab:orange",
}


def plot(res: dict, path: Path) -> None:
    """Two panels: judge accuracy and eval training reward against step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for variant, seeds in res.items():
        for seed, r in seeds.items():
            steps = [c[0] for c in r["curve"]]
            label = variant if seed == min(seeds) else None
            c = COLORS.get(variant, "k")
            a.plot(steps, [x[1] for x in r["curve"]], color=c, label=label, alpha=0.8)
            if not variant.startswith("pairwise"):  # its eval reward is a win rate against the base
                b.plot(steps, [x[2] for x in r["curve"]], color=c, label=label, alpha=0.8)
            if r["retired"]:  # a rollback's retired branch, dotted
                xs = sorted(r["retired"])
                a.plot([x[0] for x in xs], [x[1] for x in xs], color=c, ls=":", alpha=0.6)
    a.set(xlabel="step", ylabel="judge accuracy (gold reward)", title="gold: the SVC judge")
    b.set(xlabel="step", ylabel=f"eval reward (digits + {INK:g} ink)", title="training reward")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _med(xs: list, fmt: str = ".3f") -> str:
    """The median of the known values (``—``: none), and how many of them there are."""
    known = [x for x in xs if x is not None]
    if not known:
        return f"— (0 of {len(xs)})"
    return f"{statistics.median(known):{fmt}} ({len(known)} of {len(xs)})"


def tables(res: dict) -> str:
    """The per-seed table and the pass/fail of each claim."""
    lines = [
        "| variant | seed | last step | judge peak (step) | judge last | fall after peak | "
        "reward at peak → last | best-gold checkpoint (judge) | rollbacks |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for variant, seeds in res.items():
        for seed, r in sorted(seeds.items()):
            best = (
                "—" if r["best_gold"] is None else f"step {r['best_step']} ({r['best_gold']:.3f})"
            )
            lines.append(
                f"| {variant} | {seed} | {r['last_step']} | {r['peak']:.3f} ({r['peak_step']}) | "
                f"{r['last']:.3f} | {r['fall']:.3f} | {r['reward_at_peak']:.3f} → "
                f"{r['reward_last']:.3f} | {best} | {r['rollbacks']} |"
            )
    checks = []
    none = res.get("none", {})
    for seed, r in sorted(none.items()):
        fall, at, by = r["hack"]
        rewards = {step: reward for step, _, reward in r["curve"]}
        shown = fall >= HACK_FALL
        episode = (
            f"its largest fall while the eval reward rose: {fall:.3f} below its best so far "
            f"(step {at} → {by}, reward {rewards[at]:.3f} → {rewards[by]:.3f})"
            if by >= 0
            else "it never fell while the eval reward rose"
        )
        checks.append(
            f"- none, seed {seed}: judge peaks at step {r['peak_step']} ({r['peak']:.3f}) and "
            f"falls {r['fall']:.3f} by step {r['last_step']} while the reward goes "
            f"{r['reward_at_peak']:.3f} → {r['reward_last']:.3f}; {episode}: "
            f"{'hacking shown' if shown else 'NOT shown'} (a fall ≥ {HACK_FALL:g})"
        )
    for variant in ("stop", "stop_patience2"):
        for seed, r in sorted(res.get(variant, {}).items()):
            ref = none.get(seed)
            if ref is None or r["best_gold"] is None:
                continue
            evals_after = (r["last_step"] - r["peak_step"]) // 5
            ended = (
                f"stopped at step {r['stopped_at']}"
                if r.get("stopped_at") is not None
                else f"no trip, ran to step {r['last_step']}"
            )
            checks.append(
                f"- {variant}, seed {seed}: {ended} ({evals_after} evals after the judge's peak "
                f"so far, {r['peak']:.3f} at step {r['peak_step']}); best checkpoint's judge "
                f"{r['best_gold']:.3f} = {r['best_gold'] / r['peak']:.3f}× that peak (target "
                f"≥ 0.98×, within 2 evals); the unguarded run's peak over all "
                f"{ref['last_step']} steps: {ref['peak']:.3f} at step {ref['peak_step']} "
                f"({r['best_gold'] / ref['peak']:.3f}×)"
            )
    for seed, r in sorted(res.get("rollback", {}).items()):
        ref = none.get(seed)
        if ref is None:
            continue
        checks.append(
            f"- rollback, seed {seed}: ends at step {r['last_step']} with judge {r['last']:.3f} "
            f"(peak {ref['peak']:.3f}; target ≥ peak − 0.02 = {ref['peak'] - 0.02:.3f}), "
            f"{r['rollbacks']} rollback(s)"
        )
    side = [
        "",
        "| reward | judge ≥ 0.9 at step (median) | judge ≥ 0.95 | peak judge | fall after the peak "
        "| largest fall while the reward rose |",
    ]
    side.append("|---|---|---|---|---|---|")
    names = {
        "none": f"pointwise (digits + {INK:g} ink)",
        "pairwise": "pairwise (same score)",
        "pairwise_ties": "pairwise, ties within 0.05",
    }
    for variant, name in names.items():
        seeds = res.get(variant, {})
        if not seeds:
            continue
        side.append(
            f"| {name} | {_med([r['to_0.9'] for r in seeds.values()], 'g')} | "
            f"{_med([r['to_0.95'] for r in seeds.values()], 'g')} | "
            f"{_med([r['peak'] for r in seeds.values()])} | "
            f"{_med([r['fall'] for r in seeds.values()])} | "
            f"{_med([r['hack'][0] for r in seeds.values()])} |"
        )
    return "\n".join(lines + [""] + checks + side)


def write_report(res: dict, out: Path, block: str = "") -> None:
    """The curves PNG, and the tables between the markers of docs/reward_hacking.md: those of
    the first block, or with ``block`` those of ``hacking bench: <block>`` (a later bench of
    some variants beside the first one's, with its own figure)."""
    begin, end = (
        (BEGIN, END) if not block else (BEGIN[:-4] + f": {block} -->", END[:-4] + f": {block} -->")
    )
    figure = FIGURE if not block else FIGURE.with_name(f"reward_hacking_curves_{block}.png")
    plot(res, figure)
    for name in ("grid_before.png", "grid_after.png"):
        src = out / "none_s0" / name
        if src.is_file() and not block:
            shutil.copy(src, ROOT / "docs" / f"reward_hacking_{name}")
    text = DOC.read_text()
    if begin not in text:  # a new block: at the end of the document
        text = text.rstrip("\n") + f"\n\n{begin}\n{end}\n"
    a, b = text.index(begin) + len(begin), text.index(end)
    seeds = ", ".join(map(str, SEEDS))
    body = f"\n\n![judge and reward curves]({figure.name})\n\nSeeds {seeds}.\n\n{tables(res)}\n\n"
    DOC.write_text(text[:a] + body + text[b:])
