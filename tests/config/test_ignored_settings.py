"""Settings a run would silently ignore are refused in one line (a LoRA setting of a full
fine-tune, another algorithm's section, given on the command line), a preset's own LoRA
targets are not (LoRA turned off), an error about a preset's value names the preset, and a
misspelt choice gets a "did you mean" from substrings too (issue 39, the newcomer's walk)."""

from __future__ import annotations

import pytest

from flowgrpo.config import ConfigError, load_config
from flowgrpo.rewards import build_reward


def _error(preset: str | None, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(preset, list(overrides), check_paths=False)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_lora_settings_of_a_full_fine_tune_are_refused() -> None:
    msg = _error(None, "lora.rank=8")  # the toy is a full fine-tune
    assert msg.startswith("config key 'lora.rank' is set (8) but lora.enabled=false")
    assert "remove lora.rank or set lora.enabled=true" in msg
    assert "lora.target_modules" in _error(None, "lora.target_modules=[to_q]")
    assert load_config(None, ["lora.enabled=true", "lora.rank=8"], check_paths=False).lora.rank == 8
    # unsetting one (the memory planner's full fine-tune) is not a setting to ignore
    load_config(None, ["lora.target_modules=null"], check_paths=False)


def test_a_presets_lora_targets_do_not_block_a_full_fine_tune() -> None:
    """docs/memory.md's full fine-tune of wan-t2v-ocr: the preset sets lora.target_modules."""
    cfg = load_config("wan-t2v-ocr", ["lora.enabled=false"], check_paths=False)
    assert not cfg.lora.enabled and cfg.lora.target_modules  # kept, unused


def test_another_algorithms_section_is_refused() -> None:
    msg = _error(None, "algorithm=nft", "flow_grpo.kl_beta=0.1")
    assert msg.startswith("config key 'flow_grpo.kl_beta' is a setting of algorithm=flow_grpo")
    assert "this run's algorithm is nft" in msg and "(this run's is nft.kl_beta)" in msg
    assert load_config(None, ["flow_grpo.kl_beta=0.1"], check_paths=False).flow_grpo.kl_beta == 0.1
    # a preset's sections for other algorithms stay (sd3-ocr carries several)
    assert load_config("sd3-ocr", ["algorithm=nft"], check_paths=False).algorithm == "nft"


def test_an_error_about_a_presets_value_names_the_preset() -> None:
    msg = _error("flux2-pickscore", "sample.num_steps=3")
    assert msg.startswith("config key 'sample.window_hi' must be <= 2")
    assert msg.endswith("(set by preset 'flux2-pickscore': override it with sample.window_hi=...)")
    mine = _error("flux2-pickscore", "sample.num_steps=3", "sample.window_hi=9")
    assert "set by preset" not in mine  # the command line set it


def test_did_you_mean_finds_substrings() -> None:
    assert _error(None, "algorithm=dppo").endswith("got 'dppo' (did you mean 'flow_dppo'?)")
    with pytest.raises(ValueError) as e:
        build_reward("jpeg")
    assert "(did you mean 'jpeg_compressibility' or 'jpeg_incompressibility'?)" in str(e.value)
