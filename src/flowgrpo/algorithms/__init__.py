"""RL algorithms on one engine: ``algorithm=<name>`` picks one, its settings are the config
section of the same name. Adding an algorithm = one module + one line here."""

from __future__ import annotations

import importlib
from typing import Any

#: name -> "module:Class" (imported when used)
ALGORITHMS: dict[str, str] = {
    "flow_grpo": "flowgrpo.algorithms.flow_grpo:FlowGRPO",
    "mix_grpo": "flowgrpo.algorithms.mix_grpo:MixGRPO",
    "grpo_guard": "flowgrpo.algorithms.grpo_guard:GRPOGuard",
    "nft": "flowgrpo.algorithms.nft:DiffusionNFT",
}


def algorithm_class(name: str) -> Any:
    """The class registered as ``name`` (ValueError listing the names otherwise)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; one of {', '.join(ALGORITHMS)}")
    module, _, attr = ALGORITHMS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["ALGORITHMS", "algorithm_class"]
