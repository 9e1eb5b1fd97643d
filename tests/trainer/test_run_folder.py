"""A run folder is the run's own (issue 24): a resume takes new optimizer settings, a checkpoint
counts as good only once a rollout from it was finite, run.overwrite deletes only what a run
wrote, a live run locks its folder, and metrics.jsonl / eval.jsonl stay right after an early
failure, a restart or a deleted folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_run_safety import SMALL

from flowgrpo import cli
from flowgrpo.trainer.logging import read_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train(capsys, out: Path, *extra: str) -> tuple[int, list[str], list[str]]:
    """``flowgrpo train`` in this process: (exit code, stdout lines, error lines)."""
    code = cli.main(["train", "toy-digits", *SMALL, f"run.output_dir={out}", *extra])
    got = capsys.readouterr()
    errors = [x for x in got.err.splitlines() if x.startswith("flowgrpo: error")]
    return code, got.out.splitlines(), errors


def test_resume_with_a_new_lr_uses_it_from_the_next_step_and_says_so(tmp_path, capsys):
    """Before: the restored optimizer kept lr 3e-4 and weight decay 1e-4, without a word."""
    out = tmp_path / "lr"
    assert train(capsys, out, "trainer.max_steps=2", "trainer.save_every=1")[0] == 0
    code, lines, errors = train(
        capsys, out, "trainer.max_steps=3", "trainer.resume=auto", "optim.lr=1e-6",
        "optim.weight_decay=0",
    )  # fmt: skip
    assert code == 0, errors
    said = [x for x in lines if x.startswith("optimizer settings changed")]
    assert said == [
        "optimizer settings changed on resume, in effect from step 3: "
        "optim.lr 0.0003 -> 1e-06, optim.weight_decay 0.0001 -> 0"
    ]
    assert [r["train/lr"] for r in read_jsonl(out / "metrics.jsonl")] == [3e-4, 3e-4, 1e-6]
