"""The run folder's own files at a start, without a model (issue 40, items 2 and 7): the
branch a resume from an earlier step abandons is moved aside with its metric rows, what a
killed save or prune left goes, and overwrite's test of which checkpoints are the run's."""

from __future__ import annotations

import json
from pathlib import Path

from flowgrpo.trainer.logging import read_jsonl
from flowgrpo.trainer.run_folder import (
    recorded_run_ids,
    removable_checkpoint,
    retire_later_branch,
    tidy_on_start,
)


def _checkpoint(root: Path, step: int, run_id: str | None, complete: bool = True) -> Path:
    """A folder with the names a checkpoint write produces (contents do not matter here)."""
    d = root / f"step_{step}"
    (d / "rng").mkdir(parents=True)
    (d / "rng" / "rank_0.pt").write_bytes(b"x")
    (d / "__0_0.distcp").write_bytes(b"x")
    (d / "meta.json").write_text(json.dumps({"step": step, "run_id": run_id}))
    if complete:
        (d / "COMPLETE").write_text("ok\n")
    return d


def _rows(path: Path, steps: list[int]) -> None:
    path.write_text("".join(json.dumps({"step": s, "reward_mean": s / 10}) + "\n" for s in steps))


def test_retiring_moves_later_checkpoints_and_rows_and_says_so(tmp_path):
    out, ckpts = tmp_path, tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        _checkpoint(ckpts, step, "r1")
    _rows(out / "metrics.jsonl", [1, 2, 3, 4])
    _rows(out / "eval.jsonl", [0, 2, 4])
    line = retire_later_branch(out, ckpts, 2)
    aside = next(ckpts.glob("abandoned_after_step_2.*"))
    assert line == (
        "resuming from step 2 abandons the later branch of this folder: moved its checkpoints "
        f"step_3, step_4 and 3 metric rows after step 2 to {aside}"
    )
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(["step_1", "step_2", aside.name])
    assert sorted(p.name for p in aside.iterdir()) == [
        "eval.jsonl", "metrics.jsonl", "step_3", "step_4",
    ]  # fmt: skip
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert [r["step"] for r in read_jsonl(out / "eval.jsonl")] == [0, 2]
    assert [r["step"] for r in read_jsonl(aside / "metrics.jsonl")] == [3, 4]
    assert retire_later_branch(out, ckpts, 2) is None  # nothing later now: nothing said


def test_a_start_removes_leftovers_records_the_run_and_retires(tmp_path):
    out, ckpts = tmp_path, tmp_path / "checkpoints"
    _checkpoint(ckpts, 1, "r1")
    _checkpoint(ckpts, 2, "r1", complete=False)  # a prune killed midway (old rmtree order)
    _checkpoint(ckpts, 3, "r1").rename(ckpts / "step_3.tmp")  # a save killed midway
    _checkpoint(ckpts, 5, "r1")  # a later branch
    (ckpts / "step_best.tmp").mkdir()  # a user's
    (ckpts / "step_best.tmp" / "model.bin").write_bytes(b"mine")
    lines = tidy_on_start(out, ckpts, 1, "r1")
    assert lines[0] == (
        f"removed what an interrupted checkpoint write or prune left in {ckpts}: step_2, step_3.tmp"
    )
    assert len(lines) == 2 and "moved its checkpoints step_5 and 0 metric rows" in lines[1]
    assert recorded_run_ids(out) == {"r1"}
    names = sorted(p.name for p in ckpts.iterdir() if not p.name.startswith("abandoned"))
    assert names == ["step_1", "step_best.tmp"]
    assert tidy_on_start(out, ckpts, 1, "r2") == [] and recorded_run_ids(out) == {"r1", "r2"}


def test_overwrite_takes_only_the_recorded_runs_checkpoints(tmp_path):
    mine, other = _checkpoint(tmp_path, 1, "r1"), _checkpoint(tmp_path, 100, "someone")
    old = _checkpoint(tmp_path, 7, None)  # from before run ids
    user = tmp_path / "step_9"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    assert removable_checkpoint(mine, {"r1"}) and removable_checkpoint(old, {"r1"})
    assert not removable_checkpoint(other, {"r1"}) and not removable_checkpoint(user, {"r1"})
    assert removable_checkpoint(other, None)  # no record (an older folder): as before
