"""Group-relative advantages (GRPO) and the combination of several named rewards."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import NamedTuple

import torch

COMBINE_MODES = ("weighted_sum", "advantage")


def _group_index(group_ids: Sequence[Hashable] | torch.Tensor, n: int) -> torch.Tensor:
    """Map arbitrary hashable group ids (ints, prompt strings, ...) to dense ints [N]."""
    ids = group_ids.tolist() if isinstance(group_ids, torch.Tensor) else list(group_ids)
    if len(ids) != n:
        raise ValueError(f"got {len(ids)} group ids for {n} rewards")
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(g, len(dense)) for g in ids], dtype=torch.long)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    global_std: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """A_i = (r_i - mean of r over i's group) / (std + eps), [N] fp32.

    std is taken over all N rewards when ``global_std`` else over i's group (unbiased=False).
    A group whose rewards are all equal (a group of one included) has A = 0 exactly: its fp32
    mean can differ from the common value by an ulp (0.1 x 12 / 12 != 0.1), which would give
    advantages of ~1e-7 / std that survive an exact-zero test.
    """
    r = rewards.detach().float().reshape(-1).cpu()
    idx = _group_index(group_ids, r.numel())
    n_groups = int(idx.max()) + 1 if idx.numel() else 0
    counts = torch.zeros(n_groups).index_add_(0, idx, torch.ones_like(r))
    means = torch.zeros(n_groups).index_add_(0, idx, r) / counts
    hi = torch.full((n_groups,), -float("inf")).scatter_reduce(0, idx, r, "amax")
    lo = torch.full((n_groups,), float("inf")).scatter_reduce(0, idx, r, "amin")
    centred = torch.where((hi == lo)[idx], torch.zeros_like(r), r - means[idx])
    if global_std:
        std = r.std(unbiased=False) if r.numel() > 1 else torch.tensor(0.0)
    else:
        var = torch.zeros(n_groups).index_add_(0, idx, centred**2) / counts
        std = var.sqrt()[idx]
    return (centred / (std + eps)).to(rewards.device)


def group_pairs(group_ids: Sequence[Hashable] | torch.Tensor) -> tuple[list[int], list[int]]:
    """Every unordered pair (i, j), i < j, of samples in the same group: (firsts, seconds),
    group by group in order of first appearance, each group's pairs in
    ``itertools.combinations`` order (Pref-GRPO's ``cal_win_rate_images``)."""
    idx = _group_index(group_ids, len(group_ids)).tolist()
    members: dict[int, list[int]] = {}
    for i, g in enumerate(idx):
        members.setdefault(g, []).append(i)
    firsts: list[int] = []
    seconds: list[int] = []
    for rows in members.values():
        for a in range(len(rows)):
            for b in range(a + 1, len(rows)):
                firsts.append(rows[a])
                seconds.append(rows[b])
    return firsts, seconds


def win_rates(
    outcomes: Sequence[float] | torch.Tensor,
    firsts: Sequence[int] | torch.Tensor,
    seconds: Sequence[int] | torch.Tensor,
    n: int,
) -> torch.Tensor:
    """Each sample's win rate over the comparisons it took part in, [n] fp32.

    ``outcomes[p]`` in [0, 1] is how far sample ``firsts[p]`` beat ``seconds[p]`` (1 a win,
    0 a loss, 0.5 a tie; a judge's probability is allowed): the first gets ``outcomes[p]``,
    the second ``1 - outcomes[p]``. win_i = (i's wins) / (i's comparisons), 0 for a sample
    compared with none: Pref-GRPO's ``_pairwise_win_rate`` (CodeGoat24/Pref-GRPO @ 3e787f6,
    fastvideo/rewards/unifiedreward_think.py), where a tie or an unreadable answer counts 0.5
    to each side.
    """
    o = torch.as_tensor(outcomes, dtype=torch.float32).reshape(-1).cpu()
    a = torch.as_tensor(firsts, dtype=torch.long).reshape(-1).cpu()
    b = torch.as_tensor(seconds, dtype=torch.long).reshape(-1).cpu()
    if not (o.numel() == a.numel() == b.numel()):
        raise ValueError(f"got {o.numel()} outcomes for {a.numel()} firsts and {b.numel()} seconds")
    if o.numel() and not bool(((o >= 0) & (o <= 1)).all()):
        raise ValueError(
            f"pairwise outcomes must lie in [0, 1], got {o[(o < 0) | (o > 1) | o.isnan()][:3].tolist()}"
        )
    if bool((a == b).any()):
        raise ValueError("a sample cannot be compared with itself")
    wins = torch.zeros(n).index_add_(0, a, o).index_add_(0, b, 1 - o)
    counts = (
        torch.zeros(n).index_add_(0, a, torch.ones_like(o)).index_add_(0, b, torch.ones_like(o))
    )
    return torch.where(counts > 0, wins / counts.clamp_min(1), torch.zeros_like(wins))


def preference_advantages(
    outcomes: Sequence[float] | torch.Tensor,
    firsts: Sequence[int] | torch.Tensor,
    seconds: Sequence[int] | torch.Tensor,
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    global_std: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Group-relative preference advantages (Pref-GRPO, arXiv 2508.20751): each sample's win
    rate within its group (``win_rates``), normalised as ``group_advantages`` normalises
    rewards, [N] fp32."""
    rates = win_rates(outcomes, firsts, seconds, len(group_ids))
    return group_advantages(rates, group_ids, global_std=global_std, eps=eps)


class CombinedRewards(NamedTuple):
    """reward: the weighted sum of the components [N]; advantages: what the loss uses [N]."""

    reward: torch.Tensor
    advantages: torch.Tensor


def combine_rewards(
    rewards: Mapping[str, torch.Tensor],
    weights: Mapping[str, float],
    group_ids: Sequence[Hashable] | torch.Tensor,
    *,
    mode: str = "weighted_sum",
    global_std: bool = True,
    eps: float = 1e-4,
) -> CombinedRewards:
    """Combine named rewards {name: [N]} with ``weights`` {name: w}.

    mode "weighted_sum": A = group_advantages(sum_i w_i r_i).
    mode "advantage" (advantage aggregation): A = sum_i w_i group_advantages(r_i), so a reward
    with a large scale cannot drown the others.
    """
    if mode not in COMBINE_MODES:
        raise ValueError(f"unknown reward combine mode {mode!r}; expected one of {COMBINE_MODES}")
    if not rewards:
        raise ValueError("combine_rewards needs at least one reward")
    missing = sorted(set(rewards) - set(weights))
    if missing:
        raise ValueError(f"no weight given for reward(s) {missing}")
    names = list(rewards)
    total = sum(float(weights[k]) * rewards[k].detach().float().reshape(-1) for k in names)
    if mode == "weighted_sum":
        adv = group_advantages(total, group_ids, global_std=global_std, eps=eps)
    else:
        adv = sum(
            float(weights[k])
            * group_advantages(rewards[k], group_ids, global_std=global_std, eps=eps)
            for k in names
        )
    return CombinedRewards(total, adv)


def zero_std_ratio(
    rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor, *, tol: float = 1e-8
) -> float:
    """Fraction of groups whose rewards have no spread (max - min <= tol): they teach nothing."""
    r = rewards.detach().float().reshape(-1).cpu()
    idx = _group_index(group_ids, r.numel())
    n_groups = int(idx.max()) + 1 if idx.numel() else 0
    if n_groups == 0:
        return 0.0
    hi = torch.full((n_groups,), -float("inf")).scatter_reduce(0, idx, r, "amax")
    lo = torch.full((n_groups,), float("inf")).scatter_reduce(0, idx, r, "amin")
    return float(((hi - lo) <= tol).float().mean())


def reward_stats(
    rewards: Mapping[str, torch.Tensor], group_ids: Sequence[Hashable] | torch.Tensor
) -> dict[str, float]:
    """Per-batch logging statistics: ``reward/<name>_mean``, ``reward/<name>_std`` per reward,
    and ``zero_std_ratio/<name>`` (fraction of groups with no spread)."""
    out: dict[str, float] = {}
    for name, r in rewards.items():
        r = r.detach().float().reshape(-1)
        out[f"reward/{name}_mean"] = float(r.mean())
        out[f"reward/{name}_std"] = float(r.std(unbiased=False))
        out[f"zero_std_ratio/{name}"] = zero_std_ratio(r, group_ids)
    return out
