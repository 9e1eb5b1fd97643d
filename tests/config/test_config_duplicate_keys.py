"""A key given twice in a YAML config (YAML keeps the last one silently) is refused in one
line naming the key, the file and both lines, `base:` included."""

from __future__ import annotations

import pytest

from flowgrpo.config import ConfigError, load_config


@pytest.mark.parametrize(
    "text, key, lines",
    [
        ("base: toy-digits\ntrainer:\n  max_steps: 3\n  max_steps: 5\n", "max_steps", (3, 4)),
        ("base: toy-digits\nsample: {num_steps: 4}\nbase: sd3-ocr\n", "base", (1, 3)),
        ("seed: 1\nseed: 2\n", "seed", (1, 2)),
        ("reward:\n  - {name: digits, weight: 1, weight: 2}\n", "weight", (2, 2)),
    ],
)
def test_duplicate_yaml_keys_are_refused(tmp_path, text, key, lines) -> None:
    path = tmp_path / "my.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), [])
    assert str(info.value) == (
        f"{path}: key {key!r} appears twice (lines {lines[0]} and {lines[1]}); keep one "
        "(YAML would silently use the last)"
    )


def test_the_same_key_in_different_mappings_and_yaml_merges_are_fine(tmp_path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text(
        "base: toy-digits\n"
        "defaults: &d {num_steps: 4}\n"
        "sample: {<<: *d, num_steps: 6}\n"  # an explicit key over a merged one: YAML's rule
        "trainer: {max_steps: 3}\n"
        "run: {name: x}\n"
    )
    with pytest.raises(ConfigError, match="unknown config key 'defaults"):
        load_config(str(path), [])  # parsed: only the unknown section is refused
    path.write_text("base: toy-digits\nsample: {num_steps: 4}\ntrainer: {max_steps: 4}\n")
    cfg = load_config(str(path), [])
    assert (cfg.sample.num_steps, cfg.trainer.max_steps) == (4, 4)
