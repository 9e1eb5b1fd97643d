"""Unit tests of the trainer's logging helpers and per-sample seeding (fast, no model)."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
import torch

from flowgrpo.trainer.figures import make_grid, plot_reward_curve
from flowgrpo.trainer.logging import (
    RunLogger,
    deterministic_view,
    read_jsonl,
    summary_table,
    truncate_jsonl,
)
from flowgrpo.trainer.seeds import generators, sample_seed
from flowgrpo.trainer.setup import padded_shard


def test_make_grid_upscales_nearest_with_square_cells():
    img = torch.zeros(3, 1, 8, 8)
    img[0, 0, 0, 0] = 1.0  # one white pixel -> an 8x8 white block after x8 nearest upscaling
    grid = make_grid(img, nrow=2)  # 2 columns, 2 rows of 64 px cells, 2 px borders
    assert grid.shape == (2 * 64 + 6, 2 * 64 + 6, 3) and grid.dtype == np.uint8
    assert (grid[2:10, 2:10] == 255).all() and (grid[10:66, 10:66] == 0).all()
    assert grid[0, 0, 0] == 128 and grid[1, 70, 1] == 128  # borders
    wide = make_grid(torch.ones(1, 3, 4, 8))  # non-square: centred on a square cell
    assert wide.shape[0] == wide.shape[1]


def test_jsonl_truncate_skips_torn_lines(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 5)) + '{"step": 5, "x')
    assert [r["step"] for r in read_jsonl(p)] == [1, 2, 3, 4]
    truncate_jsonl(p, 2)
    assert [r["step"] for r in read_jsonl(p)] == [1, 2]


def test_logger_writes_rows_and_curve(tmp_path):
    log = RunLogger(tmp_path, total_steps=2, tensorboard=True, progress=False)
    log.log_eval({"step": 0, "eval/reward_mean": 0.1, "eval/accuracy": 0.5})
    for s in (1, 2):
        log.log_step({"step": s, "reward_mean": 0.1 * s, "time/step_s": 1.0, "t": torch.tensor(2)})
    log.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[1] == {"step": 2, "reward_mean": 0.2, "time/step_s": 1.0, "t": 2}
    assert deterministic_view(rows[1]) == {"step": 2, "reward_mean": 0.2, "t": 2}
    assert any((tmp_path / "tensorboard").iterdir())
    png = plot_reward_curve(rows, read_jsonl(tmp_path / "eval.jsonl"), tmp_path / "c.png")
    assert png.stat().st_size > 1000
    RunLogger(tmp_path, enabled=False).log_step({"step": 9})  # other ranks: no-op
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 2


def test_summary_table_lists_base_and_final():
    text = summary_table({"eval/accuracy": 0.6, "x": 1}, {"eval/accuracy": 0.93, "x": 2})
    assert "eval/accuracy" in text and "0.600" in text and "0.930" in text and "+0.330" in text
    assert "\nx" not in text


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    with pytest.raises(ImportError, match="pip install wandb"):
        RunLogger(tmp_path, wandb="offline", tensorboard=False, progress=False)
    with pytest.raises(ValueError, match="run.wandb"):
        RunLogger(tmp_path / "b", wandb="sometimes", tensorboard=False, progress=False)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb not installed")
def test_wandb_offline_runs(tmp_path):
    log = RunLogger(tmp_path, wandb="offline", tensorboard=False, progress=False)
    log.log_step({"step": 1, "reward_mean": 0.5})
    log.close()
    assert any(tmp_path.rglob("*.wandb"))


def test_wandb_offline_logs_videos_as_gifs_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import tempfile

    from PIL import Image

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    log = RunLogger(tmp_path / "run", wandb="offline", tensorboard=False, progress=False)
    log.log_images("eval/images", torch.rand(2, 3, 4, 8, 8), 1)
    log.close()
    (gif,) = (tmp_path / "run").rglob("offline-run-*/files/media/videos/eval/*.gif")
    with Image.open(gif) as im:
        assert im.n_frames == 4
    assert not any((tmp_path / "tmp").rglob("*.gif"))


def test_per_sample_noise_depends_on_seed_step_index_only():
    assert sample_seed(0, 1, 2) == sample_seed(0, 1, 2)
    seeds = {sample_seed(s, t, i) for s in range(3) for t in range(3) for i in range(50)}
    assert len(seeds) == 450 and all(0 <= x < 2**63 for x in seeds)
    a = [torch.randn(3, generator=g) for g in generators(0, 5, [7, 8], "cpu")]
    b = [torch.randn(3, generator=g) for g in generators(0, 5, [8], "cpu")]
    assert torch.equal(a[1], b[0]) and not torch.equal(a[0], a[1])


def test_shards_cover_the_batch():
    from flowgrpo.data.prompts import check_divides, rank_slice

    assert [rank_slice(12, 3, r) for r in range(3)] == [(0, 4), (4, 4), (8, 4)]
    check_divides(12, 3)
    with pytest.raises(ValueError, match="divide evenly over 3 data-parallel ranks"):
        check_divides(10, 3)
    with pytest.raises(ValueError, match="divide evenly over 3 data-parallel ranks"):
        rank_slice(10, 3, 0)
    parts = [padded_shard(7, r, 3) for r in range(3)]  # 3 per rank, the last padded
    assert parts == [([0, 1, 2], 3), ([3, 4, 5], 3), ([6, 6, 6], 1)]


def test_grid_layout_rows_are_prompts_columns_are_seeds():
    from flowgrpo.trainer.setup import grid_layout

    idx, cols = grid_layout(500, 50)  # toy: 10 digits x 50 seeds -> 10 rows of 6 seeds
    assert cols == 6 and len(idx) == 60 and {0, 5, 50, 455} <= idx and 6 not in idx
    idx, cols = grid_layout(1000, 2)  # many prompts: the first seed of 64 prompts
    assert cols == 8 and idx == set(range(0, 128, 2))
    assert grid_layout(5, 1) == ({0, 1, 2, 3, 4}, 5)


def test_the_progress_bar_ends_once_before_the_final_table(tmp_path, capsys, monkeypatch):
    """Before: tqdm redrew the bar around each line of the final table (3 extra bars)."""
    from flowgrpo.trainer.logging import write_final_report

    monkeypatch.delenv("FLOWGRPO_NO_PROGRESS", raising=False)
    log = RunLogger(tmp_path, total_steps=2, tensorboard=False, progress=True)
    for step in (1, 2):
        log.log_step({"step": step, "reward_mean": 0.5, "samples": 8 * step})
    log.log_eval({"step": 2, "eval/reward_mean": 0.6})
    capsys.readouterr()
    summary = {"base": {"eval/reward_mean": 0.5}, "final": {"eval/reward_mean": 0.6}}
    write_final_report(
        tmp_path, torch.zeros(1, 1, 8, 8), 1, {**summary, "steps": 2, "wall_s": 1.0}, log
    )
    log.close()
    out = capsys.readouterr()
    assert out.err.count("2/2") == 1  # the bar's last state, printed once
    assert out.err.rfind("2/2") < len(out.err) and "eval/reward_mean" in out.out
    assert "\r" not in out.err.split("2/2", 1)[1]  # nothing redrawn after it
