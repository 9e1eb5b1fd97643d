"""The benchmark runs end to end at a tiny size and writes every field (no timing asserts)."""

import json

import pytest

from bench.run import KINDS, TARGETS, main

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
    # the allocator's peaks come from extra profiled runs that --quick leaves out
    assert figures == set(TARGETS) - {"sharded_alloc_over_floor"}


def test_algorithms_report_table_and_plot(tmp_path):
    """write_report puts one row per algorithm (an unreached target says so) and the plot
    between the markers of the doc, keeping the text around them."""
    from bench.algorithms import ALGORITHMS, write_report

    def result(reached: bool, scale: float) -> dict:
        curve = [
            {"step": s, "train_s": s * scale, "images": 160 * s, "accuracy": 0.6 + 0.01 * s,
             "judge_accuracy": 0.6 + 0.01 * s, "diversity": 0.3 - 0.001 * s}
            for s in range(0, 41, 10)
        ]  # fmt: skip
        there = curve[3] if reached else None
        return {
            "curve": curve,
            "time_to_target_s": there and there["train_s"],
            "images_to_target": there and there["images"],
            "accuracy_at_target": there and there["accuracy"],
            "judge_at_target": there and there["judge_accuracy"],
            "diversity_at_target": there and there["diversity"],
            "final_judge_accuracy": 0.9,
            "final_accuracy": 0.91,
            "final_diversity": 0.2,
            "time_to_target_over_flow_grpo": (scale / 2.0) if reached else None,
        }

    results = {name: result(name != "grpo_guard", 2.0 - 0.5 * i) for i, name in
               enumerate(ALGORITHMS)}  # fmt: skip
    doc = tmp_path / "algorithms.md"
    doc.write_text(
        "before\n<!-- toy comparison: start -->\nold\n<!-- toy comparison: end -->\nafter\n"
    )
    write_report(results, doc)
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == list(ALGORITHMS)
    assert "| 60 s | 1.00 | 4800 |" in rows[0] and "not reached" in rows[2]
    assert (tmp_path / "algorithms_toy.png").stat().st_size > 1000
