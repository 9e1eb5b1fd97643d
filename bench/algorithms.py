"""The algorithms compared on the toy by time-to-reward (``python -m bench --sections algorithms``).

Each algorithm trains the default preset (``flowgrpo train toy-digits algorithm=NAME``) with
the same seed and the same number of steps in a subprocess, evaluating every few steps. From
its metrics.jsonl and eval.jsonl: eval accuracy, judge accuracy and diversity against training
wall time (the steps' own time, evals excluded) and images; the time to judge accuracy 0.95;
the final judge accuracy; the diversity at that point. ``write_report`` puts the table and a
plot into docs/algorithms.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ALGORITHMS = ("flow_grpo", "mix_grpo", "grpo_guard", "nft")
TARGET = 0.95  # judge accuracy
ROOT = Path(__file__).resolve().parents[1]


def run_one(algorithm: str, out: Path, steps: int, eval_every: int) -> dict[str, object]:
    from flowgrpo.trainer.logging import read_jsonl

    args = [sys.executable, "-m", "flowgrpo", "train", "toy-digits", f"algorithm={algorithm}"]
    args += [f"trainer.max_steps={steps}", f"trainer.eval_every={eval_every}"]
    args += ["trainer.save_every=0", "run.tensorboard=false", "run.progress_bar=false"]
    args += [f"run.output_dir={out}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    child = subprocess.run(args, env=env, capture_output=True, text=True)
    if child.returncode:
        raise RuntimeError(f"{algorithm}: exit {child.returncode}: {child.stderr[-2000:]}")
    rows, evals = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "eval.jsonl")
    clock = {0: 0.0}
    samples = {0: 0}
    for r in rows:  # training wall time and images up to each step
        clock[r["step"]] = clock[r["step"] - 1] + r["time/step_s"]
        samples[r["step"]] = r["samples"]
    curve = [
        {
            "step": e["step"],
            "train_s": clock[e["step"]],
            "images": samples[e["step"]],
            "accuracy": e["eval/accuracy"],
            "judge_accuracy": e["eval/judge_accuracy"],
            "diversity": e["eval/diversity"],
        }
        for e in evals
    ]
    reached = next((c for c in curve if c["judge_accuracy"] >= TARGET and c["step"] > 0), None)
    return {
        "curve": curve,
        "time_to_target_s": reached["train_s"] if reached else None,
        "images_to_target": reached["images"] if reached else None,
        "accuracy_at_target": reached["accuracy"] if reached else None,
        "judge_at_target": reached["judge_accuracy"] if reached else None,
        "diversity_at_target": reached["diversity"] if reached else None,
        "final_judge_accuracy": curve[-1]["judge_accuracy"],
        "final_accuracy": curve[-1]["accuracy"],
        "final_diversity": curve[-1]["diversity"],
        "train_s": clock[rows[-1]["step"]],
    }


def bench_algorithms(*, quick: bool = False) -> dict[str, object]:
    steps, every = (1, 1) if quick else (40, 2)
    out: dict[str, object] = {"steps": steps, "eval_every": every, "target_judge": TARGET}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ALGORITHMS:
            out[name] = run_one(name, Path(tmp) / name, steps, every)
    base = out["flow_grpo"]["time_to_target_s"]
    for name in ALGORITHMS:
        t = out[name]["time_to_target_s"]
        out[name]["time_to_target_over_flow_grpo"] = t / base if t and base else None
    return out


def write_report(results: dict, doc: Path = ROOT / "docs" / "algorithms.md") -> None:
    """The table and the plot (docs/algorithms_toy.png) between the report markers of ``doc``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name in ALGORITHMS:
        curve = results[name]["curve"]
        t = [c["train_s"] for c in curve]
        for ax, key in zip(axes, ("accuracy", "judge_accuracy", "diversity"), strict=True):
            ax.plot(t, [c[key] for c in curve], marker="o", ms=3, label=name)
            ax.set_title(key.replace("_", " "))
            ax.set_xlabel("training wall time (s)")
    axes[1].axhline(TARGET, color="grey", lw=0.8, ls="--")
    axes[0].legend()
    fig.tight_layout()
    png = doc.parent / "algorithms_toy.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)

    def fmt(v, spec=".3f"):
        return "—" if v is None else format(v, spec)

    lines = [
        "| algorithm | time to judge ≥ 0.95 | × Flow-GRPO | images | accuracy / judge / "
        "diversity there | final accuracy / judge / diversity |",
        "|---|---|---|---|---|---|",
    ]
    for name in ALGORITHMS:
        r = results[name]
        there = f"{fmt(r['accuracy_at_target'])} / {fmt(r['judge_at_target'])} / " + fmt(
            r["diversity_at_target"]
        )
        final = f"{fmt(r['final_accuracy'])} / {fmt(r['final_judge_accuracy'])} / " + fmt(
            r["final_diversity"]
        )
        t = r["time_to_target_s"]
        lines.append(
            f"| `{name}` | {'not reached' if t is None else f'{t:.0f} s'} | "
            f"{fmt(r['time_to_target_over_flow_grpo'], '.2f')} | "
            f"{r['images_to_target'] or '—'} | {there} | {final} |"
        )
    table = "\n".join(lines)
    text = doc.read_text()
    start, end = "<!-- toy comparison: start -->", "<!-- toy comparison: end -->"
    body = f"{start}\n{table}\n\n![toy comparison](algorithms_toy.png)\n{end}"
    if start in text:
        text = text[: text.index(start)] + body + text[text.index(end) + len(end) :]
    else:
        text += "\n" + body + "\n"
    doc.write_text(text)


__all__ = ["ALGORITHMS", "bench_algorithms", "write_report"]
