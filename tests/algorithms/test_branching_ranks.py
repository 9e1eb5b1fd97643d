"""Branching rollouts (``sample.branching``) train alike on 1 process and 2 gloo ranks (one
tree each), for every algorithm that takes them; the update trains each edge once and its
first forward recomputes the rollout's log-probs (ratio 1)."""

from __future__ import annotations

import algo_ranks as ar
import pytest
import torch

from flowgrpo.testing.ranks import spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cases on 2 gloo ranks (one spawn) while this process runs them on 1."""
    from flowgrpo.engine import init_distributed

    init_distributed()
    out = tmp_path_factory.mktemp("tree_ranks") / "two_ranks.pt"
    ctx = spawn(ar.job_tree, 2, str(out), join=False)
    try:
        single = {case: ar.run_tree(*case) for case in ar.TREE_CASES}
    finally:
        while not ctx.join():
            pass
    return single, torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", ar.TREE_CASES, ids=["-".join(c) for c in ar.TREE_CASES])
def test_tree_update_on_two_ranks_equals_one_process(runs, case):
    single, sharded = runs
    one, two = single[case], sharded[case]
    assert "error" not in two, two.get("error")
    traj = one["traj"]
    k = traj.num_train_steps
    assert traj.branching is not None and len(traj) == 8
    # each edge once: per tree 2 + 4 (+ 4 per further step), none at zero advantage here
    assert one["metrics"]["tree_edges_trained"] == two["metrics"]["tree_edges_trained"]
    assert 0 < one["metrics"]["tree_edges_trained"] <= 2 * traj.branching.edges(k) < 8 * k
    assert one["metrics"]["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # recompute = rollout
    before = ar.run_initial(*case)
    moved = max((one["params"][n] - before[n]).abs().max().item() for n in before)
    assert moved > 1e-4, "the update moved nothing"
    worst = max((one["params"][n] - two["params"][n]).abs().max().item() for n in before)
    assert worst < 2e-5 * max(1.0, moved), (worst, moved)
    for key in ("loss", "grad_norm"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7)
