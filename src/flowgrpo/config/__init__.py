"""Run configuration: one dataclass per section (``schema``), presets and ``key=value``
overrides (``loader``), the checks that need the disk (``validate``)."""

from flowgrpo.algorithms.base import UpdateConfig
from flowgrpo.config.loader import (
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    list_presets,
    load_config,
    preset_dict,
)
from flowgrpo.config.schema import (
    DEFAULT_PRESET,
    AdvantageConfig,
    Config,
    DataConfig,
    ModelConfig,
    RunConfig,
    SampleConfig,
    TrainerConfig,
)
from flowgrpo.config.validate import validate
from flowgrpo.engine.config import EMAConfig, FSDPConfig, LoraConfig, OptimConfig
from flowgrpo.rewards.spec import RewardSpec
from flowgrpo.settings import ConfigError

__all__ = [
    "DEFAULT_PRESET",
    "AdvantageConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EMAConfig",
    "FSDPConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimConfig",
    "RewardSpec",
    "RunConfig",
    "SampleConfig",
    "TrainerConfig",
    "UpdateConfig",
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "list_presets",
    "load_config",
    "preset_dict",
    "validate",
]
