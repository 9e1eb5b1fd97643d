"""Checkpoint directory handling: crash safety, the COMPLETE marker, keep_last."""

import pytest
import tinymodel as tm

from flowgrpo.engine import checkpoint as ckpt_mod
from flowgrpo.engine import latest_checkpoint, load_checkpoint, save_checkpoint


def test_latest_checkpoint_needs_marker_and_ignores_tmp(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    for name, marker in [("step_3", True), ("step_7", False), ("step_9.tmp", True), ("x", True)]:
        (tmp_path / name).mkdir()
        if marker:
            (tmp_path / name / ckpt_mod.MARKER).write_text("ok")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_3"
    (tmp_path / "step_12").mkdir()
    (tmp_path / "step_12" / ckpt_mod.MARKER).write_text("ok")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_12"  # numeric, not lexicographic


def test_interrupted_save_leaves_previous_loadable(dist1, tiny_traj, tmp_path, monkeypatch):
    from flowgrpo.engine import DiffusersFSDPEngine

    traj, adv = tiny_traj.select([0, 1]), tm.ADVANTAGES[:2]
    cfg = tm.make_config("clip", micro_batch_size=2)
    engine = DiffusersFSDPEngine(tm.TinyAdapter(), cfg)
    engine.train_step(traj, adv)
    saved = tm.trainable(engine)
    first = save_checkpoint(engine, tmp_path, 1, extra={"epoch": 1})
    assert first == tmp_path / "step_1" and (first / ckpt_mod.MARKER).is_file()
    engine.train_step(traj, adv)

    def boom(_):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ckpt_mod, "_write_marker", boom)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(engine, tmp_path, 2)
    monkeypatch.undo()
    assert (tmp_path / "step_2.tmp").is_dir()  # the half-written save is there ...
    assert not (tmp_path / "step_2").exists()
    assert latest_checkpoint(tmp_path) == first  # ... but never taken as complete
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(engine, tmp_path / "step_2.tmp")

    fresh = DiffusersFSDPEngine(tm.TinyAdapter(), cfg)
    assert load_checkpoint(fresh, tmp_path) == (1, {"epoch": 1})
    after = tm.trainable(fresh)
    assert max((after[k] - saved[k]).abs().max().item() for k in saved) == 0.0

    # later saves clean stale .tmp dirs and keep only the newest keep_last
    for step in (3, 4, 5):
        save_checkpoint(fresh, tmp_path, step, keep_last=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step_4", "step_5"]
    assert sorted(p.name for p in (tmp_path / "step_5" / "rng").iterdir()) == ["rank_0.pt"]


def test_load_rejects_lora_full_mismatch(dist1, tiny_traj, tmp_path):
    from flowgrpo.engine import DiffusersFSDPEngine

    engine = DiffusersFSDPEngine(tm.TinyAdapter(), tm.make_config("clip"))
    save_checkpoint(engine, tmp_path, 0)
    full = DiffusersFSDPEngine(tm.TinyAdapter(), tm.make_config("full", **{"loss.kl_beta": 0.0}))
    with pytest.raises(ValueError, match="lora"):
        load_checkpoint(full, tmp_path)
