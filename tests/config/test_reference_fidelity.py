"""Presets against the runs they cite (issue 39): the values that differed, and the docs lines
that say where a preset keeps a documented difference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from flowgrpo.algorithms import ALGORITHMS, algorithm_class
from flowgrpo.config import load_config
from flowgrpo.functional.sde import sde_step_with_logprob

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PRESETS = ROOT / "src" / "flowgrpo" / "config" / "presets"


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


def _unirl_flow_sde_step(v, x, sigma, sigma_next, eta, prev_sample, sigma_max):
    """UniRL's FlowSDEStrategy.step + compute_log_prob, transcribed (Tencent-Hunyuan/UniRL @
    1a7b501 unirl/sde/kernels.py:185-235)."""
    dt = sigma_next - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    mean = (
        x * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    std_var = std_dev_t * torch.sqrt(-dt)
    log_prob = (
        -((prev_sample - mean) ** 2) / (2 * std_var**2)
        - torch.log(std_var)
        - 0.5 * math.log(2 * math.pi)
    )
    return mean, std_var, log_prob.mean(dim=tuple(range(1, x.ndim)))


@pytest.mark.parametrize("sigma", [1.0, 0.9, 0.4])
def test_unirl_flow_sde_noise_is_flow_grpo_sde(sigma: float) -> None:
    """HunyuanVideo-1.5's reference noise (UniRL's FlowSDEStrategy, eta 0.25) is the same
    formula as sde_type 'sde' with a = eta: mean, step std and log-prob."""
    g = torch.Generator().manual_seed(0)
    x, v, prev = (torch.randn(3, 4, 2, 5, 6, generator=g, dtype=torch.float64) for _ in range(3))
    s, s_next = (torch.tensor(t, dtype=torch.float64) for t in (sigma, sigma - 0.1))
    s_max = 0.95
    ours = sde_step_with_logprob(
        v, x, sigma, sigma - 0.1, noise_level=0.25, prev_sample=prev, sigma_max=s_max
    )
    mean, std, logp = _unirl_flow_sde_step(v, x, s, s_next, 0.25, prev, s_max)
    torch.testing.assert_close(ours.prev_sample_mean, mean, rtol=1e-12, atol=1e-12)
    step_std = ours.std_dev_t * math.sqrt(0.1)
    torch.testing.assert_close(step_std, std.expand(3), rtol=1e-9, atol=0)
    torch.testing.assert_close(ours.log_prob, logp, rtol=1e-9, atol=1e-9)


def test_hunyuan_video15_rollout_has_unirls_eight_sde_steps_among_steps_0_to_8() -> None:
    """UniRL: AllSDEScheduler(timestep_fraction [0, 0.6], num_sde_steps 8) over 16 steps, one
    draw per step for every sample, ODE elsewhere; here a window of 8 in [0, 9), drawn per
    step. Before: SDE on all 15 non-final steps, the first 9 trained."""
    cfg = load_config("hunyuan-video15-pickscore", [], check_paths=False)
    s = cfg.sample
    assert s.num_steps == 16 and int(16 * 0.6) == 9
    assert (s.window_size, s.window_lo, s.window_hi, s.window_draw) == (8, 0, 9, "step")
    algo = algorithm_class(cfg.algorithm)(cfg, None, None)
    starts = set()
    for step in range(1, 30):
        w = algo.rollout_plan(step).sde_window
        assert w.hi - w.lo == 8 and 0 <= w.lo <= 1  # 8 stochastic steps, all within 0-8
        starts.add(w.lo)
    assert starts == {0, 1}
    for name in ALGORITHMS:  # every algorithm runs the preset (those with their own sampling
        load_config("hunyuan-video15-pickscore", [f"algorithm={name}"], check_paths=False)
    header = (PRESETS / "hunyuan-video15-pickscore.yaml").read_text()
    assert "were not compared" not in header and "is the same formula" in header
    assert "0.569" in header and "0.486" in header


def test_docs_say_where_the_editing_sources_differ_from_the_authors_runs() -> None:
    """Qwen-Image-Edit: flow_grpo's VL encoder sees the [-1, 1] tensor rescaled by 1/255 again
    (2/255 of the content's std), its sources go 1024 -> 512 -> 1024; FLUX.1 Kontext: Pillow's
    default filter there, Lanczos here. Kept (diffusers' forms), and said so."""
    models = " ".join((DOCS / "models.md").read_text().split())
    assert "flow_grpo's Qwen-Image-Edit run differs" in models
    assert "2/255 = 0.78%" in models and "1024 → 512 → 1024" in models
    assert "Pillow's default" in models and "rms 0.0071 and 0.0027" in models
    edit = (PRESETS / "qwen-image-edit-counting.yaml").read_text()
    assert "square: the same" not in edit and "0.78%" in edit
    assert "Pillow's default" in (PRESETS / "flux-kontext-counting.yaml").read_text()
    readme = (ROOT / "README.md").read_text()
    assert (
        "QwenImageEditPipeline.from_pretrained(path, **QwenImageEditAdapter.load_components("
        in (readme)
    )


def test_mix_grpo_conditioning_and_time_shift_citation() -> None:
    math_md = " ".join((DOCS / "math.md").read_text().split())
    assert "int(σ·1000)/1000" in math_md and "at most 0.00091" in math_md
    from flowgrpo.functional import time_shift

    doc = " ".join(time_shift.time_shift_grid.__doc__.split())
    assert "sampling_utils.py:9-10" in doc and "train_grpo_flux.py:187-189" in doc
    assert "18-20" not in doc
