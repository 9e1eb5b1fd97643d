"""Every config key is declared with its help and documented in docs/training.md, and the help
reaches ``flowgrpo config show``: adding a setting touches its dataclass (and the code that
uses it), the docs table being regenerated from it (``make docs``)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import yaml

from flowgrpo.config import load_config
from flowgrpo.config.docs import commented_yaml, key_help, markdown_table
from flowgrpo.config.loader import REWARD_LISTS, valid_keys
from flowgrpo.config.schema import Config

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def _fields(cls: type, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _fields(hints[f.name], prefix + f.name + ".")
        else:
            yield prefix + f.name, f


def test_every_field_has_help_and_is_documented() -> None:
    fields = dict(_fields(Config))
    assert len(fields) > 80
    for key, f in fields.items():
        assert f.metadata.get("help"), f"{key} has no help text"
    leaves = {k for k in valid_keys() if not any(v.startswith(k + ".") for v in valid_keys())}
    assert set(key_help()) == leaves | set(REWARD_LISTS)
    assert {"reward", "eval_reward", "eval.gold_reward"} <= set(REWARD_LISTS)
    doc = DOC.read_text()
    assert markdown_table() in doc, "regenerate: make docs (python -m flowgrpo.config.docs --write)"
    for key in key_help():
        assert f"| `{key}` |" in doc, key
    assert "| `trainer.max_steps` | `1000` |" in doc and "| `reward` | `digits:1.0` |" in doc


def test_config_show_carries_the_help_and_still_parses() -> None:
    cfg = load_config(None, [], check_paths=False)
    text = commented_yaml(cfg)
    assert "  # AdamW learning rate.\n  lr: 0.0003" in text
    assert "# Training steps (one rollout + update each).\n  max_steps: 40" in text
    assert yaml.safe_load(text) == yaml.safe_load(text.replace("#", "#"))
    from flowgrpo.config import config_from_dict

    assert config_from_dict(yaml.safe_load(text)) == cfg
