"""The help of every config key, read from the settings' declarations (``setting(help=...)``),
as the markdown table of docs/training.md and as comments in ``flowgrpo config show``.

``python -m flowgrpo.config.docs`` prints the table; ``python -m flowgrpo.config.docs --write``
rewrites it inside docs/training.md (``make docs``). A test checks the docs hold it verbatim.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path
from typing import Any

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


def commented_yaml(cfg: Config) -> str:
    """``config_to_yaml(cfg)`` with each key's help as a comment above it."""
    helps = key_help()
    out, path = [], []  # path: (indent, key) of the enclosing sections
    for line in config_to_yaml(cfg).splitlines():
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
        out.append(line)
        path.append((indent, name))
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write_docs()
    else:
        print(markdown_table(), end="")
