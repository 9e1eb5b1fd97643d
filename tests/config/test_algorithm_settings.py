"""Each algorithm's settings in a preset (the ``algorithms:`` overlay), what each algorithm
refuses rather than ignores, its eval guidance, and MixGRPO's schedule checked before a run."""

from __future__ import annotations

import pytest
import yaml

from flowgrpo import cli
from flowgrpo.config import ConfigError, load_config


def _load(preset: str | None, *overrides: str):
    return load_config(preset, list(overrides), check_paths=False)


def _error(preset: str | None, *overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        _load(preset, *overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_preset_gives_each_algorithm_its_authors_shared_settings():
    base = _load("sd3-ocr")
    mix = _load("sd3-ocr", "algorithm=mix_grpo")
    assert (base.sample.num_steps, base.sample.group_size, base.update.num_minibatches) == (
        10,
        24,
        2,
    )
    assert (mix.sample.num_steps, mix.sample.group_size, mix.update.num_minibatches) == (25, 12, 4)
    assert mix.sample.same_latent and not base.sample.same_latent
    guard = _load("sd3-ocr", "algorithm=grpo_guard")
    assert guard.optim.lr == 1e-4 and guard.advantage.global_std is False
    assert guard.grpo_guard.bias_reduce == "sample"
    flux = _load("flux-pickscore", "algorithm=mix_grpo")
    assert flux.sample.time_shift == 3.0 and flux.optim.lr == 1e-5 and not flux.lora.enabled
    assert (flux.model.height, flux.sample.num_steps, flux.sample.group_size) == (720, 25, 12)
    qwen = _load("qwen-image-ocr", "algorithm=nft")  # NFT has no SDE window to keep
    assert qwen.sample.window_size == 0 and qwen.sample.prompts_per_step == 24


def test_user_overrides_win_over_the_algorithms_values_in_any_order():
    a = _load("sd3-ocr", "sample.num_steps=12", "algorithm=mix_grpo")
    b = _load("sd3-ocr", "algorithm=mix_grpo", "sample.num_steps=12")
    assert a.sample.num_steps == b.sample.num_steps == 12
    assert a.sample.group_size == 12  # the rest of the overlay still applies
    # the last algorithm= decides which overlay applies
    c = _load("sd3-ocr", "algorithm=mix_grpo", "algorithm=flow_grpo")
    assert c.algorithm == "flow_grpo" and c.sample.num_steps == 10


def test_config_show_prints_the_chosen_algorithms_settings(capsys):
    assert cli.main(["config", "show", "sd3-ocr", "algorithm=mix_grpo"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["algorithm"] == "mix_grpo"
    assert shown["sample"]["num_steps"] == 25 and shown["update"]["num_minibatches"] == 4


def test_overlay_mistakes_are_one_line_errors(tmp_path):
    def preset(body: str) -> str:
        path = tmp_path / "p.yaml"
        path.write_text("base: sd3-ocr\n" + body)
        return str(path)

    msg = _error(preset("algorithms:\n  mixgrpo:\n    sample: {num_steps: 3}\n"))
    assert "unknown algorithm 'mixgrpo' under 'algorithms'" in msg and "'mix_grpo'" in msg
    msg = _error(preset("algorithms:\n  nft:\n    sample: {num_stepz: 3}\n"))
    assert "unknown config key 'sample.num_stepz'" in msg and "algorithms.nft" in msg
    msg = _error(preset("algorithms:\n  nft:\n    sample: {num_steps: x}\n"))
    assert "'sample.num_steps' expects int" in msg  # checked even when nft is not chosen
    msg = _error(preset("algorithms:\n  nft:\n    algorithm: flow_grpo\n"))
    assert "'algorithm' cannot be set per algorithm" in msg
    assert "must map algorithm names" in _error(preset("algorithms: [1, 2]\n"))


def test_nft_evaluates_at_its_own_guidance_unless_told():
    assert _load("sd3-ocr", "algorithm=nft").sample.eval_guidance_scale == 1.0
    assert _load("sd3-ocr").sample.eval_guidance_scale == 4.5
    assert _load("sd3-ocr", "algorithm=grpo_guard").sample.eval_guidance_scale == 4.5
    told = _load("sd3-ocr", "algorithm=nft", "sample.eval_guidance_scale=4.5")
    assert told.sample.eval_guidance_scale == 4.5
    assert _load("sd3-ocr", "algorithm=nft", "nft.guidance_scale=2").sample.eval_guidance_scale == 2


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["algorithm=nft", "sample.window_size=2"],
            "config key 'sample.window_size' must be 0 with algorithm=nft",
        ),
        (
            ["algorithm=nft", "sample.timestep_fraction=0.5"],
            "config key 'sample.timestep_fraction' must be 1 with algorithm=nft",
        ),
        (
            ["algorithm=nft", "sample.sde_type=cps"],
            "config key 'sample.sde_type' must be left at 'sde' with algorithm=nft",
        ),
        (
            ["algorithm=nft", "ema.enabled=true", "sample.use_ema_for_rollout=true"],
            "config key 'sample.use_ema_for_rollout' must be false with algorithm=nft",
        ),
        (
            ["algorithm=mix_grpo", "sample.window_size=2"],
            "config key 'sample.window_size' must be 0 with algorithm=mix_grpo",
        ),
        (
            ["algorithm=mix_grpo", "sample.timestep_fraction=0.5"],
            "config key 'sample.timestep_fraction' must be 1 with algorithm=mix_grpo",
        ),
        (
            ["algorithm=grpo_guard", "sample.sde_type=cps"],
            "config key 'sample.sde_type' must be 'sde' with algorithm=grpo_guard",
        ),
    ],
)
def test_settings_an_algorithm_would_ignore_are_refused(overrides, expected):
    assert _error(None, *overrides).startswith(expected)
    _load(None, *[o for o in overrides if o.startswith(("algorithm", "ema"))])  # alone: fine


def test_mix_grpo_without_roll_back_is_refused_when_the_window_would_pass_the_end():
    """The toy: 10 steps, window moved every 10 steps -> empty (start = 8) from step 81 on."""
    msg = _error(None, "algorithm=mix_grpo", "mix_grpo.roll_back=false", "trainer.max_steps=90")
    assert msg.startswith("mix_grpo.roll_back=false: the SDE window reaches the end of the 10-step")
    assert "at step 81, so steps 81..90 would train nothing" in msg
    assert "trainer.max_steps=80" in msg
    _load(None, "algorithm=mix_grpo", "mix_grpo.roll_back=false", "trainer.max_steps=80")
    _load(None, "algorithm=mix_grpo", "trainer.max_steps=90")  # rolls back: trains again
