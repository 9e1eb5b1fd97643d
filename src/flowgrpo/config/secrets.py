"""Secrets never leave the process: the one rule for what a logged or saved config hides.

An option whose name's last word is ``token``, ``key``, ``secret``, ``password``,
``passphrase``, ``apikey``, ``auth``, ``authorization``, ``credentials`` or ``cookie``
(``token``, ``api_key``, ``auth_token``, ``hf_token``, ``Authorization`` ...) is a secret, at any
depth of the config (inside a reward's ``options``, inside a list). Every config written to
the run folder, a checkpoint, tensorboard or wandb, or printed (``flowgrpo config show``),
passes through :func:`redact` first, and every recorded command line through
:func:`redact_args`, which judges an argument by its parsed value: ``KEY=VALUE`` with a
secret anywhere in the dotted ``KEY``, or a structured ``VALUE`` (``reward=[{name: remote,
options: {token: ...}}]``, ``reward.remote.options={token: ...}``) with a secret key at any
depth. A secret is better given through the environment (the remote reward reads
``FLOWGRPO_REWARD_TOKEN``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml

REDACTED = "<redacted>"
_SECRET_WORDS = (
    "token|key|secret|password|passwd|passphrase|apikey|auth|authorization|credentials?|cookie"
)
_SECRET_NAME = re.compile(rf"(?:^|[_\-.])({_SECRET_WORDS})$", re.IGNORECASE)


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


def _hides(value: Any) -> bool:
    """Whether ``redact`` changes ``value``: it holds a set secret at some depth."""
    return redact(value) != value


#: ``NAME:`` or ``"NAME":`` where NAME's last word is a secret name (a YAML/JSON mapping key)
_SECRET_KEY_TEXT = re.compile(rf"""["']?([\w.\-]*(?:{_SECRET_WORDS}))["']?\s*[:=]""", re.IGNORECASE)


def redact_value_text(raw: str) -> str:
    """The text of one override's value with its secrets hidden: parsed as YAML (as the
    loader parses it), every secret key at any depth redacted and the value written back
    as one-line YAML; text that does not parse but names a secret key is hidden whole."""
    if not any(is_secret_name(m.group(1)) for m in _SECRET_KEY_TEXT.finditer(raw)):
        return raw
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return REDACTED
    if not isinstance(value, Mapping | list) or not _hides(value):
        return raw
    text = yaml.safe_dump(redact(value), default_flow_style=True, sort_keys=False, width=2**31)
    return text.strip().removesuffix("...").strip()


def redact_override(arg: str) -> str:
    """One ``KEY=VALUE`` (or ``--KEY=VALUE``) with its secret hidden: the whole value when a
    word of the dotted ``KEY`` is a secret name, else the secrets inside a structured value
    (``redact_value_text``). Anything else is returned as it is."""
    key, sep, value = arg.partition("=")
    if not sep or not value:
        return arg
    if any(is_secret_name(word) for word in key.lstrip("-").split(".")):
        return f"{key}={REDACTED}"
    return f"{key}={redact_value_text(value)}"


def redact_args(args: list[str]) -> list[str]:
    """Command-line arguments with every secret's value replaced (``redact_override``), and
    the word after a bare ``--KEY`` that is a secret name
    (``reward.remote.options.token=abc`` -> ``reward.remote.options.token=<redacted>``;
    ``reward.remote.options={url: u, token: abc}`` -> ``...={url: u, token: <redacted>}``)."""
    out, hide_next = [], False
    for arg in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        sep = "=" in arg
        hide_next = not sep and arg.startswith("--") and is_secret_name(arg.lstrip("-"))
        out.append(redact_override(arg))
    return out
