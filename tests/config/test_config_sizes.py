"""User mistakes that used to be internal errors (or silent rounding) deep in a run are
one-line config errors before anything loads: image/video sizes against the family's rule
(read from the pipeline's config files only), the seed's 64 bits, and a deterministic rollout
under a log-prob algorithm."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from flowgrpo.config import ConfigError, load_config
from flowgrpo.config.shipped import preset_pipelines
from flowgrpo.testing.families import double, kinds, params

#: the families whose test double states its published checkpoint's size rule
PUBLISHED = kinds(lambda f: f.published is not None)


def model_dir(root: Path, kind: str) -> Path:
    """A model folder of ``kind``'s published config numbers (``Family.published``): config
    files only, no weights."""
    fam = double(kind)
    d = root / kind
    for name, conf in (("vae", fam.published.vae), ("transformer", fam.published.transformer)):
        (d / name).mkdir(parents=True)
        (d / name / "config.json").write_text(json.dumps(conf))
    (d / "model_index.json").write_text(json.dumps({"_class_name": fam.pipeline_class}))
    return d


def presets(kind: str) -> list[str]:
    """The shipped presets made for ``kind``'s pipeline (their ``made_for``; a preset refuses
    another family's pipeline)."""
    cls = double(kind).pipeline_class
    made_for = [name for name, classes in sorted(preset_pipelines().items()) if cls in classes]
    assert made_for, f"no shipped preset is made for {cls}"
    return made_for


def error(*overrides: str, command: str = "sample", preset: str = "toy-digits") -> str:
    with pytest.raises(ConfigError) as info:
        load_config(preset, list(overrides), command=command)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("kind", params(PUBLISHED))
def test_a_side_off_the_published_rule_is_a_config_error(tmp_path, kind) -> None:
    rule = double(kind).published
    path = model_dir(tmp_path, kind)  # config files only: there is no weight to load
    bad = 32 * rule.multiple + rule.multiple // 2
    for preset, side in itertools.product(presets(kind), ("height", "width")):
        msg = error(f"model.path={path}", f"model.{side}={bad}", preset=preset)
        assert f"'model.{side}' must be a positive multiple of {rule.multiple} for {rule.name}" in (
            msg
        )


@pytest.mark.parametrize("kind", params(PUBLISHED))
def test_published_sizes_pass(tmp_path, kind) -> None:
    rule = double(kind).published
    path = model_dir(tmp_path, kind)
    for preset in presets(kind):
        load_config(preset, [f"model.path={path}", *rule.valid], command="sample")


@pytest.mark.parametrize(
    "kind, overrides, expected",
    [
        (
            "sd3",
            ["model.height=30"],
            "config key 'model.height' must be a positive multiple of 16 for SD3 "
            "(VAE 8 x patch 2), got 30",
        ),
        (
            "flux",
            ["model.height=32", "model.width=22"],  # the pipeline would make 16 px silently
            "config key 'model.width' must be a positive multiple of 16 for FLUX "
            "(VAE 8 x 2x2 packing), got 22",
        ),
        (
            "wan",
            ["model.height=480", "model.width=832", "model.num_frames=100001"],
            "config key 'model.num_frames' must be <= 4093 for Wan",
        ),
        (
            "wan",
            ["model.height=480", "model.width=832", "model.num_frames=80"],
            "config key 'model.num_frames' must be 4k + 1 (1, 5, 9, ...) for Wan, got 80",
        ),
        (
            "sd3",
            ["model.height=512", "model.width=512", "model.num_frames=5"],
            "config key 'model.num_frames' applies to video models only; SD3 generates images",
        ),
    ],
)
def test_each_rules_own_message(tmp_path, kind, overrides, expected) -> None:
    """The whole message where a family's rule says more than its multiple: the factors it
    comes from, a video's frames, frames asked of an image model."""
    assert expected in error(f"model.path={model_dir(tmp_path, kind)}", *overrides,
                             preset=presets(kind)[0])  # fmt: skip


def test_flux_adapter_refuses_a_size_it_would_round() -> None:
    """The tiny FLUX (VAE factor 2: multiples of 4) made 22x22 requests 20x20 images."""
    import torch

    from flowgrpo.models import build_adapter
    from flowgrpo.testing.tiny import tiny_pipeline

    adapter = build_adapter(tiny_pipeline("flux"))
    with pytest.raises(ValueError, match="width must be a positive multiple of 4 for FLUX"):
        adapter.prepare_latents(1, 24, 22, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="height must be a positive multiple of 4 for FLUX"):
        adapter.schedule(4, 22, 24)
    assert adapter.prepare_latents(1, 24, 20).shape[1] == (24 // 4) * (20 // 4)


def test_seed_over_64_bits_is_a_config_error() -> None:
    assert error("seed=18446744073709551616") == (
        "config key 'seed' must be in [0, 18446744073709551615], got 18446744073709551616"
    )
    assert load_config(None, ["seed=18446744073709551615"]).seed == 2**64 - 1


@pytest.mark.parametrize("algorithm", ["flow_grpo", "mix_grpo"])
def test_a_deterministic_rollout_under_a_log_prob_algorithm_is_a_config_error(algorithm) -> None:
    msg = error(f"algorithm={algorithm}", "sample.noise_level=0", f"{algorithm}.kl_beta=0")
    assert msg.startswith(f"config key 'sample.noise_level' must be > 0 with algorithm={algorithm}")
    load_config(None, ["algorithm=nft", "sample.noise_level=0"])  # nft trains without log-probs
