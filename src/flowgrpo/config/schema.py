"""Typed run configuration: one dataclass per section, YAML presets, ``key=value`` overrides.

``load_config("sd3-ocr", ["model.path=/models/sd35", "trainer.max_steps=100"])`` starts from the
dataclass defaults, applies the preset (``config/presets/<name>.yaml`` or a YAML file path),
then the overrides, and validates. Every problem is a ``ConfigError`` (a ValueError) with one
line naming the key. The engine's sections (lora, optim, loss, fsdp, ema) are its own
dataclasses; ``engine_config(cfg)`` assembles its ``EngineConfig``. Parsing lives in
``loader.py``, range checks in ``validate.py``; this module holds the types.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowgrpo.engine.config import (
    EMAConfig,
    EngineConfig,
    FSDPConfig,
    LoraConfig,
    LossConfig,
    OptimConfig,
)

DEFAULT_PRESET = "toy-digits"
MODEL_KINDS = ("auto", "toy", "qwen_image", "sd3", "flux")
DTYPES = ("auto", "fp32", "bf16", "fp16")
SDE_TYPES = ("sde", "cps")
CFG_GRAD_MODES = ("both", "cond_only")
REWARD_MODES = ("weighted_sum", "advantage")
WANDB_MODES = ("offline", "online", "disabled")
LR_SCHEDULES = ("constant", "cosine")


class ConfigError(ValueError):
    """A bad configuration: one line naming the key, what is allowed and what was given."""


@dataclass
class ModelConfig:
    """Which pipeline to load. ``path`` is a local diffusers directory (required except for
    the toy, where it is unused); ``kind`` "auto" detects the family from the pipeline class.
    ``max_sequence_length``: text tokens per prompt (null = the pipeline's default)."""

    path: str | None = None
    kind: str = "auto"
    dtype: str = "auto"
    height: int = 512
    width: int = 512
    true_cfg_scale: float = 1.0
    max_sequence_length: int | None = None
    pretrained: bool = True


@dataclass
class SampleConfig:
    """Rollout (SDE, training) and eval (ODE) sampling, and the group structure: each step draws
    ``prompts_per_step`` prompts (m, global) and samples each ``group_size`` times (K)."""

    num_steps: int = 10
    eval_num_steps: int = 40
    guidance_scale: float = 4.5
    eval_guidance_scale: float | None = None
    noise_level: float = 0.7
    sde_type: str = "sde"
    window_size: int = 0
    window_lo: int = 0
    window_hi: int | None = None
    timestep_fraction: float = 1.0
    deterministic_last_step: bool = True
    prompts_per_step: int = 8
    group_size: int = 16
    rollout_batch_size: int = 8
    negative_prompt: str = ""
    use_ema_for_rollout: bool = False


@dataclass
class DataConfig:
    """Prompt files (.txt / .jsonl / .parquet) and the eval split."""

    train_prompts: str | None = None
    eval_prompts: str | None = None
    eval_fraction: float = 0.0
    eval_num_prompts: int = 0
    eval_samples_per_prompt: int = 1
    shuffle: bool = True


@dataclass
class RewardConfig:
    """One reward: registry name or ``package.module:function``, its weight and options.
    ``key_weights`` weights the entries of a dict-returning reward; ``alias`` names it in logs."""

    name: str = "digits"
    weight: float = 1.0
    options: dict[str, Any] = field(default_factory=dict)
    key_weights: dict[str, float] | None = None
    alias: str | None = None


@dataclass
class AdvantageConfig:
    """How rewards become advantages: ``mode`` "weighted_sum" (sum rewards, then normalise per
    group) or "advantage" (normalise each reward, then sum); std over the whole global batch
    (``global_std``) or per group; ``async_reward`` scores rewards in a background thread."""

    mode: str = "weighted_sum"
    global_std: bool = True
    async_reward: bool = False


@dataclass
class TrainConfig:
    """Policy update per rollout: ``num_minibatches`` optimizer steps, each accumulating
    micro-batches of ``micro_batch_size`` samples over all trained timesteps.
    ``skip_zero_advantage`` drops samples whose advantage is exactly 0 first (flow_grpo does);
    ``cfg_grad`` "both" differentiates both guidance branches (exact), "cond_only" only the
    conditional one (cheaper, biased: the original Flow-GRPO paper's form; opt-in)."""

    micro_batch_size: int = 4
    num_minibatches: int = 2
    max_consecutive_skips: int = 3
    skip_zero_advantage: bool = True
    cfg_grad: str = "both"


@dataclass
class TrainerConfig:
    """Loop length, eval/checkpoint cadence and resume ("auto" = newest complete checkpoint
    under ``run.output_dir``; a path = that checkpoint; null = fresh run)."""

    max_steps: int = 1000
    eval_every: int = 50
    save_every: int = 50
    keep_last: int = 2
    resume: str | None = None
    log_every: int = 1


@dataclass
class RunConfig:
    """Where and how to log. ``{preset}`` in ``output_dir`` becomes the preset's name.
    ``overwrite`` lets a fresh run reuse a folder that holds another run (deleting that
    run's outputs); ``debug`` prints tracebacks with errors."""

    output_dir: str = "runs/{preset}"
    name: str | None = None
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "flowgrpo"
    wandb_mode: str = "offline"
    progress_bar: bool = True
    num_threads: int = 0
    overwrite: bool = False
    debug: bool = False


def _default_rewards() -> list[RewardConfig]:
    return [RewardConfig()]


@dataclass
class Config:
    """The whole run. ``preset`` records where it came from (informational)."""

    seed: int = 0
    preset: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: list[RewardConfig] = field(default_factory=_default_rewards)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)


def engine_config(cfg: Config) -> EngineConfig:
    """The engine's settings from a Config (copies; the Config is not modified).

    ``fsdp.param_dtype`` "auto" follows ``model.dtype`` when that is explicit; a cosine
    schedule with ``optim.total_steps`` 0 runs over ``trainer.max_steps * train.num_minibatches``
    optimizer steps.
    """
    from dataclasses import replace

    fsdp = replace(cfg.fsdp)
    if fsdp.param_dtype == "auto" and cfg.model.dtype != "auto":
        fsdp.param_dtype = cfg.model.dtype
    optim = replace(cfg.optim, betas=tuple(cfg.optim.betas))
    if optim.lr_schedule == "cosine" and optim.total_steps == 0:
        optim.total_steps = cfg.trainer.max_steps * cfg.train.num_minibatches
    lora = replace(cfg.lora)
    if isinstance(lora.target_modules, list):
        lora.target_modules = list(lora.target_modules)
    return EngineConfig(
        lora=lora,
        optim=optim,
        loss=replace(cfg.loss),
        fsdp=fsdp,
        ema=replace(cfg.ema),
        micro_batch_size=cfg.train.micro_batch_size,
        num_minibatches=cfg.train.num_minibatches,
        max_consecutive_skips=cfg.train.max_consecutive_skips,
        skip_zero_advantage=cfg.train.skip_zero_advantage,
        cfg_grad=cfg.train.cfg_grad,
        seed=cfg.seed,
    )


# The parsing half (load_config & co.) is re-exported here: ``loader`` imports this module's
# types first, so the import at the bottom is not circular.
from flowgrpo.config.loader import (  # noqa: E402
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    list_presets,
    load_config,
    preset_dict,
)
from flowgrpo.config.validate import validate  # noqa: E402

__all__ = [
    "AdvantageConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EMAConfig",
    "FSDPConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardConfig",
    "RunConfig",
    "SampleConfig",
    "TrainConfig",
    "TrainerConfig",
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "engine_config",
    "list_presets",
    "load_config",
    "preset_dict",
    "validate",
]
