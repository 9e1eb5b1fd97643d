"""Which files of a run folder are this run's, across its starts and resumes.

- ``.flowgrpo-run-ids`` (in the run folder): the run ids that wrote checkpoints here, one a
  line (each start adds its own; a stale id is harmless). ``run.overwrite`` deletes only the checkpoints of these ids
  (``removable_checkpoint``): a ``step_<N>`` another run wrote (copied in by hand) stays.
- A resume from step N while later checkpoints exist abandons their branch: those
  ``step_<M>`` (M > N) and the rows of ``metrics.jsonl`` / ``eval.jsonl`` after step N are
  moved to ``checkpoints/abandoned_after_step_<N>.<time>/``, and one line says so; a later
  ``trainer.resume=auto`` then continues the new branch, and the metrics hold it alone.
  (``trainer.resume=auto`` that finds no checkpoint to take, every one diverged, starts
  from step 0: N = 0.) flowgrpo never deletes an abandoned branch, ``run.overwrite``
  included: it is yours to keep or remove.
- What a killed save or prune left (``step_<N>.tmp``, a ``step_<N>`` without its COMPLETE
  marker) is removed at the next start, when it holds only what a checkpoint write produces
  (``flowgrpo.engine.checkpoint_dirs.remove_leftovers``).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from flowgrpo.engine.checkpoint_dirs import (
    STEP_DIR,
    STEP_TMP,
    remove_leftovers,
    run_id_of,
    written_by_save,
)

RUN_IDS = ".flowgrpo-run-ids"
ABANDONED = re.compile(r"abandoned_after_step_\d+\.\d{8}-\d{6}(-\d+)?")
#: the run folder's files with one row per step (moved with an abandoned branch)
STEP_ROWS = ("metrics.jsonl", "eval.jsonl")


def recorded_run_ids(out: Path) -> set[str] | None:
    """The run ids recorded in the run folder ``out``; None when there is no record (a folder
    written before records were kept)."""
    try:
        return {x.strip() for x in (out / RUN_IDS).read_text().splitlines() if x.strip()}
    except FileNotFoundError:
        return None


def record_run_id(out: Path, run_id: str | None) -> None:
    """Add ``run_id`` to the run folder's record (rank 0, at the start of a run)."""
    if not run_id or run_id in (recorded_run_ids(out) or set()):
        return
    with open(out / RUN_IDS, "a") as f:
        f.write(f"{run_id}\n")


def removable_checkpoint(folder: Path, run_ids: set[str] | None) -> bool:
    """Whether ``run.overwrite`` may delete ``folder`` (a ``step_<N>`` or ``step_<N>.tmp``):
    it holds only what a checkpoint write produces, and (with a record of the folder's run
    ids) one of those runs wrote it, or it is partial (no meta.json) or predates run ids."""
    if not written_by_save(folder):
        return False
    if run_ids is None or STEP_TMP.match(folder.name) or not (folder / "meta.json").is_file():
        return True
    return run_id_of(folder) in run_ids | {None}


def _split_rows(path: Path, step: int) -> tuple[list[str], list[str]]:
    """(lines of rows up to ``step``, lines of rows after it) of a jsonl file."""
    keep, later = [], []
    for line in path.read_text().splitlines():
        try:
            row_step = int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError, TypeError):
            row_step = 0
        (later if row_step > step else keep).append(line + "\n")
    return keep, later


def retire_later_branch(out: Path, ckpt_root: Path, step: int) -> str | None:
    """Move the ``step_<M>`` folders with M > ``step`` and the rows after ``step`` to
    ``checkpoints/abandoned_after_step_<step>.<time>/``; returns the line that says so, or
    None when there is no later checkpoint (rank 0)."""
    if not ckpt_root.is_dir():
        return None
    later = sorted(
        (int(m.group(1)), d)
        for d in ckpt_root.iterdir()
        if (m := STEP_DIR.match(d.name)) and int(m.group(1)) > step and d.is_dir()
    )
    if not later:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = ckpt_root / f"abandoned_after_step_{step}.{stamp}"
    n = 0
    while dest.exists():
        n += 1
        dest = ckpt_root / f"abandoned_after_step_{step}.{stamp}-{n}"
    dest.mkdir()
    for _, d in later:
        d.rename(dest / d.name)
    rows = 0
    for name in STEP_ROWS:
        path = out / name
        if not path.is_file():
            continue
        keep, moved = _split_rows(path, step)
        if moved:
            (dest / name).write_text("".join(moved))
            path.write_text("".join(keep))
            rows += len(moved)
    names = ", ".join(d.name for _, d in later)
    return (
        f"resuming from step {step} abandons the later branch of this folder: moved its "
        f"checkpoints {names} and {rows} metric rows after step {step} to {dest}"
    )


def tidy_on_start(
    out: Path, ckpt_root: Path, resumed_step: int | None, run_id: str | None
) -> list[str]:
    """At the start of a run (rank 0, once its checkpoint has loaded): remove what a killed
    run left, retire the branch a resume from an earlier step abandons, and record this
    run's id. Returns the lines to print."""
    lines = []
    ids = (recorded_run_ids(out) or set()) | {run_id}
    removed = remove_leftovers(ckpt_root, ids)
    if removed:
        lines.append(
            f"removed what an interrupted checkpoint write or prune left in {ckpt_root}: "
            + ", ".join(removed)
        )
    if resumed_step is not None:
        line = retire_later_branch(out, ckpt_root, resumed_step)
        if line:
            lines.append(line)
    record_run_id(out, run_id)
    return lines


__all__ = [
    "ABANDONED",
    "RUN_IDS",
    "STEP_ROWS",
    "record_run_id",
    "recorded_run_ids",
    "removable_checkpoint",
    "retire_later_branch",
    "tidy_on_start",
]
