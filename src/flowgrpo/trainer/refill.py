"""``sample.refill_rounds``: constant groups (every reward of the group equal: no advantage, no
policy gradient) are replaced by freshly sampled groups, up to a budget.

This is DAPO's dynamic sampling (Yu et al., arXiv 2503.14476; verl ``recipe/dapo``, documented
in volcengine/verl @ b178a3c docs/algo/dapo.md "Dynamic Sampling (with Group Filtering)"):
groups whose metric has std 0 are filtered out and more groups are generated until the batch
holds ``train_batch_size`` informative groups, then it is cut to that size; a bounded number
of extra generation rounds (``max_num_gen_batches``). verl-omni's group refill
(verl-project/verl-omni @ a1139ba docs/start/diffusion_v1.md,
``trainer.v1.sampler.max_incomplete_group_refill_rounds``) replaces dropped groups with exactly
as many new ones, in a bounded number of rounds. Here, per step:

- the step's own m groups are sampled and scored as always;
- each round draws as many new groups as the batch still holds constant ones (rounded up so
  that every data-parallel rank samples an equal share, never beyond
  ``sample.refill_max_groups`` extra groups per step), from prompts drawn uniformly with a
  generator seeded by (seed, step, round) — the step's own draw and the prompt sampler are
  untouched, so a resumed run repeats a straight run exactly;
- in order, each constant group of the batch is replaced by the next informative new group;
  new constant groups are dropped; the batch keeps m groups (DAPO's cut). When the budget or
  the rounds run out, the remaining constant groups stay (they train with advantage 0, as
  without refill), instead of DAPO's error.

New samples get global numbers after the step's (their noise seeds: (seed, step, number)) and
group ids after the step's m. The metrics (``refill/...``) say how many groups were replaced,
how many extra groups and samples it cost, and the constant-group fraction before refill
(``zero_std_ratio`` is the trained batch's, after).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch

from flowgrpo.data.prompts import rank_slice
from flowgrpo.rollout import Trajectory

SALT = 0x5EF1  # the refill prompts' stream, apart from the sampler's
TOL = 1e-8  # a group is constant when max - min of its rewards <= this (as zero_std_ratio)


def constant_groups(reward: torch.Tensor, group_ids: list[int]) -> dict[int, bool]:
    """{group id: whether its rewards are all equal (max − min ≤ 1e-8)} in first-appearance
    order; the same rule as the ``zero_std_ratio`` metric."""
    r = reward.detach().double().reshape(-1).cpu()
    out: dict[int, list[float]] = {}
    for g, v in zip(group_ids, r.tolist(), strict=True):
        lo, hi = out.get(g, (v, v))
        out[g] = (min(lo, v), max(hi, v))
    return {g: hi - lo <= TOL for g, (lo, hi) in out.items()}


def refill_draw(
    seed: int, step: int, round_: int, num_prompts: int, num_groups: int, group_size: int
) -> tuple[list[int], list[int]]:
    """(dataset indices, group offsets 0..num_groups-1) of a round's num_groups x group_size new
    samples in global order: prompts drawn uniformly (without replacement while they last), each
    repeated group_size times, shuffled (a group's samples spread over ranks, as the step's
    draw). A function of (seed, step, round) only."""
    rng = np.random.default_rng([int(seed), SALT, int(step), int(round_)])
    prompts = rng.choice(num_prompts, size=num_groups, replace=num_groups > num_prompts)
    groups = np.repeat(np.arange(num_groups), group_size)
    groups = groups[rng.permutation(groups.size)]
    return [int(prompts[g]) for g in groups.tolist()], groups.tolist()


def round_size(constant: int, budget: int, group_size: int, dp_size: int) -> int:
    """Groups to draw in a round: ``constant`` rounded up to a multiple of the least number of
    groups whose samples divide evenly over ``dp_size`` ranks (every rank must run as many
    forwards), capped by ``budget`` rounded down to that multiple."""
    unit = dp_size // math.gcd(group_size, dp_size)
    want = -(-constant // unit) * unit
    return min(want, budget // unit * unit)


def replace_constant(
    batch: list[int], flags: dict[int, bool], candidates: list[int]
) -> tuple[list[int], int]:
    """``batch`` (group ids in order) with each constant group replaced, in order, by the next
    informative group of ``candidates``; returns (the new batch, groups replaced)."""
    fresh = iter([g for g in candidates if not flags[g]])
    out, replaced = [], 0
    for g in batch:
        if flags[g]:
            new = next(fresh, None)
            if new is not None:
                g, replaced = new, replaced + 1
        out.append(g)
    return out, replaced


class Refilled(NamedTuple):
    """A step's batch after refill: this rank's trajectory, the global rewards and group ids
    of the trained samples (global order), which of them this rank holds (positions into that
    order, in the trajectory's row order), their global sample numbers, and the metrics."""

    traj: Trajectory
    rewards: dict[str, torch.Tensor]
    group_ids: torch.Tensor
    positions: torch.Tensor
    numbers: list[int]
    reward_s: float
    metrics: dict[str, float]


def refill(
    run: Any,
    step: int,
    traj: Trajectory,
    rewards: dict[str, torch.Tensor],
    groups: list[int],
    mine: list[int],
    score: Callable[..., tuple[Trajectory, Any, float]],
    gather: Callable[[Any, Any], dict[str, torch.Tensor]],
) -> Refilled:
    """Replace the step's constant groups (see the module docstring). ``traj``, ``rewards``,
    ``groups``, ``mine``: the step's rollout as sampled (this rank's trajectory, the gathered
    rewards, every sample's group id, this rank's global sample numbers); ``score(plan,
    prompts, metadata, numbers, locations, groups)`` samples and scores this rank's share,
    ``gather(rewards)`` all-gathers rewards."""
    cfg, engine = run.cfg, run.engine
    s = cfg.sample
    weights = run.reward.weights_of(rewards)
    m = s.prompts_per_step
    budget = m if s.refill_max_groups is None else s.refill_max_groups

    def flags_of(rw: dict[str, torch.Tensor], ids: list[int]) -> dict[int, bool]:
        combined = run.algorithm.advantages(rw, weights, torch.tensor(ids))
        return constant_groups(combined.reward, ids)

    all_groups, all_rewards = list(groups), {k: [v] for k, v in rewards.items()}
    local_numbers, parts = list(mine), [traj]
    flags = flags_of(rewards, groups)
    batch = list(dict.fromkeys(groups))  # the step's m groups, in first-appearance order
    before = sum(flags[g] for g in batch) / len(batch)
    replaced = drawn = rounds = 0
    reward_s, next_group = 0.0, m
    for r in range(1, s.refill_rounds + 1):
        constant = sum(flags[g] for g in batch)
        n_groups = round_size(constant, budget - drawn, s.group_size, engine.dp_size)
        if constant == 0 or n_groups == 0:
            break
        indices, offsets = refill_draw(
            cfg.seed, step, r, len(run.train_data), n_groups, s.group_size
        )
        new_groups = [next_group + o for o in offsets]
        first = len(all_groups)  # the new samples' global numbers follow every earlier one
        start, count = rank_slice(len(indices), engine.dp_size, engine.dp_rank)
        numbers = list(range(first + start, first + start + count))
        prompts, metadata = run.train_data.select(indices[start : start + count])
        locations = [run.train_data.locations[i] for i in indices[start : start + count]]
        part, local, seconds = score(
            run.rollout_plan(step), prompts, metadata, numbers, locations,
            new_groups[start : start + count],
        )  # fmt: skip
        new_rewards = gather(run, local)
        reward_s += seconds
        parts.append(part)
        local_numbers += numbers
        all_groups += new_groups
        for k, v in new_rewards.items():
            all_rewards[k].append(v)
        flags.update(flags_of(new_rewards, new_groups))
        batch, n_replaced = replace_constant(batch, flags, list(dict.fromkeys(new_groups)))
        replaced += n_replaced
        drawn += n_groups
        rounds += 1
        next_group += n_groups
    kept = set(batch)
    every = {k: torch.cat(v) for k, v in all_rewards.items()}
    selected = [i for i, g in enumerate(all_groups) if g in kept]  # global numbers, in order
    place = {n: j for j, n in enumerate(selected)}
    local_rows = [i for i, n in enumerate(local_numbers) if n in place]
    merged = Trajectory.cat(parts) if len(parts) > 1 else traj
    index = torch.tensor(selected, dtype=torch.long)
    metrics = {
        "refill/rounds": float(rounds),
        "refill/groups_sampled": float(drawn),
        "refill/groups_refilled": float(replaced),
        "refill/samples": float(drawn * s.group_size),
        "refill/zero_std_ratio_before": before,
    }
    return Refilled(
        traj=merged.select(local_rows),
        rewards={k: v[index] for k, v in every.items()},
        group_ids=torch.tensor([all_groups[i] for i in selected]),
        positions=torch.tensor([place[local_numbers[i]] for i in local_rows], dtype=torch.long),
        numbers=[local_numbers[i] for i in local_rows],
        reward_s=reward_s,
        metrics=metrics,
    )


__all__ = ["Refilled", "constant_groups", "refill", "refill_draw", "replace_constant", "round_size"]
