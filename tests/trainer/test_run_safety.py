"""Nothing lost, nothing hidden (issue 13): a folder holding another run is refused or
overwritten on request, divergence stops with one line and never writes non-finite weights,
and failures while running are one line on stderr naming the culprit, exit 1, on one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from flowgrpo import cli
from flowgrpo.testing.models import random_toy_path
from flowgrpo.trainer.logging import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SMALL = [
    f"model.path={random_toy_path()}",  # random init: independent of the shipped asset
    "sample.prompts_per_step=2",
    "sample.group_size=4",
    "sample.num_steps=4",
    "sample.eval_num_steps=4",
    "sample.rollout_batch_size=4",
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=2",
    "update.micro_batch_size=4",
    "trainer.eval_every=0",
    "run.progress_bar=false",
    "run.tensorboard=false",
]


def run_cli(capsys, out: Path, *extra: str) -> tuple[int, list[str]]:
    """``flowgrpo train`` in this process: (exit code, the error lines on stderr)."""
    code = cli.main(["train", "toy-digits", *SMALL, f"run.output_dir={out}", *extra])
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.startswith("flowgrpo: error")]


def checkpoint_run_ids(out: Path) -> dict[str, str | None]:
    return {
        d.name: json.loads((d / "meta.json").read_text()).get("run_id")
        for d in sorted((out / "checkpoints").iterdir())
    }


def test_a_second_run_never_destroys_or_mixes_with_the_first(tmp_path, capsys):
    """Before: the second run's keep-last pruning deleted its own step_1/step_2 and kept the
    old run's step_3/step_4, which eval/sample/export then used."""
    out = tmp_path / "x"
    code, _ = run_cli(capsys, out, "trainer.max_steps=4", "trainer.save_every=1")
    assert code == 0
    first = checkpoint_run_ids(out)
    assert list(first) == ["step_3", "step_4"]
    (out / "notes.txt").write_text("mine")  # not a run output: never touched
    code, errors = run_cli(capsys, out, "trainer.max_steps=2", "trainer.save_every=1", "seed=1")
    assert code == 2 and len(errors) == 1
    assert str(out) in errors[0] and "trainer.resume=auto" in errors[0]
    assert "run.overwrite=true" in errors[0]
    assert checkpoint_run_ids(out) == first  # refused before anything was written
    code, _ = run_cli(
        capsys, out, "trainer.max_steps=2", "trainer.save_every=1", "seed=1", "run.overwrite=true"
    )
    assert code == 0
    second = checkpoint_run_ids(out)
    assert list(second) == ["step_1", "step_2"]
    assert len(set(second.values())) == 1 and set(second.values()).isdisjoint(first.values())
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert (out / "notes.txt").read_text() == "mine"


def test_divergence_is_one_line_and_no_non_finite_checkpoint(tmp_path, capsys):
    """optim.lr=1e6: before, a checkpoint of NaN weights was written and the run died on
    "reward images must lie in [0, 1], got range [nan, nan]"."""
    out = tmp_path / "lr"
    code, errors = run_cli(
        capsys, out, "optim.lr=1e6", "trainer.max_steps=6", "trainer.save_every=1"
    )
    assert code == 1 and len(errors) == 1, errors
    assert errors[0].startswith("flowgrpo: error: training diverged") and "optim.lr" in errors[0]
    assert "reward" not in errors[0]
    for step in (out / "checkpoints").iterdir():  # whatever was kept is finite
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(step), str(tmp_path / f"{step.name}.pt"))
        model = torch.load(tmp_path / f"{step.name}.pt", weights_only=True)["model"]
        assert all(torch.isfinite(t).all() for t in model.values())


def test_config_floats_must_be_finite(tmp_path, capsys):
    code, errors = run_cli(capsys, tmp_path / "inf", "optim.lr=inf")
    assert code == 2 and errors == [
        "flowgrpo: error: config key 'optim.lr' must be a finite number, got inf"
    ]
    assert not (tmp_path / "inf").exists()


def test_bad_metadata_names_the_reward_and_the_line(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"a handwritten {d}", "digit": d} for d in range(4)]
    rows[2]["digit"] = "x"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, errors = run_cli(
        capsys, tmp_path / "meta", f"data.train_prompts={prompts}", "sample.prompts_per_step=4",
        "trainer.max_steps=1",
    )  # fmt: skip
    assert code == 1 and len(errors) == 1, errors
    assert "reward 'digits' failed" in errors[0] and f"{prompts}:3" in errors[0]
    assert "metadata 'digit' must be an integer 0-9, got 'x'" in errors[0]


def test_unwritable_output_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    out = tmp_path / "file" / "run"
    code, errors = run_cli(capsys, out, "trainer.max_steps=1")
    assert code == 1 and len(errors) == 1
    assert errors[0].startswith(f"flowgrpo: error: cannot write to run.output_dir {out}")


def test_debug_switch_prints_the_traceback(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    cli.main(["train", *SMALL, f"run.output_dir={tmp_path / 'file' / 'r'}", "run.debug=true"])
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.strip().endswith(
        "folder (run.output_dir=...)"
    )


REWARD = """
import os

def flaky(images, prompts, metadata):
    if os.environ.get("RANK") == "1":
        raise ConnectionError("reward backend down on this node")
    return [0.5] * len(prompts)
"""


def test_a_failure_on_one_rank_is_reported_once_and_every_rank_exits(tmp_path):
    """2 CLI processes (as torchrun starts them): the reward fails on rank 1 only. Exactly one
    line in all, from rank 1; both exit 1; nothing hangs (the timeout would fail the test)."""
    from flowgrpo.testing.ranks import start_cli_ranks

    (tmp_path / "flakymod.py").write_text(REWARD)
    args = ["train", "toy-digits", *SMALL, f"run.output_dir={tmp_path / 'ddp'}"]
    procs = start_cli_ranks(
        [*args, "trainer.max_steps=2", "reward=flakymod:flaky"], pythonpath=[str(tmp_path)]
    )
    errs = [p.communicate(timeout=180)[1] for p in procs]
    assert [p.returncode for p in procs] == [1, 1], errs
    lines = [[x for x in e.splitlines() if x.startswith("flowgrpo: error")] for e in errs]
    assert lines[0] == [] and len(lines[1]) == 1, errs
    assert "reward 'flaky' failed" in lines[1][0] and "backend down" in lines[1][0]
    assert all("Traceback" not in e for e in errs)
