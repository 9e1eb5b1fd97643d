"""The reward-hacking bench's summary of run folders (no training): peak, fall, crossings."""

import json

from bench.hacking import command, largest_hack, summarize
from bench.hacking_report import tables


def _run(folder, curve, best=None):
    folder.mkdir(parents=True)
    rows = [{"step": s, "eval/gold/digits_judge": j, "eval/reward_mean": r} for s, j, r in curve]
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if best is not None:
        (folder / "best.json").write_text(json.dumps(best))


def test_summary_of_a_hacked_and_a_stopped_run(tmp_path):
    _run(tmp_path / "none_s0", [(0, 0.6, 0.7), (5, 0.92, 0.9), (10, 0.96, 1.0), (15, 0.9, 1.1)])
    best = {"gold": {"step": 10, "gold": 0.96, "checkpoint": "c"}, "rollbacks": 0}
    curve = [(0, 0.6, 0.7), (5, 0.92, 0.9), (10, 0.96, 1.0), (15, 0.9, 1.1)]
    _run(tmp_path / "stop_patience2_s0", curve, best)  # no trip: no stop event
    best["events"] = [{"action": "stop", "step": 15, "line": "guard: stopped ..."}]
    _run(tmp_path / "stop_s0", curve, best)
    res = summarize(tmp_path)
    r = res["none"][0]
    assert (r["peak"], r["peak_step"], r["last"], r["to_0.9"], r["to_0.95"]) == (
        0.96,
        10,
        0.9,
        5,
        10,
    )
    assert abs(r["fall"] - 0.06) < 1e-12 and r["reward_last"] > r["reward_at_peak"]
    text = tables(res)
    assert "none, seed 0: judge peaks at step 10 (0.960) and falls 0.060 by step 15" in text
    assert (
        "largest fall while the eval reward rose: 0.060 below its best so far (step 10 → 15" in text
    )
    assert "hacking shown" in text
    assert "stop, seed 0: stopped at step 15 (1 evals after the judge's peak so far, 0.960" in text
    assert "1.000× that peak" in text
    assert "stop_patience2, seed 0: no trip, ran to step 15" in text


def test_commands_name_the_variant_and_seed(tmp_path):
    cmd = command("rollback", 2, tmp_path)
    assert "guard.action=rollback" in cmd and "seed=2" in cmd
    assert f"run.output_dir={tmp_path / 'rollback_s2'}" in cmd
    assert "eval.gold_reward=digits_judge" in cmd


def test_largest_hack_is_a_fall_below_the_best_so_far_while_the_reward_rose():
    # (step, judge, reward): a dip with the reward down (not a hack), a new best at 15, then a
    # fall of 0.2 with the reward up (the hack) and a deeper one with the reward back down
    curve = [(0, 0.5, 1.0), (5, 0.8, 1.1), (10, 0.6, 1.0), (15, 0.9, 1.2), (20, 0.7, 1.3)]
    curve.append((25, 0.55, 1.15))
    fall, at, by = largest_hack(curve)
    assert (round(fall, 12), at, by) == (0.2, 15, 20)
    assert largest_hack([(0, 0.5, 1.0), (5, 0.6, 1.1)]) == (0.0, -1, -1)  # never fell
