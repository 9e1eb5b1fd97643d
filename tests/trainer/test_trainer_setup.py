"""build_adapter_for: model.path -> pipeline -> adapter, with the family options of the config."""

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.engine.dist import DistInfo
from flowgrpo.testing.tiny import tiny_pipeline
from flowgrpo.trainer.setup import build_adapter_for

CPU = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")


def test_flux_true_cfg_scale_reaches_the_adapter(tmp_path):
    tiny_pipeline("flux").save_pretrained(tmp_path / "flux")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\n")
    overrides = [
        f"model.path={tmp_path / 'flux'}",
        f"data.train_prompts={prompts}",
        f"reward.pickscore.options.path={tmp_path}",
        "model.dtype=fp32",
    ]
    plain = build_adapter_for(load_config("flux-pickscore", overrides), CPU)
    assert type(plain).__name__ == "FluxAdapter" and not plain.uses_cfg(3.5)
    cfg = load_config("flux-pickscore", [*overrides, "flux.true_cfg_scale=2.0"])
    adapter = build_adapter_for(cfg, CPU)
    assert adapter.true_cfg_scale == 2.0 and adapter.uses_cfg(3.5)


def test_family_options_on_another_family_are_a_clear_error():
    flux = r"'flux.true_cfg_scale' does not apply to ToyDigitsPipeline \(family toy\): it is a "
    for over, match in (
        ("flux.true_cfg_scale=2.0", flux + "setting of family flux"),
        ("model.true_cfg_scale=2.0", flux + "setting of family flux"),  # the old key
        ("model.max_sequence_length=77", "'model.max_sequence_length' does not apply to ToyDigit"),
    ):
        with pytest.raises(ValueError, match=match):  # the config check, before loading
            load_config(None, [over])
        cfg = load_config(None, [over], check_paths=False)
        with pytest.raises(ValueError, match=match):  # and the adapter's build
            build_adapter_for(cfg, CPU)


def test_the_toy_loads_like_any_model():
    from flowgrpo.models.registry import load_pipeline, resolve_model_path
    from flowgrpo.toy.pipeline import shipped_dir

    assert resolve_model_path("builtin:toy-digits") == shipped_dir()
    assert (shipped_dir() / "model_index.json").is_file()
    adapter = build_adapter_for(load_config(None, []), CPU)
    assert type(adapter).__name__ == "ToyAdapter"
    assert type(load_pipeline("builtin:toy-digits")).__name__ == "ToyDigitsPipeline"
    with pytest.raises(ValueError, match="no built-in pipeline 'toy'"):
        resolve_model_path("builtin:toy")
