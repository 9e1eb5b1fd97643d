"""Fixed-seed evaluation of the toy digits model: accuracy, reward, judge and diversity."""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.toy.pipeline import IMAGE_SIZE, ToyAdapter, ToyDigitsPipeline


def digit_prompts(samples_per_digit: int, template: str = "a handwritten {}") -> list[str]:
    """[0]*n + [1]*n + ... + [9]*n prompts (10 * n), digit-major."""
    return [template.format(d) for d in range(10) for _ in range(samples_per_digit)]


def eval_generators(n: int, seed: int) -> list[torch.Generator]:
    """One CPU generator per sample, so a sample's noise is the same in any batch."""
    return [torch.Generator().manual_seed(seed * 100_003 + i) for i in range(n)]


@torch.no_grad()
def evaluate_toy(
    model: ToyDigitsPipeline | ToyAdapter,
    *,
    samples_per_digit: int = 16,
    num_steps: int = 10,
    seed: int = 0,
    guidance_scale: float = 1.0,
    noise_level: float = 0.0,
    transformer: torch.nn.Module | None = None,
    classifier: Any = None,
) -> dict[str, Any]:
    """Sample 10 digits x ``samples_per_digit`` with fixed per-sample seeds (ODE by default).

    Returns accuracy (classifier argmax == digit), reward_mean (mean digits_reward),
    judge_accuracy (independent SVC), diversity, and the images [10 n, 1, 8, 8] in [0, 1].
    """
    from flowgrpo.rollout.sampler import sample_trajectories
    from flowgrpo.toy.reward import digit_probs, digits_judge, diversity

    adapter = model if isinstance(model, ToyAdapter) else ToyAdapter(model)
    prompts = digit_prompts(samples_per_digit)
    digits = torch.arange(10).repeat_interleave(samples_per_digit)
    traj = sample_trajectories(
        adapter,
        prompts,
        num_steps=num_steps,
        guidance_scale=guidance_scale,
        noise_level=noise_level,
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        generator=eval_generators(len(prompts), seed),
        transformer=transformer,
    )
    images = traj.images
    probs = digit_probs(images, classifier)
    return {
        "accuracy": float((probs.argmax(-1) == digits).float().mean()),
        "reward_mean": float(probs.gather(1, digits[:, None]).mean()),
        "judge_accuracy": digits_judge(images, digits),
        "diversity": diversity(images, digits),
        "images": images,
    }


__all__ = ["digit_prompts", "eval_generators", "evaluate_toy"]
