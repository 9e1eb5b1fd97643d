"""The toy's test double: the built-in ``ToyDigitsPipeline`` with random weights from the
seed (8 x 8 digit images; no stock diffusers pipeline to compare with)."""

from __future__ import annotations

from typing import Any

from flowgrpo.testing.family import Family


def build(tcfg: dict[str, Any], seeds) -> Any:
    """A ``ToyDigitsPipeline`` with random weights (seed 0 for ``tiny_pipeline("toy")``)."""
    from flowgrpo.toy.pipeline import ToyDigitsPipeline

    return ToyDigitsPipeline.from_config(seed=next(seeds) // 1000)


DOUBLES = (
    Family(
        "toy",
        ((8, 8), (8, 8)),
        size=(8, 8),
        prompts=("a handwritten 3", "a handwritten 7", "a handwritten 0", "a handwritten 5"),
        stock=False,
        train_size=(8, 8),
        pipeline_class="ToyDigitsPipeline",
        build=build,
        tier="core",  # every algorithm x LoRA/full runs on it
    ),
)
