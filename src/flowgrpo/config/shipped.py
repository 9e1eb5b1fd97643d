"""The shipped presets (``flowgrpo/config/presets/*.yaml``) and what each is made for, as its
own file says under ``made_for``:

    made_for:
      pipelines: [WanPipeline]            # model_index.json's _class_name it fits
      models:                             # the planner's config sets (model.path=known:NAME)
        - wan2.1-t2v-1.3b
        - wan2.2-t2v-a14b: [wan.guidance_scale_2=3.0]   # with the settings that model needs

``made_for`` describes the file; it is not a training setting: the loader takes it out of
every YAML file (``without_made_for``), a user's own included. ``validate`` refuses a shipped
preset on a pipeline it is not made for (``preset_pipelines``); docs/memory.md's tables and
``flowgrpo memory PRESET`` plan each preset on its models (``preset_models``).
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Mapping
from typing import Any

import yaml

from flowgrpo.settings import ConfigError

MADE_FOR = "made_for"


def preset_dir() -> Any:
    """The folder of the shipped presets (an importlib.resources Traversable)."""
    return importlib.resources.files("flowgrpo.config") / "presets"


def list_presets() -> list[str]:
    """Names of the shipped presets."""
    return sorted(p.name[:-5] for p in preset_dir().iterdir() if p.name.endswith(".yaml"))


def without_made_for(data: dict, origin: str) -> dict:
    """``data`` (a YAML file's mapping) without its ``made_for`` (what the file is made for,
    not a setting); ConfigError naming ``origin`` when that is not a mapping."""
    found = data.pop(MADE_FOR, None)
    if found is not None and not isinstance(found, Mapping):
        raise ConfigError(
            f"config key {MADE_FOR!r} in {origin} must be a mapping (pipelines: [...], "
            f"models: [...]), got {type(found).__name__}"
        )
    return data


@functools.cache
def _made_for() -> dict[str, dict[str, Any]]:
    """{preset: its ``made_for`` mapping}, read from the shipped files once."""
    out: dict[str, dict[str, Any]] = {}
    for name in list_presets():
        data = yaml.safe_load((preset_dir() / f"{name}.yaml").read_text()) or {}
        found = data.get(MADE_FOR)
        if not isinstance(found, Mapping) or not found.get("pipelines"):
            raise ConfigError(
                f"shipped preset {name!r} must say what it is made for: "
                f"{MADE_FOR}: {{pipelines: [...], models: [...]}}"
            )
        out[name] = dict(found)
    return out


def preset_pipelines() -> dict[str, tuple[str, ...]]:
    """{shipped preset: the pipeline classes it is made for}, in preset name order."""
    return {name: tuple(m["pipelines"]) for name, m in _made_for().items()}


def preset_models() -> list[tuple[str, str, list[str]]]:
    """(preset, config set, the settings that model needs) for each model a shipped preset is
    written for: the rows of docs/memory.md's tables, in preset name order."""
    rows = []
    for name, m in _made_for().items():
        for entry in m.get("models") or []:
            if isinstance(entry, Mapping):  # {config set: [key=value, ...]}
                (model, extra), *_ = entry.items()
                rows.append((name, str(model), [str(x) for x in extra or []]))
            else:
                rows.append((name, str(entry), []))
    return rows


__all__ = [
    "MADE_FOR",
    "list_presets",
    "preset_dir",
    "preset_models",
    "preset_pipelines",
    "without_made_for",
]
