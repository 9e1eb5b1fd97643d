"""Pairwise (preference) rewards in a run, and the gold rewards of its evals.

Pairwise rewards (``flowgrpo.rewards.is_pairwise``): at a training step every pair of samples
of a group is judged (Pref-GRPO: all ``itertools.combinations`` of a group), the pairs spread
over the data-parallel ranks, and each sample's reward is its win rate in its group
(``flowgrpo.functional.advantages.win_rates``); the algorithm then normalises it as any reward. At
an eval a pairwise reward judges each eval image against the base model's image of the same
prompt and noise: its eval score is the win rate against the base (0.5 at the base eval).

Gold rewards (``eval.gold_reward``): scored at evals only, logged as ``eval/gold/<name>``, their
weighted sum as ``eval/gold_score``, and ``eval/hacking_gap`` = the training reward's relative
gain since the base eval minus the gold score's.
"""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.engine.dist import all_gather_object
from flowgrpo.functional.advantages import group_pairs, win_rates

GOLD_SCORE = "eval/gold_score"
HACKING_GAP = "eval/hacking_gap"


def _group_firsts(obj: Any, sp_size: int) -> list[Any]:
    """Every rank's ``obj``, one per sequence-parallel group, in data-parallel order."""
    return all_gather_object(obj)[::sp_size]


def _spread_scores(
    reward: Any,
    engine: Any,
    images: torch.Tensor,
    prompts: list[str],
    metadata: list[dict],
    firsts: list[int],
    seconds: list[int],
    images_b: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``reward.score_pairs`` over all pairs, each data-parallel rank scoring a contiguous
    share (an SP group's first rank only) -> {label: [P]} on every rank, in pair order.
    ``images_b``: the second images come from it (indexed by ``seconds``) instead."""
    n, dp = len(firsts), engine.dp_size
    per = -(-n // dp) if n else 0
    lo, hi = engine.dp_rank * per, min(n, (engine.dp_rank + 1) * per)
    local = None
    if engine.sp_rank == 0:
        if images_b is None:
            local = reward.score_pairs(images, prompts, metadata, firsts[lo:hi], seconds[lo:hi])
        else:  # pair i = (images[firsts[i]], images_b[seconds[i]]): stack them side by side
            a, b = firsts[lo:hi], seconds[lo:hi]
            both = torch.cat([images[a], images_b[b]])
            k = len(a)
            local = reward.score_pairs(
                both,
                [prompts[i] for i in a] * 2,
                [metadata[i] for i in a] * 2,
                list(range(k)),
                list(range(k, 2 * k)),
            )
    parts = [p for p in _group_firsts(local, engine.sp_size)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def pairwise_rewards(
    run: Any,
    images: torch.Tensor,
    prompts: list[str],
    metadata: list[dict],
    groups: list[int],
) -> dict[str, torch.Tensor]:
    """A training step's pairwise rewards: {label: win rates [N]} of the global batch
    (``groups``: every sample's group, global order) from this rank's ``images`` (its share,
    in global order). {} without pairwise rewards. Collective."""
    labels = run.reward.pairwise_labels
    if not labels:
        return {}
    sp = run.engine.sp_size
    every = torch.cat(_group_firsts(images.cpu(), sp))
    all_prompts = [p for part in _group_firsts(list(prompts), sp) for p in part]
    all_meta = [m for part in _group_firsts(list(metadata), sp) for m in part]
    firsts, seconds = group_pairs(groups)
    outcomes = _spread_scores(run.reward, run.engine, every, all_prompts, all_meta, firsts, seconds)
    return {k: win_rates(outcomes[k], firsts, seconds, len(groups)) for k in labels}


def pairwise_eval(
    run: Any,
    images: torch.Tensor,
    base: torch.Tensor,
    prompts: list[str],
    metadata: list[dict],
) -> dict[str, torch.Tensor]:
    """An eval's pairwise rewards on this rank's eval ``images`` against the base model's
    ``base`` images of the same samples: {label: [n] outcomes, 1 = beats the base}. Every
    rank scores its own samples (an SP group's first rank; the others get None)."""
    if not run.reward.pairwise_labels or run.engine.sp_rank != 0:
        return {} if run.engine.sp_rank == 0 else None  # type: ignore[return-value]
    n = images.shape[0]
    both = torch.cat([images.cpu(), base.cpu()])
    return run.reward.score_pairs(
        both, list(prompts) * 2, list(metadata) * 2, list(range(n)), list(range(n, 2 * n))
    )


def gold_metrics(
    gold_reward: Any, scores: dict[str, torch.Tensor], base: dict[str, float] | None, out: dict
) -> dict[str, float]:
    """``eval/gold/<name>`` per gold output, ``eval/gold_score`` (their weighted sum of
    means), and ``eval/hacking_gap`` against the ``base`` eval's metrics (0 at the base eval):
    (reward - reward0) / |reward0| - (gold - gold0) / |gold0|."""
    metrics = {f"eval/gold/{k}": float(v.float().mean()) for k, v in scores.items()}
    total = 0.0
    for k, v in scores.items():
        total += (gold_reward.weight_of(k) or 0.0) * float(v.float().mean())
    metrics[GOLD_SCORE] = total
    ref = base if base is not None else {**out, **metrics}
    r0, g0 = ref["eval/reward_mean"], ref[GOLD_SCORE]
    gain_r = (out["eval/reward_mean"] - r0) / max(abs(r0), 1e-8)
    gain_g = (total - g0) / max(abs(g0), 1e-8)
    metrics[HACKING_GAP] = gain_r - gain_g
    return metrics


__all__ = ["GOLD_SCORE", "HACKING_GAP", "gold_metrics", "pairwise_eval", "pairwise_rewards"]
