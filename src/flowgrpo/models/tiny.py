"""The old home of the tiny test pipelines, kept as a re-export (DESIGN.md contract 4:
``flowgrpo.models.tiny.tiny_pipeline`` keeps working). They live in :mod:`flowgrpo.testing`,
one module per family: test doubles are not model code. A name resolves on first use through
its import path, as the registries name what sits above them, so importing ``flowgrpo.models``
never loads the test kit."""

from __future__ import annotations

import importlib
from typing import Any

_REEXPORTED = ("tiny_pipeline", "tiny_size")


def __getattr__(name: str) -> Any:
    if name not in _REEXPORTED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module("flowgrpo.testing"), name)
