"""Branching rollouts: the tree's shape, its advantage estimators and its pruning (pure math).

A tree starts from one latent and splits into ``factors[j]`` children at trained step offset
``split_steps[j]`` (offsets count from the first trained SDE step), so its L = prod(factors)
leaves share every step before their last common split. A rollout batch holds whole trees,
one after the other, leaf rows in order: after trained step k the rows of one node are
``span(k)`` consecutive rows, and the edge into that node (trained step k) is recorded, with
the same latents and log-prob, on each of them. Row b "owns" the edge when b is the node's
first row: the update trains each edge once.

Two estimators turn the leaves' scores into one advantage per edge [B, K]:

- ``depth`` (BranchGRPO, Li et al. arXiv 2509.06040; Fredreic1849/BranchGRPO @ ffc3c90,
  fastvideo/train_branchgrpo_flux.py ``compute_node_rewards_from_leaves`` and
  ``compute_hierarchical_advantages_by_depth``): a node's value is the mean of its leaves'
  (``fusion="mean"``) or the softmax-of-child-edge-log-prob weighted sum of its children's
  (``fusion="logprob"``, their ``--tree_prob_weighted``); the nodes of one depth of one tree
  are standardized together, (v - mean) / (std + 1e-8) with the unbiased std, 0 when the
  depth has one node or std < 1e-6. The edge into a node gets the node's advantage.
- ``backup`` (TreeGRPO, Ding & Ye arXiv 2512.08153, ICLR 2026, Eq. "A_edge(e') = sum_e
  w_u(e) A_edge(e)"; its code is not public in any index we could read, so this follows the
  paper): the leaves' group-relative advantages are fused up the tree (``fusion="logprob"``:
  w = softmax over the children's edge log-probs; ``"mean"``: equal weights) and each edge
  gets its child's fused value, unstandardized.

Pruning (BranchGRPO's, same file, ``train_one_step_tree``): ``prune_steps`` drops the edges of
those trained step offsets from the update (their ``--depth_pruning``: child depth = step + 1);
width pruning keeps, of the edges after the last split, the best ``ratio`` of each leaf's chain
(``"branch"``, their mode 1) or the best and worst ``ratio / 2`` of the tree's (``"extremes"``,
their mode 2, which they take over a rank's whole batch: here per tree, so the ranks' layout
cannot change it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ESTIMATORS = ("depth", "backup")
FUSIONS = ("mean", "logprob")
WIDTH_PRUNING = ("none", "branch", "extremes")


@dataclass(frozen=True)
class BranchSpec:
    """A tree: split at trained step offsets ``split_steps`` (increasing) into ``factors``
    children each."""

    split_steps: tuple[int, ...]
    factors: tuple[int, ...]

    def __post_init__(self) -> None:
        s, f = tuple(int(v) for v in self.split_steps), tuple(int(v) for v in self.factors)
        if not s or len(s) != len(f):
            raise ValueError(f"a tree needs one factor per split step, got {s} and {f}")
        if any(v < 0 for v in s) or any(b <= a for a, b in zip(s, s[1:])):
            raise ValueError(f"split steps must be increasing offsets >= 0, got {s}")
        if any(v < 2 for v in f):
            raise ValueError(f"branch factors must be >= 2, got {f}")
        object.__setattr__(self, "split_steps", s)
        object.__setattr__(self, "factors", f)

    @property
    def leaves(self) -> int:
        """L: samples (leaves) per tree."""
        return math.prod(self.factors)

    def factor_at(self, k: int) -> int:
        """Children per node made by trained step offset ``k`` (1: no split)."""
        return dict(zip(self.split_steps, self.factors)).get(k, 1)

    def nodes_after(self, k: int) -> int:
        """Nodes per tree after trained step offset ``k`` (k = -1: before any, the root)."""
        return math.prod(f for s, f in zip(self.split_steps, self.factors) if s <= k)

    def span(self, k: int) -> int:
        """Leaves under each node after trained step offset ``k``."""
        return self.leaves // self.nodes_after(k)

    def edges(self, num_steps: int) -> int:
        """Distinct edges of one tree over ``num_steps`` trained steps."""
        return sum(self.nodes_after(k) for k in range(num_steps))

    def calls_per_sample(self, num_steps: int, first: int) -> float:
        """Transformer calls per sample (per leaf) of a rollout of ``num_steps`` steps whose
        first trained step is ``first``: each node calls it once per step (independent samples:
        ``num_steps``)."""
        nodes = [self.nodes_after(i - first - 1) for i in range(num_steps)]
        return sum(nodes) / self.leaves

    def owners(self, batch: int, num_steps: int) -> torch.Tensor:
        """[B, K] bool: row b is the first row of the node its edge at step k enters."""
        self.check_batch(batch)
        local = torch.arange(batch) % self.leaves
        spans = torch.tensor([self.span(k) for k in range(num_steps)])
        return (local[:, None] % spans[None, :]) == 0

    def check_batch(self, batch: int) -> None:
        if batch % self.leaves:
            raise ValueError(f"{batch} samples are not whole trees of {self.leaves} leaves")


def _node_values(per_row: torch.Tensor, spec: BranchSpec, k: int) -> torch.Tensor:
    """[B] (constant over each node's rows) -> [T, nodes_after(k)]: one value per node."""
    span = spec.span(k)
    return per_row[::span].reshape(-1, spec.nodes_after(k))


def fuse_up(
    leaf_values: torch.Tensor, log_probs: torch.Tensor, spec: BranchSpec, fusion: str = "mean"
) -> torch.Tensor:
    """Each node's value, on every row under it: [B, K], column k = the value of the node after
    trained step k. Leaves (after the last step) hold ``leaf_values`` [B]; a node's value is the
    mean of its children's (``"mean"``: with equal subtrees, the mean of its leaves), or their
    sum weighted by the softmax of the child edges' log-probs ``log_probs`` [B, K]
    (``"logprob"``); a node with one child passes its child's value up."""
    if fusion not in FUSIONS:
        raise ValueError(f"unknown fusion {fusion!r}; expected one of {FUSIONS}")
    v = leaf_values.detach().double().reshape(-1).cpu()
    lp = log_probs.detach().double().cpu()
    batch, num_steps = lp.shape
    spec.check_batch(batch)
    if v.numel() != batch:
        raise ValueError(f"got {v.numel()} leaf values for {batch} rows")
    if spec.split_steps[-1] >= num_steps:
        raise ValueError(f"split step {spec.split_steps[-1]} >= the {num_steps} trained steps")
    out = torch.empty(batch, num_steps, dtype=torch.float64)
    out[:, -1] = v
    for k in range(num_steps - 2, -1, -1):
        f = spec.factor_at(k + 1)
        if f == 1:
            out[:, k] = out[:, k + 1]
            continue
        child = _node_values(out[:, k + 1], spec, k + 1).reshape(-1, f)  # [T * n_k, f]
        if fusion == "mean":
            parent = child.mean(dim=1)
        else:
            w = torch.softmax(_node_values(lp[:, k + 1], spec, k + 1).reshape(-1, f), dim=1)
            parent = (w * child).sum(dim=1)
        out[:, k] = parent.repeat_interleave(spec.span(k))
    return out


def depth_advantages(values: torch.Tensor, spec: BranchSpec) -> torch.Tensor:
    """BranchGRPO: node values [B, K] (``fuse_up``) standardized over the nodes of each depth
    of each tree (unbiased std; 0 with one node or std < 1e-6) -> [B, K]."""
    out = torch.zeros_like(values)
    for k in range(values.shape[1]):
        n = spec.nodes_after(k)
        if n == 1:
            continue
        nodes = _node_values(values[:, k], spec, k)  # [T, n]
        mean, std = nodes.mean(dim=1, keepdim=True), nodes.std(dim=1, keepdim=True)
        adv = torch.where(std < 1e-6, torch.zeros_like(nodes), (nodes - mean) / (std + 1e-8))
        out[:, k] = adv.reshape(-1).repeat_interleave(spec.span(k))
    return out


def tree_advantages(
    leaf_values: torch.Tensor,
    log_probs: torch.Tensor,
    spec: BranchSpec,
    *,
    estimator: str = "depth",
    fusion: str = "mean",
) -> torch.Tensor:
    """One advantage per (row, trained step) [B, K] fp32 (equal on the rows of one edge) from
    the leaves' scores [B] and the rollout's log-probs [B, K]: ``depth`` standardizes the fused
    node values per depth (BranchGRPO), ``backup`` uses them as they are (TreeGRPO)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown tree estimator {estimator!r}; expected one of {ESTIMATORS}")
    values = fuse_up(leaf_values, log_probs, spec, fusion)
    adv = depth_advantages(values, spec) if estimator == "depth" else values
    return adv.float()


def train_mask(
    advantages: torch.Tensor,
    spec: BranchSpec,
    *,
    prune_steps: tuple[int, ...] = (),
    width: str = "none",
    width_ratio: float = 0.5,
) -> torch.Tensor:
    """[B, K] bool: the edges the update trains, each once (on its owner row), less the
    trained step offsets ``prune_steps`` (depth pruning) and the width-pruned edges after the
    last split (``width``: "branch" keeps the best max(1, int(n * ratio)) of each leaf's n;
    "extremes" the best keep // 2 and worst keep - keep // 2 of the tree's, keep = max(2,
    int(n * ratio)); ties keep the earlier edge, leaf by leaf then step by step)."""
    if width not in WIDTH_PRUNING:
        raise ValueError(f"unknown width pruning {width!r}; expected one of {WIDTH_PRUNING}")
    batch, num_steps = advantages.shape
    mask = spec.owners(batch, num_steps)
    for k in prune_steps:
        if 0 <= k < num_steps:
            mask[:, k] = False
    last = spec.split_steps[-1]
    tail = [k for k in range(last + 1, num_steps) if k not in prune_steps]
    if width == "none" or not tail:
        return mask
    adv = advantages.detach().cpu().tolist()
    for t in range(0, batch, spec.leaves):
        edges = [(b, k) for b in range(t, t + spec.leaves) for k in tail]
        if width == "branch":
            keep = []
            for b in range(t, t + spec.leaves):
                chain = sorted(((b, k) for k in tail), key=lambda e: adv[e[0]][e[1]], reverse=True)
                keep += chain[: max(1, int(len(chain) * width_ratio))]
        else:
            ranked = sorted(edges, key=lambda e: adv[e[0]][e[1]], reverse=True)
            n_keep = min(len(ranked), max(2, int(len(ranked) * width_ratio)))
            best = n_keep // 2
            keep = ranked[:best] + (
                ranked[len(ranked) - (n_keep - best) :] if n_keep > best else []
            )
        kept = set(keep)
        for b, k in edges:
            if (b, k) not in kept:
                mask[b, k] = False
    return mask


__all__ = [
    "ESTIMATORS",
    "FUSIONS",
    "WIDTH_PRUNING",
    "BranchSpec",
    "depth_advantages",
    "fuse_up",
    "train_mask",
    "tree_advantages",
]
