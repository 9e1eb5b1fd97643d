"""The CLI: help, config show, dispatch to the trainer's functions, one-line errors."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

from flowgrpo import cli
from flowgrpo.config import config_from_dict, load_config
from flowgrpo.config.schema import DEFAULT_PRESET


@pytest.fixture
def fake_trainer(monkeypatch):
    """Stand-in for flowgrpo.trainer.loop and .commands recording what the CLI passes."""
    calls: dict = {}
    mod = types.ModuleType("flowgrpo.trainer.loop")
    mod.run_training = lambda cfg: calls.setdefault("train", cfg)
    mod.run_sample = lambda cfg, ckpt, prompts, out: (
        calls.setdefault("sample", (cfg, ckpt, prompts, out))
        and [Path(out) / f"{i}.png" for i in range(len(prompts))]
    )
    mod.run_eval = lambda cfg, ckpt: calls.setdefault("eval", (cfg, ckpt)) and {"eval/x": 1.0}
    mod.run_export_lora = lambda cfg, ckpt, out, full=False, raw=False: calls.setdefault(
        "export", (cfg, ckpt, out, full)
    )[2]
    monkeypatch.setitem(sys.modules, "flowgrpo.trainer.loop", mod)
    monkeypatch.setitem(sys.modules, "flowgrpo.trainer.commands", mod)
    return calls


def test_top_level_help_is_fast_and_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flowgrpo", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for command in ("train", "config", "sample", "eval", "export-lora", "toy", "reward-server"):
        assert command in out.stdout
    # --help must not import torch (the config and the trainer are imported by the handlers)
    probe = "import sys, flowgrpo.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"
    assert cli.DEFAULT_PRESET == DEFAULT_PRESET


def test_train_help_prints_usage_and_effective_config(capsys) -> None:
    assert cli.main(["train", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: flowgrpo train")
    cfg = config_from_dict(yaml.safe_load(text.split("every key is settable as KEY=VALUE):")[1]))
    assert cfg == load_config(check_paths=False)
    assert cli.main(["train", "sd3-ocr", "trainer.max_steps=7", "-h"]) == 0
    assert "max_steps: 7" in capsys.readouterr().out


def test_config_show_round_trips(capsys) -> None:
    args = ["config", "show", "qwen-image-ocr", "seed=5", "reward=ocr,jpeg_compressibility:0.1"]
    assert cli.main(args) == 0
    shown = config_from_dict(yaml.safe_load(capsys.readouterr().out))
    assert shown == load_config("qwen-image-ocr", args[3:], check_paths=False)
    assert shown.seed == 5 and [r.weight for r in shown.reward] == [1.0, 0.1]
    assert cli.main(["config", "list"]) == 0
    assert "toy-digits  (default)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "trainer.max_step=2"], "unknown config key 'trainer.max_step' (did you mean"),
        (["train", "sample.group_size=1"], "config key 'sample.group_size' must be >= 2"),
        (["train", "sd3-ocr"], "model.path is required for preset 'sd3-ocr'"),
        (["config", "show", "nope"], "unknown preset 'nope'"),
        (["sample"], "flowgrpo sample needs --prompts"),
        (
            ["train", "data.train_prompts=/no/such.txt"],
            "config key 'data.train_prompts': prompt file /no/such.txt not found",
        ),
    ],
)
def test_errors_are_one_line_exit_2(argv, expected, capsys, fake_trainer) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowgrpo: error: " + expected)
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not fake_trainer


def test_commands_dispatch_to_the_trainer(tmp_path, capsys, fake_trainer) -> None:
    assert cli.main(["train", "trainer.max_steps=2", "seed=3", "resume=auto"]) == 0
    cfg = fake_trainer["train"]
    assert (cfg.trainer.max_steps, cfg.seed, cfg.trainer.resume) == (2, 3, "auto")
    assert cli.main(["sample", "--prompts", "a handwritten 3", "a handwritten 4", "--out",
                     str(tmp_path)]) == 0  # fmt: skip
    _, ckpt, prompts, out = fake_trainer["sample"]
    assert (ckpt, prompts, out) == (None, ["a handwritten 3", "a handwritten 4"], str(tmp_path))
    # overrides may also follow the options
    assert (
        cli.main(["eval", "--checkpoint", "runs/x", "seed=4", "--out", str(tmp_path / "m.json")])
        == 0
    )
    cfg, ckpt = fake_trainer["eval"]
    assert (cfg.seed, ckpt) == (4, "runs/x")
    assert '"eval/x": 1.0' in (tmp_path / "m.json").read_text()
    assert cli.main(["export-lora", "--checkpoint", "c", "--out", "l.safetensors"]) == 0
    assert fake_trainer["export"][1:] == ("c", "l.safetensors", False)
    del fake_trainer["export"]
    assert cli.main(["export-lora", "--checkpoint", "c", "--full", "--out", "dir"]) == 0
    assert fake_trainer["export"][1:] == ("c", "dir", True)
    assert "wrote LoRA weights (the trained weights; this run has no EMA) to l.safetensors" in (
        capsys.readouterr().out
    )
    assert cli.main(["eval", "--bogus"]) == 2
