"""What a newcomer reads (issue 39's walk): the help names every algorithm, the README says to
activate .venv and maps every model family, a piped run prints step lines, a finished run's
second start does not claim it trained, a video run's banner counts frames."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from flowgrpo.algorithms import ALGORITHMS
from flowgrpo.config import load_config
from flowgrpo.models.registry import SUPPORTED_PIPELINES
from flowgrpo.trainer.logging import (
    LINE_EVERY_S,
    RunLogger,
    startup_banner,
    steps_done,
    wants_bar,
    write_final_report,
)

ROOT = Path(__file__).resolve().parents[2]


def test_help_names_every_algorithm(capsys) -> None:
    from flowgrpo import cli

    parser = cli.build_parser([])
    text = parser.format_help()
    for name in ALGORITHMS:
        assert name in text, name
    assert "train with Flow-GRPO" not in text


def test_readme_says_to_activate_the_venv_and_maps_every_family() -> None:
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert "source .venv/bin/activate" in quick and "command not found" in quick
    row = next(line for line in readme.splitlines() if line.startswith("| `flowgrpo.models`"))
    modules = {v.split(":")[0].rsplit(".", 1)[1] for v in SUPPORTED_PIPELINES.values()}
    modules.discard("pipeline")  # the toy's, in flowgrpo.toy
    assert modules and all(f"`{m}`" in row for m in modules), modules


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_pipe_gets_step_lines_and_a_slow_run_a_line_a_minute(tmp_path, capsys) -> None:
    assert wants_bar(True, _Tty()) and not wants_bar(True, io.StringIO())
    assert not wants_bar(False, _Tty())
    log = RunLogger(tmp_path, total_steps=10, tensorboard=False, progress=False, log_every=5)
    log.log_step({"step": 1, "reward_mean": 0.5})
    assert capsys.readouterr().out == ""  # not a 5th step, not a minute yet
    log._last_line -= LINE_EVERY_S + 1
    log.log_step({"step": 2, "reward_mean": 0.5})
    log.close()
    assert capsys.readouterr().out.startswith("step 2/10")


def test_the_last_line_says_what_this_process_trained(tmp_path, capsys) -> None:
    assert steps_done(40, 0) == "40 steps"
    assert steps_done(40, 30) == "steps 31-40 (resumed at step 30)"
    assert steps_done(40, 40).startswith("no step to train (the run had finished at step 40")
    log = RunLogger(tmp_path, total_steps=2, start_step=2, tensorboard=False, progress=False)
    summary = {"base": {"eval/r": 0.5}, "final": {"eval/r": 0.6}, "steps": 2, "wall_s": 8.0}
    write_final_report(tmp_path, torch.zeros(1, 1, 8, 8), 1, summary, log)
    log.close()
    out = capsys.readouterr().out
    assert "2 steps, 8 s" not in out and "no step to train" in out


def test_a_video_banner_counts_frames() -> None:
    cfg = load_config(None, [], check_paths=False)
    kw = dict(world_size=1, device="cpu", trainable=1, total=2, output_dir="runs/x")
    assert "images" in startup_banner(cfg, **kw) and "frames" not in startup_banner(cfg, **kw)
    video = startup_banner(cfg, num_frames=9, **kw)
    assert " videos (" in video and "px, 9 frames" in video
