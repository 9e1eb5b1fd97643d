"""The built-in toy digits task: a model (pipeline + adapter) and its rewards like any other,
plus its data, pretraining and evaluation.

It sits above everything it uses (models, rollout, rewards); nothing below imports it: the
registries name ``ToyDigitsPipeline``'s adapter, the ``digits`` rewards and the built-in
``builtin:toy-digits`` / ``builtin:digits`` by import path. Names are imported lazily so that
``python -m flowgrpo.toy.pretrain`` runs cleanly.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_digits_data": "flowgrpo.toy.data",
    "digit_prompt_set": "flowgrpo.toy.data",
    "ToyAdapter": "flowgrpo.toy.pipeline",
    "digits_reward": "flowgrpo.toy.reward",
    "digits_eval": "flowgrpo.toy.reward",
    "digit_prompts": "flowgrpo.toy.eval",
    "eval_generators": "flowgrpo.toy.eval",
    "evaluate_toy": "flowgrpo.toy.eval",
    "add_toy_parser": "flowgrpo.toy.pretrain",
    "main": "flowgrpo.toy.pretrain",
    "pretrain_toy": "flowgrpo.toy.pretrain",
    "train_digits_classifier": "flowgrpo.toy.pretrain",
    "ToyDigitsPipeline": "flowgrpo.toy.pipeline",
    "parse_digit": "flowgrpo.toy.pipeline",
    "shipped_dir": "flowgrpo.toy.pipeline",
    "toy_pipeline": "flowgrpo.toy.pipeline",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flowgrpo.toy' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = sorted(_EXPORTS)
