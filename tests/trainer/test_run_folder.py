"""A run folder is the run's own (issue 24): a resume takes new optimizer settings, a checkpoint
counts as good only once a rollout from it was finite, run.overwrite deletes only what a run
wrote, a live run locks its folder, and metrics.jsonl / eval.jsonl stay right after an early
failure, a restart or a deleted folder."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_run_safety import SMALL

from flowgrpo import cli
from flowgrpo.trainer.logging import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
SRC = str(Path(__file__).resolve().parents[2] / "src")


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


def test_overwrite_deletes_only_what_a_run_wrote(tmp_path, capsys):
    """Before: run.overwrite=true deleted the whole checkpoints/, tensorboard/ and wandb/."""
    out = tmp_path / "ow"
    assert train(capsys, out, "trainer.max_steps=1", "run.tensorboard=true")[0] == 0
    first = (out / "checkpoints" / "step_1" / "meta.json").read_text()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    wandb_run = out / "wandb" / "offline-run-20260101_000000-abc123"  # what wandb writes
    (wandb_run / "files").mkdir(parents=True)
    (out / "wandb" / "debug.log").write_text("log")
    (out / "wandb" / "latest-run").symlink_to(wandb_run.name)
    mine = {  # a user's files beside the run's
        "checkpoints/my_model.safetensors": "weights",
        "tensorboard/notes.txt": "notes",
        "wandb/settings": "[default]",
        "notes.txt": "mine",
    }
    for name, text in mine.items():
        (out / name).write_text(text)
    # a user's folder named like a stale write (before: the first save's pruning of
    # step_*.tmp deleted it), and a checkpoint another run wrote (before: overwrite deleted it)
    (out / "checkpoints" / "step_best.tmp").mkdir()
    (out / "checkpoints" / "step_best.tmp" / "model.safetensors").write_text("best")
    other = out / "checkpoints" / "step_100"
    shutil.copytree(out / "checkpoints" / "step_1", other)
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "run_id": "another-run"}))
    code, _, errors = train(capsys, out, "trainer.max_steps=1", "run.overwrite=true", "seed=1")
    assert code == 0, errors
    assert {name: (out / name).read_text() for name in mine} == mine
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "my_model.safetensors",
        "step_1",
        "step_100",
        "step_best.tmp",
    ]
    assert (out / "checkpoints" / "step_best.tmp" / "model.safetensors").read_text() == "best"
    assert json.loads((other / "meta.json").read_text())["run_id"] == "another-run"
    assert (out / "checkpoints" / "step_1" / "meta.json").read_text() != first  # the new run's
    assert sorted(p.name for p in (out / "tensorboard").iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in (out / "wandb").iterdir()) == ["settings"]


HOLD = """
import fcntl, os, socket, sys, time
f = open(os.path.join(sys.argv[1], ".flowgrpo.lock"), "a+")
fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a live run holds
f.write(f"pid {os.getpid()} on {socket.gethostname()}")
f.flush()
print("locked", flush=True)
time.sleep(600)
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if k not in extra:
            env.pop(k, None)
    return env


@contextlib.contextmanager
def live_run(out: Path):
    """Another process holding ``out`` as a live run does (an exclusive flock on its
    .flowgrpo.lock); SIGKILLed at the end (its lock file stays behind, as a killed run's)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(out)], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def test_a_resume_from_an_earlier_step_retires_the_abandoned_branch(tmp_path, capsys):
    """Before: resuming step_2 while step_3 and step_4 existed, then trainer.resume=auto,
    resumed the abandoned branch's step_4 and metrics.jsonl held steps [1, 2, 3, 5]."""
    out = tmp_path / "branch"
    ckpts = out / "checkpoints"
    code, _, errors = train(
        capsys, out, "trainer.max_steps=4", "trainer.save_every=1", "trainer.keep_last=10"
    )
    assert code == 0, errors
    old = {d: (ckpts / d / "meta.json").read_text() for d in ("step_3", "step_4")}
    code, lines, errors = train(
        capsys, out, f"trainer.resume={ckpts / 'step_2'}", "trainer.max_steps=3",
        "trainer.save_every=1", "trainer.keep_last=10",
    )  # fmt: skip
    assert code == 0, errors
    said = [x for x in lines if "abandons the later branch" in x]
    assert len(said) == 1 and "step_3, step_4" in said[0] and "3 metric rows" in said[0], lines
    aside = [d for d in ckpts.iterdir() if d.name.startswith("abandoned_after_step_2.")]
    assert len(aside) == 1 and said[0].endswith(str(aside[0]))
    assert {d: (aside[0] / d / "meta.json").read_text() for d in old} == old  # moved, whole
    assert [r["step"] for r in read_jsonl(aside[0] / "metrics.jsonl")] == [3, 4]
    assert [r["step"] for r in read_jsonl(aside[0] / "eval.jsonl")] == [4]  # the last eval
    code, lines, errors = train(
        capsys, out, "trainer.resume=auto", "trainer.max_steps=5", "trainer.save_every=1",
        "trainer.keep_last=10",
    )  # fmt: skip
    assert code == 0, errors
    assert any(f"resumed    from {ckpts / 'step_3'} (step 3)" in x for x in lines), lines
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    steps = sorted(d.name for d in ckpts.iterdir() if d.name.startswith("step_"))
    assert steps == ["step_1", "step_2", "step_3", "step_4", "step_5"]


def test_a_live_run_locks_its_folder_and_a_killed_run_does_not(tmp_path, capsys):
    """Before: two runs into one folder both went ahead (interleaved metrics.jsonl)."""
    out = tmp_path / "lock"
    assert train(capsys, out, "trainer.max_steps=1", "trainer.save_every=1")[0] == 0
    assert not (out / ".flowgrpo.lock").exists()  # released at the end of the run
    with live_run(out) as holder:
        code, _, errors = train(capsys, out, "trainer.max_steps=2", "trainer.resume=auto")
        assert code == 1
        assert errors == [
            f"flowgrpo: error: run.output_dir {out} is in use by a running training run "
            f"(pid {holder.pid} on {socket.gethostname()}): wait for it to end or stop it, or "
            "choose another run.output_dir"
        ]
        assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]  # untouched
    assert (out / ".flowgrpo.lock").exists()  # the killed holder's lock file is left ...
    code, _, errors = train(capsys, out, "trainer.max_steps=2", "trainer.resume=auto")
    assert code == 0, errors  # ... and does not block the resume
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]


def test_the_lock_under_torchrun_two_ranks(tmp_path):
    """2 CLI processes as torchrun starts them: refused in one line while another run holds
    the folder (both exit 1, nothing hangs). (The 2-process runs of test_trainer_e2e.py and
    test_run_safety.py train under the lock: rank 0 holds it for both.)"""
    out = tmp_path / "ddp"
    out.mkdir()

    from flowgrpo.testing.ranks import start_cli_ranks

    def two_ranks() -> tuple[list[int], list[list[str]]]:
        args = ["train", "toy-digits", *SMALL, f"run.output_dir={out}", "trainer.max_steps=1"]
        procs = start_cli_ranks(args)
        errs = [p.communicate(timeout=180)[1] for p in procs]
        lines = [[x for x in e.splitlines() if x.startswith("flowgrpo: error")] for e in errs]
        return [p.returncode for p in procs], lines

    with live_run(out):
        codes, lines = two_ranks()
        assert codes == [1, 1], lines
        assert len(lines[0]) == 1 and lines[1] == [], lines
        assert "is in use by a running training run" in lines[0][0]
    assert not (out / "metrics.jsonl").exists()


def test_a_run_that_fails_before_step_1_does_not_block_the_rerun(tmp_path, capsys):
    """Before: the failed run left an empty metrics.jsonl, and the corrected rerun was refused
    ("already holds a run"); rerun with run.overwrite, eval.jsonl then had its step 0 twice."""
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": f"a handwritten {d}", "digit": d} for d in range(4)]
    bad = [*rows[:2], {**rows[2], "digit": "x"}, rows[3]]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in bad))
    out = tmp_path / "early"
    args = (f"data.train_prompts={prompts}", "sample.prompts_per_step=4", "trainer.max_steps=1")
    code, _, errors = train(capsys, out, *args)
    assert code == 1 and "metadata 'digit'" in errors[0]
    assert not (out / "metrics.jsonl").exists()
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))  # the corrected file
    code, _, errors = train(capsys, out, *args)
    assert code == 0, errors
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]
    assert [r["step"] for r in read_jsonl(out / "eval.jsonl")] == [0, 1]


def test_no_step_logged_means_no_run_in_the_folder(tmp_path):
    """An empty metrics.jsonl (a failed run of an older version) does not block a fresh run,
    and truncating away every row (a restart from step 0) leaves no file behind."""
    from flowgrpo.config.validate import holds_run
    from flowgrpo.trainer.logging import truncate_jsonl

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("")
    assert not holds_run(tmp_path)
    metrics.write_text('{"step": 1}\n')
    assert holds_run(tmp_path)
    truncate_jsonl(metrics, 1)
    assert read_jsonl(metrics) == [{"step": 1}]
    truncate_jsonl(metrics, -1)
    assert not metrics.exists() and not holds_run(tmp_path)


def test_a_crash_before_the_first_checkpoint_does_not_repeat_the_step_0_eval(tmp_path):
    """kill -9 during step 1 (as an elastic restart would), then trainer.resume=auto: there is
    no checkpoint, the run starts over, and eval.jsonl holds step 0 once (before: twice)."""
    from test_fault_injection import _run

    out = tmp_path / "crash"
    killed = _run(out, "trainer.max_steps=1", point="rollout", hit=2)  # step 1's 1st chunk
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(out / "eval.jsonl")] == [0]
    assert not (out / "checkpoints").exists()
    resumed = _run(out, "trainer.max_steps=1", "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(out / "eval.jsonl")] == [0, 1]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]


def test_a_run_folder_deleted_mid_run_is_an_error(tmp_path, capsys, monkeypatch):
    """Before: the run wrote on into deleted files and exited 0, its metrics lost."""
    from flowgrpo.trainer import loop

    out, real = tmp_path / "gone", loop.train_one_step

    def step_then_delete(run, step):
        metrics = real(run, step)
        if step == 1:
            shutil.rmtree(out)
        return metrics

    monkeypatch.setattr(loop, "train_one_step", step_then_delete)
    code, _, errors = train(capsys, out, "trainer.max_steps=2")
    assert code == 1
    assert errors == [
        f"flowgrpo: error: run.output_dir {out} (or a log file in it) was deleted while the run "
        "was writing to it: its metrics are lost; start the run again"
    ]


def _markers(out: Path) -> dict[str, list[str]]:
    from flowgrpo.engine.checkpoint import DIVERGED, ROLLOUT_OK

    return {
        d.name: [m for m in (ROLLOUT_OK, DIVERGED) if (d / m).exists()]
        for d in sorted((out / "checkpoints").iterdir())
    }


def test_a_checkpoint_whose_rollout_diverges_is_never_the_last_good_one(tmp_path, capsys):
    """optim.lr=100: step 1's weights are finite, their rollout is not. Before: step_1 was kept
    as "the last good checkpoint", and every resume from it diverged again."""
    out = tmp_path / "poisoned"
    code, _, errors = train(
        capsys, out, "optim.lr=100", "trainer.max_steps=3", "trainer.save_every=1"
    )
    step_1 = out / "checkpoints" / "step_1"
    assert code == 1 and errors == [
        "flowgrpo: error: training diverged: the rollout of step 2 produced non-finite latents "
        f"(the weights give NaN/inf); {step_1} holds these weights and is marked diverged; no "
        "checkpoint of this run has given a finite rollout: start again with a lower optim.lr "
        "(run.overwrite=true)"
    ]
    assert _markers(out) == {"step_1": ["DIVERGED"]}
    code, _, errors = train(capsys, out, "trainer.max_steps=1", "trainer.resume=auto")
    assert code == 0, errors  # step_1 is not resumed from: the run starts over
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1]


def test_divergence_names_the_last_good_checkpoint_and_pruning_keeps_it(tmp_path, capsys):
    """Two good steps, then a resume with optim.lr=100 and trainer.keep_last=1: step 3's
    weights diverge at step 4's rollout. step_2 (its rollout at step 3 was finite) is kept
    although keep_last=1, named, and the next trainer.resume=auto continues from it."""
    out = tmp_path / "named"
    assert train(capsys, out, "trainer.max_steps=2", "trainer.save_every=1")[0] == 0
    assert _markers(out) == {"step_1": ["ROLLOUT_OK"], "step_2": ["ROLLOUT_OK"]}
    code, _, errors = train(
        capsys, out, "trainer.max_steps=4", "trainer.save_every=1", "trainer.keep_last=1",
        "trainer.resume=auto", "optim.lr=100",
    )  # fmt: skip
    ckpts = out / "checkpoints"
    assert code == 1 and errors == [
        "flowgrpo: error: training diverged: the rollout of step 4 produced non-finite latents "
        f"(the weights give NaN/inf); {ckpts / 'step_3'} holds these weights and is marked "
        f"diverged; the last good checkpoint is {ckpts / 'step_2'}: resume from it "
        "(trainer.resume=auto) with a lower optim.lr"
    ]
    assert _markers(out) == {"step_2": ["ROLLOUT_OK"], "step_3": ["DIVERGED"]}
    code, _, errors = train(capsys, out, "trainer.max_steps=3", "trainer.resume=auto")
    assert code == 0, errors  # from step_2 (step_3's weights would diverge again)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [(r["step"], r["train/lr"]) for r in rows] == [(1, 3e-4), (2, 3e-4), (3, 3e-4)]
