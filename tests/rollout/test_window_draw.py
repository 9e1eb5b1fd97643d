"""``sample.window_draw``: the SDE window's start drawn per sample (the default) or once per
training step for every sample and rank (Flow-Factory's draw, ``current_sde_steps`` seeded by
``seed + epoch``, X-GenGroup/Flow-Factory @ a0b2bc5 scheduler/flow_match_euler_discrete.py
151-160)."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.algorithms import algorithm_class
from flowgrpo.config import load_config
from flowgrpo.models.sd3 import SD3Adapter
from flowgrpo.rollout import SDEWindow, sample_trajectories
from flowgrpo.settings import ConfigError
from flowgrpo.testing.tiny import tiny_pipeline

WINDOW = ["sample.num_steps=10", "sample.window_size=2", "sample.window_lo=1", "sample.window_hi=6"]


def _plan(overrides: list[str], step: int):
    cfg = load_config(None, overrides, check_paths=False)
    algo = algorithm_class(cfg.algorithm)(
        cfg, None, None
    )  # a plan needs neither engine nor adapter
    return algo.rollout_plan(step).sde_window


def test_drawn_once_is_a_function_of_seed_and_step_and_covers_every_start() -> None:
    w = SDEWindow(size=2, lo=1, hi=6)
    starts = []
    for step in range(1, 201):
        a = w.drawn_once(9, seed=3, step=step)
        assert a == w.drawn_once(9, seed=3, step=step)  # another rank, or a resumed run
        assert a.size == 2 and a.hi == a.lo + 2 and 1 <= a.lo <= 4
        starts.append(a.lo)
    counts = torch.bincount(torch.tensor(starts), minlength=5)[1:]
    assert (counts > 30).all(), counts  # uniform over the 4 starts (50 each expected)
    assert SDEWindow(3, 0).drawn_once(9, seed=0, step=1).hi <= 9  # hi None = available
    with pytest.raises(ValueError, match="does not fit"):
        SDEWindow(size=4, lo=3, hi=6).drawn_once(9, seed=0, step=1)


def test_the_step_draw_gives_every_sample_of_a_step_one_window() -> None:
    per_step = [_plan([*WINDOW, "sample.window_draw=step"], s) for s in range(1, 41)]
    assert all(p.hi - p.lo == 2 and 1 <= p.lo <= 4 for p in per_step)
    assert len({p.lo for p in per_step}) == 4  # it moves from step to step
    expected = SDEWindow(2, 1, 6).drawn_once(9, seed=1, step=7)  # from seed and step alone
    assert _plan([*WINDOW, "sample.window_draw=step", "seed=1"], 7) == expected
    default = _plan(WINDOW, 7)  # per sample: the sampler draws each sample's start
    assert default == SDEWindow(2, 1, 6)

    adapter = SD3Adapter(tiny_pipeline("sd3"), max_sequence_length=8)
    gens = [torch.Generator().manual_seed(s) for s in range(6)]
    opts = dict(num_steps=10, guidance_scale=1.0, noise_level=0.7, height=16, width=16)
    traj = sample_trajectories(
        adapter, ["a"] * 6, sde_window=per_step[6], generator=gens, decode=False, **opts
    )
    assert (traj.step_indices[:, 0] == per_step[6].lo).all()
    gens = [torch.Generator().manual_seed(s) for s in range(6)]
    traj = sample_trajectories(
        adapter, ["a"] * 6, sde_window=default, generator=gens, decode=False, **opts
    )
    assert len(set(traj.step_indices[:, 0].tolist())) > 1  # per sample


def test_window_draw_is_refused_without_a_window() -> None:
    with pytest.raises(ConfigError, match="sample.window_draw"):
        load_config(None, ["sample.window_draw=step"], check_paths=False)
    with pytest.raises(ConfigError, match="sample.window_draw"):
        load_config(None, [*WINDOW, "sample.window_draw=epoch"], check_paths=False)
