"""``sample.refill_rounds``: constant groups replaced by freshly sampled ones (DAPO's dynamic
sampling), by hand on the pieces and in toy runs with a reward that is constant for some
prompts: the metrics' accounting, the trained batch, determinism and a bit-exact resume."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.testing.models import random_toy_path
from flowgrpo.trainer.logging import deterministic_view, read_jsonl
from flowgrpo.trainer.refill import constant_groups, refill_draw, replace_constant, round_size

# -- the pieces, by hand ---------------------------------------------------------------------


def test_constant_groups_by_hand():
    r = torch.tensor([0.5, 0.5, 0.1, 0.9, 1.0, 1.0 + 1e-9, 0.2])
    assert constant_groups(r, [3, 3, 1, 1, 7, 7, 9]) == {3: True, 1: False, 7: True, 9: True}


def test_refill_draw_is_a_function_of_seed_step_and_round():
    a = refill_draw(0, 5, 1, num_prompts=10, num_groups=3, group_size=4)
    assert a == refill_draw(0, 5, 1, num_prompts=10, num_groups=3, group_size=4)
    indices, groups = a
    assert sorted(groups) == [0] * 4 + [1] * 4 + [2] * 4
    assert all(len({i for i, g in zip(indices, groups) if g == k}) == 1 for k in range(3))
    assert len({indices[groups.index(k)] for k in range(3)}) == 3  # no prompt twice while they last
    assert a != refill_draw(0, 5, 2, 10, 3, 4) and a != refill_draw(0, 6, 1, 10, 3, 4)
    assert a != refill_draw(1, 5, 1, 10, 3, 4)


@pytest.mark.parametrize(
    "constant, budget, k, dp, expected",
    [(3, 10, 16, 1, 3), (3, 2, 16, 1, 2), (3, 10, 4, 8, 4), (1, 10, 3, 2, 2), (3, 1, 3, 2, 0)],
)
def test_round_size_divides_over_the_ranks_within_the_budget(constant, budget, k, dp, expected):
    n = round_size(constant, budget, k, dp)
    assert n == expected and (n * k) % dp == 0


def test_replace_constant_in_order():
    flags = {0: True, 1: False, 2: True, 3: True, 10: True, 11: False, 12: False}
    assert replace_constant([0, 1, 2, 3], flags, [10, 11, 12]) == ([11, 1, 12, 3], 2)
    assert replace_constant([1], flags, [11]) == ([1], 0)


# -- toy runs --------------------------------------------------------------------------------

# constant for the digits 0-4, the image's mean brightness (varies per sample) for 5-9
HALF_CONSTANT = """import torch

def score(images, prompts, metadata):
    out = images.float().flatten(1).mean(1)
    low = torch.tensor([int(p.split()[-1]) < 5 for p in prompts])
    return torch.where(low, torch.full_like(out, 0.5), out)
"""
SMALL = [
    f"model.path={random_toy_path()}",
    "sample.prompts_per_step=4",
    "sample.group_size=4",
    "sample.num_steps=3",
    "sample.eval_num_steps=3",
    "sample.rollout_batch_size=16",
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=1",
    "update.micro_batch_size=16",
    "trainer.eval_every=0",
    "run.progress_bar=false",
    "run.tensorboard=false",
    "reward=half_constant_r38:score",
    "sample.refill_rounds=2",
]


def train(out: Path, *extra: str) -> dict:
    from flowgrpo.trainer.loop import run_training

    cfg = load_config("toy-digits", [*SMALL, f"run.output_dir={out}", *extra], command="train")
    return run_training(cfg)


@pytest.fixture(scope="module")
def reward_module(tmp_path_factory):
    import sys

    where = tmp_path_factory.mktemp("reward")
    (where / "half_constant_r38.py").write_text(HALF_CONSTANT)
    sys.path.insert(0, str(where))
    yield
    sys.path.remove(str(where))


@pytest.fixture(scope="module")
def straight(reward_module, tmp_path_factory):
    out = tmp_path_factory.mktemp("refill") / "run"
    train(out, "trainer.max_steps=3", "trainer.save_every=2")
    return out


@pytest.mark.slow  # trains end to end
def test_metrics_account_for_every_refilled_group(straight):
    """Per step: constant fraction after = before − replaced / m; extra samples = extra groups
    x K; ``samples`` counts them; the step's own draw (m = 4 of 10 prompts, half of them
    constant) leaves constant groups that refill replaces."""
    rows = read_jsonl(straight / "metrics.jsonl")
    total, replaced = 0, 0
    for r in rows:
        m = 4
        assert r["zero_std_ratio"] == pytest.approx(
            r["refill/zero_std_ratio_before"] - r["refill/groups_refilled"] / m
        )
        assert r["refill/samples"] == 4 * r["refill/groups_sampled"]
        assert r["refill/groups_refilled"] <= r["refill/groups_sampled"]
        total += 16 + int(r["refill/samples"])
        assert r["samples"] == total
        replaced += r["refill/groups_refilled"]
    assert replaced > 0 and sum(r["refill/zero_std_ratio_before"] for r in rows) > 0
    assert min(r["zero_std_ratio"] for r in rows) < max(
        r["refill/zero_std_ratio_before"] for r in rows
    )


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(dst))
    return torch.load(dst, weights_only=False)["model"]


@pytest.mark.slow  # trains end to end
def test_resume_is_bit_exact(straight, tmp_path):
    """3 steps straight == the straight run's checkpoint at step 2, resume=auto, 1 more step:
    the metrics (refill's included) and the weights."""
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_3")
    (resumed / "metrics.jsonl").write_text(
        "".join(line for line in (straight / "metrics.jsonl").read_text().splitlines(True)[:2])
    )
    summary = train(resumed, "trainer.max_steps=3", "trainer.save_every=2", "trainer.resume=auto")
    assert summary["resumed_from"].endswith("step_2")
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3]
    assert [deterministic_view(r) for r in a] == [deterministic_view(r) for r in b]
    assert any(r["refill/groups_refilled"] > 0 for r in a)
    wa, wb = _weights(straight / "checkpoints/step_3"), _weights(resumed / "checkpoints/step_3")
    assert wa.keys() == wb.keys() and len(wa) > 10
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


@pytest.mark.slow  # trains end to end
def test_refill_feeds_dpo_pairs(reward_module, tmp_path):
    """Refill under algorithm=dpo (pairs from the refilled groups): every one of the m trained
    groups gives one pair, whatever prompts the refill drew."""
    train(tmp_path / "run", "algorithm=dpo", "trainer.max_steps=1", "trainer.save_every=0")
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["train/pairs_trained"] == 4.0
    assert row["zero_std_ratio"] == pytest.approx(
        row["refill/zero_std_ratio_before"] - row["refill/groups_refilled"] / 4
    )
