"""The reward-hacking guard and the best checkpoint, as plain functions of the run's evals.

A run's guard record (``state["guard"]``, saved in every checkpoint so that a resume repeats
the run exactly) holds one row per eval: ``[step, training reward, gold score, checkpoint]``
(the checkpoint saved at that step, or None), how many rollbacks happened and the settings
they applied. Everything else is computed from those rows:

- the peak: the eval with the best gold score;
- the guard trips at an eval whose gold score is ``max_gold_drop`` or more below the peak's
  while its training reward is above the peak's (the reward rose, the gold fell: hacking),
  and with ``patience`` N at the N-th such eval in a row (one noisy eval does not trip it);
- the best checkpoint by gold (or by training reward): the best row that has a checkpoint;
  a rollback resumes from the best checkpoint at or before the peak.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from flowgrpo.engine.checkpoint_dirs import KEEP

#: the run folder's record of its best checkpoints (``--checkpoint best`` reads it)
BEST_FILE = "best.json"
#: float tolerance of the drop test: a drop of exactly ``max_gold_drop`` trips the guard
_TOL = 1e-9


def new_record() -> dict[str, Any]:
    """An empty guard record (JSON-able)."""
    return {"evals": [], "rollbacks": 0, "applied": {}, "events": []}


class Row(NamedTuple):
    """One eval: its step, training reward (``eval/reward_mean``), gold score
    (``eval/gold_score``) and the checkpoint saved at its step (None: none)."""

    step: int
    reward: float
    gold: float
    checkpoint: str | None


def rows(record: dict[str, Any]) -> list[Row]:
    return [Row(int(s), float(r), float(g), c) for s, r, g, c in record["evals"]]


def record_eval(record: dict[str, Any], step: int, reward: float, gold: float) -> None:
    """Add the eval at ``step`` (replacing an earlier row of the same step)."""
    record["evals"] = [e for e in record["evals"] if int(e[0]) != step]
    record["evals"].append([int(step), float(reward), float(gold), None])


def record_checkpoint(record: dict[str, Any], step: int, path: str | Path) -> None:
    """The checkpoint saved at ``step``: it belongs to that step's eval row, if any."""
    for e in record["evals"]:
        if int(e[0]) == step:
            e[3] = str(path)


def forget_after(record: dict[str, Any], step: int) -> None:
    """Drop the evals after ``step`` (a rollback abandons them)."""
    record["evals"] = [e for e in record["evals"] if int(e[0]) <= step]


def drop_missing(record: dict[str, Any]) -> None:
    """Forget the checkpoints of rows whose folder is gone (pruned, moved aside)."""
    for e in record["evals"]:
        if e[3] is not None and not Path(e[3]).is_dir():
            e[3] = None


def peak(record: dict[str, Any]) -> Row | None:
    """The eval with the best gold score (the earliest of equals)."""
    best = None
    for row in rows(record):
        if best is None or row.gold > best.gold:
            best = row
    return best


def best_checkpoint(
    record: dict[str, Any], by: str = "gold", up_to: int | None = None
) -> Row | None:
    """The eval with a checkpoint whose ``by`` ("gold" or "reward") score is the best (the
    earliest of equals), among those at or before step ``up_to``."""
    best = None
    for row in rows(record):
        if row.checkpoint is None or (up_to is not None and row.step > up_to):
            continue
        if best is None or getattr(row, by) > getattr(best, by):
            best = row
    return best


class Trip(NamedTuple):
    """Why the guard tripped: the eval ``now``, the ``peak``, and the gold score's drop."""

    now: Row
    peak: Row
    drop: float


def check(record: dict[str, Any], max_gold_drop: float, patience: int = 1) -> Trip | None:
    """The guard's rule at the latest eval: a Trip when the gold score of each of the latest
    ``patience`` evals is ``max_gold_drop`` or more below the peak's while its training
    reward is above the peak's; else None."""
    evals = sorted(rows(record), key=lambda r: r.step)
    top = peak(record)
    if len(evals) < patience or top is None:
        return None
    latest = evals[len(evals) - patience :]
    if all(top.gold - r.gold >= max_gold_drop - _TOL and r.reward > top.reward for r in latest):
        return Trip(latest[-1], top, top.gold - latest[-1].gold)
    return None


def trip_line(trip: Trip, action: str, target: Row | None) -> str:
    """The one line a trip prints: the eval, the figures, the best-gold checkpoint."""
    now, top = trip.now, trip.peak
    where = (
        f"best-gold checkpoint {target.checkpoint} (step {target.step}, gold {target.gold:.4g})"
        if target is not None
        else f"no checkpoint at or before the peak (step {top.step}) to return to"
    )
    return (
        f"guard: {action} at the eval at step {now.step}: gold score {now.gold:.4g} is "
        f"{trip.drop:.4g} below its best {top.gold:.4g} (step {top.step}) while the training "
        f"reward rose {top.reward:.4g} -> {now.reward:.4g}; {where}"
    )


def kept(record: dict[str, Any]) -> set[str]:
    """The checkpoints the pruning rule must keep: the best by gold, the best by training
    reward, and the rollback target (the best by gold at or before the peak)."""
    top = peak(record)
    picks = [
        best_checkpoint(record, "gold"),
        best_checkpoint(record, "reward"),
        best_checkpoint(record, "gold", up_to=None if top is None else top.step),
    ]
    return {p.checkpoint for p in picks if p is not None and p.checkpoint is not None}


def best_summary(record: dict[str, Any]) -> dict[str, Any]:
    """What ``best.json`` holds: the best checkpoint by gold and by training reward."""

    def entry(row: Row | None) -> dict[str, Any] | None:
        if row is None:
            return None
        return {
            "step": row.step,
            "checkpoint": row.checkpoint,
            "gold": row.gold,
            "reward": row.reward,
        }

    return {
        "gold": entry(best_checkpoint(record, "gold")),
        "reward": entry(best_checkpoint(record, "reward")),
        "rollbacks": int(record.get("rollbacks", 0)),
        "events": list(record.get("events", [])),
    }


def write_best(out: Path, record: dict[str, Any]) -> None:
    """Write ``best.json`` in the run folder and move the ``KEEP`` markers to the
    checkpoints ``kept`` names (rank 0)."""
    (out / BEST_FILE).write_text(json.dumps(best_summary(record), indent=2) + "\n")
    keep = kept(record)
    root = out / "checkpoints"
    if root.is_dir():
        for d in root.iterdir():
            marker = d / KEEP
            if str(d) in keep and d.is_dir():
                marker.write_text("kept: a best checkpoint (best.json)\n")
            elif marker.exists():
                marker.unlink()


# -- in a run ----------------------------------------------------------------------------------


class GuardRollback(Exception):
    """The guard tripped with ``guard.action=rollback``: the run resumes from ``target`` (the
    best-gold checkpoint at or before the peak) with ``record`` (the guard's, as it tripped)
    and ``guard.on_rollback`` applied (``loop.run_training``)."""

    def __init__(self, target: Path, record: dict[str, Any], line: str) -> None:
        super().__init__(line)
        self.target, self.record, self.line = target, record, line


def recorded_settings(checkpoint: Path) -> dict[str, Any]:
    """The settings earlier rollbacks applied (``guard.on_rollback``), from the checkpoint's
    trainer state: a resume after a rollback runs with them, as the run did."""
    try:
        state = json.loads((Path(checkpoint) / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}
    return dict((state.get("guard") or {}).get("applied") or {})


def after_rollback(rollback: GuardRollback, step: int, applied: dict[str, Any]) -> dict:
    """The tripped run's record, back at the target's ``step``: later evals forgotten, one
    more rollback counted, the settings it ``applied`` recorded, the event logged."""
    rec = rollback.record
    forget_after(rec, step)
    rec["rollbacks"] = int(rec.get("rollbacks", 0)) + 1
    rec["applied"] = {**rec.get("applied", {}), **applied}
    rec["events"].append({"action": "rollback", "to_step": step, "line": rollback.line})
    return rec


def on_eval(cfg: Any, record: dict[str, Any], step: int, metrics: dict) -> Trip | None:
    """Add an eval to the record (runs with gold rewards) -> the guard's Trip, or None (no
    trip, no guard, or the base eval)."""
    record_eval(record, step, metrics["eval/reward_mean"], metrics["eval/gold_score"])
    drop = cfg.guard.max_gold_drop
    return None if drop is None or step == 0 else check(record, drop, cfg.guard.patience)


def act_on_trip(cfg: Any, record: dict[str, Any], trip: Trip, write: Any) -> str:
    """The guard tripped (its step saved): raise GuardRollback to resume from the best-gold
    checkpoint at or before the peak, or stop: ``write`` one line, return it. A rollback with
    no checkpoint to return to, or past ``guard.max_rollbacks``, stops instead."""
    g = cfg.guard
    target = best_checkpoint(record, "gold", up_to=trip.peak.step)
    if g.action == "rollback" and target is not None and record["rollbacks"] < g.max_rollbacks:
        raise GuardRollback(
            Path(target.checkpoint), record, trip_line(trip, "rolling back", target)
        )
    if g.action == "rollback" and target is None:
        what = "stopped: no checkpoint to roll back to"
    elif g.action == "rollback":
        what = f"stopped after {record['rollbacks']} rollbacks (guard.max_rollbacks)"
    else:
        what, target = "stopped", best_checkpoint(record, "gold")
    line = trip_line(trip, what, target)
    record["events"].append({"action": "stop", "step": trip.now.step, "line": line})
    write(line)
    return line


def resolve_best(output_dir: str | Path, by: str = "gold") -> Path:
    """``--checkpoint best``: the run folder's best checkpoint by gold score (``by``
    "reward": by training reward). A ValueError saying why when there is none."""
    path = Path(output_dir) / BEST_FILE
    if not path.is_file():
        raise ValueError(
            f"--checkpoint best: {path} does not exist (a run records its best checkpoint "
            "when it has eval.gold_reward and saves at eval steps)"
        )
    entry = json.loads(path.read_text()).get(by)
    if not entry or not entry.get("checkpoint"):
        raise ValueError(
            f"--checkpoint best: {path} names no checkpoint by {by} (no checkpoint was saved "
            "at an eval step: set trainer.save_every to a multiple of trainer.eval_every)"
        )
    ckpt = Path(entry["checkpoint"])
    if not ckpt.is_dir():
        raise ValueError(f"--checkpoint best: {ckpt} (named by {path}) no longer exists")
    return ckpt


__all__ = [
    "BEST_FILE",
    "GuardRollback",
    "act_on_trip",
    "after_rollback",
    "on_eval",
    "recorded_settings",
    "KEEP",
    "Row",
    "Trip",
    "best_checkpoint",
    "best_summary",
    "check",
    "drop_missing",
    "forget_after",
    "kept",
    "new_record",
    "peak",
    "record_checkpoint",
    "record_eval",
    "resolve_best",
    "rows",
    "trip_line",
    "write_best",
]
