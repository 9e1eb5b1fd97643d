"""Secrets never leave the process: the one rule for what a logged or saved config hides.

An option whose name's last word is ``token``, ``key``, ``secret``, ``password`` or
``apikey`` (``token``, ``api_key``, ``auth_token``, ``hf_token`` ...) is a secret: every
config written to the run folder, a checkpoint, tensorboard or wandb passes through
:func:`redact` first. A secret is better given through the environment (the remote reward
reads ``FLOWGRPO_REWARD_TOKEN``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"(?:^|[_\-.])(token|key|secret|password|passwd|apikey)$", re.IGNORECASE)


def is_secret_name(name: str) -> bool:
    """Whether an option called ``name`` holds a secret (by its last word)."""
    return bool(_SECRET_NAME.search(str(name)))


def redact(value: Any) -> Any:
    """A copy of ``value`` (nested dicts/lists/tuples) with every secret's value replaced by
    ``"<redacted>"``; an unset secret (None or "") stays as it is, so a reader sees it was unset."""
    if isinstance(value, Mapping):
        return {
            k: (REDACTED if is_secret_name(k) and v not in (None, "") else redact(v))
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return type(value)(redact(v) for v in value)
    return value


def redact_args(args: list[str]) -> list[str]:
    """Command-line arguments with every secret's value replaced: ``KEY=VALUE`` and
    ``--KEY=VALUE`` whose key is a secret name, and the word after a bare ``--KEY`` that is
    one (``reward.remote.options.token=abc`` -> ``reward.remote.options.token=<redacted>``)."""
    out, hide_next = [], False
    for arg in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        key, sep, value = arg.partition("=")
        if sep and value and is_secret_name(key.lstrip("-")):
            out.append(f"{key}={REDACTED}")
            continue
        hide_next = not sep and arg.startswith("--") and is_secret_name(arg.lstrip("-"))
        out.append(arg)
    return out
