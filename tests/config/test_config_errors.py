"""Config errors of issue 6: one line, naming the key, the allowed range and the value."""

from __future__ import annotations

import pytest

from flowgrpo.config import ConfigError, load_config
from flowgrpo.data.prompts import load_prompts


def _error(*overrides: str, preset: str | None = None, check_paths: bool = False) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(preset, list(overrides), check_paths=check_paths)
    message = str(info.value)
    assert "\n" not in message
    assert isinstance(info.value, ValueError)
    return message


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "trainer.max_step=2",
            "unknown config key 'trainer.max_step' (did you mean 'trainer.max_steps'?)",
        ),
        ("max_steps=2", "unknown config key 'max_steps' (did you mean 'trainer.max_steps'?)"),
        (
            "sample.noise=0.5",
            "unknown config key 'sample.noise' (did you mean 'sample.noise_level'?)",
        ),
        ("optim.lrr=1e-4", "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
        ("trainer.max_steps.x=1", "unknown config key 'trainer.max_steps.x'"),
    ],
)
def test_unknown_key_names_closest(override: str, expected: str) -> None:
    assert _error(override).startswith(expected)


@pytest.mark.parametrize(
    "override, expected",
    [
        ("trainer.max_steps=ten", "config key 'trainer.max_steps' expects int, got 'ten'"),
        ("seed=1.5", "config key 'seed' expects int, got 1.5"),
        ("run.tensorboard=maybe", "config key 'run.tensorboard' expects bool, got 'maybe'"),
        ("optim.lr=fast", "config key 'optim.lr' expects float, got 'fast'"),
        ("optim.betas=[0.9]", "config key 'optim.betas' expects a list of 2 float, got [0.9]"),
        ("trainer=5", "config key 'trainer' is a section"),
    ],
)
def test_wrong_type_names_key_type_and_value(override: str, expected: str) -> None:
    assert _error(override).startswith(expected)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["sample.group_size=1"], "config key 'sample.group_size' must be >= 2"),
        (["flow_grpo.clip_range=0"], "config key 'flow_grpo.clip_range' must be > 0, got 0.0"),
        (["sample.noise_level=-0.1"], "config key 'sample.noise_level' must be >= 0, got -0.1"),
        (["optim.lr=0"], "config key 'optim.lr' must be > 0, got 0.0"),
        (["sample.sde_type=ode"], "config key 'sample.sde_type' must be one of 'sde', 'cps'"),
        (
            ["sample.sde_type=cps", "sample.noise_level=1.2"],
            "'sample.noise_level' must be in [0, 1]",
        ),
        (["sample.timestep_fraction=0"], "'sample.timestep_fraction' must be in (0, 1]"),
        (["advantage.mode=max"], "'advantage.mode' must be one of 'weighted_sum', 'advantage'"),
        (["model.dtype=fp8"], "'model.dtype' must be one of 'auto', 'fp32', 'bf16', 'fp16'"),
        (["sample.use_ema_for_rollout=true"], "'ema.enabled' must be true with sample.use_ema"),
        (["reward=ocr,ocr:0.5"], "'reward' must be a list of distinct rewards"),
        # window: 10 steps with a deterministic last step leave 9 stochastic steps
        (["sample.window_size=2", "sample.window_hi=10"], "'sample.window_hi' must be <= 9"),
        (
            ["sample.window_size=4", "sample.window_lo=7"],
            "'sample.window_size' must be <= 2 (window_hi 9 - window_lo 7",
        ),
        (["sample.window_size=2", "sample.window_lo=-1"], "'sample.window_lo' must be >= 0"),
        # one step from sigma = 1 has an infinite 'sde' noise scale (was NaN log-probs)
        (
            ["sample.num_steps=1", "sample.deterministic_last_step=false"],
            "'sample.num_steps' must be >= 2 with sde_type 'sde', got 1",
        ),
        (["flow_grpo.cfg_grad=uncond"], "'flow_grpo.cfg_grad' must be one of 'both', 'cond_only'"),
    ],
)
def test_out_of_range_names_key_and_range(overrides: list[str], expected: str) -> None:
    assert expected in _error(*overrides)


def test_window_at_the_edge_is_accepted() -> None:
    cfg = load_config(None, ["sample.window_size=3", "sample.window_lo=6"], check_paths=False)
    assert (cfg.sample.window_size, cfg.sample.window_lo, cfg.sample.window_hi) == (3, 6, None)
    cfg = load_config(
        None, ["sample.window_size=10", "sample.deterministic_last_step=false"], check_paths=False
    )
    assert cfg.sample.window_size == 10
    assert "must be <= 9" in _error("sample.window_size=10")


def test_missing_model_path_for_real_presets() -> None:
    msg = _error(preset="sd3-ocr", check_paths=True)
    assert msg.startswith(
        "model.path is required for preset 'sd3-ocr': point it at a local diffusers directory"
    )
    assert "model.path is required for preset 'qwen-image-ocr'" in _error(
        preset="qwen-image-ocr", check_paths=True
    )
    assert "does not exist" in _error(
        "model.path=/no/such/model", preset="flux-pickscore", check_paths=True
    )


def test_missing_and_empty_prompt_files(tmp_path) -> None:
    missing = tmp_path / "nope.txt"
    msg = _error(f"model.path={tmp_path}", f"data.train_prompts={missing}", preset="sd3-ocr",
                 check_paths=True)  # fmt: skip
    assert msg == f"config key 'data.train_prompts': prompt file {missing} not found"
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    msg = _error(f"data.train_prompts={empty}", check_paths=True)
    assert msg == f"config key 'data.train_prompts': prompt file {empty} is empty"
    msg = _error(f"model.path={tmp_path}", preset="sd3-ocr", check_paths=True)
    assert msg.startswith("data.train_prompts is required for preset 'sd3-ocr'")
    # the dataset loader (what the trainer calls) says the same
    with pytest.raises(FileNotFoundError, match="prompt file not found: .*nope.txt"):
        load_prompts(missing)
    with pytest.raises(ValueError, match="empty.txt contains no prompts"):
        load_prompts(empty)


def test_pickscore_needs_a_model_path(tmp_path) -> None:
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    ok = [f"model.path={tmp_path}", f"data.train_prompts={prompts}"]
    msg = _error(*ok, preset="flux-pickscore", check_paths=True)
    assert msg.startswith("reward 'pickscore' needs options.path")
    assert "reward.pickscore.options.path=" in msg
    cfg = load_config(
        "flux-pickscore", [*ok, f"reward.pickscore.options.path={tmp_path}"], command="train"
    )
    assert cfg.reward[0].options == {"path": str(tmp_path)}


def test_preference_rewards_need_their_files(tmp_path) -> None:
    """hpsv2 / image_reward / aesthetic name the option a user left out before anything loads."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    ok = [f"model.path={tmp_path}", f"data.train_prompts={prompts}"]
    msg = _error(*ok, "reward=hpsv2", preset="flux-pickscore", check_paths=True)
    assert msg.startswith("reward 'hpsv2' needs options.path")
    ckpt = tmp_path / "HPS_v2.1_compressed.pt"
    ckpt.write_bytes(b"")
    over = [*ok, "reward=aesthetic", f"reward.aesthetic.options.path={ckpt}"]
    msg = _error(*over, preset="flux-pickscore", check_paths=True)
    assert msg.startswith("reward 'aesthetic' needs options.clip_path")
    assert "reward.aesthetic.options.clip_path=" in msg


def test_unknown_preset_and_bad_override_syntax() -> None:
    assert _error(preset="sd3ocr").startswith("unknown preset 'sd3ocr' (did you mean 'sd3-ocr'?")
    assert _error("trainer.max_steps").startswith("override 'trainer.max_steps' must look like")
    assert "no reward 'ocr' in the reward list ['digits']" in _error("reward.ocr.weight=2")
    assert "did you mean 'reward.digits.weight'" in _error("reward.digits.wieght=2")


def test_non_utf8_prompt_file_names_the_file_and_line(tmp_path) -> None:
    latin1 = tmp_path / "prompts.txt"
    latin1.write_bytes("a cat\nun caf\u00e9\n".encode("latin-1"))
    msg = _error(f"data.train_prompts={latin1}", check_paths=True)
    expected = f"prompt file {latin1}:2: not UTF-8 text (byte 0xe9); save the file as UTF-8"
    assert msg == f"config key 'data.train_prompts': {expected}"
    with pytest.raises(ValueError) as info:  # what the trainer calls says the same
        load_prompts(latin1)
    assert str(info.value) == expected[len("prompt file ") :]


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            "reward=mymod:nan",
            "config key 'reward[0]': weight of reward 'mymod' must be a finite number, got 'nan' "
            "(for a function named 'nan' give a weight: mymod:nan:1.0)",
        ),
        (
            "reward=digits:1,ocr:inf",
            "config key 'reward[1]': weight of reward 'ocr' must be a finite number, got 'inf'",
        ),
        ("reward=digits:-Infinity", "weight of reward 'digits' must be a finite number"),
        ("reward.digits.weight=nan", "config key 'reward.digits.weight' must be a finite number"),
        ("reward={digits: .inf}", "config key 'reward.digits.weight' must be a finite number"),
        (
            "reward.digits.key_weights={acc: .nan}",
            "config key 'reward.digits.key_weights.acc' must be a finite number, got nan",
        ),
    ],
)
def test_reward_weights_must_be_finite(override: str, expected: str) -> None:
    msg = _error(override)
    assert msg.startswith(expected) or ("config key" in msg and expected in msg), msg
    assert "-Infinity:1.0" not in msg  # the hint is for names only


def test_a_function_named_like_a_number_takes_a_weight() -> None:
    from flowgrpo.config import RewardSpec

    cfg = load_config(None, ["reward=mymod:nan:0.5,digits"], check_paths=False)
    assert cfg.reward == [RewardSpec(name="mymod:nan", weight=0.5), RewardSpec("digits")]


def test_multi_reward_rejects_non_finite_weights() -> None:
    from flowgrpo.rewards import MultiReward, RewardSpec

    with pytest.raises(
        ValueError, match="config key 'reward.digits.weight' must be a finite number"
    ):
        MultiReward([RewardSpec("digits", float("nan"))])
    with pytest.raises(ValueError, match="'reward.digits.key_weights.acc' must be a finite number"):
        MultiReward([RewardSpec("digits", 1.0, key_weights={"acc": float("inf")})])


# -- settings that cannot apply, and resumes refused or allowed (issue 40 item 8) -----------------
@pytest.mark.parametrize(
    "override, key",
    [
        ("awm.timestep_fraction=0.01", "'awm.timestep_fraction'"),  # int(14 x 0.01) = 0 levels
        ("awm.train_timesteps=100", "'awm.train_timesteps' must be <= 11"),  # 11 levels
    ],
)
def test_awm_levels_that_cannot_apply(override: str, key: str) -> None:
    assert key in _error("algorithm=awm", override, preset="sd3-ocr")
    load_config("sd3-ocr", ["algorithm=awm", "awm.train_timesteps=11"], check_paths=False)


def _base(root, name: str, weights: int):
    """A pipeline folder holding a transformer config and a weight file of ``weights`` bytes."""
    import json

    folder = root / name
    (folder / "transformer").mkdir(parents=True)
    (folder / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusion3Pipeline", "transformer": ["diffusers", "X"]})
    )
    config = {"num_layers": 24, "_diffusers_version": name}  # versions are not the model
    (folder / "transformer" / "config.json").write_text(json.dumps(config))
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"0" * weights)
    return folder


def test_resume_on_another_base_model_is_refused(tmp_path) -> None:
    from flowgrpo.config.record import check_resume, write_record

    base, copy, other = (_base(tmp_path, n, w) for n, w in (("a", 10), ("b", 10), ("c", 11)))
    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_1"
    ckpt.mkdir(parents=True)
    write_record(run, load_config("sd3-ocr", [f"model.path={base}"], check_paths=False))
    check_resume(
        load_config("sd3-ocr", [f"model.path={copy}"], check_paths=False), ckpt
    )  # a copy: same model
    with pytest.raises(ConfigError) as info:
        check_resume(load_config("sd3-ocr", [f"model.path={other}"], check_paths=False), ckpt)
    assert "'model.path'" in str(info.value) and "another base model" in str(info.value)
    assert "\n" not in str(info.value)
    allowed = ["trainer.allow_config_change=true", f"model.path={other}"]
    check_resume(load_config("sd3-ocr", allowed, check_paths=False), ckpt)


def test_resume_may_add_the_embedding_cache_or_vae_slicing(tmp_path) -> None:
    from flowgrpo.config.record import check_resume, write_record

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_1"
    ckpt.mkdir(parents=True)
    write_record(run, load_config("sd3-ocr", [], check_paths=False))
    check_resume(
        load_config("sd3-ocr", [f"model.embed_cache_dir={tmp_path}/cache"], check_paths=False), ckpt
    )
    check_resume(load_config("sd3-ocr", ["model.vae_slicing=true"], check_paths=False), ckpt)
    with pytest.raises(ConfigError, match="model.height"):  # what the run computes: refused
        check_resume(load_config("sd3-ocr", ["model.height=256"], check_paths=False), ckpt)
