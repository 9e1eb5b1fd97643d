"""FSDP2 training engine for diffusers transformers: LoRA or full, DCP checkpoints, exports.

By job: ``parallelize`` (LoRA, sharding, SP, the block list), ``load`` (each rank's shards from
the files), ``engine`` (``DiffusersFSDPEngine``: the train-step machinery and its
``state_dict``), ``checkpoint`` (persisting that state), ``export`` (LoRA / full exports).

Names are imported lazily so that reading a config (``flowgrpo.engine.config``) does not pay
for importing torch.distributed, peft and diffusers.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "UnsafeCheckpointError": "checkpoint",
    "EMAConfig": "config",
    "EngineConfig": "config",
    "FSDPConfig": "config",
    "LoraConfig": "config",
    "OptimConfig": "config",
    "DistInfo": "dist",
    "build_mesh": "dist",
    "cleanup": "dist",
    "init_distributed": "dist",
    "seed_everything": "dist",
    "EMA": "ema",
    "DiffusersFSDPEngine": "engine",
    "merge_lora": "export",
    "ParallelMesh": "sp",
    "build_parallel_mesh": "sp",
    "enable_sequence_parallel": "sp",
    "set_sp_gradient_scale": "sp",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flowgrpo.engine' has no attribute {name!r}")
    return getattr(import_module(f"flowgrpo.engine.{_EXPORTS[name]}"), name)
