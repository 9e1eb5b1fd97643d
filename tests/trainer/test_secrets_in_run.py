"""A reward's token never reaches the run folder: not the wandb files (``run-*.wandb``,
``debug.log``, metadata), tensorboard or the checkpoints, even when given on the command line,
inside a structured override as much as under its own key."""

from __future__ import annotations

import sys

import pytest

from flowgrpo import cli
from flowgrpo.rewards.server import serve_reward
from flowgrpo.testing.models import random_toy_path
from flowgrpo.testing.ranks import one_thread

pytestmark = pytest.mark.slow  # an end-to-end run (~15 s)

TOKEN = "tok-5ecret-9f3a7c2e1b"


def test_the_reward_token_is_in_no_file_of_the_run_folder(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("FLOWGRPO_REWARD_TOKEN", raising=False)
    server = serve_reward("digits", token=TOKEN).start_in_thread()
    out = tmp_path / "run"
    argv = [
        "train",
        "toy-digits",
        f"model.path={random_toy_path()}",
        "sample.prompts_per_step=2",
        "sample.group_size=2",
        "sample.num_steps=2",
        "sample.eval_num_steps=2",
        "data.eval_num_prompts=1",
        "data.eval_samples_per_prompt=2",
        "update.micro_batch_size=4",
        "trainer.max_steps=1",
        "trainer.save_every=1",
        "run.progress_bar=false",
        "run.wandb=true",
        "run.wandb_mode=offline",
        # the token in each form an override can take: a whole reward list, an options
        # mapping, a dotted key (each must be redacted by the parsed value's path)
        f"reward=[{{name: remote, options: {{url: '{server.url}', token: {TOKEN}}}}}]",
        f"reward.remote.options={{url: '{server.url}', token: {TOKEN}, timeout: 30}}",
        f"reward.remote.options.token={TOKEN}",
        f"run.output_dir={out}",
    ]
    monkeypatch.setattr(sys, "argv", ["flowgrpo", *argv])  # as the command line gives it
    try:
        with one_thread():
            assert cli.main(argv) == 0, capsys.readouterr().err
    finally:
        server.close()
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in files) and any(p.name == "debug.log" for p in files)
    assert any("tfevents" in p.name for p in files) and (out / "checkpoints" / "step_1").is_dir()
    leaked = [str(p.relative_to(out)) for p in files if TOKEN.encode() in p.read_bytes()]
    assert leaked == [], f"the token is written in {leaked}"
    # wandb's record still says a token was set (redacted) and keeps the rest (the URL)
    record = next(p for p in files if p.suffix == ".wandb").read_bytes()
    assert b"<redacted>" in record and server.url.encode() in record
