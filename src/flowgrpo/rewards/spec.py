"""One reward entry of a run (``RewardSpec``), its naming rule and its one parser.

The run config's ``reward`` (and ``eval_reward``) list holds these; ``MultiReward`` builds
from them. ``label`` is the one naming rule (logs, outputs, ``reward.LABEL.x=...``
overrides); ``parse_reward_specs`` is the one parser of every written form.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from flowgrpo.settings import ConfigError, setting, short_repr


@dataclass
class RewardSpec:
    """One reward: registry name or ``package.module:function``, its weight and options.

    ``key_weights`` only matters for a reward returning a dict: it weights its entries
    individually (entries not listed get weight 0, i.e. are only logged). Without it every
    entry gets ``weight``.
    """

    name: str = setting(
        "digits",
        "Registry name (`ocr`, `jpeg_compressibility`, `digits`, `pickscore`, ...) or "
        "`package.module:function`.",
    )
    weight: float = setting(1.0, "Weight in the combined reward / advantage.")
    options: dict[str, Any] = setting(
        help="Keyword options of the reward (e.g. `path` for pickscore).", default_factory=dict
    )
    key_weights: dict[str, float] | None = setting(
        None,
        "Weights of the entries of a dict-returning reward (unlisted entries are only logged).",
    )
    alias: str | None = setting(None, "Name in logs (to use one reward twice).")
    frames: str | int = setting(
        "all",
        "Videos: an image reward scores every frame (`all`) or this many evenly spaced ones "
        "(first and last included), averaged per video; a video reward gets the whole video.",
    )

    @property
    def label(self) -> str:
        """Name in outputs and logs: the alias, else the registry name, else the import path's
        attribute (``pkg.mod:score`` -> ``score``)."""
        return self.alias or self.name.rpartition(":")[2].rpartition(".")[2] or self.name

    def check(self) -> None:
        """Name given, weights finite (a ConfigError naming ``reward.LABEL...`` otherwise)."""
        if not isinstance(self.name, str) or not self.name.strip():
            raise ConfigError(
                f"config key 'reward.name' must be a registry name or module:function, "
                f"got {self.name!r}"
            )
        if not math.isfinite(self.weight):
            raise ConfigError(
                f"config key 'reward.{self.label}.weight' must be a finite number, "
                f"got {self.weight!r}"
            )
        try:
            self.frames = check_frames(self.frames, f"config key 'reward.{self.label}.frames'")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        for k, w in (self.key_weights or {}).items():
            if not math.isfinite(w):
                raise ConfigError(
                    f"config key 'reward.{self.label}.key_weights.{k}' must be a finite "
                    f"number, got {w!r}"
                )


def check_frames(frames: Any, key: str = "frames") -> str | int:
    """``"all"`` or a whole number >= 1; ValueError naming ``key`` otherwise."""
    if frames == "all":
        return "all"
    if isinstance(frames, bool) or not isinstance(frames, (int, str)):
        raise ValueError(f"{key} must be 'all' or a whole number >= 1, got {frames!r}")
    try:
        n = int(frames)
    except ValueError:
        raise ValueError(f"{key} must be 'all' or a whole number >= 1, got {frames!r}") from None
    if n < 1:
        raise ValueError(f"{key} must be 'all' or a whole number >= 1, got {frames!r}")
    return n


def check_labels(specs: list[RewardSpec], key: str = "reward") -> None:
    """Two entries may not share a label (``a.m:score`` and ``b.m:score`` both log as
    "score"): a ConfigError at config time, not a crash when the rewards are built."""
    labels = [s.label for s in specs]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ConfigError(
            f"config key {key!r} must be a list of distinct rewards, got {dup} more than once "
            f"(give one an alias: {key}.{dup[0]}.alias=...)"
        )


def _from_text(text: str, key: str) -> RewardSpec:
    """'ocr', 'ocr:0.5', 'pkg.mod:fn', 'pkg.mod:fn:0.5'. A tail that parses as a non-finite
    float ('digits:nan', 'mymod:inf') is an error, not a weight nor a name."""
    name, sep, tail = text.rpartition(":")
    if sep and name:
        try:
            weight = float(tail)
        except ValueError:
            return RewardSpec(name=text.strip())
        if not math.isfinite(weight):
            tail = tail.strip()
            hint = (
                f" (for a function named {tail!r} give a weight: {text.strip()}:1.0)"
                if tail.isidentifier()
                else ""
            )
            raise ConfigError(
                f"config key {key!r}: weight of reward {name.strip()!r} must be a finite number, "
                f"got {tail!r}{hint}"
            )
        return RewardSpec(name=name.strip(), weight=weight)
    return RewardSpec(name=text.strip())


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"config key {key!r} expects float, got {short_repr(value)}")
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"config key {key!r} expects float, got {short_repr(value)}") from None


def _from_mapping(item: Mapping, key: str) -> RewardSpec:
    known = [f.name for f in fields(RewardSpec)]
    unknown = sorted(set(map(str, item)) - set(known))
    if unknown:
        raise ConfigError(
            f"unknown config key '{key}.{unknown[0]}' (a reward has {', '.join(known)})"
        )
    if "name" not in item:
        raise ConfigError(f"config key {key!r} needs a 'name', got {short_repr(dict(item))}")
    spec = RewardSpec(name=str(item["name"]))
    if "weight" in item:
        spec.weight = _number(item["weight"], f"{key}.weight")
    for name in ("options", "key_weights"):
        value = item.get(name)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"config key '{key}.{name}' expects a mapping, got {short_repr(value)}"
            )
        if name == "options":
            spec.options = {str(k): v for k, v in value.items()}
        else:
            spec.key_weights = {str(k): _number(v, f"{key}.{name}.{k}") for k, v in value.items()}
    if item.get("alias") is not None:
        spec.alias = str(item["alias"])
    if item.get("frames") is not None:
        spec.frames = item["frames"]
    return spec


def parse_reward_specs(value: Any, key: str = "reward") -> list[RewardSpec]:
    """Every written form of a reward list -> [RewardSpec]: ``"ocr"``,
    ``"ocr:1.0,jpeg_compressibility:0.1"``, ``{"ocr": 1.0, ...}``, a mapping with ``name``,
    a RewardSpec, or a list of names / mappings / RewardSpecs. ConfigError naming ``key``."""
    if isinstance(value, str):
        items: list[Any] = [s for s in (p.strip() for p in value.split(",")) if s]
    elif isinstance(value, Mapping) and "name" not in value:
        items = [
            {"name": k, **v} if isinstance(v, Mapping) else {"name": k, "weight": v}
            for k, v in value.items()
        ]
    elif isinstance(value, (Mapping, RewardSpec)):
        items = [value]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(
            f"config key {key!r} expects reward names like 'ocr' or 'ocr:1.0,"
            f"jpeg_compressibility:0.1' or a list of {{name, weight, options}}, got {short_repr(value)}"
        )
    out = []
    for i, item in enumerate(items):
        here = f"{key}[{i}]"
        if isinstance(item, RewardSpec):
            out.append(
                RewardSpec(
                    item.name,
                    item.weight,
                    dict(item.options),
                    None if item.key_weights is None else dict(item.key_weights),
                    item.alias,
                    item.frames,
                )
            )
        elif isinstance(item, str):
            out.append(_from_text(item, here))
        elif (
            isinstance(item, Mapping)
            and "name" not in item
            and len(item) == 1
            and str(next(iter(item))) not in {f.name for f in fields(RewardSpec)}
        ):
            ((name, weight),) = item.items()
            out.append(RewardSpec(name=str(name), weight=_number(weight, here)))
        elif isinstance(item, Mapping):
            out.append(_from_mapping(item, here))
        else:
            raise ConfigError(f"config key {here!r} expects a reward name or mapping, got {item!r}")
    return out


__all__ = ["RewardSpec", "check_frames", "check_labels", "parse_reward_specs"]
