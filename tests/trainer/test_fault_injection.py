"""Fault injection (issue 13, §7): kill -9 at several points of a toy run, then
``trainer.resume=auto``: the final weights and metrics equal an uninterrupted run bit for bit,
with no step duplicated or missing. A full disk during a save: one line, exit 1, the previous
checkpoint stays loadable, and the run resumes to the same result."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flowgrpo.testing.models import random_toy_path
from flowgrpo.trainer.logging import deterministic_view, read_jsonl

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ARGS = [
    "toy-digits",
    f"model.path={random_toy_path()}",  # random init: independent of the shipped asset
    "sample.prompts_per_step=2",
    "sample.group_size=4",
    "sample.num_steps=4",  # 3 trained steps
    "sample.eval_num_steps=4",
    "sample.rollout_batch_size=4",  # 2 chunks per step
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=2",
    "update.micro_batch_size=4",  # 2 micro-batches x 3 steps = 6 losses per step
    "trainer.max_steps=4",
    "trainer.eval_every=2",
    "trainer.save_every=1",
    "trainer.keep_last=2",
    "run.progress_bar=false",
    "run.tensorboard=false",
]
# (point, hit): where the run is killed
CASES = {
    "mid-rollout": ("rollout", 8),  # calls: eval@0, step 1 (2), step 2 (2), eval@2, step 3 (2nd)
    "mid-training": ("train", 15),  # the 3rd loss of step 3's training pass
    "mid-save": ("save", 2),  # step 2's checkpoint: shards written, not marked complete
    "mid-eval": ("eval", 2),  # the evaluation after step 2 (before its checkpoint)
}


def _run(out: Path, *extra: str, point: str = "none", hit: int = 0):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = str(HERE.parents[1] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, str(HERE / "fault_driver.py"), point, str(hit), "--"]
    cmd += [*ARGS, f"run.output_dir={out}", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _final_weights(out: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = out / "final.pt"
    dcp_to_torch_save(str(out / "checkpoints" / "step_4"), str(dst))
    return torch.load(dst, weights_only=True)["model"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("faults") / "straight"
    res = _run(out)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def _assert_same_run(out: Path, ref: Path) -> None:
    rows, want = read_jsonl(out / "metrics.jsonl"), read_jsonl(ref / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # none duplicated, none missing
    assert [deterministic_view(r) for r in rows] == [deterministic_view(r) for r in want]
    evals = read_jsonl(out / "eval.jsonl")
    assert [deterministic_view(r) for r in evals] == [
        deterministic_view(r) for r in read_jsonl(ref / "eval.jsonl")
    ]
    got, ref_w = _final_weights(out), _final_weights(ref)
    assert got.keys() == ref_w.keys()
    assert all(torch.equal(got[k], ref_w[k]) for k in got)  # bit for bit


@pytest.mark.parametrize("case", list(CASES))
def test_kill_minus_nine_then_resume_equals_straight_run(straight, tmp_path, case):
    point, hit = CASES[case]
    out = tmp_path / case
    killed = _run(out, point=point, hit=hit)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    if point == "save":
        assert (out / "checkpoints" / "step_2.tmp").is_dir()
        assert not (out / "checkpoints" / "step_2").exists()
    resumed = _run(out, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(out, straight)


def test_disk_full_during_a_save_is_one_line_and_resumable(straight, tmp_path):
    out = tmp_path / "enospc"
    full = _run(out, point="enospc", hit=3)  # step 3's checkpoint
    assert full.returncode == 1, full.stderr[-3000:]
    errors = [x for x in full.stderr.splitlines() if x.startswith("flowgrpo: error")]
    assert len(errors) == 1 and "Traceback" not in full.stderr
    assert "No space left on device" in errors[0] and "step_3.tmp" in errors[0]
    ckpts = sorted(d.name for d in (out / "checkpoints").iterdir())
    assert ckpts == ["step_1", "step_2"]  # the previous checkpoint is complete and kept
    resumed = _run(out, "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _assert_same_run(out, straight)
