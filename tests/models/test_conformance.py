"""Every model family passes the same checks (flowgrpo.testing.conformance): its noise-0
rollout equals the stock diffusers pipeline, rollouts are batch invariant, the training pass
recomputes the rollout's log-probs under any micro-batch split (fp32) and exactly with bf16
weights, its LoRA targets exist and its LoRA export loads in the stock pipeline. A family
joins by its module in ``flowgrpo.testing.families`` (every registered family has one); its
cost tier marks its rows slow (``params``); "2 ranks equal 1 process" for every family and
algorithm: tests/algorithms/test_algorithms.py over the same list."""

from __future__ import annotations

import pytest

from flowgrpo.testing import conformance as C
from flowgrpo.testing.families import cross_params, params

pytestmark = pytest.mark.usefixtures("one_thread")
FAMILIES = params(C.FAMILIES)
STOCK = params(f for f in C.FAMILIES if f.stock)
#: the SDE kinds: every one on the core families, one each on the others (the noise rule is
#: the sampler's, the same for every family)
SDE_TYPES = cross_params(C.FAMILIES, ["sde", "cps"])


@pytest.fixture(scope="module")
def pipes():
    """One fp32 pipeline per family, built on first use (the checks never modify it)."""
    cache = {}

    def get(fam: C.Family):
        if fam.kind not in cache:
            cache[fam.kind] = fam.pipeline()
        return cache[fam.kind]

    return get


@pytest.mark.parametrize("guidance_scale", [1.0, 4.5])
@pytest.mark.parametrize("which", [0, 1], ids=["size0", "size1"])
@pytest.mark.parametrize("fam", STOCK)
def test_noise0_rollout_equals_the_stock_pipeline(pipes, fam, which, guidance_scale):
    C.check_noise0_matches_pipeline(fam, pipes(fam), fam.sizes[which], guidance_scale)


@pytest.mark.parametrize("fam", FAMILIES)
def test_rollout_is_batch_invariant(pipes, fam):
    C.check_batch_invariance(fam, pipes(fam), guidance_scale=4.5)


@pytest.mark.parametrize(("fam", "sde_type"), SDE_TYPES)
def test_log_probs_recompute_under_any_micro_batch_split(pipes, fam, sde_type):
    C.check_log_prob_splits(fam, pipes(fam), sde_type)


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    cache = {}

    def get(fam: C.Family):
        if fam.kind not in cache:
            cache[fam.kind] = C.bf16_adapter(fam, tmp_path_factory.mktemp(f"bf16-{fam.kind}"))
        return cache[fam.kind]

    return get


@pytest.mark.parametrize(("fam", "sde_type"), SDE_TYPES)
def test_bf16_training_pass_is_exactly_on_policy(bf16, fam, sde_type):
    C.check_bf16_on_policy(fam, bf16(fam), sde_type)


@pytest.mark.parametrize("fam", FAMILIES)
def test_checkpointing_keeps_the_gradients(pipes, fam):
    C.check_checkpointing_gradients(fam, pipes(fam))


@pytest.mark.parametrize("fam", FAMILIES)
def test_lora_targets_exist(pipes, fam):
    C.check_lora_targets(fam, pipes(fam))


@pytest.mark.parametrize("fam", FAMILIES)
def test_lora_export_loads_in_the_stock_pipeline(dist1, fam, tmp_path):
    C.check_lora_export(fam, tmp_path)
