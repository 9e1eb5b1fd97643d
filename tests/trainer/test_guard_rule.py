"""The guard's rule and the best checkpoint, as functions of a run's evals (no training)."""

import json

import pytest

from flowgrpo.engine.checkpoint_dirs import KEEP
from flowgrpo.trainer import guard


def _record(evals):
    rec = guard.new_record()
    for step, reward, gold, ckpt in evals:
        guard.record_eval(rec, step, reward, gold)
        if ckpt:
            guard.record_checkpoint(rec, step, ckpt)
    return rec


def test_trips_when_gold_falls_while_reward_rises():
    rec = _record([(0, 0.5, 0.60, None), (5, 0.8, 0.90, "c5"), (10, 0.9, 0.89, "c10")])
    assert guard.check(rec, 0.02) is None  # 0.01 below the peak: not yet
    guard.record_eval(rec, 15, 0.95, 0.88)  # exactly 0.02 below, reward above the peak's
    trip = guard.check(rec, 0.02)
    assert trip is not None and trip.peak.step == 5 and trip.now.step == 15
    assert trip.drop == pytest.approx(0.02)
    line = guard.trip_line(trip, "stopped", guard.best_checkpoint(rec, up_to=trip.peak.step))
    assert line == (
        "guard: stopped at the eval at step 15: gold score 0.88 is 0.02 below its best 0.9 "
        "(step 5) while the training reward rose 0.8 -> 0.95; best-gold checkpoint c5 (step 5, "
        "gold 0.9)"
    )


def test_patience_waits_for_that_many_tripping_evals_in_a_row():
    # step 10 trips alone; with patience 2 it needs step 15 to trip as well
    rec = _record([(0, 0.5, 0.60, None), (5, 0.8, 0.90, "c5"), (10, 0.9, 0.85, "c10")])
    assert guard.check(rec, 0.02, patience=1) is not None
    assert guard.check(rec, 0.02, patience=2) is None
    guard.record_eval(rec, 15, 0.95, 0.91)  # the judge recovered past the peak: no trip
    assert guard.check(rec, 0.02, patience=2) is None
    guard.record_eval(rec, 20, 0.96, 0.88)  # 0.03 below the new peak (step 15) ...
    assert guard.check(rec, 0.02, patience=2) is None  # ... but step 15 itself did not trip
    guard.record_eval(rec, 25, 0.97, 0.87)
    trip = guard.check(rec, 0.02, patience=2)
    assert trip is not None and (trip.now.step, trip.peak.step) == (25, 15)
    assert trip.drop == pytest.approx(0.04)
    guard.record_eval(rec, 30, 0.90, 0.80)  # the reward fell below the peak's: not hacking
    assert guard.check(rec, 0.02, patience=2) is None


def test_no_trip_when_the_training_reward_fell_too():
    # gold and reward both fell: a collapse, not hacking; the guard leaves it to the user
    rec = _record([(5, 0.8, 0.90, "c5"), (10, 0.7, 0.80, "c10")])
    assert guard.check(rec, 0.02) is None


def test_best_checkpoints_and_rollback_target():
    rec = _record(
        [(0, 0.5, 0.6, None), (5, 0.7, 0.85, "c5"), (10, 0.8, 0.95, None), (15, 0.9, 0.9, "c15")]
    )
    assert guard.peak(rec).step == 10  # the peak has no checkpoint ...
    assert guard.best_checkpoint(rec, "gold").checkpoint == "c15"  # best gold with one
    assert guard.best_checkpoint(rec, "reward").checkpoint == "c15"
    # ... so a rollback returns to the best checkpoint at or before the peak
    assert guard.best_checkpoint(rec, "gold", up_to=10).checkpoint == "c5"
    assert guard.kept(rec) == {"c5", "c15"}
    guard.forget_after(rec, 5)
    assert [r.step for r in guard.rows(rec)] == [0, 5]


def test_peak_at_the_base_eval_has_no_checkpoint_before_it():
    rec = _record([(0, 0.5, 0.9, None), (5, 0.8, 0.8, "c5")])
    trip = guard.check(rec, 0.05)
    assert trip is not None and trip.peak.step == 0
    assert guard.best_checkpoint(rec, "gold", up_to=trip.peak.step) is None
    assert "no checkpoint at or before the peak (step 0)" in guard.trip_line(trip, "x", None)


def test_write_best_moves_keep_markers_and_resolve_best(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (5, 10):
        (root / f"step_{s}").mkdir(parents=True)
    c5, c10 = str(root / "step_5"), str(root / "step_10")
    rec = _record([(5, 0.7, 0.9, c5), (10, 0.9, 0.8, c10)])
    guard.write_best(tmp_path, rec)
    best = json.loads((tmp_path / guard.BEST_FILE).read_text())
    assert best["gold"]["checkpoint"] == c5 and best["reward"]["checkpoint"] == c10
    assert (root / "step_5" / KEEP).is_file() and (root / "step_10" / KEEP).is_file()
    assert guard.resolve_best(tmp_path) == root / "step_5"
    assert guard.resolve_best(tmp_path, "reward") == root / "step_10"
    guard.record_eval(rec, 15, 0.95, 0.99)
    guard.record_checkpoint(rec, 15, str(root / "step_10"))  # pretend: the newest one
    guard.forget_after(rec, 10)
    rec["evals"][1][2] = 0.95  # step 10 becomes the best by gold and reward
    guard.write_best(tmp_path, rec)
    assert not (root / "step_5" / KEEP).exists()  # no longer needed: prunable again
    with pytest.raises(ValueError, match="does not exist"):
        guard.resolve_best(tmp_path / "nowhere")
