"""Reward hacking on the toy, caught by the guard (``python -m bench.hacking``, or
``python -m bench --sections hacking``).

The toy's reward is made hackable: the classifier's probability of the prompt's digit plus
1.0 x ``digits_ink`` (mean brightness, which an image maximises by painting its background,
not by being a better digit). The gold reward is the toy's independent SVC judge
(``eval.gold_reward=digits_judge``), never trained on. Six variants, seeds 0, 1, 2, each one
run of ``flowgrpo train`` in a subprocess on one thread:

- ``none``: no guard: the judge peaks and falls while the training reward still rises;
- ``stop``: ``guard.max_gold_drop=0.02 guard.action=stop``;
- ``stop_patience2``: the same with ``guard.patience=2`` (the drop at two evals in a row);
- ``rollback``: the same with ``guard.action=rollback guard.on_rollback.optim.lr=1e-4``;
- ``pairwise``: no guard, the same hackable score judged in pairs (``digits_pairwise`` with
  ``ink_weight=1.0``): each sample's reward is its win rate in its group (Pref-GRPO);
- ``pairwise_ties``: the same with ``margin=0.05``: scores closer than 0.05 are a tie (0.5 to
  each side), as a judge that cannot tell two images apart answers.

``run`` trains what is missing under ``--out``; ``report`` reads the run folders and writes
the figures and the tables into docs/reward_hacking.md (between its BEGIN/END markers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import reaches

ROOT = Path(__file__).resolve().parents[1]
SEEDS = (0, 1, 2)
DOC = ROOT / "docs" / "reward_hacking.md"
MAX_DROP = 0.02
#: the weight of the hackable ink term (0.5 hacked too slowly to show in 40 steps: the docs' table
#: of the settings tried)
INK = 1.0
#: a fall of the judge that counts as hacking in the report: about 1.5x the standard deviation
#: of the difference of two 200-image evals at accuracy 0.85 (0.036), where the guard trips at
#: MAX_DROP, within that noise, on purpose: it must trip early
HACK_FALL = 0.05
COMMON = (
    f"reward=digits:1.0,digits_ink:{INK}",
    "eval.gold_reward=digits_judge",
    "optim.lr=5e-4",
    "sample.group_size=8",
    "data.eval_samples_per_prompt=20",
    "trainer.max_steps=40",
    "trainer.eval_every=5",
    "trainer.save_every=5",
    "trainer.keep_last=2",
    "run.num_threads=1",
    "run.tensorboard=false",
    "run.progress_bar=false",
)
VARIANTS: dict[str, tuple[str, ...]] = {
    "none": (),
    "stop": (f"guard.max_gold_drop={MAX_DROP}", "guard.action=stop"),
    "stop_patience2": (f"guard.max_gold_drop={MAX_DROP}", "guard.action=stop", "guard.patience=2"),
    "rollback": (
        f"guard.max_gold_drop={MAX_DROP}",
        "guard.action=rollback",
        "guard.on_rollback.optim.lr=1.0e-4",
        "guard.max_rollbacks=2",
    ),
    "pairwise": ("reward=digits_pairwise", f"reward.digits_pairwise.options.ink_weight={INK}"),
    "pairwise_ties": (
        "reward=digits_pairwise",
        f"reward.digits_pairwise.options.ink_weight={INK}",
        "reward.digits_pairwise.options.margin=0.05",
    ),
}


def command(variant: str, seed: int, out: Path) -> list[str]:
    """The ``flowgrpo train`` command line of one run."""
    return [
        sys.executable,
        "-m",
        "flowgrpo",
        "train",
        "toy-digits",
        *COMMON,
        *VARIANTS[variant],
        f"seed={seed}",
        f"run.output_dir={out / f'{variant}_s{seed}'}",
        "run.overwrite=true",
    ]


def _train(variant: str, seed: int, out: Path) -> str:
    folder = out / f"{variant}_s{seed}"
    if (folder / "done.json").is_file():
        return f"{folder.name}: already done"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(out / f"{variant}_s{seed}.log", "w") as log:
        rc = subprocess.call(
            ["nice", "-n", "5", *command(variant, seed, out)], stdout=log, stderr=log, env=env
        )
    if rc == 0:
        (folder / "done.json").write_text(json.dumps({"rc": rc}))
    return f"{folder.name}: rc {rc}"


def run(out: Path, variants: list[str], seeds: list[int], jobs: int) -> None:
    """Train every (variant, seed) not done yet under ``out``, ``jobs`` at a time."""
    todo = [(v, s) for v in variants for s in seeds]
    with ThreadPoolExecutor(jobs) as pool:
        for line in pool.map(lambda vs: _train(vs[0], vs[1], out), todo):
            print(line, flush=True)


# -- the report --------------------------------------------------------------------------------


def evals(folder: Path) -> list[dict]:
    """The run's evals (eval.jsonl), one per step (a rollback's retired branch excluded)."""
    rows: dict[int, dict] = {}
    for line in (folder / "eval.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[int(r["step"])] = r  # a rolled-back step: the later row wins
    return [rows[k] for k in sorted(rows)]


def retired(folder: Path) -> list[dict]:
    """Eval rows a rollback retired (``checkpoints/abandoned_after_step_*``)."""
    out = []
    for d in sorted((folder / "checkpoints").glob("abandoned_after_step_*")):
        f = d / "eval.jsonl"
        if f.is_file():
            out += [json.loads(x) for x in f.read_text().splitlines()]
    return out


def judge(r: dict) -> float:
    return float(r["eval/gold/digits_judge"])


def largest_hack(curve: list[tuple[int, float, float]]) -> tuple[float, int, int]:
    """The judge's largest fall below its best so far at an eval whose training reward is above
    the reward at that best: the guard's own rule (``trainer.guard.check``, any drop) at each
    eval of a whole run. (fall, the best's step, the fallen eval's step); (0.0, -1, -1) when the
    judge never fell while the reward rose. ``curve``: (step, judge, eval reward) per eval."""
    from flowgrpo.trainer import guard

    record, out = guard.new_record(), (0.0, -1, -1)
    for step, judge_accuracy, reward in curve:
        guard.record_eval(record, step, reward, judge_accuracy)
        trip = guard.check(record, 0.0)
        if trip is not None and trip.drop > out[0]:
            out = (trip.drop, trip.peak.step, trip.now.step)
    return out


def first_step(rows: list[dict], target: float) -> int | None:
    """The first eval step whose judge accuracy reaches ``target`` (None: never)."""
    return next((int(r["step"]) for r in rows if reaches(judge(r), target)), None)


def summarize(out: Path) -> dict:
    """Per variant and seed: the judge's peak (value, step), its last value, the fall after
    the peak, the first step at judge >= 0.9 and 0.95, the step where the run ended, and for
    guarded runs the guard's lines and the best checkpoint's judge."""
    res: dict = {}
    for variant in VARIANTS:
        for seed in SEEDS:
            folder = out / f"{variant}_s{seed}"
            if not (folder / "eval.jsonl").is_file():
                continue
            rows = evals(folder)
            peak = max(rows, key=judge)
            best = (
                json.loads((folder / "best.json").read_text())
                if (folder / "best.json").is_file()
                else {}
            )

            after = [judge(r) for r in rows if r["step"] >= peak["step"]]
            curve = [(int(r["step"]), judge(r), float(r["eval/reward_mean"])) for r in rows]
            res.setdefault(variant, {})[seed] = {
                "peak": judge(peak),
                "peak_step": int(peak["step"]),
                "last": judge(rows[-1]),
                "last_step": int(rows[-1]["step"]),
                "fall": judge(peak) - min(after),
                "reward_last": float(rows[-1]["eval/reward_mean"]),
                "reward_at_peak": float(peak["eval/reward_mean"]),
                "to_0.9": first_step(rows, 0.9),
                "to_0.95": first_step(rows, 0.95),
                "best_gold": (best.get("gold") or {}).get("gold"),
                "best_step": (best.get("gold") or {}).get("step"),
                "rollbacks": best.get("rollbacks", 0),
                "stopped_at": next(
                    (e["step"] for e in best.get("events", []) if e["action"] == "stop"), None
                ),
                "hack": largest_hack(curve),
                "curve": curve,
                "retired": [(int(r["step"]), judge(r)) for r in retired(folder)],
            }
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("run", "report", "all"))
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "hacking")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument(
        "--block",
        default="",
        help="report into its own block of docs/reward_hacking.md (hacking bench: BLOCK)",
    )
    args = p.parse_args(argv)
    if args.what in ("run", "all"):
        run(
            args.out,
            args.variants.split(","),
            [int(s) for s in args.seeds.split(",")],
            args.jobs,
        )
    if args.what in ("report", "all"):
        from bench.hacking_report import write_report

        write_report(summarize(args.out), args.out, args.block)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = [
    "COMMON",
    "HACK_FALL",
    "INK",
    "SEEDS",
    "VARIANTS",
    "command",
    "largest_hack",
    "main",
    "run",
    "statistics",
    "summarize",
]
