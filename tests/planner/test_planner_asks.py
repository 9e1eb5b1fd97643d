"""The planner asks the sampler and the algorithm instead of re-deriving: the trained steps
are the sampler's K (rounded down, as ``sample_trajectories`` rounds), the rollout's guidance
is the algorithm's, and the editing-model + prompt-cache refusal is the trainer's one rule."""

from __future__ import annotations

import pytest

from flowgrpo.algorithms import algorithm_class
from flowgrpo.config import ConfigError, load_config
from flowgrpo.config.checks import check_prompt_cache
from flowgrpo.rollout.sampler import SDEWindow, _trained_steps


@pytest.mark.parametrize(
    "algorithm, overrides",
    [
        ("flow_grpo", ["sample.num_steps=10", "sample.timestep_fraction=0.99"]),
        ("flow_grpo", ["sample.num_steps=10", "sample.timestep_fraction=0.5"]),
        ("flow_grpo", ["sample.num_steps=10", "sample.deterministic_last_step=true"]),
        ("flow_grpo", ["sample.window_size=2", "sample.window_lo=0", "sample.window_hi=5"]),
        ("grpo_guard", ["sample.num_steps=7", "sample.timestep_fraction=0.6"]),
        ("nft", ["sample.num_steps=10"]),
        ("awm", ["sample.num_steps=10"]),
    ],
)
def test_trained_steps_are_the_samplers(algorithm, overrides):
    """K from the algorithm equals the K the sampler's own step picker returns for the plan
    the algorithm hands it (its window, fraction and last-step rule)."""
    cfg = load_config("sd3-ocr", [f"algorithm={algorithm}", *overrides], check_paths=False)
    s = cfg.sample
    window = None
    fraction, last = s.timestep_fraction, s.deterministic_last_step
    if algorithm in ("nft", "awm"):  # their rollout_plan: no window, the whole trajectory
        fraction = 1.0
    elif s.window_size > 0:
        window = SDEWindow(s.window_size, s.window_lo, s.window_hi)
    _, _, k = _trained_steps(
        2,
        s.num_steps,
        sde_window=window,
        timestep_fraction=fraction,
        deterministic_last_step=last,
        generator=None,
    )
    assert algorithm_class(algorithm).trained_steps(cfg) == k


def test_trained_steps_round_down_as_the_sampler_does():
    cfg = load_config(
        "sd3-ocr",
        [
            "sample.num_steps=10",
            "sample.timestep_fraction=0.99",
            "sample.deterministic_last_step=false",
        ],
        check_paths=False,
    )
    # 10 stochastic steps x 0.99 = 9.9: the sampler trains 9 (the planner once said 10)
    assert algorithm_class("flow_grpo").trained_steps(cfg) == 9


def test_mix_grpo_trains_its_largest_window():
    cfg = load_config("sd3-ocr", ["algorithm=mix_grpo"], check_paths=False)
    from flowgrpo.algorithms.mix_grpo import window_at

    sizes = {end - start for start, end in (window_at(cfg, step) for step in range(1, 200))}
    assert algorithm_class("mix_grpo").trained_steps(cfg) == max(sizes)


@pytest.mark.parametrize("algorithm, key", [("nft", "nft"), ("awm", "awm"), ("flow_grpo", None)])
def test_rollout_guidance_is_the_algorithms(algorithm, key):
    cfg = load_config(
        "sd3-ocr", [f"algorithm={algorithm}", "sample.guidance_scale=4.5"], check_paths=False
    )
    want = getattr(cfg, key).guidance_scale if key else 4.5
    assert algorithm_class(algorithm).rollout_guidance_scale(cfg) == want


def test_the_prompt_cache_refusal_is_one_rule():
    check_prompt_cache(False, "/tmp/cache")
    check_prompt_cache(True, None)
    with pytest.raises(ConfigError, match="model.embed_cache_dir: an editing model's prompt"):
        check_prompt_cache(True, "/tmp/cache")
    from flowgrpo.planner import plan_memory

    over = ["model.path=known:qwen-image-edit", "model.embed_cache_dir=/tmp/cache"]
    cfg = load_config("qwen-image-edit-counting", over, check_paths=False)
    with pytest.raises(ConfigError, match="editing model's prompt embeddings"):
        plan_memory(cfg, 8, 80)


def test_a_masked_attention_keeps_no_n_squared_on_the_cpu():
    """What the planner assumes of a trimmed prompt's [B, 1, 1, S] mask (Qwen-Image's joint
    mask): torch's SDPA saves the same bytes for backward with it as without (no N^2 x heads
    probabilities); a full [B, H, S, S] float mask would add its own N^2."""
    import torch
    import torch.nn.functional as F

    s = 512
    q, k, v = (torch.randn(1, 4, s, 32, requires_grad=True) for _ in range(3))

    def saved(mask):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return total[0]

    plain = saved(None)
    assert saved(torch.ones(1, 1, 1, s, dtype=torch.bool)) - plain < s * 8  # O(S), not N^2
    assert saved(torch.zeros(1, 4, s, s)) - plain >= 4 * s * s * 4  # the full mask itself
