"""The help of every config key, read from the settings' declarations (``setting(help=...)``),
as the markdown table of docs/training.md and as comments in ``flowgrpo config show``.

``python -m flowgrpo.config.docs`` prints the table; ``python -m flowgrpo.config.docs --write``
rewrites it inside docs/training.md (``make docs``). A test checks the docs hold it verbatim.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import typing
from pathlib import Path
from typing import Any

import yaml

from flowgrpo.algorithms import DEFAULT_ALGORITHM
from flowgrpo.config.loader import REWARD_LISTS, config_to_dict, config_to_yaml
from flowgrpo.config.schema import Config
from flowgrpo.rewards.spec import RewardSpec

DOC = Path(__file__).resolve().parents[3] / "docs" / "training.md"
TABLE_HEADER = "| key | default | meaning |"


def key_help() -> dict[str, str]:
    """Every leaf key (``reward`` lists as ``reward`` and ``reward.NAME.field``) -> its help,
    in declaration order."""
    out: dict[str, str] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key, tp = prefix + f.name, hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, key + ".")
                continue
            out[key] = f.metadata.get("help", "")
            if key in REWARD_LISTS:
                for g in dataclasses.fields(RewardSpec):
                    out[f"{key}.NAME.{g.name}"] = g.metadata.get("help", "")

    walk(Config, "")
    return out


def _default(key: str, defaults: dict[str, Any]) -> str:
    node: Any = defaults
    for part in key.split("."):
        if part == "NAME":
            node = node[0] if node else dataclasses.asdict(RewardSpec())
            continue
        node = node[part]
    if key in REWARD_LISTS:
        return "`" + (",".join(f"{r['name']}:{r['weight']}" for r in node) or "[]") + "`"
    return "`" + json.dumps(node) + "`"


def markdown_table() -> str:
    """| key | default | meaning | for every leaf key, in schema order."""
    defaults = config_to_dict(Config())
    rows = [TABLE_HEADER, "|---|---|---|"]
    for key, text in key_help().items():
        rows.append(f"| `{key}` | {_default(key, defaults)} | {text} |")
    return "\n".join(rows) + "\n"


def write_docs(path: Path = DOC) -> None:
    """Replace the key table inside ``path`` with ``markdown_table()``."""
    lines = path.read_text().split("\n")
    start = lines.index(TABLE_HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines[start:end] = markdown_table().rstrip("\n").split("\n")
    path.write_text("\n".join(lines))


def commented_yaml(cfg: Config, origins: dict[str, str] | None = None) -> str:
    """``config_to_yaml(cfg)`` with each key's help as a comment above it and, with
    ``origins`` (``value_origins``), where its value came from at the end of its line.
    Secrets are redacted: this text is printed (``config show``, ``train --help``)."""
    helps = key_help()
    origins = origins or {}
    out, path = [], []  # path: (indent, key) of the enclosing sections
    for line in config_to_yaml(cfg, redacted=True).splitlines():
        body = line.lstrip(" ")
        indent = len(line) - len(body)
        if body.startswith("- ") or ":" not in body:
            out.append(line)
            continue
        while path and path[-1][0] >= indent:
            path.pop()
        name = body.split(":", 1)[0]
        key = ".".join([p for _, p in path] + [name])
        if path and path[0][1] in REWARD_LISTS:  # inside a reward entry: no per-field comment
            out.append(line)
            continue
        text = helps.get(key)
        if text:
            out.append(f"{' ' * indent}# {text}")
        out.append(f"{line}  # {origins[key]}" if key in origins else line)
        path.append((indent, name))
    return "\n".join(out) + "\n"


# -- where each value came from -----------------------------------------------------------------

_KEY_LINE = re.compile(r"^(\s*)(- )?([A-Za-z_][\w.]*)\s*:(.*)$")


def _split_comment(rest: str) -> tuple[str, str]:
    """(value, comment) of the text after ``key:`` (a ``#`` inside quotes is not a comment)."""
    quote = None
    for i, ch in enumerate(rest):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or rest[i - 1] in " \t"):
            return rest[:i].strip(), rest[i + 1 :].strip()
    return rest.strip(), ""


def preset_notes(text: str) -> tuple[list[str], dict[str, str]]:
    """A preset's YAML text -> (its header comment lines, {dotted key: its comment}).

    A key's comment is the one at the end of its line plus the comment-only lines below it; a
    comment line between sections goes to the next key. A section whose own line carries a
    comment holds one paragraph for all its keys (the comments beside them continue it)."""
    header: list[str] = []
    notes: dict[str, list[str]] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the enclosing sections
    last: str | None = None  # the key that a comment-only line continues
    pending: list[str] = []  # comment lines between sections, for the next key
    paragraph: tuple[int, str] | None = None  # (indent, key) of a commented section
    seen_key = False
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            comment = stripped.lstrip("#").strip()
            if not seen_key:
                header.append(comment)
            elif raw.startswith("#"):
                pending.append(comment)
            elif last is not None:
                notes.setdefault(last, []).append(comment)
            continue
        m = _KEY_LINE.match(raw)
        if m is None:
            if stripped.startswith("- ") and stack:  # a list entry ({name: ocr, ...}):
                comment = _split_comment(stripped[2:])[1]  # its comment is the list's
                key = ".".join(k for _, k in stack)
                if comment:
                    notes.setdefault(key, []).append(comment)
                last = key
            continue
        indent, item = len(m.group(1)), bool(m.group(2))
        seen_key = True
        if item:  # an entry of a list (reward): its comment is the list's
            key = ".".join(k for _, k in stack)
        else:
            while stack and stack[-1][0] >= indent:
                stack.pop()
            key = ".".join([k for _, k in stack] + [m.group(3)])
        if paragraph is not None and indent <= paragraph[0] and not item:
            paragraph = None
        value, comment = _split_comment(m.group(4))
        target = paragraph[1] if paragraph is not None and key != paragraph[1] else key
        if pending:
            notes.setdefault(target, []).extend(pending)
            pending = []
        if comment:
            notes.setdefault(target, []).append(comment)
        if paragraph is not None and key != paragraph[1]:
            notes.setdefault(key, []).append(f"see {paragraph[1]}")
        if not value and not item:  # a section (or a list) opens
            stack.append((indent, m.group(3)))
            if comment and paragraph is None:
                paragraph = (indent, key)
        last = target
    return header, {k: " ".join(v) for k, v in notes.items()}


def _preset_text(name: str) -> tuple[str, str]:
    """(YAML text, label) of a shipped preset name or a YAML path."""
    from flowgrpo.config.loader import _looks_like_path, _preset_dir

    if _looks_like_path(name) or Path(name).is_file():
        path = Path(name).expanduser()
        return path.read_text(), str(path)
    return (_preset_dir() / f"{name}.yaml").read_text(), name


def _flat_keys(data: Any, prefix: str = "") -> dict[str, bool]:
    """{dotted key: is a section} of a nested mapping (reward lists are leaves)."""
    keys: dict[str, bool] = {}
    if isinstance(data, dict) and prefix.rstrip(".") not in REWARD_LISTS:
        for k, v in data.items():
            keys[prefix + str(k)] = isinstance(v, dict) and str(k) not in REWARD_LISTS
            keys.update(_flat_keys(v, f"{prefix}{k}."))
    return keys


def value_origins(preset: str | None, overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the preset's header lines, {dotted key: where its value came from}): "command line"
    for an override, "preset NAME" and the preset file's comment (its citation) for a value
    the preset sets (or its ``base``); keys left at the default are not listed."""
    from flowgrpo.config.loader import (
        ALIASES,
        DEFAULT_PRESET,
        OVERLAYS,
        _chosen_algorithm,
        _looks_like_path,
        preset_dict,
    )

    name = preset or DEFAULT_PRESET
    data, label = preset_dict(name)
    overlays = data.pop(OVERLAYS, None) or {}
    text, _ = _preset_text(name)
    header, notes = preset_notes(text)
    base = yaml.safe_load(text).get("base") if text.strip() else None
    if base is not None and not (_looks_like_path(str(base)) or Path(str(base)).is_file()):
        base_notes = preset_notes(_preset_text(str(base))[0])[1]
        notes = {**base_notes, **notes}
    origins = {}
    for key, is_section in sorted(_flat_keys(data).items()):
        note = notes.get(key)
        if note or not is_section:  # a section line is marked only when it has a note
            origins[key] = f"preset {label}" + (f": {note}" if note else "")
    chosen = _chosen_algorithm(overrides) or data.get("algorithm", DEFAULT_ALGORITHM)
    for key, is_section in sorted(_flat_keys(overlays.get(chosen) or {}).items()):
        if not is_section:  # the preset's value for the chosen algorithm, with its citation
            note = notes.get(f"{OVERLAYS}.{chosen}.{key}") or notes.get(f"{OVERLAYS}.{chosen}")
            origins[key] = f"preset {label}, {OVERLAYS}.{chosen}" + (f": {note}" if note else "")
    for text in overrides:
        key = text.split("=", 1)[0].strip()
        key = ALIASES.get(key, key)  # an old key sets (and marks) the new one
        origins[key] = "command line"
        if key.split(".")[0] in REWARD_LISTS:
            origins[key.split(".")[0]] = "command line"
    return header, origins


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write_docs()
    else:
        print(markdown_table(), end="")
