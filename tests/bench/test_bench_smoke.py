"""The benchmark runs end to end at a tiny size and writes every field (no timing asserts).
The per-model sections run on one kind (Qwen-Image: its masked text beside SD3, which the
zero-advantage, sharding and memory sections use): the code is the same for every kind, and
each kind's own parts are the conformance tests'."""

import json

import pytest

from bench.run import TARGETS, main

KINDS = ("qwen_image",)

ROLLOUT = {
    "transformer_calls",
    "sampler_s",
    "floor_s",
    "pipeline_s",
    "sampler_over_floor",
    "sampler_over_pipeline",
    "text_encode_s",
    "sampler_over_floor_with_text",
    "overhead_s",
    "floor_plus_overhead_over_floor",
}
TRAINING = {
    "FB_s",
    "train_s",
    "train_over_floor",
    "F2_s",
    "FB2_s",
    "cfg_train_s",
    "cfg_train_over_floor",
    "cfg_kl_train_s",
    "cfg_kl_train_over_floor",
    "cfg_cond_only_s",
    "cfg_cond_only_over_exact",
}
SP = {
    "image_tokens",
    "text_tokens",
    "sp1_peak_mb",
    "sp2_peak_mb",
    "sp1_pass_peak_mb",
    "sp2_pass_peak_mb",
    "sp1_model_state_mb",
    "sp2_model_state_mb",
    "sp1_per_sample_s",
    "sp2_per_sample_s",
    "sp2_peak_over_sp1",
    "sp2_time_over_sp1",
}
ZERO_ADVANTAGE = {
    "all_kept_s",
    "zero_dropped_s",
    "kept_fraction",
    "time_ratio",
    "time_ratio_over_kept_fraction",
}


@pytest.mark.slow
def test_quick_benchmark_writes_every_field(tmp_path):
    out = tmp_path / "results.json"
    assert (
        main(
            [
                "--quick",
                "--out",
                str(out),
                "--sections",
                "rollout,batched_cfg,training,zero_advantage,sharding,sp,memory,toy",
                "--kinds",
                ",".join(KINDS),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert {"torch", "diffusers", "cpu_count", "python"} <= set(results["machine"])
    for kind in KINDS:
        assert ROLLOUT <= set(results["rollout"][kind])
        assert {"batched_s", "separate_s", "batched_cfg_speedup"} <= set(
            results["batched_cfg"][kind]
        )
        assert TRAINING <= set(results["training"][kind])
        assert SP <= set(results["sp"][kind])
        assert results["sp"][kind]["sp2_peak_mb"] > 0
        for value in results["rollout"][kind].values():
            assert value > 0
    assert ZERO_ADVANTAGE <= set(results["zero_advantage"]["sd3"])
    assert results["zero_advantage"]["sd3"]["kept_fraction"] == 0.5
    assert "two_rank_per_sample_over_one_rank" in results["sharding"]["sd3"]
    memory = results["memory"]["full_2rank"]
    assert {"floor_mb", "sharded_rss_peak_mb", "sharded_one_block_rss_peak_mb"} <= set(memory)
    assert memory["sharded_rss_peak_mb"] > 0 and "sharded_over_floor" in memory
    toy = results["toy"]
    assert {"wall_s", "peak_rss_mb", "steps", "base_accuracy", "final_accuracy"} <= set(toy)
    assert toy["steps"] == 2 and toy["peak_rss_mb"] > 0
    figures = {row["figure"] for row in results["targets"]}
    # the allocator's peaks come from extra profiled runs that --quick leaves out; the
    # algorithms' targets come from the algorithms section (not run here)
    algorithms = {"time_to_target_over_flow_grpo", "diversity_at_target_over_flow_grpo"}
    allocator = {"sharded_alloc_over_floor", "sharded_alloc_over_floor_same_phase"}
    assert figures == set(TARGETS) - allocator - algorithms


def _toy_run(scale: float, reached: bool, seed: int) -> dict:
    """A synthetic run: judge accuracy rises 0.01 a step from 0.6 (0.95 at step 35) over
    ``scale`` seconds a step; an unreached run stays below the target."""
    from bench.algorithms import summarize_run

    top = 1.0 if reached else 0.9
    curve = [
        {"step": s, "train_s": s * scale, "wall_s": s * scale, "images": 160 * s,
         "accuracy": min(0.58 + 0.01 * s, top), "judge_accuracy": min(0.6 + 0.01 * s + 0.001 * seed, top),
         "diversity": 0.3 - 0.001 * s}
        for s in range(0, 41, 5)
    ]  # fmt: skip
    return summarize_run(curve)


def test_a_target_met_exactly_counts_though_logged_in_float32():
    """475 of 500 images is 0.95: the trainer's float32 mean logs 0.949999988, which a plain
    ``>= 0.95`` missed (five crossings of the 3-seed table were read 2-12 steps late)."""
    import torch

    from bench import reaches
    from bench.algorithms import summarize_run

    logged = float(torch.tensor([1.0] * 475 + [0.0] * 25).mean())
    assert logged < 0.95 and reaches(logged, 0.95)
    assert not reaches(474 / 500, 0.95)
    curve = [
        {"step": s, "train_s": 2.0 * s, "images": 160 * s, "accuracy": a, "judge_accuracy": a,
         "diversity": 0.2}
        for s, a in ((0, 0.6), (2, 0.9), (4, logged), (6, 0.97))
    ]  # fmt: skip
    assert summarize_run(curve)["time_to_target_s"] == 8.0  # step 4, not step 6


def test_algorithms_summary_is_median_and_range_over_seeds():
    """Crossing, medians, ranges, the common budget and the ratio to Flow-GRPO, by hand."""
    from bench.algorithms import summarize

    runs = {
        "flow_grpo": [_toy_run(2.0 + 0.1 * s, True, s) for s in range(3)],
        "slow": [_toy_run(1.0, True, 0), _toy_run(1.0, False, 1), _toy_run(1.0, False, 2)],
    }
    # flow_grpo seeds cross at step 35 (judge 0.950, 0.951, 0.952): times 70, 73.5, 77 s
    summary = summarize(runs, budget_s=40.0)
    t = summary["flow_grpo"]["time_to_target_s"]
    assert (t["median"], t["low"], t["high"], t["n"]) == pytest.approx((73.5, 70.0, 77.0, 3))
    assert summary["flow_grpo"]["gap_at_target"]["median"] == pytest.approx(0.021)
    assert summary["slow"]["time_to_target_s"]["n"] == 1  # one seed of three crossed
    assert summary["slow"]["time_to_target_over_flow_grpo"] == pytest.approx(35 / 73.5)
    # at 40 s flow_grpo's seeds have their evals at 35, 40, 35 s: steps 15 (2.0, 2.2 s/step)
    # and 15 (2.1 s/step: step 20 is at 42 s)
    judge = summary["flow_grpo"]["judge_at_budget"]
    assert judge["values"] == pytest.approx([0.8, 0.751, 0.752])
    assert summary["slow"]["judge_at_budget"]["median"] == pytest.approx(0.9)


def test_algorithms_report_table_and_plot(tmp_path):
    """write_report puts one row per table row (an unreached target says so) and the plot
    between the markers of the doc, keeping the text around them."""
    from bench import algorithms
    from bench.algorithms import ROWS, summarize

    runs = {
        r.key: [_toy_run(2.0 - 0.2 * i, r.key != "grpo_guard", s) for s in range(3)]
        for i, r in enumerate(ROWS)
    }
    results = {
        "steps": 40,
        "seeds": [0, 1, 2],
        "budget_s": 30.0,
        "rows": {r.key: {"settings": r.settings} for r in ROWS},
        "runs": runs,
        "summary": summarize(runs, 30.0),
    }
    doc = tmp_path / "algorithms.md"
    doc.write_text(
        "before\n<!-- toy comparison: start -->\nold\n<!-- toy comparison: end -->\nafter\n"
    )
    algorithms.write_report(results, doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == [r.key for r in ROWS]
    assert "| 3/3 | 70 s | 1.00 | 5600 | +0.021 (+0.020–+0.022) |" in rows[0]
    assert "| 0/3 | — | — |" in rows[2]
    assert (tmp_path / "algorithms_toy.png").stat().st_size > 1000


def test_algorithms_time_is_step_times_the_quiet_step():
    """finish() times every eval by its step x the row's quiet per-step time, keeps the runs'
    measured CPU time, and names the best row against Flow-GRPO."""
    from bench.algorithms import ROWS, finish

    rows = (ROWS[0], ROWS[1])
    runs = {r.key: [_toy_run(9.0, True, s) for s in range(2)] for r in rows}  # measured 9 s/step
    out = finish(runs, {"flow_grpo": 2.0, "mix_grpo": 0.5}, rows, (0, 1), 40, 5)
    curve = out["runs"]["mix_grpo"][0]["curve"]
    assert [c["train_s"] for c in curve[:3]] == [0.0, 2.5, 5.0]
    assert [c["cpu_s"] for c in curve[:3]] == [0.0, 45.0, 90.0]
    assert out["summary"]["flow_grpo"]["time_to_target_s"]["median"] == 70.0  # step 35 x 2 s
    assert out["budget_s"] == 20.0  # mix_grpo's step 40 x 0.5 s
    assert out["best"]["row"] == "mix_grpo"
    assert out["best"]["time_to_target_over_flow_grpo"] == 0.25


def test_algorithms_gap_table_splits_the_step_and_prices_the_target():
    """gap_rows: each row's quiet step cost split by its measured shares, its steps to the
    target (time / step cost), and what 0.2x Flow-GRPO's time would take, worked by hand."""
    from bench.algorithms import ROWS, finish, gap_rows

    rows = (ROWS[0], ROWS[1])
    runs = {r.key: [_toy_run(9.0, True, s) for s in range(2)] for r in rows}
    out = finish(runs, {"flow_grpo": 2.0, "mix_grpo": 0.5}, rows, (0, 1), 40, 5)
    shares = {"rollout": 0.25, "reward": 0.05, "train": 0.6, "other": 0.1}
    out["step_shares"] = {"flow_grpo": shares, "mix_grpo": shares}
    lines = gap_rows(out)
    assert len(lines) == 4 and lines[1].startswith("|---")
    # Flow-GRPO: step 35 x 2 s = 70 s; 0.2x = 14 s: 7 steps at 2 s, or 0.40 s/step at 35 steps
    assert lines[2] == "| `flow_grpo` | 35 | 2.00 | 0.50 / 0.10 / 1.20 / 0.20 | 1.00 | 7.0 | 0.40 |"
    # MixGRPO: step 35 x 0.5 s = 17.5 s (0.25x): 28 steps at 0.5 s, or 0.40 s/step at 35
    assert lines[3] == "| `mix_grpo` | 35 | 0.50 | 0.12 / 0.03 / 0.30 / 0.05 | 0.25 | 28.0 | 0.40 |"
