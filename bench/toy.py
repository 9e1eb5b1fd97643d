"""The embedded toy default: wall-clock and samples to reach the eval target, peak memory.

Runs `python -m flowgrpo train` (the `make demo` job) in a subprocess and reads its
metrics.jsonl; peak memory is the child's max resident set size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EVAL_TARGET = 0.9  # eval accuracy the demo must reach


def bench_toy(*, quick: bool = False) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [f"run.output_dir={tmp}", "run.progress_bar=false", "run.tensorboard=false"]
        if quick:
            overrides += [
                "trainer.max_steps=2",
                "trainer.eval_every=1",
                "trainer.save_every=2",
                "sample.prompts_per_step=2",
                "sample.group_size=4",
                "data.eval_num_prompts=2",
                "data.eval_samples_per_prompt=4",
            ]
        t0 = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-m", "flowgrpo", "train", "toy-digits", *overrides],
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.DEVNULL,
        )
        _, status, usage = os.wait4(child.pid, 0)  # this child's own peak memory
        child.returncode = os.waitstatus_to_exitcode(status)
        if child.returncode != 0:
            raise RuntimeError(f"the toy run failed with exit code {child.returncode}")
        wall = time.perf_counter() - t0
        peak_mb = usage.ru_maxrss / 1024
        rows = [json.loads(line) for line in Path(tmp, "metrics.jsonl").read_text().splitlines()]
        # eval.jsonl holds every eval, step 0 (the base model) included
        evals = [json.loads(line) for line in Path(tmp, "eval.jsonl").read_text().splitlines()]
    elapsed, reached = 0.0, None
    for r in rows:
        elapsed += float(r.get("time/step_s", 0.0))
        if reached is None and r.get("eval/accuracy", 0.0) >= EVAL_TARGET and r["step"] > 0:
            reached = {"step": r["step"], "train_s": elapsed, "samples": r.get("samples")}
    return {
        "wall_s": wall,
        "peak_rss_mb": peak_mb,
        "steps": rows[-1]["step"] if rows else 0,
        "base_accuracy": evals[0]["eval/accuracy"] if evals else None,
        "final_accuracy": evals[-1]["eval/accuracy"] if evals else None,
        "base_judge_accuracy": evals[0].get("eval/judge_accuracy") if evals else None,
        "final_judge_accuracy": evals[-1].get("eval/judge_accuracy") if evals else None,
        "base_diversity": evals[0].get("eval/diversity") if evals else None,
        "final_diversity": evals[-1].get("eval/diversity") if evals else None,
        "target_accuracy": EVAL_TARGET,
        "reached_target": reached,
    }
