"""Presets against the runs they cite (issue 39): the values that differed, and the docs lines
that say where a preset keeps a documented difference."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowgrpo.config import load_config

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize(
    "preset",
    [
        "flux2-pickscore",
        "flux2-klein-pickscore",
        "qwen-image-21-pickscore",
        "z-image-pickscore",
        "z-image-turbo-pickscore",
    ],
)
def test_flow_factory_ema_interval_is_four_epochs_in_optimizer_steps(preset: str) -> None:
    """Flow-Factory's ema_update_interval 4 counts epochs (one ema_step per rollout,
    trainers/grpo.py @ a0b2bc5); each epoch takes gradient_step_per_epoch 2 optimizer steps."""
    cfg = load_config(preset, [], check_paths=False)
    assert cfg.ema.enabled and cfg.ema.decay == 0.9
    assert cfg.ema.update_every == 4 * cfg.update.num_minibatches == 8


def test_engine_docs_say_how_each_reference_counts_its_ema_steps() -> None:
    text = " ".join((DOCS / "engine.md").read_text().split())
    assert "counts epochs" in text
    assert "once per **micro-batch**" in text and "0.9⁶ = 0.53" in text
    assert "after incrementing the step count" in text
