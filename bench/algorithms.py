"""The algorithms compared on the toy by time-to-reward (``python -m bench --sections algorithms``).

Each row trains the default preset (``flowgrpo train toy-digits algorithm=NAME``, plus the
row's own overrides) for the same number of steps with the same eval schedule, once per seed,
one run at a time in a subprocess on one thread. A row does the same work at every step (same
batch, same trained steps), so its time to a point of the curve is that point's step times the
row's per-step time on a quiet machine (``quiet_step_s``: the median CPU time of steps 2-5 of a
short run without evals, the least of two rounds over every row, measured after the training
runs; evals are never counted). A shared machine inflates even the CPU time of identical steps
(Flow-GRPO's three seeds measured 2.5, 2.9 and 3.2 s/step median beside other jobs), so the
runs' own per-step times are kept (``cpu_s``, ``wall_s``) but not used for the table.

Per row, over the seeds: the median and range of the time and of the images generated until
judge accuracy first reaches ``TARGET``; the judge − reward-accuracy gap and the diversity
there; the judge accuracy at a common time budget (the shortest 40-step run of all); the final
values at the last step. ``write_report`` puts the table and the plot (judge accuracy against
time, median and range) into docs/algorithms.md. ``python -m bench.algorithms`` re-reads the
stored curves; ``python -m bench.algorithms shares`` measures where each row's step goes
(rollout / reward / update) and adds the table of what 0.2x Flow-GRPO's time would take.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench import reaches

TARGET = 0.95  # judge accuracy
REFILL = "sample.refill_rounds=2"  # a refill row's setting (its steps cost what they sample)
SEEDS = (0, 1, 2)
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Row:
    """One line of the table: an algorithm with the toy preset's settings for it (its authors'
    adapted to the toy, documented in the preset) plus ``overrides`` (a tuning is its own row)."""

    key: str
    algorithm: str
    overrides: tuple[str, ...] = ()
    settings: str = "toy preset (authors' settings adapted)"


ROWS = (
    Row("flow_grpo", "flow_grpo"),
    Row("mix_grpo", "mix_grpo"),
    Row("grpo_guard", "grpo_guard"),
    Row(
        "nft",
        "nft",
        ("nft.timesteps=null", "nft.kl_beta=1.0e-4"),
        "authors': every noise level, KL 1e-4",
    ),
    Row("nft_tuned", "nft", (), "tuned on the toy (preset): 3 noise levels, KL 0.01"),
    Row("awm", "awm"),
    Row("flow_dppo", "flow_dppo"),
    Row("dpo", "dpo", (), "authors': pairs sampled by the reference (base), beta 100"),
    Row(
        "dpo_policy",
        "dpo",
        ("dpo.rollout_policy=policy",),
        "online: pairs sampled by the current policy, beta 100",
    ),
    Row(
        "flow_grpo_refill",
        "flow_grpo",
        (REFILL,),
        "Flow-GRPO + refill: constant groups resampled, 2 rounds, <= 10 extra groups a step",
    ),
    Row(
        "nft_tuned_refill",
        "nft",
        (REFILL,),
        "nft_tuned + refill: constant groups resampled, 2 rounds, <= 10 extra groups a step",
    ),
    Row(
        "flow_grpo_branch",
        "flow_grpo",
        ("sample.branching.split_steps=[0,2,4,6]", "sample.branching.factors=[2,2,2,2]"),
        "BranchGRPO tree: splits at steps 0, 2, 4, 6 into 2 (16 leaves), depth advantages",
    ),
    Row(
        "mix_grpo_branch",
        "mix_grpo",
        (
            "sample.branching.split_steps=[0,1,2,3]",
            "sample.branching.factors=[2,2,2,2]",
            "sample.branching.estimator=backup",
            "sample.branching.fusion=logprob",
        ),
        "TreeGRPO tree: every window step splits into 2 (16 leaves), log-prob backup",
    ),
    Row(
        "flow_grpo_off_policy",
        "flow_grpo",
        ("trainer.off_policy_steps=1",),
        "Flow-GRPO, one-step-off-policy rollouts (sequential), the preset's clip 1e-4",
    ),
    Row(
        "flow_grpo_off_policy_clip",
        "flow_grpo",
        ("trainer.off_policy_steps=1", "flow_grpo.clip_range=1.0e-2"),
        "Flow-GRPO, one-step-off-policy rollouts (sequential), clip 1e-2",
    ),
)
ALGORITHMS = tuple(r.key for r in ROWS)  # the table's rows, in order


def run_one(row: Row, seed: int, out: Path, steps: int, eval_every: int) -> dict[str, object]:
    """One training run; its eval curve against the steps' CPU time, and where it crosses."""

    args = [sys.executable, "-m", "flowgrpo", "train", "toy-digits", f"algorithm={row.algorithm}"]
    args += [f"seed={seed}", f"trainer.max_steps={steps}", f"trainer.eval_every={eval_every}"]
    args += ["trainer.save_every=0", "run.tensorboard=false", "run.progress_bar=false"]
    args += ["run.num_threads=1", f"run.output_dir={out}", *row.overrides]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    child = subprocess.run(args, env=env, capture_output=True, text=True)
    if child.returncode:
        raise RuntimeError(
            f"{row.key} seed {seed}: exit {child.returncode}: {child.stderr[-2000:]}"
        )
    return read_run(out)


def read_run(out: Path) -> dict[str, object]:
    """A finished run folder's eval curve against its steps' CPU time, and where it crosses."""
    from flowgrpo.trainer.logging import read_jsonl

    rows, evals = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "eval.jsonl")
    clock, wall, samples, extra = {0: 0.0}, {0: 0.0}, {0: 0}, {0: 0}
    for r in rows:  # training CPU time, wall time and images up to each step
        clock[r["step"]] = clock[r["step"] - 1] + r["time/step_cpu_s"]
        wall[r["step"]] = wall[r["step"] - 1] + r["time/step_s"]
        samples[r["step"]] = r["samples"]  # with refill's extra samples
        extra[r["step"]] = extra[r["step"] - 1] + int(r.get("refill/samples", 0))
    curve = [
        {
            "step": e["step"],
            "extra_samples": extra[e["step"]],
            "train_s": clock[e["step"]],  # until finish() times it by the quiet step
            "cpu_s": clock[e["step"]],
            "wall_s": wall[e["step"]],
            "images": samples[e["step"]],
            "accuracy": e["eval/accuracy"],
            "judge_accuracy": e["eval/judge_accuracy"],
            "diversity": e["eval/diversity"],
        }
        for e in evals
    ]
    return summarize_run(curve)


def quiet_step_s(row: Row, out: Path, steps: int = 5) -> float:
    """The median CPU time of steps 2..``steps`` of a short run of ``row`` (evals only at
    steps 0 and last, outside the steps' time). A refill row is measured without refill (its
    steps' cost varies with what they resample: ``sample_s`` prices the extra samples)."""
    return quiet_costs(row, out, steps)[0]


def _short_run(row: Row, out: Path, steps: int) -> list[dict]:
    """The metrics of steps 2..``steps`` of a short run of ``row`` (evals only at steps 0 and
    last, outside the steps' time; a refill row without refill)."""
    from flowgrpo.trainer.logging import read_jsonl

    args = [sys.executable, "-m", "flowgrpo", "train", "toy-digits", f"algorithm={row.algorithm}"]
    args += [f"trainer.max_steps={steps}", "trainer.eval_every=0", "trainer.save_every=0"]
    args += ["run.tensorboard=false", "run.progress_bar=false", "run.num_threads=1"]
    args += [f"run.output_dir={out}", "data.eval_samples_per_prompt=1", *row.overrides]
    if REFILL in row.overrides:
        args.append("sample.refill_rounds=0")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    child = subprocess.run(args, env=env, capture_output=True, text=True)
    if child.returncode:
        raise RuntimeError(f"{row.key}: exit {child.returncode}: {child.stderr[-2000:]}")
    return [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] >= 2]


#: the parts of a step the trainer times (``time/<part>_s``): the rest of its wall time is
#: "other" (the step's bookkeeping: advantages, logging; the optimizer's step is in train)
PARTS = ("rollout", "reward", "train")


def quiet_costs(row: Row, out: Path, steps: int = 5) -> tuple[float, float, dict[str, float]]:
    """(``quiet_step_s``, the CPU time of one sample's rollout and reward in those steps: the
    step's CPU time x the rollout's and reward's share of its wall time / the samples, and the
    median share of a step's wall time in each of ``PARTS`` and in the rest, "other"; one
    thread, so wall time ~ CPU time)."""
    rows = _short_run(row, out, steps)
    per_sample = [
        r["time/step_cpu_s"] * (r["time/rollout_s"] + r["time/reward_s"]) / r["time/step_s"]
        / (r["samples"] / r["step"])
        for r in rows
    ]  # fmt: skip
    shares = {
        p: statistics.median(r[f"time/{p}_s"] / r["time/step_s"] for r in rows) for p in PARTS
    }
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    step_s = statistics.median(r["time/step_cpu_s"] for r in rows)
    return step_s, statistics.median(per_sample), shares


def calibrate(
    rows: tuple[Row, ...], rounds: int = 2
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """Each row's per-step time on a quiet machine: the least of ``rounds`` rounds over every
    row (rounds interleave the rows, so a burst of other work hits one measurement of each);
    a refill row also gets ``<key>/sample_s``, the price of one extra sample (that round's).
    Second: each row's step split into ``PARTS`` (``quiet_costs``), of the same round."""
    best: dict[str, float] = {}
    shares: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for row in rows:
                t, per_sample, split = quiet_costs(row, Path(tmp) / f"{row.key}_{i}")
                if t < best.get(row.key, float("inf")):
                    best[row.key], shares[row.key] = t, split
                    if REFILL in row.overrides:
                        best[f"{row.key}/sample_s"] = per_sample
    return best, shares


def with_step_cost(curve: list[dict], step_s: float, sample_s: float = 0.0) -> list[dict]:
    """``curve`` with ``train_s`` = step x the row's quiet per-step time + its extra (refill)
    samples so far x their quiet price (the runs' measured CPU time kept as ``cpu_s``)."""
    return [
        {
            **c,
            "cpu_s": c.get("cpu_s", c["train_s"]),
            "train_s": c["step"] * step_s + c.get("extra_samples", 0) * sample_s,
        }
        for c in curve
    ]


def summarize_run(curve: list[dict]) -> dict[str, object]:
    """The crossing of ``TARGET`` (the first eval after step 0 at or above it) and the end."""
    reached = next(
        (c for c in curve if reaches(c["judge_accuracy"], TARGET) and c["step"] > 0), None
    )
    at = (lambda key: reached[key]) if reached else (lambda key: None)
    return {
        "curve": curve,
        "time_to_target_s": at("train_s"),
        "images_to_target": at("images"),
        "accuracy_at_target": at("accuracy"),
        "judge_at_target": at("judge_accuracy"),
        "gap_at_target": reached and reached["judge_accuracy"] - reached["accuracy"],
        "diversity_at_target": at("diversity"),
        "final_step": curve[-1]["step"],
        "final_judge_accuracy": curve[-1]["judge_accuracy"],
        "final_accuracy": curve[-1]["accuracy"],
        "final_diversity": curve[-1]["diversity"],
        "train_s": curve[-1]["train_s"],
    }


def judge_at(curve: list[dict], t: float) -> float:
    """The judge accuracy of the last eval at or before training time ``t``."""
    return [c["judge_accuracy"] for c in curve if c["train_s"] <= t][-1]


@dataclass
class Spread:
    """Median and range over the seeds; ``n`` of them had a value (a run that never crossed
    has none)."""

    median: float | None
    low: float | None
    high: float | None
    n: int
    values: list = field(default_factory=list)

    @classmethod
    def of(cls, values: list) -> Spread:
        have = [v for v in values if v is not None]
        if not have:
            return cls(None, None, None, 0, list(values))
        return cls(statistics.median(have), min(have), max(have), len(have), list(values))


def summarize(runs: dict[str, list[dict]], budget_s: float) -> dict[str, dict[str, object]]:
    """Per row: every figure's median and range over its seeds, and the judge at the budget."""
    keys = (
        "time_to_target_s",
        "images_to_target",
        "accuracy_at_target",
        "judge_at_target",
        "gap_at_target",
        "diversity_at_target",
        "final_accuracy",
        "final_judge_accuracy",
        "final_diversity",
        "train_s",
    )
    out = {}
    for key, seeds in runs.items():
        figures = {k: vars(Spread.of([r[k] for r in seeds])) for k in keys}
        figures["judge_at_budget"] = vars(
            Spread.of([judge_at(r["curve"], budget_s) for r in seeds])
        )
        out[key] = figures
    base = out["flow_grpo"]["time_to_target_s"]["median"]
    for figures in out.values():
        t = figures["time_to_target_s"]["median"]
        figures["time_to_target_over_flow_grpo"] = t / base if t is not None and base else None
    return out


def bench_algorithms(
    *,
    quick: bool = False,
    rows: tuple[Row, ...] = ROWS,
    seeds: tuple[int, ...] = SEEDS,
    only: tuple[str, ...] = (),
    previous: dict | None = None,
) -> dict[str, object]:
    """Train every row (or, with ``only``, just those rows, taking the others' curves from
    ``previous``, an earlier full run's results) and time them all by one calibration."""
    steps, every = (1, 1) if quick else (40, 2)
    seeds = seeds[:1] if quick else seeds
    unknown = sorted(set(only) - {r.key for r in rows})
    if unknown:
        raise ValueError(f"--rows: no such row {unknown[0]!r} (rows: {', '.join(ALGORITHMS)})")
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            if only and row.key not in only:
                kept = (previous or {}).get("runs", {}).get(row.key)
                if kept is None:  # a row added since, never measured: left out of this table
                    print(f"algorithms: {row.key} has no earlier results: left out (train it "
                          "with --rows)", file=sys.stderr, flush=True)  # fmt: skip
                    continue
                runs[row.key] = kept
                continue
            runs[row.key] = [
                run_one(row, s, Path(tmp) / f"{row.key}_{s}", steps, every) for s in seeds
            ]
            print(f"algorithms: {row.key} done", file=sys.stderr, flush=True)
    rows = tuple(r for r in rows if r.key in runs)
    step_s, shares = calibrate(rows, rounds=1 if quick else 2)
    return {**finish(runs, step_s, rows, seeds, steps, every), "step_shares": shares}


def finish(
    runs: dict[str, list[dict]],
    step_s: dict[str, float],
    rows: tuple[Row, ...],
    seeds: tuple[int, ...],
    steps: int,
    every: int,
) -> dict[str, object]:
    """The results: each run's curve timed by its row's quiet per-step time, the summary over
    the seeds (the common budget: the shortest last step of all), and the best row."""
    runs = {
        key: [
            summarize_run(with_step_cost(r["curve"], step_s[key], step_s.get(f"{key}/sample_s", 0)))
            for r in seeds_
        ]
        for key, seeds_ in runs.items()
    }
    budget = min(r["train_s"] for seeds_ in runs.values() for r in seeds_)
    out: dict[str, object] = {
        "steps": steps,
        "eval_every": every,
        "target_judge": TARGET,
        "seeds": list(seeds),
        "time": "step x the row's per-step CPU time on a quiet machine, one thread (s)",
        "step_s": step_s,
        "budget_s": budget,
        "rows": {
            r.key: {
                "algorithm": r.algorithm,
                "overrides": list(r.overrides),
                "settings": r.settings,
            }
            for r in rows
        },
        "runs": runs,
        "summary": summarize(runs, budget),
    }
    best = min(
        (k for k in out["summary"] if k != "flow_grpo"),
        key=lambda k: out["summary"][k]["time_to_target_over_flow_grpo"] or float("inf"),
    )
    out["best"] = {
        "row": best,
        "time_to_target_over_flow_grpo": out["summary"][best]["time_to_target_over_flow_grpo"],
        "diversity_at_target_over_flow_grpo": _ratio(
            out["summary"][best]["diversity_at_target"]["median"],
            out["summary"]["flow_grpo"]["diversity_at_target"]["median"],
        ),
    }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def median_band(curves: list[list[dict]], grid: list[float]) -> tuple[list, list, list]:
    """Median, low and high judge accuracy over ``curves`` at each time of ``grid`` (each
    curve held at its last eval: a step function, as the runs were seen)."""
    med, low, high = [], [], []
    for t in grid:
        values = [judge_at(c, t) for c in curves]
        med.append(statistics.median(values))
        low.append(min(values))
        high.append(max(values))
    return med, low, high


def gap_rows(results: dict, target: float = 0.2) -> list[str]:
    """docs/algorithms.md's table of where each row's step time goes and what ``target`` x
    Flow-GRPO's time to the judge target would take: at the row's step cost, that many steps;
    at the row's steps, that step cost. Needs ``results["step_shares"]`` (``measure_shares``)."""
    summary, shares, step_s = results["summary"], results["step_shares"], results["step_s"]
    budget = target * summary["flow_grpo"]["time_to_target_s"]["median"]
    lines = [
        f"| row | steps to judge {TARGET} (median) | CPU s/step | rollout / reward / update / "
        f"other | × Flow-GRPO | {target:g}× needs: steps at this cost | or s/step at these "
        "steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, sm in summary.items():
        if key not in shares:
            continue
        t = sm["time_to_target_s"]["median"]
        cost = step_s[key]
        split = " / ".join(f"{shares[key][p] * cost:.2f}" for p in (*PARTS, "other"))
        ratio = sm["time_to_target_over_flow_grpo"]
        steps = None if t is None else t / cost
        lines.append(
            f"| `{key}` | {'—' if steps is None else f'{steps:.0f}'} | {cost:.2f} | {split} | "
            f"{'—' if ratio is None else f'{ratio:.2f}'} | {budget / cost:.1f} | "
            f"{'—' if steps is None else f'{budget / steps:.2f}'} |"
        )
    return lines


def measure_shares(path: Path = ROOT / "bench" / "results.json") -> dict[str, dict]:
    """Each stored row's step split (one ``calibrate`` round, its times dropped: the stored
    calibration stays) into ``path``'s results and docs/algorithms.md (``python -m
    bench.algorithms shares``; a full run measures them with its own calibration)."""
    import json

    results = json.loads(path.read_text())
    algos = results["algorithms"]
    _, algos["step_shares"] = calibrate(tuple(r for r in ROWS if r.key in algos["runs"]), 1)
    path.write_text(json.dumps(results, indent=2) + "\n")
    write_report(algos)
    return algos["step_shares"]


def write_report(results: dict, doc: Path = ROOT / "docs" / "algorithms.md") -> None:
    """The table and the plot (docs/algorithms_toy.png) between the report markers of ``doc``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, runs = results["summary"], results["runs"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    end = max(r["train_s"] for seeds in runs.values() for r in seeds)
    grid = [end * i / 400 for i in range(401)]
    for key, seeds in runs.items():
        med, low, high = median_band([r["curve"] for r in seeds], grid)
        (line,) = axes[0].step(grid, med, where="post", label=key, lw=1.4)
        axes[0].fill_between(grid, low, high, step="post", alpha=0.15, color=line.get_color())
        for i, r in enumerate(seeds):  # diversity against judge accuracy, each seed
            axes[1].plot(
                [c["judge_accuracy"] for c in r["curve"]],
                [c["diversity"] for c in r["curve"]],
                marker="o", ms=2, lw=0.6, color=line.get_color(),
                label=key if i == 0 else None,
            )  # fmt: skip
    axes[0].axhline(TARGET, color="grey", lw=0.8, ls="--")
    axes[0].set_xlabel("training time (s): step x the row's quiet step time, one CPU thread")
    axes[0].set_ylabel("judge accuracy (median, range over seeds)")
    axes[0].set_ylim(0.5, 1.01)
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("judge accuracy")
    axes[1].set_ylabel("diversity")
    axes[1].axvline(TARGET, color="grey", lw=0.8, ls="--")
    fig.tight_layout()
    png = doc.parent / "algorithms_toy.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)

    def fmt(s: dict, spec: str = ".3f", unit: str = "") -> str:
        if s["median"] is None:
            return "—"
        if s["low"] == s["high"]:
            return f"{s['median']:{spec}}{unit}"
        return f"{s['median']:{spec}}{unit} ({s['low']:{spec}}–{s['high']:{spec}})"

    n = len(results["seeds"])
    lines = [
        f"| row | settings | reached | time to judge ≥ {TARGET} | × Flow-GRPO | images | "
        f"judge − accuracy there | diversity there | judge at {results['budget_s']:.0f} s | "
        f"step {results['steps']}: accuracy / judge / diversity |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in summary.items():
        ratio = s["time_to_target_over_flow_grpo"]
        final = " / ".join(
            f"{s[k]['median']:.3f}"
            for k in ("final_accuracy", "final_judge_accuracy", "final_diversity")
        )
        lines.append(
            f"| `{key}` | {results['rows'][key]['settings']} | "
            f"{s['time_to_target_s']['n']}/{n} | {fmt(s['time_to_target_s'], '.0f', ' s')} | "
            f"{'—' if ratio is None else f'{ratio:.2f}'} | {fmt(s['images_to_target'], '.0f')} | "
            f"{fmt(s['gap_at_target'], '+.3f')} | {fmt(s['diversity_at_target'])} | "
            f"{fmt(s['judge_at_budget'])} | {final} |"
        )
    table = "\n".join(lines)
    text = _between(
        doc.read_text(), "toy comparison", f"{table}\n\n![toy comparison](algorithms_toy.png)"
    )
    if "step_shares" in results:
        text = _between(text, "toy gap", "\n".join(gap_rows(results)))
    doc.write_text(text)


def _between(text: str, name: str, body: str) -> str:
    """``text`` with ``body`` between its ``<!-- name: start/end -->`` markers (appended, with
    them, where they are missing)."""
    start, stop = f"<!-- {name}: start -->", f"<!-- {name}: end -->"
    body = f"{start}\n{body}\n{stop}"
    if start in text:
        return text[: text.index(start)] + body + text[text.index(stop) + len(stop) :]
    return text + "\n" + body + "\n"


def resummarize(path: Path = ROOT / "bench" / "results.json") -> dict[str, object]:
    """The table again from the stored runs and calibration of ``path`` (no training, no
    timing): for a change in how the curves are read (``python -m bench.algorithms``)."""
    import json

    from bench.run import check_targets

    results = json.loads(path.read_text())
    old = results["algorithms"]
    rows = tuple(r for r in ROWS if r.key in old["runs"])
    results["algorithms"] = finish(
        old["runs"], old["step_s"], rows, tuple(old["seeds"]), old["steps"], old["eval_every"]
    )
    if "step_shares" in old:  # measured apart (measure_shares): kept
        results["algorithms"]["step_shares"] = old["step_shares"]
    results["targets"] = check_targets(results)
    path.write_text(json.dumps(results, indent=2) + "\n")
    write_report(results["algorithms"])
    return results["algorithms"]


if __name__ == "__main__":  # python -m bench.algorithms [shares]: re-read the stored runs
    measure_shares() if sys.argv[1:] == ["shares"] else resummarize()


__all__ = ["ALGORITHMS", "ROWS", "Row", "bench_algorithms", "calibrate", "finish", "gap_rows",
           "measure_shares", "quiet_costs", "resummarize", "summarize", "write_report"]  # fmt: skip
