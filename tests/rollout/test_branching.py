"""Branching rollouts on the tiny SD3 pipeline (fp32): transformer calls counted, every node's
log-prob recomputed exactly, shared prefixes identical, a tree reproducible in any batch."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models.sd3 import SD3Adapter
from flowgrpo.rollout import BranchSpec, SDEWindow, sample_trajectories, trajectory_log_prob
from flowgrpo.testing.tiny import tiny_pipeline

H, W = 16, 24
TOY_TREE = BranchSpec((0, 2, 4, 6), (2, 2, 2, 2))  # the bench's tree: 16 leaves, 10 steps


@pytest.fixture(scope="module")
def sd3():
    return SD3Adapter(tiny_pipeline("sd3"), max_sequence_length=8)


def _sample(adapter, prompts, spec, seeds=None, **kw):
    seeds = range(len(prompts)) if seeds is None else seeds
    opts = dict(
        num_steps=4,
        guidance_scale=4.5,
        noise_level=0.7,
        height=H,
        width=W,
        decode=False,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        branching=spec,
    )
    opts.update(kw)
    return sample_trajectories(adapter, prompts, **opts)


class Counter:
    """Counts the rows the transformer is called on (one call of a batch of n = n calls)."""

    def __init__(self, adapter):
        self.adapter, self.rows, self.velocity = adapter, 0, adapter.velocity

    def __enter__(self):
        def counted(transformer, x, *args, **kw):
            self.rows += x.shape[0]
            return self.velocity(transformer, x, *args, **kw)

        self.adapter.velocity = counted
        return self

    def __exit__(self, *exc):
        self.adapter.velocity = self.velocity


def test_transformer_calls_per_sample_at_the_default_tree(sd3):
    prompts = ["a red cat"] * TOY_TREE.leaves
    with Counter(sd3) as tree:
        _sample(sd3, prompts, TOY_TREE, num_steps=10)
    with Counter(sd3) as flat:
        _sample(sd3, prompts, None, num_steps=10)
    assert flat.rows == 16 * 10
    assert tree.rows == 1 + 2 + 2 + 4 + 4 + 8 + 8 + 16 * 3 == 77
    assert tree.rows / 16 == TOY_TREE.calls_per_sample(10, 0)
    assert 1 - tree.rows / flat.rows >= 0.40  # 52% fewer


def test_every_node_recomputes_its_log_prob_and_shared_steps_are_one(sd3):
    spec = BranchSpec((0, 1), (2, 2))
    prompts = ["a red cat"] * 4 + ["two blue birds"] * 4
    traj = _sample(sd3, prompts, spec)
    assert traj.branching == spec and traj.log_probs.shape == (8, 3)
    for k in range(3):  # rows under one node hold the same edge, bit for bit
        span = spec.span(k)
        for first in range(0, 8, span):
            rows = slice(first, first + span)
            assert torch.equal(
                traj.latents[rows, k + 1],
                traj.latents[first, k + 1].expand_as(traj.latents[rows, k + 1]),
            )
            assert bool((traj.log_probs[rows, k] == traj.log_probs[first, k]).all())
        distinct = traj.log_probs[::span, k]
        assert len(set(distinct.tolist())) == len(distinct)  # different nodes differ
    worst = 0.0
    with torch.enable_grad():
        for k in range(3):
            for split in ([0, 5, 3], [1, 2, 4, 6, 7]):
                index = torch.tensor(split)
                out = trajectory_log_prob(sd3, sd3.transformer, traj, k, index)
                worst = max(worst, (out.log_prob - traj.log_probs[index, k]).abs().max().item())
    assert worst < 1e-6
    # the update's packing: any (row, step) cells as one-step samples recompute the same
    rows, steps = torch.tensor([7, 0, 2, 5]), torch.tensor([2, 0, 1, 1])
    flat = traj.cells(rows, steps)
    assert flat.latents.shape[:2] == (4, 2) and flat.num_train_steps == 1
    with torch.enable_grad():
        out = trajectory_log_prob(sd3, sd3.transformer, flat, 0)
    assert (out.log_prob - traj.log_probs[rows, steps]).abs().max().item() < 1e-6


def test_a_tree_is_the_same_in_any_batch(sd3):
    spec = BranchSpec((1,), (2,))
    both = _sample(sd3, ["a red cat"] * 2 + ["a dog"] * 2, spec)
    alone = _sample(sd3, ["a dog"] * 2, spec, seeds=[2, 3])
    assert torch.allclose(both.final_latents[2:], alone.final_latents, atol=1e-5)
    assert torch.allclose(both.log_probs[2:], alone.log_probs, atol=1e-5)
    assert not torch.equal(both.final_latents[2], both.final_latents[3])  # the split's noise
    assert torch.equal(both.latents[2, :2], both.latents[3, :2])  # the shared prefix


def test_branching_inside_a_window_and_with_means(sd3):
    spec = BranchSpec((0, 1), (2, 2))
    traj = _sample(
        sd3,
        ["a red cat"] * 4,
        spec,
        num_steps=6,
        sde_window=SDEWindow(2, 2, 3 + 1),
        record_means=True,
    )
    assert traj.step_indices[:, 0].tolist() == [2] * 4  # the window: steps 2 and 3
    assert traj.means.shape[:2] == (4, 2)
    assert bool((traj.latents[:, 0] == traj.latents[0, 0]).all())  # one root, ODE to the window


def test_bad_trees_are_refused(sd3):
    spec = BranchSpec((0, 1), (2, 2))
    with pytest.raises(ValueError, match="whole trees"):
        _sample(sd3, ["a"] * 6, spec)
    with pytest.raises(ValueError, match="different prompts"):
        _sample(sd3, ["a", "a", "b", "b"], spec)
    with pytest.raises(ValueError, match="outside the 1 trained"):
        _sample(sd3, ["a"] * 4, spec, num_steps=6, sde_window=SDEWindow(1, 2, 3))
