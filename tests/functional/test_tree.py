"""The branching rollouts' tree math (``flowgrpo.functional.tree``) against an independent node-by-node
transcription of BranchGRPO's estimator and pruning (Fredreic1849/BranchGRPO @ ffc3c90,
fastvideo/train_branchgrpo_flux.py: ``TreeNode``, ``compute_node_rewards_from_leaves``,
``compute_hierarchical_advantages_by_depth`` and the pruning in ``train_one_step_tree``) and
hand-computed TreeGRPO backups."""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.functional.advantages import group_advantages
from flowgrpo.functional.tree import BranchSpec, fuse_up, train_mask, tree_advantages


class Node:
    """The authors' TreeNode, reduced to what the estimator reads."""

    def __init__(self, parent=None, log_prob=0.0, step=-1):
        self.parent, self.children, self.log_prob, self.step = parent, [], log_prob, step
        self.depth = 0 if parent is None else parent.depth + 1
        self.reward = self.advantage = None
        if parent is not None:
            parent.children.append(self)

    def leaves(self):
        return [self] if not self.children else [x for c in self.children for x in c.leaves()]


def build_tree(spec: BranchSpec, log_probs: torch.Tensor, t: int) -> tuple[Node, list[Node]]:
    """Tree ``t`` grown step by step as their sampler does: each node gets one child per step,
    ``factor`` at a split; edge log-probs from the rows of ``log_probs`` [B, K] it covers."""
    root = Node()
    frontier = [(root, t * spec.leaves)]  # (node, its first leaf row)
    span = spec.leaves
    for k in range(log_probs.shape[1]):
        f = spec.factor_at(k)
        span //= f
        nxt = []
        for node, first in frontier:
            for j in range(f):
                row = first + j * span
                nxt.append((Node(node, float(log_probs[row, k]), step=k), row))
        frontier = nxt
    return root, [n for n, _ in frontier]


def authors_advantages(rewards, log_probs, spec, prob_weighted):
    """[B, K] from the transcription: node rewards bottom-up (mean of leaf descendants, or the
    softmax of child log-probs), advantages standardized per depth within each tree."""
    out = torch.zeros(log_probs.shape, dtype=torch.float64)
    for t in range(len(rewards) // spec.leaves):
        root, leaves = build_tree(spec, log_probs, t)
        for i, leaf in enumerate(leaves):
            leaf.reward = torch.tensor(float(rewards[t * spec.leaves + i]), dtype=torch.float64)
        nodes, stack = [], [root]
        while stack:
            n = stack.pop()
            nodes.append(n)
            stack.extend(n.children)
        by_depth = {}
        for n in nodes:
            by_depth.setdefault(n.depth, []).append(n)
        for d in sorted(by_depth, reverse=True)[1:]:
            for n in by_depth[d]:
                if not n.children:
                    continue
                if not prob_weighted:
                    n.reward = torch.stack([x.reward for x in n.leaves()]).mean()
                elif len(n.children) == 1:
                    n.reward = n.children[0].reward
                else:
                    lp = torch.tensor([c.log_prob for c in n.children], dtype=torch.float64)
                    w = torch.softmax(lp, dim=0)
                    n.reward = torch.sum(w * torch.stack([c.reward for c in n.children]))
        for nodes_d in by_depth.values():
            if len(nodes_d) <= 1:
                for n in nodes_d:
                    n.advantage = torch.tensor(0.0)
                continue
            r = torch.stack([n.reward for n in nodes_d])
            std = r.std()
            adv = torch.zeros_like(r) if std < 1e-6 else (r - r.mean()) / (std + 1e-8)
            for n, a in zip(nodes_d, adv):
                n.advantage = a
        for i, leaf in enumerate(leaves):  # each row: the advantages along its path
            n = leaf
            while n.parent is not None:
                out[t * spec.leaves + i, n.step] = float(n.advantage)
                n = n.parent
    return out


SPECS = [BranchSpec((0, 2), (2, 3)), BranchSpec((1, 2, 3), (2, 2, 2)), BranchSpec((0,), (4,))]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("fusion", ["mean", "logprob"])
def test_depth_estimator_equals_branchgrpo_transcription(spec, fusion):
    g = torch.Generator().manual_seed(0)
    trees, k = 3, 5
    rewards = torch.rand(trees * spec.leaves, generator=g)
    rewards[: spec.leaves] = 0.25  # a constant tree: all its advantages are 0
    # a shared edge has one log-prob, recorded on each of its rows
    lp = -torch.rand(trees * spec.leaves, k, generator=g, dtype=torch.float64)
    for kk in range(k):
        span = spec.span(kk)
        lp[:, kk] = lp[::span, kk].repeat_interleave(span)
    ours = tree_advantages(rewards, lp, spec, estimator="depth", fusion=fusion)
    ref = authors_advantages(rewards, lp, spec, fusion == "logprob")
    assert ours.shape == (trees * spec.leaves, k)
    assert torch.allclose(ours.double(), ref, atol=1e-6), (ours, ref)
    assert bool(ref[spec.leaves :].ne(0).any()) and not bool(ours[: spec.leaves].any())
    # before the first split a tree has one node per depth: 0
    assert not bool(ours[:, : spec.split_steps[0]].any())


def test_depth_estimator_on_group_advantages_equals_it_on_rewards():
    """The update passes the leaves' group advantages (a positive affine map of the rewards
    within a group = tree): standardizing per depth removes the map."""
    spec = BranchSpec((0, 2), (2, 4))
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(4 * spec.leaves, generator=g)
    lp = torch.zeros(len(rewards), 4)
    groups = torch.arange(len(rewards)) // spec.leaves
    on_adv = tree_advantages(group_advantages(rewards, groups), lp, spec)
    on_rewards = tree_advantages(rewards, lp, spec)
    assert torch.allclose(on_adv, on_rewards, atol=1e-4)


def test_backup_estimator_by_hand():
    """TreeGRPO: a 2 x 2 tree (splits at steps 0 and 1, 3 trained steps); edge values are the
    log-prob-softmax-weighted averages of the children's, unstandardized."""
    spec = BranchSpec((0, 1), (2, 2))
    leaf = torch.tensor([1.0, -1.0, 0.5, 0.0])
    lp = torch.tensor(
        [[-1.0, -2.0, -3.0], [-1.0, -1.0, -3.1], [-1.5, -0.5, -2.0], [-1.5, -0.7, -2.2]]
    )
    adv = tree_advantages(leaf, lp, spec, estimator="backup", fusion="logprob")
    assert torch.allclose(adv[:, 2], leaf)  # step 2: no split, each leaf's own edge
    assert torch.allclose(adv[:, 1], leaf)  # step 1 enters the leaves' chains
    w0 = 1 / (1 + math.exp(-1.0 - -2.0))  # softmax(-2, -1)[0] for the first node's children
    n0 = w0 * 1.0 + (1 - w0) * -1.0
    w1 = 1 / (1 + math.exp(-0.7 - -0.5))
    n1 = w1 * 0.5 + (1 - w1) * 0.0
    assert adv[:, 0].tolist() == pytest.approx([n0, n0, n1, n1], abs=1e-6)
    mean = tree_advantages(leaf, lp, spec, estimator="backup", fusion="mean")
    assert mean[:, 0].tolist() == pytest.approx([0.0, 0.0, 0.25, 0.25])


def test_fuse_up_refuses_partial_trees_and_late_splits():
    spec = BranchSpec((0, 1), (2, 2))
    with pytest.raises(ValueError, match="whole trees"):
        fuse_up(torch.zeros(6), torch.zeros(6, 3), spec)
    with pytest.raises(ValueError, match="trained steps"):
        fuse_up(torch.zeros(4), torch.zeros(4, 1), spec)
    with pytest.raises(ValueError, match="one factor per split"):
        BranchSpec((0, 1), (2,))
    with pytest.raises(ValueError, match=">= 2"):
        BranchSpec((0,), (1,))


def test_owner_mask_trains_each_edge_once():
    spec = BranchSpec((0, 2, 4, 6), (2, 2, 2, 2))
    mask = spec.owners(2 * spec.leaves, 9)
    per_tree = int(mask.sum()) // 2
    assert per_tree == spec.edges(9) == 2 + 2 + 4 + 4 + 8 + 8 + 16 + 16 + 16
    assert mask[:, 0].nonzero().squeeze(1).tolist() == [0, 8, 16, 24]


def authors_pruned(adv, spec, prune_steps, mode, ratio):
    """Their training-sample list after depth then width pruning, as (row, step) owner cells."""
    samples = []
    for t in range(adv.shape[0] // spec.leaves):  # DFS order: a leaf's chain, step by step
        for b in range(t * spec.leaves, (t + 1) * spec.leaves):
            for k in range(adv.shape[1]):
                if (b % spec.leaves) % spec.span(k) == 0 and (b, k) not in samples:
                    samples.append((b, k))
    samples.sort(key=lambda e: (e[0] // spec.leaves, e[0], e[1]))
    samples = [s for s in samples if s[1] not in prune_steps]  # depth pruning: child depth
    last = spec.split_steps[-1]
    out = []
    for t in range(adv.shape[0] // spec.leaves):
        mine = [s for s in samples if s[0] // spec.leaves == t]
        tail = [s for s in mine if s[1] > last]
        other = [s for s in mine if s[1] <= last]
        if mode == "branch":
            kept = []
            for b in sorted({s[0] for s in tail}):
                group = [s for s in tail if s[0] == b]
                group = sorted(group, key=lambda s: float(adv[s]), reverse=True)
                kept += group[: max(1, int(len(group) * ratio))]
        else:
            ranked = sorted(tail, key=lambda s: float(adv[s]), reverse=True)
            keep = max(2, int(len(ranked) * ratio))
            best = keep // 2
            kept = ranked[:best] + ranked[-(keep - best) :]
        out += other + kept
    return set(out)


@pytest.mark.parametrize("mode", ["branch", "extremes"])
def test_pruning_equals_the_authors(mode):
    spec = BranchSpec((0, 1), (2, 2))
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(2 * spec.leaves, 6, generator=g)
    mask = train_mask(adv, spec, prune_steps=(1, 4), width=mode, width_ratio=0.5)
    ours = {tuple(x) for x in mask.nonzero().tolist()}
    assert ours == authors_pruned(adv, spec, (1, 4), mode, 0.5)
    assert len(ours) < int(spec.owners(8, 6).sum())
    full = train_mask(adv, spec)
    assert bool((full == spec.owners(8, 6)).all())


def test_calls_per_sample_of_the_toy_tree():
    """The toy's tree (splits at 0, 2, 4, 6 into 2, 10 steps): 77 calls for 16 leaves."""
    spec = BranchSpec((0, 2, 4, 6), (2, 2, 2, 2))
    assert spec.calls_per_sample(10, 0) == 77 / 16
    assert 1 - spec.calls_per_sample(10, 0) / 10 >= 0.4
