"""Gold rewards, the guard (stop / rollback), the best checkpoint and pairwise rewards in tiny
toy runs (2 digits x K=4, 4 sampling steps, an eval and a checkpoint every step).

The guard is forced to trip: the reward is ``digits``, the gold reward ``digits_ink`` (mean
brightness). On this run (random toy, seed 0, lr 1e-3) the ink rises to step 2 (0.6296),
then falls to 0.6288 (step 3, 0.0008 down) and 0.6171 (step 4, 0.0125 down) while the
reward's eval mean rises past its step-2 value: with ``guard.max_gold_drop=0.005`` the guard
trips at the eval of step 4, its peak at step 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.settings import ConfigError
from flowgrpo.testing.models import random_toy_path
from flowgrpo.trainer.logging import deterministic_view, read_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = [
    "sample.prompts_per_step=2",
    "sample.group_size=4",
    "sample.num_steps=4",
    "sample.eval_num_steps=4",
    "sample.rollout_batch_size=8",
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=2",
    "update.micro_batch_size=8",
    "trainer.eval_every=1",
    "trainer.save_every=1",
    "trainer.keep_last=1",
    "run.progress_bar=false",
    "run.tensorboard=false",
    "optim.lr=1e-3",
    "eval.gold_reward=digits_ink",
]
GUARD = ["guard.max_gold_drop=0.005"]


def cfg_for(out: Path, *extra: str):
    return load_config(
        "toy-digits", [f"model.path={random_toy_path()}", *SMALL, f"run.output_dir={out}", *extra]
    )


def train(out: Path, *extra: str) -> dict:
    from flowgrpo.trainer.loop import run_training

    return run_training(cfg_for(out, *extra))


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(dst))
    return torch.load(dst, weights_only=False)["model"]


def same_run(a: Path, b: Path, step: int) -> None:
    """Metrics, evals and the step's weights of two run folders are identical."""
    ra, rb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    assert [deterministic_view(r) for r in ra] == [deterministic_view(r) for r in rb]
    assert read_jsonl(a / "eval.jsonl") == read_jsonl(b / "eval.jsonl")
    wa, wb = weights(a / f"checkpoints/step_{step}"), weights(b / f"checkpoints/step_{step}")
    assert wa.keys() == wb.keys() and len(wa) > 10
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("stop") / "run"
    return out, train(out, "trainer.max_steps=6", *GUARD, "guard.action=stop")


@pytest.mark.slow  # trains end to end
def test_stop_names_the_eval_figures_and_best_checkpoint(stopped, capsys):
    out, summary = stopped
    assert summary["steps"] == 4  # stopped at the eval of step 4, not at step 6
    line = summary["guard"]["stopped"]
    assert line.startswith("guard: stopped at the eval at step 4: gold score 0.6171 is 0.01246 ")
    assert "below its best 0.6296 (step 2)" in line
    assert f"best-gold checkpoint {out / 'checkpoints' / 'step_2'} (step 2" in line
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 1, 2, 3, 4]
    gold = [e["eval/gold_score"] for e in evals]
    assert gold == [e["eval/gold/digits_ink"] for e in evals]  # one gold reward, weight 1
    assert max(gold) == gold[2] and gold[2] - gold[4] >= 0.005
    assert evals[4]["eval/reward_mean"] > evals[2]["eval/reward_mean"]
    # the gap: the training reward's relative gain minus the gold score's, since the base
    r0, g0 = evals[0]["eval/reward_mean"], gold[0]
    for e in evals:
        gap = (e["eval/reward_mean"] - r0) / r0 - (e["eval/gold_score"] - g0) / g0
        assert e["eval/hacking_gap"] == pytest.approx(gap, rel=1e-5, abs=1e-7)
    best = json.loads((out / "best.json").read_text())
    assert best["gold"]["step"] == 2 and best["gold"]["checkpoint"].endswith("step_2")
    # the training reward's best eval (0.403 at step 3, above step 4's 0.396)
    assert best["reward"]["step"] == 3
    # keep_last=1, yet the best checkpoints by gold and by reward are kept (the newest: 4)
    kept = sorted(d.name for d in (out / "checkpoints").iterdir() if d.is_dir())
    assert kept == ["step_2", "step_3", "step_4"]


@pytest.mark.slow  # trains end to end
def test_checkpoint_best_selects_the_best_gold_checkpoint(stopped):
    from flowgrpo.cli import main

    out, _ = stopped
    metrics = out.parent / "eval_best.json"
    assert main(["eval", "--checkpoint", f"best:{out}", "--out", str(metrics)]) == 0
    got = json.loads(metrics.read_text())
    step2 = read_jsonl(out / "eval.jsonl")[2]
    assert got["eval/gold_score"] == pytest.approx(step2["eval/gold_score"], abs=1e-6)
    assert got["eval/reward_mean"] == pytest.approx(step2["eval/reward_mean"], abs=1e-6)


@pytest.mark.slow  # trains end to end
def test_resume_after_a_stop_is_exact(stopped, tmp_path):
    """Stopped at 4, resumed (guard off) to 6 == 6 steps straight without the guard."""
    first, _ = stopped
    resumed = tmp_path / "resumed"
    shutil.copytree(first, resumed)
    summary = train(resumed, "trainer.max_steps=6", "trainer.resume=auto")
    assert summary["resumed_from"].endswith("step_4") and summary["guard"]["stopped"] is None
    straight = tmp_path / "straight"
    train(straight, "trainer.max_steps=6")
    same_run(straight, resumed, 6)


@pytest.mark.slow  # trains end to end
def test_rollback_resumes_from_the_peak_and_resume_after_it_is_exact(tmp_path):
    rollback = [*GUARD, "guard.action=rollback", "guard.on_rollback.optim.lr=1.0e-4"]
    rollback += ["guard.max_rollbacks=1"]
    full = tmp_path / "full"
    summary = train(full, "trainer.max_steps=6", *rollback)
    assert summary["steps"] == 6 and summary["guard"]["rollbacks"] == 1
    (event,) = summary["guard"]["events"]
    assert event["action"] == "rollback" and event["to_step"] == 2
    assert event["line"].startswith("guard: rolling back at the eval at step 4: gold score")
    rows = read_jsonl(full / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]  # the retired 3, 4 moved aside
    assert [r["train/lr"] for r in rows] == [1e-3, 1e-3, 1e-4, 1e-4, 1e-4, 1e-4]
    (aside,) = (full / "checkpoints").glob("abandoned_after_step_2.*")
    assert sorted(p.name for p in aside.iterdir() if p.is_dir()) == ["step_3", "step_4"]
    # the same run cut at step 5 and resumed (no setting given: the rollback's lr is recorded)
    cut = tmp_path / "cut"
    train(cut, "trainer.max_steps=5", *rollback)
    summary = train(cut, "trainer.max_steps=6", *rollback, "trainer.resume=auto")
    assert summary["resumed_from"].endswith("step_5") and summary["guard"]["rollbacks"] == 1
    same_run(full, cut, 6)


@pytest.mark.slow  # trains end to end
def test_rollback_without_a_checkpoint_before_the_peak_stops(tmp_path):
    # gold = -ink: its best is the base eval (step 0), which has no checkpoint
    summary = train(
        tmp_path / "run",
        "trainer.max_steps=3",
        "eval.gold_reward=digits_ink:-1.0",
        *GUARD,
        "guard.action=rollback",
    )
    line = summary["guard"]["stopped"]
    assert summary["steps"] == 1 and summary["guard"]["rollbacks"] == 0
    assert line.startswith("guard: stopped: no checkpoint to roll back to at the eval at step 1")
    assert line.endswith("no checkpoint at or before the peak (step 0) to return to")


@pytest.mark.slow  # trains end to end
def test_pairwise_reward_trains_and_evals_against_the_base(tmp_path):
    out = tmp_path / "run"
    train(out, "trainer.max_steps=1", "reward=digits_pairwise", "eval.gold_reward=digits_judge")
    (row,) = read_jsonl(out / "metrics.jsonl")
    assert row["reward/digits_pairwise_mean"] == pytest.approx(0.5)  # win rates average 1/2
    assert row["advantage_abs_mean"] > 0
    base = read_jsonl(out / "eval.jsonl")[0]
    assert base["eval/digits_pairwise_mean"] == 0.5  # the base against itself: all ties


def test_pairwise_rewards_are_win_rates_of_every_pair_in_a_group():
    """One process: ``pairwise_rewards`` == win rates over all within-group pairs, by hand."""
    from flowgrpo.rewards import MultiReward
    from flowgrpo.toy.reward import digits_reward
    from flowgrpo.trainer.preference import pairwise_rewards

    gen = torch.Generator().manual_seed(0)
    images = torch.rand(6, 1, 8, 8, generator=gen)
    prompts = ["a 3"] * 3 + ["a 7"] * 3
    groups = [0, 0, 0, 1, 1, 1]
    run = SimpleNamespace(
        reward=MultiReward(["digits_pairwise"]),
        engine=SimpleNamespace(dp_size=1, dp_rank=0, sp_rank=0, sp_size=1),
    )
    rates = pairwise_rewards(run, images, prompts, [{}] * 6, groups)["digits_pairwise"]
    p = torch.tensor(digits_reward(images, prompts))
    expected = []
    for i in range(6):
        mates = [j for j in range(6) if groups[j] == groups[i] and j != i]
        wins = sum(1.0 if p[i] > p[j] else 0.0 if p[i] < p[j] else 0.5 for j in mates)
        expected.append(wins / len(mates))
    torch.testing.assert_close(rates, torch.tensor(expected))


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["eval.gold_reward=digits"], "'eval.gold_reward.digits' must be a reward the run"),
        (["eval.gold_reward=[]", *GUARD], "'guard.max_gold_drop' must be null without eval"),
        ([*GUARD, "trainer.eval_every=0"], "'trainer.eval_every' must be > 0 with guard"),
        (
            [*GUARD, "guard.action=rollback", "trainer.save_every=0"],
            "'trainer.save_every' must be > 0 with guard.action=rollback",
        ),
        (["guard.on_rollback.optim.lrr=1e-4"], "guard.on_rollback.optim.lrr: unknown config key"),
        (["guard.on_rollback.optim.lr=fast"], "guard.on_rollback.optim.lr: config key 'optim.lr'"),
        (["guard.on_rollback.model.dtype=bf16"], "'guard.on_rollback.model.dtype' must be a"),
        (["guard.action=retreat"], "guard.action"),
    ],
)
def test_bad_guard_settings_are_one_line_errors(tmp_path, extra, match):
    with pytest.raises(ConfigError, match=match):
        cfg_for(tmp_path, *extra)
