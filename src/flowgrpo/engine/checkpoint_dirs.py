"""The checkpoints folder of a run: which ``step_<N>`` folders are complete, good, this
run's; pruning and removing them so that a kill midway leaves nothing that looks like a
checkpoint; and removing only what a checkpoint write produced (a user's ``step_best.tmp/``
or another run's ``step_<N>`` is never deleted).
"""

from __future__ import annotations

import json
import re
import shutil
import time
import warnings
from pathlib import Path

MARKER = "COMPLETE"
ROLLOUT_OK = "ROLLOUT_OK"  # a rollout from these weights was finite: a good checkpoint
DIVERGED = "DIVERGED"  # a rollout from these weights was not: never resumed from again
KEEP = "KEEP"  # the trainer needs it (a best checkpoint, a rollback's target): never pruned
STEP_DIR = re.compile(r"^step_(\d+)$")
STEP_TMP = re.compile(r"^step_(\d+)\.tmp$")  # a write in progress, or one a kill interrupted
#: every name ``save_checkpoint`` (and DCP for it) writes inside ``step_<N>/``
_OWN_ENTRY = re.compile(
    r"(__\d+)?\.metadata(\.tmp)?|__\d+_\d+\.distcp|engine_state\.pt|rng|rank_\d+\.pt"
    r"|trainer_state\.json|meta\.json|config\.yaml|COMPLETE|ROLLOUT_OK|DIVERGED"
)


def _complete_steps(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = STEP_DIR.match(d.name)
        if m and d.is_dir() and (d / MARKER).is_file():
            out.append((int(m.group(1)), d))
    return sorted(out)


def run_id_of(checkpoint: Path) -> str | None:
    """The ``run_id`` a checkpoint was written with (None: unknown or unreadable)."""
    try:
        return json.loads((Path(checkpoint) / "meta.json").read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def written_by_save(folder: Path) -> bool:
    """Whether everything in ``folder`` has a name ``save_checkpoint`` writes (a checkpoint,
    whole or partly written or deleted): a folder holding anything else is not removed."""
    try:
        return all(
            _OWN_ENTRY.fullmatch(e.name)
            and (e.name != "rng" or all(_OWN_ENTRY.fullmatch(r.name) for r in e.iterdir()))
            for e in folder.iterdir()
        )
    except OSError:
        return False


def _delete(folder: Path) -> None:
    """Remove a checkpoint folder so that a kill midway leaves no ``step_<N>`` that looks
    like a checkpoint: renamed to ``step_<N>.tmp`` first (atomic), then deleted; a leftover
    ``.tmp`` is removed at the next save or start (``remove_leftovers``)."""
    doomed = folder.with_name(f"{folder.name}.tmp")
    if doomed.exists() and written_by_save(doomed):
        shutil.rmtree(doomed, ignore_errors=True)
    if not doomed.exists():  # else: someone's own step_<N>.tmp/ is there: delete in place
        folder.rename(doomed)
        folder = doomed
    shutil.rmtree(folder, ignore_errors=True)


def remove_leftovers(root: str | Path, run_ids: set[str | None]) -> list[str]:
    """Remove what a killed save or prune of this run left under ``root``: ``step_<N>.tmp``
    folders, and ``step_<N>`` folders without the COMPLETE marker whose ``meta.json`` (if any
    is left) names one of ``run_ids``; only folders holding nothing but names a checkpoint
    write produces (``written_by_save``). Returns the names removed (rank 0 calls it)."""
    root, removed = Path(root), []
    if not root.is_dir():
        return removed
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.is_symlink() or not written_by_save(d):
            continue
        stale = STEP_TMP.match(d.name) is not None
        if STEP_DIR.match(d.name) and not (d / MARKER).is_file():
            stale = not (d / "meta.json").is_file() or run_id_of(d) in run_ids
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d.name)
    return removed


def _prune(root: Path, keep_last: int | None, run_id: str | None) -> None:
    """Remove stale ``step_<N>.tmp`` dirs (only those: a user's ``step_best.tmp/`` stays)
    and all but the newest ``keep_last`` complete checkpoints written by run ``run_id``, and
    the newest good one (``is_good``) and those marked ``KEEP`` (a run's best checkpoints, a
    rollback's target); other runs' checkpoints are left alone."""
    for d in root.iterdir():
        if STEP_TMP.match(d.name) and d.is_dir() and written_by_save(d):
            shutil.rmtree(d, ignore_errors=True)
    if keep_last:
        mine = [d for _, d in _complete_steps(root) if run_id_of(d) == run_id]
        keep = set(mine[-keep_last:]) | set([d for d in mine if is_good(d)][-1:])
        keep |= {d for d in mine if (d / KEEP).is_file()}  # the trainer needs it (best.json)
        for d in mine:
            if d not in keep:
                _delete(d)


def latest_checkpoint(root: str | Path) -> Path | None:
    """Newest ``<root>/step_<N>`` that has the COMPLETE marker (``.tmp`` dirs never count)
    and is not marked DIVERGED (``mark_checkpoint``)."""
    steps = [d for _, d in _complete_steps(Path(root)) if not (d / DIVERGED).exists()]
    return steps[-1] if steps else None


def is_good(checkpoint: Path) -> bool:
    """A rollout from the checkpoint's weights was finite, and none was not."""
    return (checkpoint / ROLLOUT_OK).is_file() and not (checkpoint / DIVERGED).exists()


def mark_checkpoint(checkpoint: Path, marker: str) -> None:
    """Record (rank 0) that a rollout from ``checkpoint``'s weights was finite (``ROLLOUT_OK``)
    or not (``DIVERGED``: ``latest_checkpoint`` skips it from then on)."""
    if not (checkpoint / marker).exists():
        try:
            (checkpoint / marker).write_text("yes\n")
        except FileNotFoundError:  # the checkpoint or its folder went meanwhile
            pass


def last_good_checkpoint(root: str | Path) -> Path | None:
    """Newest complete checkpoint under ``root`` that ``is_good``."""
    good = [d for _, d in _complete_steps(Path(root)) if is_good(d)]
    return good[-1] if good else None


def resume_advice(root: str | Path) -> str:
    """What to do after a divergence: resume from the last good checkpoint under ``root``
    (named), or start again when there is none. One clause, for the error line."""
    good = last_good_checkpoint(root)
    if good is None:
        return (
            "no checkpoint of this run has given a finite rollout: start again with a lower "
            "optim.lr (run.overwrite=true)"
        )
    how = "auto" if latest_checkpoint(root) == good else str(good)
    return f"the last good checkpoint is {good}: resume from it (trainer.resume={how}) with a lower optim.lr"


def _set_aside_foreign(final: Path, run_id: str | None) -> None:
    """A ``step_<N>`` already there that another run wrote (or not a checkpoint at all) is
    renamed ``step_<N>.other-<time>`` (and said so) rather than deleted by the save."""
    if not final.exists() or (written_by_save(final) and run_id_of(final) in (run_id, None)):
        return
    aside = final.with_name(f"{final.name}.other-{time.strftime('%Y%m%d-%H%M%S')}")
    final.rename(aside)
    warnings.warn(
        f"{final} was written by another run: moved to {aside.name} (not overwritten)",
        stacklevel=3,
    )


__all__ = [
    "DIVERGED",
    "KEEP",
    "MARKER",
    "ROLLOUT_OK",
    "STEP_DIR",
    "STEP_TMP",
    "is_good",
    "last_good_checkpoint",
    "latest_checkpoint",
    "mark_checkpoint",
    "remove_leftovers",
    "resume_advice",
    "run_id_of",
    "written_by_save",
]
