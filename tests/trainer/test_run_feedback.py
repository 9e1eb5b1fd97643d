"""What a run tells its user while it goes: the startup banner, a line every
``trainer.log_every`` steps without the bar, per-phase times, memory and per-GPU throughput,
the warning (and absent ratio metrics) of a step without advantage signal, captioned grids,
``flowgrpo sample``'s prompt index, and silence where the libraries' noise is known harmless.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo import cli
from flowgrpo.config import load_config
from flowgrpo.testing.models import random_toy_path
from flowgrpo.trainer.figures import make_grid, save_images
from flowgrpo.trainer.logging import RunLogger, read_jsonl, step_line

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = [
    f"model.path={random_toy_path()}",
    "sample.prompts_per_step=2",
    "sample.group_size=4",
    "sample.num_steps=4",
    "sample.eval_num_steps=4",
    "sample.rollout_batch_size=8",
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=2",
    "update.micro_batch_size=8",
    "run.progress_bar=false",
    "run.tensorboard=false",
]
CONSTANT_REWARD = "import torch\n\ndef score(images, prompts, metadata):\n    return torch.full((len(images),), 0.5)\n"


def train(out: Path, *extra: str) -> dict:
    from flowgrpo.trainer.loop import run_training

    cfg = load_config("toy-digits", [*SMALL, f"run.output_dir={out}", *extra], command="train")
    return run_training(cfg)


@pytest.fixture(scope="module")
def three_steps(tmp_path_factory):
    """3 steps, log_every 2, eval and save every 2 (and at the last step): (out, stdout)."""
    out = tmp_path_factory.mktemp("feedback") / "run"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        train(
            out,
            "trainer.max_steps=3",
            "trainer.log_every=2",
            "trainer.eval_every=2",
            "trainer.save_every=2",
        )
    return out, buf.getvalue()


@pytest.mark.slow
def test_banner_names_the_layout_parameters_batch_algorithm_and_folder(three_steps):
    out, text = three_steps
    banner = text.split("\nstep ", 1)[0]
    from flowgrpo.toy.pipeline import ToyDigitsPipeline

    model = ToyDigitsPipeline.from_pretrained(random_toy_path()).transformer
    trainable = sum(p.numel() for p in model.parameters())  # a full fine-tune trains them all
    assert banner.startswith("flowgrpo train: flow_grpo on ")
    assert "1 rank(s) on cpu: 1 replica(s) x 1 FSDP shard(s) x sequence-parallel 1" in banner
    assert f"trainable  {trainable:,} of {trainable:,} parameters (full fine-tune)" in banner
    assert "2 prompts x 4 samples = 8 images (8 per data-parallel rank)" in banner
    assert f"output     {out}" in banner
    assert banner.count("flowgrpo train:") == 1


@pytest.mark.slow
def test_without_the_bar_a_line_every_log_every_steps_with_eta(three_steps):
    _, text = three_steps
    lines = [line for line in text.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/3", "3/3"]  # log_every 2, and the last
    assert all("ETA " in line and "reward " in line and "s/step" in line for line in lines)
    assert "eval " in lines[0] and lines[1].endswith("ETA 0:00:00")


@pytest.mark.slow
def test_phase_times_memory_and_per_gpu_throughput_are_logged(three_steps):
    out, text = three_steps
    rows = read_jsonl(out / "metrics.jsonl")
    for r in rows:
        for key in ("time/rollout_s", "time/reward_s", "time/train_s", "memory/host_peak_gib"):
            assert r[key] >= 0, key
        assert r["images_per_s_per_gpu"] == pytest.approx(8 / r["time/step_s"], rel=1e-6)
        assert 0.05 < r["memory/host_peak_gib"] < 64
    assert "time/eval_s" in rows[1] and "time/eval_s" not in rows[0]  # eval at step 2
    assert "time/checkpoint_s" in rows[2] and rows[2]["time/checkpoint_s"] > 0  # saved at 2
    assert "time/checkpoint_s" not in rows[1]
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert not any(k.startswith("time/") for e in evals for k in e)  # eval.jsonl: reproducible
    assert "base eval: " in text
    assert "the last checkpoint took" in text  # the save at step 3 has no later row


@pytest.mark.slow
def test_grids_caption_each_row_with_its_prompt_and_each_image_with_its_reward(three_steps):
    out, _ = three_steps
    from PIL import Image

    bare = make_grid(torch.zeros(4, 1, 8, 8), nrow=2)  # 2 prompts x 2 seeds, no text
    texts = make_grid(torch.zeros(4, 1, 8, 8), nrow=2, captions=["p"] * 4, notes=["0"] * 4)
    for name in ("grid_before.png", "grid_after.png"):
        grid = np.asarray(Image.open(out / name).convert("RGB"))
        assert grid.shape == texts.shape, (name, grid.shape, bare.shape)
        band = (texts.shape[0] - bare.shape[0]) // 4
        assert (grid[2 : 2 + band].min(axis=-1) > 200).sum() > 20  # row 0's prompt, in white


@pytest.mark.slow
def test_a_step_without_advantage_signal_warns_and_logs_no_ratio_metrics(
    three_steps, tmp_path, monkeypatch
):
    (tmp_path / "const_reward_t23.py").write_text(CONSTANT_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        train(tmp_path / "run", "trainer.max_steps=1", "reward=const_reward_t23:score")
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["zero_std_ratio"] == 1.0 and row["advantage_abs_mean"] == 0.0
    assert "train/clipfrac" not in row and "train/ratio_mean" not in row
    assert "train/loss" in row  # what is meaningful stays
    normal = read_jsonl(three_steps[0] / "metrics.jsonl")[0]
    assert "train/clipfrac" in normal and "train/ratio_mean" in normal
    assert "warning: step 1: every group's rewards were equal" in buf.getvalue()


@pytest.mark.slow
def test_sample_writes_which_prompt_made_which_file(tmp_path, capsys):
    prompts = ["a handwritten 3", "a handwritten 8", "a handwritten 3"]
    code = cli.main(
        ["sample", "toy-digits", *SMALL, f"run.output_dir={tmp_path / 'run'}",
         "--prompts", *prompts, "--out", str(tmp_path / "s")]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    index = read_jsonl(tmp_path / "s" / "prompts.jsonl")
    assert index == [
        {"file": f"sample_{i:04d}.png", "index": i, "prompt": p} for i, p in enumerate(prompts)
    ]
    assert all((tmp_path / "s" / r["file"]).is_file() for r in index)


@pytest.mark.slow
def test_a_failing_reward_at_the_base_eval_says_base_eval(tmp_path, capsys):
    bad = tmp_path / "eval.jsonl"
    bad.write_text(json.dumps({"prompt": "a handwritten 3", "digit": "x"}) + "\n")
    code = cli.main(
        ["train", "toy-digits", *SMALL, f"run.output_dir={tmp_path / 'run'}",
         f"data.eval_prompts={bad}", "trainer.max_steps=1"]
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and err.endswith("(base eval)"), err
    assert "step -1" not in err


def test_make_grid_captions_rows_and_notes_cells():
    images = torch.zeros(4, 1, 8, 8)  # black cells: any white pixel is text
    bare = make_grid(images, nrow=2)
    grid = make_grid(
        images, nrow=2, captions=["a handwritten 7"] * 2 + ["a handwritten 1"] * 2,
        notes=["0.912", "0.100", "0.500", "0.250"],
    )  # fmt: skip
    assert grid.shape[1] == bare.shape[1]
    band = (grid.shape[0] - bare.shape[0]) // 4  # a caption and a note band on 2 rows
    assert band > 8 and grid.shape[0] - bare.shape[0] == 4 * band
    row_h = 2 + band + 64 + band
    cap0, cap1 = grid[2 : 2 + band], grid[2 + row_h : 2 + row_h + band]
    assert (cap0 > 200).any() and (cap1 > 200).any()
    assert not np.array_equal(cap0, cap1)  # each row its own prompt
    cell = grid[2 + band : 2 + band + 64, 2 : 2 + 64]
    assert (cell == 0).all()  # the image itself is untouched by the text
    note = grid[2 + band + 64 : 2 + row_h - 2, 2 : 2 + 64]
    assert (note > 200).any()
    # a prompt longer than the row is shortened to fit: no text past the row's right edge
    long = make_grid(images[:2], nrow=2, captions=["x" * 500] * 2)
    assert not (long[:, -2:] > 200).any()


def test_make_grid_per_cell_captions_when_a_row_holds_several_prompts():
    images = torch.zeros(2, 1, 8, 8)
    one = make_grid(images, nrow=2, captions=["7", "7"])
    two = make_grid(images, nrow=2, captions=["7", "1"])
    right = slice(2 + 64 + 2, 2 + 64 + 2 + 64)
    assert not (one[:14, right] > 200).any()  # one caption, at the row's start
    assert (two[:14, right] > 200).any()  # the second cell's own caption


def test_step_line_and_the_logger_print_every_log_every_steps(tmp_path, capsys):
    log = RunLogger(tmp_path, total_steps=5, tensorboard=False, progress=False, log_every=2)
    for step in range(1, 6):
        log.log_step({"step": step, "reward_mean": 0.5, "time/step_s": 1.0})
    log.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in lines] == ["2/5", "4/5", "5/5"]
    line = step_line({"step": 4, "reward_mean": 0.61234, "time/step_s": 1.5}, 40, 43.4)
    assert line == "step 4/40  reward 0.612  1.50 s/step  ETA 0:00:43"


def test_the_bar_shows_an_eta(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLOWGRPO_NO_PROGRESS", raising=False)
    log = RunLogger(tmp_path, total_steps=3, tensorboard=False, progress=True)
    log.log_step({"step": 1, "reward_mean": 0.5})
    log.close()
    assert "ETA " in capsys.readouterr().err


def test_save_images_writes_the_prompt_index(tmp_path):
    paths = save_images(torch.rand(2, 3, 8, 8), tmp_path, prompts=["a", "b"])
    assert [p.name for p in paths] == ["sample_0000.png", "sample_0001.png"]
    rows = read_jsonl(tmp_path / "prompts.jsonl")
    assert [(r["file"], r["prompt"]) for r in rows] == [
        ("sample_0000.png", "a"),
        ("sample_0001.png", "b"),
    ]


def test_tensorboard_eval_images_carry_prompt_and_reward_captions(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name, kwargs in (
        ("bare", {}),
        ("captioned", {"prompts": ["a 7", "a 1"], "rewards": [0.9, 0.1]}),
    ):
        log = RunLogger(tmp_path / name, tensorboard=True, progress=False)
        log.log_images("eval/images", torch.zeros(2, 1, 8, 8), 1, nrow=1, **kwargs)
        log.close()
    sizes = {}
    for name in ("bare", "captioned"):
        acc = EventAccumulator(str(tmp_path / name / "tensorboard"))
        acc.Reload()
        (event,) = acc.Images("eval/images")
        sizes[name] = (event.height, event.width)
    assert sizes["captioned"][1] == sizes["bare"][1]
    assert sizes["captioned"][0] > sizes["bare"][0]  # a caption band and a reward band a row


def test_wandb_gets_captioned_images_and_a_per_prompt_table(tmp_path):
    pytest.importorskip("wandb")
    log = RunLogger(tmp_path, wandb="offline", tensorboard=False, progress=False)
    log.log_images("eval/images", torch.rand(2, 3, 8, 8), 1, 1, ["a 7", "a 1"], [0.9, 0.1])
    log.close()
    (table,) = tmp_path.rglob("offline-run-*/files/media/table/eval/images_table_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"] == ["prompt", "reward", "image"]
    assert [row[:2] for row in data["data"]] == [["a 7", 0.9], ["a 1", 0.1]]


def test_wandb_video_captions_and_table_need_no_moviepy(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setitem(sys.modules, "moviepy", None)  # as if it were not installed
    log = RunLogger(tmp_path, wandb="offline", tensorboard=False, progress=False)
    log.log_images("eval/images", torch.rand(2, 3, 3, 8, 8), 1, 1, ["a 7", "a 1"], [0.9, 0.1])
    log.close()
    (table,) = tmp_path.rglob("offline-run-*/files/media/table/eval/images_table_*.table.json")
    assert [r[:2] for r in json.loads(table.read_text())["data"]] == [["a 7", 0.9], ["a 1", 0.1]]
    assert len(list(tmp_path.rglob("offline-run-*/files/media/videos/eval/*.gif"))) >= 3


def test_loading_bars_from_rank_zero_only():
    import diffusers.utils.logging as dl
    import transformers.utils.logging as tl

    from flowgrpo.trainer.quiet import quiet_known_noise

    try:
        quiet_known_noise(is_main=True)
        assert dl.is_progress_bar_enabled() and tl.is_progress_bar_enabled()
        quiet_known_noise(is_main=False)
        assert not dl.is_progress_bar_enabled() and not tl.is_progress_bar_enabled()
    finally:
        dl.enable_progress_bar()
        tl.enable_progress_bar()


def test_only_the_known_harmless_warnings_are_silenced():
    from flowgrpo.trainer.quiet import TRUNCATION_LOGGERS, quiet_known_noise

    quiet_known_noise(is_main=True)
    view = (
        "FSDP2-wrapped module (JointTransformerBlock) returned a view tensor. An in-place op "
        "on this view (e.g., `x += y`) will silently drop the pre-backward hook"
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        quiet_known_noise(is_main=True)  # its filter goes in front again
        warnings.warn(view, UserWarning, stacklevel=1)
        warnings.warn("FSDP2 something else returned a view tensor", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["FSDP2 something else returned a view tensor"]

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger(TRUNCATION_LOGGERS[0])
    handler = Keep()
    logger.addHandler(handler)
    try:
        text = "The following part of your input was truncated because CLIP can only handle sequences up to 77 tokens: "
        logger.warning(text + "['']")
        logger.warning(text + "['', '']")
        logger.warning(text + "['a neon sign that says OPEN']")
    finally:
        logger.removeHandler(handler)
    assert records == [text + "['a neon sign that says OPEN']"]


@pytest.mark.slow
def test_two_ranks_print_one_banner_and_one_line_per_step(tmp_path):
    """2 CLI processes (as torchrun starts them): rank 0 prints the banner (2 ranks, 4 images
    each) and the step lines; rank 1 prints none of it."""
    from flowgrpo.testing.ranks import start_cli_ranks

    args = ["train", "toy-digits", *SMALL, f"run.output_dir={tmp_path / 'ddp'}"]
    procs = start_cli_ranks([*args, "trainer.max_steps=1"], stdout=True)
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    rank0, rank1 = outs[0][0], outs[1][0]
    assert rank0.count("flowgrpo train:") == 1 and rank1.count("flowgrpo train:") == 0
    assert "2 rank(s) on cpu: 1 replica(s) x 2 FSDP shard(s) x sequence-parallel 1" in rank0
    assert "8 images (4 per data-parallel rank)" in rank0
    assert [x for x in rank0.splitlines() if x.startswith("step ")][0].startswith("step 1/1 ")
    assert "step 1/1" not in rank1 and "warning:" not in rank1
