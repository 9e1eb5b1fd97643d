"""The run folder (``run.output_dir``): what a run writes there, its lock, where a resume
starts, the markers a checkpoint gets, and which files are this run's across its starts.

- ``RUN_OUTPUTS``: everything a training run writes; ``run.overwrite`` deletes only these
  (``remove_run_outputs``), and inside its folders only the names of ``RUN_WRITES``.
- ``.flowgrpo.lock``: rank 0 holds it (``flock``) while a run writes here
  (``lock_output_dir`` / ``release_output_dir``): a second run into the folder is refused.
- Checkpoint markers: ``mark_good`` (a rollout from its weights was finite: ``ROLLOUT_OK``)
  and ``mark_diverged`` (it was not: ``DIVERGED``, never resumed from again).
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
from typing import TYPE_CHECKING, Any

from flowgrpo.engine.checkpoint_dirs import (
    DIVERGED,
    ROLLOUT_OK,
    STEP_DIR,
    STEP_TMP,
    latest_checkpoint,
    mark_checkpoint,
    remove_leftovers,
    run_id_of,
    written_by_save,
)

if TYPE_CHECKING:
    from flowgrpo.engine.dist import DistInfo

#: everything a training run writes into run.output_dir (``run.overwrite`` deletes only these)
RUN_OUTPUTS = (
    "metrics.jsonl",
    "eval.jsonl",
    "checkpoints",
    "tensorboard",
    "wandb",
    "grid_before.png",
    "grid_after.png",
    "reward_curve.png",
)
#: inside the folders a run writes to, the names it writes (run.overwrite deletes these only)
RUN_WRITES = {
    "checkpoints": re.compile(r"step_\d+(\.tmp)?"),  # abandoned_after_step_*: never deleted
    "tensorboard": re.compile(r"events\.out\.tfevents\..+"),
    "wandb": re.compile(r"(offline-)?run-.+|latest-run|debug(-internal)?\.log|wandb-resume\.json"),
}
LOCK_FILE = ".flowgrpo.lock"
_held_locks: list[Any] = []  # this process's open, locked lock files
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


def prepare_output_dir(cfg: Any, dist: DistInfo, *, fresh: bool) -> Path:
    """``run.output_dir``, created, checked writable and locked for this run
    (``lock_output_dir``; RunError naming it otherwise). A fresh run with ``run.overwrite``
    first deletes what an earlier run wrote there (``remove_run_outputs``). Collective."""
    from flowgrpo.engine.dist import barrier
    from flowgrpo.errors import RunError

    out = Path(cfg.run.output_dir)
    if dist.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            lock_output_dir(out)
            if fresh and cfg.run.overwrite:
                remove_run_outputs(out)
            probe = out / ".flowgrpo-write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise RunError(
                f"cannot write to run.output_dir {out}: {e.strerror or e}; choose a writable "
                "folder (run.output_dir=...)"
            ) from None
    barrier()
    return out


def remove_run_outputs(out: Path) -> None:
    """Delete what a run writes in ``out``: the files of ``RUN_OUTPUTS`` and, inside its
    folders (checkpoints/, tensorboard/, wandb/), the names of ``RUN_WRITES`` only; a folder
    left empty goes too. Anything else (a user's checkpoints/my_model.safetensors or
    step_best.tmp/) stays, and so does a checkpoint another run wrote (not one of the run ids
    recorded in ``.flowgrpo-run-ids``: ``removable_checkpoint``), said in one line."""
    import warnings

    kept = []
    for name in RUN_OUTPUTS:
        target = out / name
        pattern = RUN_WRITES.get(name)
        if pattern is not None and target.is_dir() and not target.is_symlink():
            ids = recorded_run_ids(out) if name == "checkpoints" else None
            for entry in sorted(target.iterdir()):
                if not pattern.fullmatch(entry.name):
                    continue
                if name == "checkpoints" and entry.name.startswith("step_"):
                    if not entry.is_dir() or not removable_checkpoint(entry, ids):
                        kept.append(entry.name)
                        continue
                _remove(entry)
            if not any(target.iterdir()):
                target.rmdir()
        elif target.exists() or target.is_symlink():
            _remove(target)
    if kept:
        warnings.warn(
            f"run.overwrite kept {', '.join(kept)} in {out / 'checkpoints'}: not written by the "
            "run it overwrites (another run's, or not a checkpoint); move it away yourself "
            "if it should go",
            stacklevel=2,
        )


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def lock_output_dir(out: Path) -> None:
    """Hold ``out/.flowgrpo.lock`` (an exclusive ``flock``) until ``release_output_dir``: a
    second run into a folder that a live run holds is refused with a RunError naming the
    holder. The system drops the lock when its process ends, so a killed run's lock never
    blocks a resume. Rank 0 takes it for the whole run."""
    import fcntl
    import os
    import socket
    import warnings

    from flowgrpo.errors import RunError

    path = out / LOCK_FILE
    while True:
        f = open(path, "a+")  # noqa: SIM115 - held open for the run
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = " ".join(f.read().split()) or "another process"
            f.close()
            raise RunError(
                f"run.output_dir {out} is in use by a running training run ({holder}): wait "
                "for it to end or stop it, or choose another run.output_dir"
            ) from None
        except OSError as e:  # a file system without flock (some network mounts)
            f.close()
            warnings.warn(
                f"cannot lock run.output_dir {out} ({e.strerror or e}): the run goes on "
                "unlocked; do not start a second run into this folder meanwhile",
                stacklevel=2,
            )
            return
        try:  # a release may have removed the file between open and flock: lock the new one
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _held_locks.append((path, f))


def release_output_dir() -> None:
    """Remove and unlock the run-folder locks this process holds (the end of a run)."""
    while _held_locks:
        path, f = _held_locks.pop()
        path.unlink(missing_ok=True)  # still locked: no other run can hold it meanwhile
        f.close()


def new_run_id() -> str:
    """A random id shared by every rank: checkpoints carry it so that pruning only ever
    removes this run's own checkpoints. Collective."""
    import uuid

    from flowgrpo.engine.dist import all_gather_object

    return all_gather_object(uuid.uuid4().hex)[0]


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run / checkpoints directory -> its newest complete one."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    for root in (p / "checkpoints", p):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found is not None and Path(found) != p and Path(found).parent == root:
            return Path(found)
    return p


def resolve_resume(resume: Any, ckpt_root: Path) -> Path | None:
    """trainer.resume: None/""/false -> fresh run; "auto" -> newest complete checkpoint under
    ``ckpt_root`` (fresh run if none); anything else -> that checkpoint path (must exist)."""
    if resume in (None, "", False, "none", "false", "never"):
        return None
    if resume == "auto":
        found = latest_checkpoint(ckpt_root) if ckpt_root.is_dir() else None
        return Path(found) if found is not None else None
    return resolve_checkpoint(resume)


def mark_good(checkpoint: Path | None, dist: DistInfo) -> None:
    """Mark ``checkpoint`` (rank 0) ``ROLLOUT_OK``: a rollout from its weights was finite, so
    it is a good one to resume from. None (the weights changed since the last save): nothing."""
    if checkpoint is not None and dist.is_main:
        mark_checkpoint(checkpoint, ROLLOUT_OK)


def mark_diverged(checkpoint: Path | None, dist: DistInfo) -> None:
    """Mark ``checkpoint`` (rank 0) ``DIVERGED``: its weights are finite, yet a rollout from
    them is not, so no resume takes it (``latest_checkpoint`` skips it)."""
    if checkpoint is not None and dist.is_main:
        mark_checkpoint(checkpoint, DIVERGED)


__all__ = [
    "ABANDONED",
    "LOCK_FILE",
    "RUN_IDS",
    "RUN_OUTPUTS",
    "RUN_WRITES",
    "STEP_ROWS",
    "lock_output_dir",
    "mark_diverged",
    "mark_good",
    "new_run_id",
    "prepare_output_dir",
    "record_run_id",
    "recorded_run_ids",
    "release_output_dir",
    "removable_checkpoint",
    "remove_run_outputs",
    "resolve_checkpoint",
    "resolve_resume",
    "retire_later_branch",
    "tidy_on_start",
]
