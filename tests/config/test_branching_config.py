"""``sample.branching``'s bad input: one config line naming the key (issue 38)."""

from __future__ import annotations

import pytest

from flowgrpo.config import ConfigError, load_config

TREE = ["sample.branching.split_steps=[0,2,4,6]", "sample.branching.factors=[2,2,2,2]"]


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config("toy-digits", list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (  # 8 leaves, groups of 16
            ["sample.branching.split_steps=[0,2,4]", "sample.branching.factors=[2,2,2]"],
            "config key 'sample.branching.factors' must be a tree of sample.group_size=16 "
            "leaves (their product is 8), got [2, 2, 2]",
        ),
        (  # the toy trains 9 stochastic steps: offsets 0..8
            ["sample.branching.split_steps=[0,2,4,9]", "sample.branching.factors=[2,2,2,2]"],
            "config key 'sample.branching.split_steps' must be offsets inside the 9 trained SDE "
            "steps (the first 9 of 9 stochastic steps): in [0, 8], got [0, 2, 4, 9]",
        ),
        (
            [*TREE, "sample.window_size=3", "sample.window_draw=step"],
            "config key 'sample.branching.split_steps' must be offsets inside the 3 trained SDE "
            "steps (sample.window_size=3)",
        ),
        (
            [*TREE, "sample.window_size=8"],
            "config key 'sample.window_draw' must be 'step' with sample.branching",
        ),
        (
            ["sample.branching.split_steps=[0,2]", "sample.branching.factors=[16]"],
            "config key 'sample.branching.factors' must be one factor per split step (2)",
        ),
        (
            ["sample.branching.split_steps=[2,0]", "sample.branching.factors=[4,4]"],
            "config key 'sample.branching.split_steps' must be increasing offsets >= 0",
        ),
        (
            [*TREE, "sample.rollout_batch_size=8"],
            "config key 'sample.rollout_batch_size' must be a multiple of the tree's 16 leaves",
        ),
        (
            [*TREE, "algorithm=nft"],
            "config key 'sample.branching.split_steps' must be [] with algorithm=nft (branching "
            "needs an SDE-rollout algorithm: flow_grpo, mix_grpo, grpo_guard, flow_dppo)",
        ),
        (  # mix_grpo's window of 4 at [5, 8) by step 51: the split at 3 falls outside it
            [
                "algorithm=mix_grpo",
                "sample.branching.split_steps=[0,1,2,3]",
                "sample.branching.factors=[2,2,2,2]",
                "trainer.max_steps=60",
            ],
            "config key 'sample.branching.split_steps' must be offsets inside the 3 trained SDE "
            "steps (mix_grpo's window [5, 8) at step 51)",
        ),
        (
            ["sample.branching.prune_steps=[1]"],
            "config key 'sample.branching.prune_steps' must be [] without split_steps",
        ),
        (
            ["sample.branching.estimator=backup"],
            "config key 'sample.branching.estimator' must be 'depth' without split_steps",
        ),
        (
            [*TREE, "sample.branching.width_ratio=0.25"],
            "config key 'sample.branching.width_ratio' must be 0.5 with width_pruning 'none'",
        ),
    ],
)
def test_bad_trees_name_their_key(overrides, expected):
    assert _error(*overrides).startswith(expected)


def test_a_good_tree_loads_and_reaches_the_rollout_plan():
    cfg = load_config("toy-digits", TREE)
    spec = cfg.sample.branching.spec()
    assert spec.leaves == 16 and spec.split_steps == (0, 2, 4, 6)
    assert load_config("toy-digits", []).sample.branching.spec() is None
