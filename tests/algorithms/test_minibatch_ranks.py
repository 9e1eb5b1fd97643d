"""``update.num_minibatches > 1`` gives the same update at any number of ranks: the split of
the global batch into minibatches is global (one permutation of all samples), not each rank
shuffling its own share (which made 1 process and 2 ranks train different minibatches)."""

from __future__ import annotations

import algo_ranks as ar
import pytest
import torch

from flowgrpo.testing.ranks import spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The cases on 2 gloo ranks (one spawn) while this process runs them on 1."""
    from flowgrpo.engine import init_distributed

    init_distributed()
    out = tmp_path_factory.mktemp("minibatches") / "two_ranks.pt"
    ctx = spawn(ar.job_minibatches, 2, str(out), join=False)
    try:
        single = {case: ar.run(*case, **ar.MINIBATCHES) for case in ar.MINIBATCH_CASES}
    finally:
        while not ctx.join():
            pass
    return single, torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", ar.MINIBATCH_CASES, ids=["-".join(c) for c in ar.MINIBATCH_CASES])
def test_two_minibatches_on_two_ranks_equal_one_process(runs, case):
    single, sharded = runs
    one, two = single[case], sharded[case]
    assert "error" not in two, two.get("error")
    assert one["metrics"]["optimizer_steps"] == 2.0 == two["metrics"]["optimizer_steps"]
    before = ar.run_initial(*case)
    moved = max((one["params"][n] - before[n]).abs().max().item() for n in before)
    assert moved > 1e-4, "the update moved nothing"
    worst = max((one["params"][n] - two["params"][n]).abs().max().item() for n in before)
    assert worst < 2e-5 * max(1.0, moved), (worst, moved)
    for key in ("loss", "grad_norm"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7)
