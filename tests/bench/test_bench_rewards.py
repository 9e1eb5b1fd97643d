"""The rewards benchmark runs every row at tiny size and reports positive speeds."""

import pytest


@pytest.mark.slow
def test_rewards_bench_quick_every_row():
    from bench.rewards import ROWS, bench_rewards, format_rewards

    results = bench_rewards(quick=True)
    assert list(results) == [row.name for row in ROWS]
    for name, r in results.items():
        assert r["images_per_s"] > 0 and r["batch"] == 2, name
    assert {"hpsv2", "image_reward", "aesthetic", "pickscore", "ocr"} <= set(results)
    assert format_rewards(results).count("\n") == len(ROWS) + 1
