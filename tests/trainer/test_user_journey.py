"""The journey a user takes, as the README prints it: train, export, sample, eval, resume on
tiny saved pipelines; what a run records of itself; the first hour's pitfalls (a re-run demo,
another algorithm after the demo, a reward module in the current folder, a forgotten preset,
a hub id, reward model paths and devices)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flowgrpo import cli
from flowgrpo.config import ConfigError, load_config
from flowgrpo.testing.models import random_toy_path

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[2]
TINY = [  # a run of 1-2 steps of 2 prompts x 2 samples, 2 sampling steps, 32 x 48 images
    "sample.prompts_per_step=2",
    "sample.group_size=2",
    "sample.num_steps=2",
    "sample.eval_num_steps=2",
    "sample.rollout_batch_size=4",
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=1",
    "update.micro_batch_size=4",
    "run.progress_bar=false",
    "run.tensorboard=false",
    "run.num_threads=1",
]
TOY = [f"model.path={random_toy_path()}", *TINY]


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory) -> Path:
    from flowgrpo.testing.tiny import tiny_pipeline

    path = tmp_path_factory.mktemp("sd3") / "sd35m"
    tiny_pipeline("sd3").save_pretrained(path)
    return path


def flowgrpo(capsys, *args: str) -> tuple[int, str, str]:
    """``flowgrpo ARGS`` in this process: (exit code, stdout, stderr)."""
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def dcp_tensors(ckpt: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(dst))
    return torch.load(dst, weights_only=False)


# -- 1. Using the result ----------------------------------------------------------------------


@pytest.mark.slow  # trains end to end
def test_readme_commands_in_order_on_a_tiny_saved_pipeline(sd3_dir, tmp_path, monkeypatch, capsys):
    """The README's GPU commands, in its order, on a tiny saved SD3 with the sd3-ocr preset
    (LoRA + EMA): train; export-lora (the EMA weights, which eval measures), sample and eval
    without the training prompts (the run's recorded config.yaml supplies the rest); resume."""
    from safetensors.torch import load_file

    monkeypatch.chdir(tmp_path)
    train_file, eval_file = Path("train.txt"), Path("test.txt")
    train_file.write_text('A sign that says "HI"\nA mug that says "OK"\n')
    eval_file.write_text('A door that says "PUSH"\nA cake that says "YES"\n')
    model = f"model.path={sd3_dir}"
    fast = [*TINY, "model.height=32", "model.width=48", "reward=jpeg_compressibility"]
    fast += ["optim.lr=3e-2", "ema.update_every=1", "trainer.max_steps=1"]
    code, out, err = flowgrpo(
        capsys, "train", "sd3-ocr", model, f"data.train_prompts={train_file}",
        f"data.eval_prompts={eval_file}", *fast,
    )  # fmt: skip
    assert code == 0, err
    run = Path("runs/sd3-ocr")
    step = run / "checkpoints" / "step_1"
    for folder in (run, step):  # the resolved config and the command line, recorded
        text = (folder / "config.yaml").read_text()
        assert "# command: flowgrpo train sd3-ocr model.path=" in text
        assert "trainer.max_steps=1" in text
        recorded = yaml.safe_load(text)
        assert recorded["preset"] == "sd3-ocr" and recorded["model"]["height"] == 32
    train_file.unlink()  # export, sample and eval never need the training prompts

    code, out, err = flowgrpo(
        capsys, "export-lora", "sd3-ocr", model, "--checkpoint", str(run),
        "--out", "sd35m-ocr-lora.safetensors",
    )  # fmt: skip
    assert code == 0, err
    assert "the EMA weights, which eval measures; --raw for the raw weights" in out
    code, out, err = flowgrpo(
        capsys, "export-lora", "--checkpoint", str(run), "--out", "raw.safetensors", "--raw"
    )
    assert code == 0 and "raw trained weights" in out, err
    saved = dcp_tensors(step)
    ema_file, raw_file = load_file("sd35m-ocr-lora.safetensors"), load_file("raw.safetensors")
    assert ema_file.keys() == raw_file.keys() and len(ema_file) > 4
    moved = 0.0
    for key in ema_file:  # transformer.X.lora_A.weight <-> X.lora_A.default.weight
        name = key.removeprefix("transformer.").replace(".weight", ".default.weight")
        torch.testing.assert_close(ema_file[key], saved["ema"][name], rtol=0, atol=0)
        torch.testing.assert_close(raw_file[key], saved["model"][name], rtol=0, atol=0)
        moved = max(moved, float((saved["ema"][name] - saved["model"][name]).abs().max()))
    assert moved > 1e-4  # EMA and raw differ: the test can tell them apart

    code, out, err = flowgrpo(
        capsys, "sample", "sd3-ocr", model, "--checkpoint", str(run),
        "--prompts", 'A storefront sign that says "FLOW GRPO"', "--out", "samples/",
    )  # fmt: skip
    assert code == 0 and "wrote 1 sample(s)" in out, err
    from PIL import Image

    # the run's 32 x 48 (on a square, upscaled 2x to 64 px or more), not the preset's 512 x 512
    assert Image.open("samples/sample_0000.png").size == (96, 96)
    code, out, err = flowgrpo(  # nothing but the checkpoint; an override still wins
        capsys, "sample", "--checkpoint", str(run), "--prompts", "a cat", "--out", "s2",
        "model.height=64",
    )  # fmt: skip
    assert code == 0, err
    assert Image.open("s2/sample_0000.png").size == (64, 64)  # 64 x 48: 64 px square

    code, out, err = flowgrpo(capsys, "eval", "sd3-ocr", model, "--checkpoint", str(step))
    assert code == 0, err
    last_eval = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()][-1]
    got = json.loads(out)
    assert got["eval/reward_mean"] == pytest.approx(last_eval["eval/reward_mean"], abs=1e-6)

    train_file.write_text('A sign that says "HI"\nA mug that says "OK"\n')
    code, out, err = flowgrpo(
        capsys, "train", "sd3-ocr", model, f"data.train_prompts={train_file}",
        f"data.eval_prompts={eval_file}", *fast[:-1], "trainer.max_steps=2", "trainer.resume=auto",
    )  # fmt: skip
    assert code == 0, err
    assert (run / "checkpoints" / "step_2" / "config.yaml").is_file()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]


def test_sample_and_eval_of_a_base_model_need_no_training_prompts(sd3_dir, tmp_path, capsys):
    prompts = tmp_path / "eval.txt"
    prompts.write_text('A door that says "PUSH"\n')
    size = ["model.height=32", "model.width=48", "sample.eval_num_steps=2"]
    base = ["sd3-ocr", f"model.path={sd3_dir}", *size, "reward=jpeg_compressibility"]
    code, out, err = flowgrpo(
        capsys, "sample", *base, "--prompts", "a cat", "--out", str(tmp_path / "s")
    )
    assert code == 0 and (tmp_path / "s" / "sample_0000.png").is_file(), err
    code, out, err = flowgrpo(capsys, "eval", *base, "--prompt-file", str(prompts))
    assert code == 0 and "eval/reward_mean" in json.loads(out), err


def toy_run(capsys, out: Path, *extra: str) -> tuple[int, str]:
    code, _, err = flowgrpo(capsys, "train", "toy-digits", *TOY, f"run.output_dir={out}", *extra)
    return code, err


@pytest.mark.slow  # trains end to end
def test_resume_refuses_a_config_that_changes_what_is_computed(tmp_path, capsys):
    out = tmp_path / "run"
    assert toy_run(capsys, out, "trainer.max_steps=1")[0] == 0
    more = ("trainer.max_steps=2", "trainer.resume=auto")
    code, err = toy_run(capsys, out, *more, "reward=digits:0.5", "sample.group_size=4")
    lines = [ln for ln in err.splitlines() if ln.startswith("flowgrpo: error")]
    assert code == 2 and len(lines) == 1 and len(err.strip().splitlines()) == 1, err
    assert "reward, sample.group_size differ" in lines[0]
    assert "trainer.allow_config_change=true" in lines[0]
    assert not (out / "checkpoints" / "step_2").exists()
    # where files live and how work is batched do not define the run; max_steps neither
    code, err = toy_run(capsys, out, *more, "sample.rollout_batch_size=2")
    assert code == 0, err
    code, err = toy_run(
        capsys, out, "trainer.max_steps=3", "trainer.resume=auto", "reward=digits:0.5",
        "trainer.allow_config_change=true",
    )  # fmt: skip
    assert code == 0 and (out / "checkpoints" / "step_3").is_dir(), err


def test_run_defining_keys_are_one_list():
    from flowgrpo.config.loader import config_to_dict
    from flowgrpo.config.record import changed_keys

    a = config_to_dict(load_config(None, [], check_paths=False))
    b = config_to_dict(
        load_config(
            None,
            ["model.path=/moved/toy", "flow_grpo.kl_beta=0.1", "optim.lr=1e-3"]
            + ["advantage.async_reward=true", "trainer.max_steps=80", "fsdp.sp_degree=2"],
            check_paths=False,
        )
    )
    b["nft"]["beta"] = 0.5  # another algorithm's section (an override of it is refused)
    # the algorithm's own section counts, another algorithm's and the file locations do not;
    # the learning rate is not compared here
    assert changed_keys(a, b) == ["flow_grpo.kl_beta"]


@pytest.mark.slow  # trains end to end
def test_a_checkpoint_of_another_lora_rank_is_one_line(tmp_path, capsys):
    out = tmp_path / "lora"
    lora = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8")
    assert toy_run(capsys, out, "trainer.max_steps=1", *lora)[0] == 0
    code, _, err = flowgrpo(capsys, "eval", "--checkpoint", str(out), "lora.rank=8")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(r"checkpoint \S+step_1 does not match the model: \S+lora_A\S+ has shape "
                     r"\[4, \d+\] in the checkpoint, \[8, \d+\] in the model", err), err  # fmt: skip
    code, _, err = flowgrpo(capsys, "eval", "--checkpoint", str(out), "lora.enabled=false")
    assert code == 2 and "it is a LoRA, the config is a full fine-tune" in err, err
    code, _, err = flowgrpo(
        capsys, "sample", "--checkpoint", str(out), "--prompts", "a 3", "--out", str(tmp_path),
        "lora.target_modules=[to_q,to_k,to_v,to_out.0,ff.net.0.proj]",
    )  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "does not match the model: it has no " in err and "ff.net.0.proj" in err, err


def test_the_recorded_config_hides_secrets_and_names_the_command(tmp_path, monkeypatch):
    from flowgrpo.config.record import read_record, write_record

    cfg = load_config(None, ["reward.digits.options.api_key=s3cret"], check_paths=False)
    monkeypatch.setattr(
        cli, "current_argv", ["train", "a b", "reward.digits.options.api_key=s3cret"]
    )
    write_record(tmp_path, cfg)
    text = (tmp_path / "config.yaml").read_text()
    assert "s3cret" not in text and "<redacted>" in text
    assert "# command: flowgrpo train 'a b' 'reward.digits.options.api_key=<redacted>'\n" in text
    back = read_record(tmp_path)
    assert back["reward"][0]["options"] == {}  # a redacted value is left out when read back
    assert load_config(None, [], check_paths=False, recorded=back).reward[0].name == "digits"
    with pytest.raises(ConfigError, match="used preset 'toy-digits', not 'sd3-ocr'"):
        load_config("sd3-ocr", [], check_paths=False, recorded=back)


# -- 2. The first hour ------------------------------------------------------------------------


def test_tests_run_outside_the_working_folder():
    """A user's runs/ (from `make demo`) can never change a test: tests run in an empty folder."""
    assert Path.cwd().resolve() != REPO and not Path("runs").exists()
    assert not (Path.cwd() / "pyproject.toml").exists()


@pytest.mark.slow  # trains end to end
def test_make_demo_twice_then_another_algorithm(tmp_path, monkeypatch, capsys):
    """`make demo` as the Makefile runs it, a second `make demo`, then the README's
    `flowgrpo train algorithm=nft`: each works, and the NFT run gets its own folder."""
    recipe = re.search(r"^demo:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    words = shlex.split(recipe)
    assert words[0].endswith("flowgrpo") and words[1] == "train"
    monkeypatch.chdir(tmp_path)
    small = [*TOY, "trainer.max_steps=1"]
    assert flowgrpo(capsys, *words[1:], *small)[0] == 0
    code, out, err = flowgrpo(capsys, *words[1:], *small)  # the demo again: it is finished
    assert code == 0, err
    assert len((tmp_path / "runs/toy-digits/metrics.jsonl").read_text().splitlines()) == 1
    code, out, err = flowgrpo(capsys, "train", "algorithm=nft", *small)
    assert code == 0, err
    assert (tmp_path / "runs/toy-digits-nft/checkpoints/step_1").is_dir()
    assert load_config(None, ["algorithm=nft", "run.output_dir=x"]).run.output_dir == "x"
    cfg = load_config("sd3-ocr", ["algorithm=grpo_guard"], check_paths=False)
    assert cfg.run.output_dir == "runs/sd3-ocr-grpo_guard"
    code, _, err = flowgrpo(capsys, "train", *small)  # the message offers a folder too
    assert code == 2 and "run.output_dir=DIR" in err


def test_a_reward_module_in_the_current_folder_is_importable_from_the_console_script(
    tmp_path, monkeypatch, capsys
):
    """A console script puts its bin folder on sys.path, not the current folder (as `python
    -m` does): `flowgrpo train reward=myrewards:score` must find ./myrewards.py all the same."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "myrewards.py").write_text(
        "def score(images, prompts, metadata):\n    return images.mean(dim=(1, 2, 3))\n"
    )
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "myrewards", raising=False)
    assert importlib.util.find_spec("myrewards") is None
    code, err = toy_run(capsys, tmp_path / "run", "reward=myrewards:score", "trainer.max_steps=1")
    assert code == 0, err
    rows = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "reward/score_mean" in rows
    sys.modules.pop("myrewards", None)


def test_a_forgotten_preset_names_the_presets_that_fit_the_model(sd3_dir):
    from flowgrpo.config.loader import list_presets
    from flowgrpo.config.shipped import preset_pipelines

    with pytest.raises(ConfigError, match=r"holds a StableDiffusion3Pipeline, but preset "
                       r"'toy-digits' \(the default.*flowgrpo train PRESET model.path=\.\.\. with "
                       r"PRESET one of sd3-geneval, sd3-ocr, sd3-vlm-judge$"):  # fmt: skip
        load_config(None, [f"model.path={sd3_dir}"])
    with pytest.raises(ConfigError, match="preset 'flux-pickscore' .* made for FluxPipeline"):
        load_config("flux-pickscore", [f"model.path={sd3_dir}"], command="sample")
    assert set(preset_pipelines()) == set(list_presets())  # a new preset says what it fits


def test_a_hub_id_resolves_from_the_local_cache_or_says_how_to_download(tmp_path, monkeypatch):
    import huggingface_hub.constants as hf

    from flowgrpo.models.registry import load_pipeline

    monkeypatch.setattr(hf, "HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--someone--tiny-toy"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    from flowgrpo.toy.pipeline import ToyDigitsPipeline

    ToyDigitsPipeline.from_config(seed=0).save_pretrained(snapshot)
    cfg = load_config(None, ["model.path=someone/tiny-toy"], command="sample")
    assert cfg.model.path == "someone/tiny-toy"
    assert type(load_pipeline(cfg.model.path)).__name__ == "ToyDigitsPipeline"
    with pytest.raises(ConfigError, match=r"hub id .* not in the local cache.*hf download "
                       r"stabilityai/stable-diffusion-3.5-medium"):  # fmt: skip
        load_config("sd3-ocr", ["model.path=stabilityai/stable-diffusion-3.5-medium"])


def test_reward_model_paths_are_checked_before_anything_loads(tmp_path):
    ok = [f"model.path={random_toy_path()}", "reward=pickscore"]
    with pytest.raises(ConfigError, match="'reward.pickscore.options.path': /no/PickScore_v1"):
        load_config(None, [*ok, "reward.pickscore.options.path=/no/PickScore_v1"])
    with pytest.raises(ConfigError, match="'reward.pickscore.options.processor_path'"):
        load_config(
            None,
            [*ok, f"reward.pickscore.options.path={tmp_path}"]
            + ["reward.pickscore.options.processor_path=/no/clip"],
        )


def test_reward_models_run_on_the_runs_device():
    from flowgrpo.rewards.base import _REGISTRY, takes_option
    from flowgrpo.rewards.spec import RewardSpec
    from flowgrpo.trainer.setup import build_rewards

    class OnDevice:
        accepts_video = True

        def __init__(self, device: str = "cpu") -> None:
            self.device = device

        def __call__(self, images, prompts, metadata):
            return [0.0] * len(prompts)

    _REGISTRY["_test_on_device"] = OnDevice
    try:
        made = build_rewards([RewardSpec("_test_on_device")], torch.device("cuda", 3))
        assert made.fns["_test_on_device"].device == "cuda:3"
        told = RewardSpec("_test_on_device", options={"device": "cpu"})
        assert build_rewards([told], "cuda:3").fns["_test_on_device"].device == "cpu"
    finally:
        del _REGISTRY["_test_on_device"]
    assert takes_option("pickscore", "device") and not takes_option("jpeg_compressibility", "x")
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
