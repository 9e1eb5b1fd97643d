"""How a setting is declared: once, in its section's dataclass, with its help and its check.

    @dataclass
    class OptimConfig:
        lr: float = setting(3e-4, "AdamW learning rate.", check=gt(0))

``setting`` stores the help text and the range check in the field's metadata; ``check_section``
walks a section (and the sections inside it), applies every field's check, rejects non-finite
floats, then calls the section's own ``check()`` for rules that tie several fields together.
The docs table and ``flowgrpo config show`` read the same help text. This module imports
nothing of flowgrpo, so every layer (engine, config) can declare its sections with it, nor
torch at import (``resolve_dtype`` imports it when called); it also holds the few names of the
config that several layers read (``BUILTIN``, ``DEFAULT_PRESET``, ``DTYPES``, ``resolve_dtype``,
``short_repr`` for the values quoted in errors).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

#: the prefix of a config value naming something shipped in the package
#: (``model.path=builtin:toy-digits``, ``data.train_prompts=builtin:digits``)
BUILTIN = "builtin:"
#: the preset a command uses when none is named
DEFAULT_PRESET = "toy-digits"


class ConfigError(ValueError):
    """A bad configuration: one line naming the key, what is allowed and what was given."""


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: the given value quoted in an error line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


Check = tuple[str, Callable[[Any], bool]]  # (what is allowed, as words; the test)


def setting(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    check: Check | None = None,
    default_factory: Any = dataclasses.MISSING,
) -> Any:
    """A dataclass field with its one-line ``help`` and an optional ``check``."""
    if not help:
        raise ValueError("every setting needs its help text")
    meta = {"help": help, "check": check}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def ge(bound: float, note: str = "") -> Check:
    return (f">= {bound}{note}", lambda v: v >= bound)


def gt(bound: float, note: str = "") -> Check:
    return (f"> {bound}{note}", lambda v: v > bound)


def between(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Check:
    text = f"in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"

    def ok(v: float) -> bool:
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)

    return (text, ok)


def one_of(*choices: Any) -> Check:
    def ok(v: Any) -> bool:
        return v in choices

    ok.choices = choices  # type: ignore[attr-defined]  # a failed check suggests the nearest
    return ("one of " + ", ".join(repr(c) for c in choices), ok)


def did_you_mean(name: str, choices: Iterable[Any]) -> str:
    """`` (did you mean 'x'?)`` for the choices that contain ``name`` or that it contains (at
    least 3 letters: ``jpeg`` -> ``jpeg_compressibility``, ``dppo`` -> ``flow_dppo``), else
    the closest by spelling; "" when none is near."""
    names = [str(c) for c in choices]
    low = str(name).lower()
    hits = [c for c in names if len(low) >= 3 and (low in c.lower() or c.lower() in low)]
    hits = hits or difflib.get_close_matches(str(name), names, n=1, cutoff=0.6)
    if not hits:
        return ""
    return f" (did you mean {' or '.join(repr(h) for h in hits[:3])}?)"


def optional(check: Check, what: str = "null") -> Check:
    """``check`` for a value that may also be None."""
    text, ok = check
    return (f"{text} or {what}", lambda v: v is None or ok(v))


def need(ok: bool, key: str, allowed: str, value: Any) -> None:
    """Raise ``ConfigError("config key 'KEY' must be ALLOWED, got VALUE")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"config key {key!r} must be {allowed}, got {value!r}")


def check_section(obj: Any, prefix: str = "") -> None:
    """Apply every field's check (and the finite-float rule) to dataclass ``obj``, recursing
    into nested sections and lists of them, then ``obj.check()`` if it defines one. Keys in
    messages are ``prefix + field``. Raises the first ConfigError."""
    for f in dataclasses.fields(obj):
        key, value = f"{prefix}{f.name}", getattr(obj, f.name)
        _check_value(key, value)
        check = f.metadata.get("check")
        if check is not None:
            allowed, ok = check
            try:
                passed = bool(ok(value))
            except TypeError:
                passed = False
            choices = getattr(ok, "choices", None)
            if not passed and choices is not None and isinstance(value, str):
                hint = did_you_mean(value, choices)
                raise ConfigError(f"config key {key!r} must be {allowed}, got {value!r}{hint}")
            need(passed, key, allowed, value)
    own = getattr(obj, "check", None)
    if callable(own):
        own()


def _check_value(key: str, value: Any) -> None:
    if dataclasses.is_dataclass(value):
        check_section(value, key + ".")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            label = getattr(v, "label", None)  # list entries with a name (rewards): key.NAME
            _check_value(f"{key}.{label}" if isinstance(label, str) else f"{key}[{i}]", v)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key {key!r} must be a finite number, got {value!r}")


DTYPES = ("auto", "fp32", "bf16", "fp16")  # what a dtype setting may say


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The torch dtype a dtype setting (one of ``DTYPES``) names on ``device`` (a torch.device
    or its type, "cuda"/"cpu"): "auto" = bf16 on CUDA, fp32 elsewhere. The one place that
    rule lives (model.dtype, fsdp.param_dtype/reduce_dtype, the memory planner)."""
    import torch

    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


__all__ = [
    "BUILTIN",
    "DEFAULT_PRESET",
    "DTYPES",
    "Check",
    "ConfigError",
    "between",
    "check_section",
    "ge",
    "gt",
    "need",
    "one_of",
    "optional",
    "resolve_dtype",
    "setting",
    "short_repr",
]
