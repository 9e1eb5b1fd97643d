"""docs/training.md documents every config key with the schema's default."""

from __future__ import annotations

from pathlib import Path

from flowgrpo.config.docs import KEY_HELP, markdown_table
from flowgrpo.config.loader import valid_keys

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def test_every_key_documented_with_its_default() -> None:
    sections = {k for k in valid_keys() if any(v.startswith(k + ".") for v in valid_keys())}
    leaves = [k for k in valid_keys() if k not in sections or k == "reward"]
    assert set(KEY_HELP) == set(leaves)
    table = markdown_table()
    assert table in DOC.read_text(), "regenerate: python -m flowgrpo.config.docs"
    assert "| `trainer.max_steps` | `1000` |" in table
    assert "| `sample.group_size` | `16` |" in table and "| `reward` | `digits:1.0` |" in table
