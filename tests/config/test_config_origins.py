"""``flowgrpo config show PRESET`` says where each value came from (the preset with its YAML
note, the command line, or the default), and small config mistakes get the right message:
``reward=digits:abc`` is a bad weight, ``lora.target_modules`` needs LoRA."""

from __future__ import annotations

import pytest
import yaml

from flowgrpo import cli
from flowgrpo.config import ConfigError, load_config
from flowgrpo.config.docs import preset_notes, value_origins


def show(capsys, *args: str) -> str:
    assert cli.main(["config", "show", *args]) == 0
    return capsys.readouterr().out


def line_of(text: str, start: str) -> str:
    (line,) = [x for x in text.splitlines() if x.strip().startswith(start)]
    return line


def test_config_show_marks_preset_values_with_their_citation(capsys):
    text = show(capsys, "sd3-ocr", "sample.group_size=8")
    assert text.startswith("# preset sd3-ocr:\n#   SD3.5-Medium, OCR reward: flow_grpo's")
    assert line_of(text, "max_sequence_length:") == (
        "  max_sequence_length: 128  # preset sd3-ocr: T5 tokens: flow_grpo trains and "
        "evaluates with 128 (not 256)"
    )
    assert line_of(text, "num_steps:").endswith("num_steps: 10  # preset sd3-ocr")
    assert line_of(text, "group_size:") == "  group_size: 8  # command line"
    assert line_of(text, "true_cfg_scale:") == "  true_cfg_scale: 1.0"  # the default
    # a continued comment is one note; a commented section's note covers its keys
    assert line_of(text, "deterministic_last_step:").endswith(
        "the (untrained) last step; we keep it deterministic: see docs/math.md"
    )
    assert "flow_grpo @ 2e2f712 config/grpo_guard.py" in line_of(text, "grpo_guard:")
    assert line_of(text, "bias_reduce:").endswith("# preset sd3-ocr: see grpo_guard")
    data = yaml.safe_load(text)  # still the effective config, as YAML
    assert data["sample"]["group_size"] == 8 and data["model"]["max_sequence_length"] == 128


def test_config_show_attributes_the_chosen_algorithms_preset_values(capsys):
    text = show(capsys, "sd3-ocr", "algorithm=mix_grpo")
    assert line_of(text, "num_steps:").startswith(
        "  num_steps: 25  # preset sd3-ocr, algorithms.mix_grpo"
    )
    assert line_of(text, "same_latent:").startswith(
        "  same_latent: true  # preset sd3-ocr, algorithms.mix_grpo"
    )


def test_every_shipped_preset_value_is_attributed(capsys):
    from flowgrpo.config.loader import list_presets, preset_dict

    for name in list_presets():
        _, origins = value_origins(name, [])
        data, _ = preset_dict(name)
        for section, values in data.items():
            if section == "algorithms":  # per-algorithm values: attributed when chosen
                continue
            keys = values if isinstance(values, dict) and section != "reward" else {None: 0}
            for key in keys:
                full = section if key is None else f"{section}.{key}"
                assert origins[full].startswith(f"preset {name}"), (name, full)


def test_preset_notes_reads_inline_continued_and_section_comments():
    header, notes = preset_notes(
        "# Header line one\n# two\nmodel:\n  height: 64  # because\n"
        "                # of this\n  width: 64\n# a note between sections\n"
        "nft:   # the paper's\n  beta: 1.0  # settings\nreward:\n  - {name: ocr, weight: 1.0}  # OCR\n"
        'run:\n  name: "a # not a comment"\n'
    )
    assert header == ["Header line one", "two"]
    assert notes["model.height"] == "because of this" and "model.width" not in notes
    assert notes["nft"] == "a note between sections the paper's settings"
    assert notes["nft.beta"] == "see nft"
    assert notes["reward"] == "OCR" and "run.name" not in notes


def test_a_registered_reward_with_a_bad_weight_is_a_weight_error(tmp_path, monkeypatch):
    from flowgrpo.rewards import build_reward

    with pytest.raises(ValueError) as e:
        build_reward("digits:abc")
    assert str(e.value) == (
        "weight of reward 'digits' must be a number, got 'abc' in 'digits:abc' "
        "(a reward of your own is named by its import path, module:function)"
    )
    with pytest.raises(ValueError, match="cannot import module 'nomodule_t23' of reward"):
        build_reward("nomodule_t23:abc")  # an unknown module stays an import error
    (tmp_path / "mymodule_t23.py").write_text(
        "def abc(images, prompts, metadata):\n    return [1.0]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert build_reward("mymodule_t23:abc")(None, [""], [{}]) == [1.0]  # an import path works


def test_lora_target_modules_on_a_full_fine_tune_is_a_config_error(capsys):
    with pytest.raises(ConfigError, match="'lora.target_modules' is set .* lora.enabled=false"):
        load_config(None, ["lora.target_modules=[to_q]"], check_paths=False)
    cfg = load_config(None, ["lora.enabled=true", "lora.target_modules=[to_q]"], check_paths=False)
    assert cfg.lora.target_modules == ["to_q"]
    assert cli.main(["config", "show", "lora.target_modules=[to_q]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowgrpo: error: config key 'lora.target_modules' is set")
