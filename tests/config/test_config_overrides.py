"""Overrides parse to the right types; presets load; YAML round-trips; engine config."""

from __future__ import annotations

import pytest
import yaml
from PIL import Image

from flowgrpo import cli
from flowgrpo.config import (
    Config,
    RewardSpec,
    config_from_dict,
    config_to_yaml,
    list_presets,
    load_config,
)
from flowgrpo.config.validate import checked_rewards, file_options
from flowgrpo.rewards.base import needs_source_images


def test_override_types() -> None:
    cfg = load_config(
        None,
        [
            "trainer.max_steps=2",
            "optim.lr=1e-4",  # PyYAML reads 1e-4 as a string: still a float here
            "flow_grpo.kl_beta=0",  # int accepted for a float
            "run.wandb=true",
            "sample.window_hi=null",
            "model.path=none",
            "lora.enabled=true",  # the toy is a full fine-tune: target modules need LoRA
            "lora.target_modules=[to_q, to_k]",
            "optim.betas=[0.8, 0.95]",
            "sample.negative_prompt=7",  # a string field keeps the text
            "run.name=",
            "seed=123",
            "resume=auto",  # contract 7 alias of trainer.resume
        ],
        check_paths=False,
    )
    assert cfg.trainer.max_steps == 2 and isinstance(cfg.trainer.max_steps, int)
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)
    assert cfg.flow_grpo.kl_beta == 0.0 and isinstance(cfg.flow_grpo.kl_beta, float)
    assert cfg.run.wandb is True
    assert cfg.sample.window_hi is None and cfg.model.path is None
    assert cfg.lora.target_modules == ["to_q", "to_k"]
    assert cfg.optim.betas == (0.8, 0.95)
    assert cfg.sample.negative_prompt == "7"
    assert cfg.run.name == ""
    assert cfg.seed == 123
    assert cfg.trainer.resume == "auto"
    cfg = load_config(
        None, ["lora.enabled=true", "lora.target_modules=all-linear"], check_paths=False
    )
    assert cfg.lora.target_modules == "all-linear"


def test_reward_overrides() -> None:
    def rewards(*ov: str) -> list[tuple[str, float, dict]]:
        cfg = load_config(None, list(ov), check_paths=False)
        return [(r.name, r.weight, r.options) for r in cfg.reward]

    assert rewards("reward=ocr") == [("ocr", 1.0, {})]
    assert rewards("reward=ocr:1.0,jpeg_compressibility:0.1") == [
        ("ocr", 1.0, {}),
        ("jpeg_compressibility", 0.1, {}),
    ]
    assert rewards("reward=my.pkg:score:0.5,other.mod:fn") == [
        ("my.pkg:score", 0.5, {}),
        ("other.mod:fn", 1.0, {}),
    ]
    assert rewards(
        "reward={ocr: 2, jpeg_compressibility: {weight: 0.1, options: {quality: 90}}}"
    ) == [
        ("ocr", 2.0, {}),
        ("jpeg_compressibility", 0.1, {"quality": 90}),
    ]
    assert rewards(
        "reward=ocr,jpeg_compressibility",
        "reward.1.weight=0.2",
        "reward.ocr.options.min_confidence=0.5",
    ) == [  # fmt: skip
        ("ocr", 1.0, {"min_confidence": 0.5}),
        ("jpeg_compressibility", 0.2, {}),
    ]


def test_presets_load_with_anchor_values(tmp_path) -> None:
    assert set(list_presets()) >= {"toy-digits", "qwen-image-ocr", "sd3-ocr", "flux-pickscore"}
    prompts = tmp_path / "train.txt"
    prompts.write_text('a sign that says "hello"\n')
    Image.new("RGB", (8, 8)).save(tmp_path / "src.png")
    edits = tmp_path / "edits.jsonl"  # an editing preset's rewards need source images
    edits.write_text('{"prompt": "two clocks", "image": "src.png"}\n')

    def real(name: str) -> list[str]:
        rewards = checked_rewards(load_config(name, check_paths=False))
        data = edits if any(needs_source_images(r.name) for _, r in rewards) else prompts
        return [f"model.path={tmp_path}", f"data.train_prompts={data}"] + [
            f"{key}.{r.label}.options.{option}={tmp_path}"
            for key, r in rewards
            for option in file_options(r.name)
        ]

    cfgs = {
        name: load_config(name, real(name) if name != "toy-digits" else [])
        for name in list_presets()
    }
    toy = cfgs["toy-digits"]
    assert load_config().preset == "toy-digits"
    assert (toy.model.path, toy.model.height, toy.sample.group_size) == (
        "builtin:toy-digits",
        8,
        16,
    )
    assert (toy.sample.prompts_per_step, toy.sample.num_steps, toy.sample.noise_level) == (
        10,
        10,
        0.7,
    )
    assert (toy.lora.enabled, toy.optim.lr, toy.flow_grpo.kl_beta) == (False, 3e-4, 0.04)
    assert toy.update.num_minibatches == 1 and toy.sample.guidance_scale == 1.0
    assert [r.name for r in toy.reward] == ["digits"] and toy.run.output_dir == "runs/toy-digits"
    sd3 = cfgs["sd3-ocr"]
    assert (sd3.sample.group_size, sd3.sample.guidance_scale, sd3.flow_grpo.kl_beta) == (
        24,
        4.5,
        0.04,
    )
    assert (sd3.sample.eval_num_steps, sd3.ema.enabled, sd3.reward[0].name) == (40, True, "ocr")
    qwen = cfgs["qwen-image-ocr"]
    assert (qwen.sample.noise_level, qwen.sample.window_size, qwen.sample.window_hi) == (1.2, 2, 5)
    assert (qwen.lora.rank, qwen.lora.alpha, qwen.sample.eval_num_steps) == (64, 128, 50)
    flux = cfgs["flux-pickscore"]
    assert (flux.sample.num_steps, flux.sample.eval_num_steps, flux.sample.noise_level) == (
        6,
        28,
        0.9,
    )
    assert flux.reward[0].name == "pickscore" and flux.flow_grpo.kl_beta == 0.0
    edit = cfgs["qwen-image-edit-counting"]  # flow_grpo's counting_qwenimage_edit
    assert cli.main(["config", "show", "qwen-image-edit-counting"]) == 0
    assert [(r.name, r.label, r.weight) for r in edit.reward] == [
        ("image_similarity", "image_similarity", 0.2),
        ("remote", "geneval", 0.8),
    ]
    assert (edit.sample.noise_level, edit.sample.window_size, edit.sample.group_size) == (
        1.0,
        0,
        16,
    )
    assert (edit.sample.guidance_scale, edit.sample.negative_prompt, edit.ema.enabled) == (
        4.0,
        " ",
        False,
    )
    for cfg in cfgs.values():
        assert cfg.sample.eval_guidance_scale == cfg.sample.guidance_scale  # resolved from null


def test_yaml_round_trip_and_yaml_file_preset(tmp_path) -> None:
    cfg = load_config("qwen-image-ocr", ["reward=ocr,jpeg_compressibility:0.1"], check_paths=False)
    text = config_to_yaml(cfg)
    assert config_from_dict(yaml.safe_load(text)) == cfg
    path = tmp_path / "mine.yaml"
    path.write_text("base: toy-digits\ntrainer: {max_steps: 3}\nreward: ocr:0.5\n")
    mine = load_config(str(path), ["seed=4"], check_paths=False)
    assert (mine.trainer.max_steps, mine.trainer.eval_every, mine.seed) == (3, 10, 4)
    assert mine.reward == [RewardSpec(name="ocr", weight=0.5)]
    assert mine.model.path == "builtin:toy-digits" and mine.preset == "mine"
    (tmp_path / "bad.yaml").write_text("sample: {group_sise: 4}\n")
    try:
        load_config(str(tmp_path / "bad.yaml"), check_paths=False)
    except ValueError as e:
        assert "unknown config key 'sample.group_sise' in " in str(e)
        assert "did you mean 'sample.group_size'" in str(e)
    else:  # pragma: no cover
        raise AssertionError("expected a ConfigError")


def test_the_engine_reads_the_run_config_itself() -> None:
    """No copy: the derived values are resolved once, in the sections the engine reads."""
    cfg = load_config(
        "sd3-ocr",
        ["optim.lr_schedule=cosine", "trainer.max_steps=50", "model.dtype=fp16", "seed=9"],
        check_paths=False,
    )
    assert (cfg.update.micro_batch_size, cfg.update.num_minibatches, cfg.seed) == (8, 2, 9)
    assert cfg.optim.total_steps == 100 and cfg.fsdp.param_dtype == "fp16"
    assert cfg.lora.rank == 32 and cfg.flow_grpo.kl_beta == 0.04 and cfg.ema.enabled
    explicit = load_config(None, ["optim.lr_schedule=cosine", "optim.total_steps=7"])
    assert explicit.optim.total_steps == 7 and explicit.fsdp.param_dtype == "fp32"
    assert Config().run.output_dir == "runs/{preset}"
    assert load_config(None, ["run.output_dir=out/{preset}"], check_paths=False).run.output_dir == (
        "out/toy-digits"
    )


def test_base_resolves_against_the_yaml_files_folder(tmp_path, monkeypatch) -> None:
    """``base: common.yaml`` means the file beside the YAML, wherever flowgrpo runs from."""
    conf = tmp_path / "configs"
    (conf / "shared").mkdir(parents=True)
    (conf / "shared" / "root.yaml").write_text("base: toy-digits\nseed: 11\n")
    (conf / "common.yaml").write_text("base: shared/root.yaml\ntrainer: {max_steps: 7}\n")
    (conf / "exp.yaml").write_text("base: common.yaml\ntrainer: {eval_every: 3}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "common.yaml").write_text("trainer: {max_steps: 99}\n")  # must not be used
    monkeypatch.chdir(elsewhere)
    cfg = load_config(str(conf / "exp.yaml"), check_paths=False)
    assert (cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.seed) == (7, 3, 11)
    assert cfg.model.path == "builtin:toy-digits" and cfg.preset == "exp"
    monkeypatch.chdir(conf)  # a relative top-level path still resolves against the cwd
    assert load_config("exp.yaml", check_paths=False).trainer.max_steps == 7

    (conf / "loop.yaml").write_text("base: ./loop.yaml\n")
    with pytest.raises(ValueError, match="inherits from itself"):
        load_config(str(conf / "loop.yaml"), check_paths=False)
    (conf / "orphan.yaml").write_text("base: gone.yaml\n")
    with pytest.raises(ValueError) as info:
        load_config(str(conf / "orphan.yaml"), check_paths=False)
    assert str(info.value) == (
        f"config file not found: {conf / 'gone.yaml'} (the 'base' of {conf / 'orphan.yaml'})"
    )
