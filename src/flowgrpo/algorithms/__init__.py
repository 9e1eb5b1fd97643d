"""RL algorithms on one engine: ``algorithm=<name>`` picks one, its settings are the config
section of the same name (its ``settings_class``). Adding an algorithm = one module + one line
here; nothing else in the package names an algorithm (tests/package/test_algorithm_names.py)."""

from __future__ import annotations

import importlib
from typing import Any

#: name -> "module:Class" (imported when used)
ALGORITHMS: dict[str, str] = {
    "flow_grpo": "flowgrpo.algorithms.flow_grpo:FlowGRPO",
    "mix_grpo": "flowgrpo.algorithms.mix_grpo:MixGRPO",
    "grpo_guard": "flowgrpo.algorithms.grpo_guard:GRPOGuard",
    "nft": "flowgrpo.algorithms.nft:DiffusionNFT",
    "awm": "flowgrpo.algorithms.awm:AWM",
    "flow_dppo": "flowgrpo.algorithms.flow_dppo:FlowDPPO",
    "dpo": "flowgrpo.algorithms.dpo:DPO",
}
#: what ``algorithm`` is unless a preset or an override says otherwise
DEFAULT_ALGORITHM = "flow_grpo"


def algorithm_class(name: str) -> Any:
    """The class registered as ``name`` (ValueError listing the names otherwise)."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; one of {', '.join(ALGORITHMS)}")
    module, _, attr = ALGORITHMS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def algorithm_settings() -> dict[str, type]:
    """name -> the dataclass of its settings (the config section ``name``), in registry order."""
    return {name: algorithm_class(name).settings_class for name in ALGORITHMS}


__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "algorithm_class", "algorithm_settings"]
