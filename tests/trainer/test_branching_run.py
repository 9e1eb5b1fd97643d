"""A branching run of the toy (``sample.branching``): trains, logs its tree edges, and resumes
bit-exact (4 steps straight == 2 steps, resume=auto, 2 more: metrics and weights)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.testing.models import random_toy_path
from flowgrpo.trainer.logging import deterministic_view, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SMALL = [
    f"model.path={random_toy_path()}",
    "sample.prompts_per_step=2",
    "sample.group_size=4",
    "sample.num_steps=4",
    "sample.eval_num_steps=4",
    "sample.rollout_batch_size=4",  # one tree per chunk
    "sample.branching.split_steps=[0,1]",
    "sample.branching.factors=[2,2]",
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=2",
    "update.micro_batch_size=4",
    "trainer.eval_every=2",
    "trainer.save_every=2",
    "trainer.keep_last=2",
    "run.progress_bar=false",
]


def train(out: Path, *extra: str) -> dict:
    from flowgrpo.trainer.loop import run_training

    return run_training(load_config("toy-digits", [*SMALL, f"run.output_dir={out}", *extra]))


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(dst))
    return torch.load(dst, weights_only=False)["model"]


def test_branching_run_resumes_bit_exact(tmp_path):
    first = tmp_path / "first"
    train(first, "trainer.max_steps=2")
    rows = read_jsonl(first / "metrics.jsonl")
    # 2 trees of 4 leaves, 3 trained steps: 2 + 4 + 4 edges each, none before a split
    assert [r["train/tree_edges_trained"] for r in rows] == [20.0, 20.0]
    assert all(r["train/samples_trained"] == 8.0 for r in rows)
    resumed = tmp_path / "resumed"
    shutil.copytree(first, resumed)
    summary = train(resumed, "trainer.max_steps=4", "trainer.resume=auto")
    assert summary["resumed_from"].endswith("step_2")
    straight = tmp_path / "straight"
    train(straight, "trainer.max_steps=4")
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    assert [deterministic_view(r) for r in a] == [deterministic_view(r) for r in b]
    wa, wb = weights(straight / "checkpoints/step_4"), weights(resumed / "checkpoints/step_4")
    assert wa.keys() == wb.keys() and len(wa) > 10
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    w2 = weights(resumed / "checkpoints/step_2")  # training moved the weights: the test can fail
    assert any(not torch.equal(w2[k], wb[k]) for k in wb)
