"""FSDP2 training engine for diffusers transformers: LoRA or full, DCP checkpoints, exports."""

from flowgrpo.engine.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from flowgrpo.engine.config import (
    EMAConfig,
    EngineConfig,
    FSDPConfig,
    LoraConfig,
    LossConfig,
    OptimConfig,
)
from flowgrpo.engine.dist import DistInfo, build_mesh, cleanup, init_distributed, seed_everything
from flowgrpo.engine.ema import EMA
from flowgrpo.engine.fsdp import DiffusersFSDPEngine, merge_lora

__all__ = [
    "EMA",
    "DiffusersFSDPEngine",
    "DistInfo",
    "EMAConfig",
    "EngineConfig",
    "FSDPConfig",
    "LoraConfig",
    "LossConfig",
    "OptimConfig",
    "build_mesh",
    "cleanup",
    "init_distributed",
    "latest_checkpoint",
    "load_checkpoint",
    "merge_lora",
    "save_checkpoint",
    "seed_everything",
]
