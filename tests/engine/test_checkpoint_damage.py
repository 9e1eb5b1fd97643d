"""Damaged and leftover checkpoint files (issue 40, items 2b and 7): a corrupt
``trainer_state.json`` or a truncated DCP shard is one line naming the file and offering the
previous good checkpoint (before: "Expecting property name ..." and a bare EOFError); what a
kill during a prune leaves is removed at the next start; pruning and leftover removal touch
only names a checkpoint write produces (before: a user's ``step_best.tmp/`` was deleted)."""

import json

import pytest
import tinymodel as tm

from flowgrpo.engine import checkpoint as ckpt_mod
from flowgrpo.engine import latest_checkpoint, load_checkpoint, save_checkpoint
from flowgrpo.errors import RunError


@pytest.fixture(scope="module")
def saved(tiny_traj, tmp_path_factory, dist1):
    """A root with step_1 and step_2 of one run, and the config to load them."""
    root = tmp_path_factory.mktemp("ckpts")
    cfg = tm.make_config("clip", **{"update.micro_batch_size": 2})
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    traj, adv = tiny_traj.select([0, 1]), tm.ADVANTAGES[:2]
    for step in (1, 2):
        tm.train_step(engine, traj, adv)
        save_checkpoint(engine, root, step, extra={"step": step}, run_id="r1")
    return root, cfg


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_corrupt_trainer_state_names_the_file_and_the_previous_checkpoint(saved, tmp_path):
    root, cfg = saved
    work = _copy(root, tmp_path / "c")
    (work / "step_2" / "trainer_state.json").write_text('{"step": 2, oops}')
    with pytest.raises(RunError) as err:
        load_checkpoint(tm.engine_for(tm.TinyAdapter(), cfg), work / "step_2")
    msg = str(err.value)
    assert "\n" not in msg and str(work / "step_2" / "trainer_state.json") in msg
    assert f"trainer.resume={work / 'step_1'}" in msg


def test_a_truncated_shard_names_the_file_and_the_previous_checkpoint(saved, tmp_path):
    root, cfg = saved
    work = _copy(root, tmp_path / "t")
    shard = max((work / "step_2").glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(RunError) as err:
        load_checkpoint(tm.engine_for(tm.TinyAdapter(), cfg), work / "step_2")
    msg = str(err.value)
    assert "\n" not in msg and str(shard) in msg and "truncated" in msg
    assert f"trainer.resume={work / 'step_1'}" in msg
    # the first checkpoint damaged: no earlier one to offer, said so
    first = max((work / "step_1").glob("*.distcp"), key=lambda p: p.stat().st_size)
    first.write_bytes(b"")
    with pytest.raises(RunError, match="no earlier complete checkpoint"):
        load_checkpoint(tm.engine_for(tm.TinyAdapter(), cfg), work / "step_1")


def test_leftovers_of_a_kill_go_and_nothing_else(saved, tmp_path):
    root, _ = saved
    work = _copy(root, tmp_path / "l")
    # a prune killed midway (old rmtree order: COMPLETE gone first), a write killed midway
    half = _copy(work / "step_1", work / "step_7")
    (half / "COMPLETE").unlink()
    (half / "engine_state.pt").unlink()
    _copy(work / "step_1", work / "step_8.tmp")
    user = work / "step_best.tmp"  # a user's folders, and another run's partial checkpoint
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    other = _copy(work / "step_1", work / "step_9")
    (other / "COMPLETE").unlink()
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "run_id": "someone-else"}))
    assert ckpt_mod.remove_leftovers(work, {"r1"}) == ["step_7", "step_8.tmp"]
    assert sorted(p.name for p in work.iterdir()) == ["step_1", "step_2", "step_9", "step_best.tmp"]
    assert (user / "notes.txt").read_text() == "mine"


def test_pruning_spares_a_users_tmp_folder_and_deletes_by_rename(saved, tmp_path, tiny_traj):
    root, cfg = saved
    work = _copy(root, tmp_path / "p")
    user = work / "step_best.tmp"
    user.mkdir()
    (user / "model.safetensors").write_text("mine")
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    load_checkpoint(engine, work / "step_2")
    save_checkpoint(engine, work, 3, extra={"step": 3}, keep_last=1, run_id="r1")
    assert sorted(p.name for p in work.iterdir()) == ["step_3", "step_best.tmp"]
    assert (user / "model.safetensors").read_text() == "mine"
    assert latest_checkpoint(work) == work / "step_3"


def test_a_save_moves_another_runs_checkpoint_aside(saved, tmp_path):
    """Before: a save deleted whatever step_<N> was there, another run's included."""
    root, cfg = saved
    work = _copy(root, tmp_path / "o")
    other = _copy(work / "step_2", work / "step_3")
    meta = json.loads((other / "meta.json").read_text())
    (other / "meta.json").write_text(json.dumps({**meta, "run_id": "someone-else"}))
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    load_checkpoint(engine, work / "step_2")
    with pytest.warns(UserWarning, match="written by another run: moved to step_3.other-"):
        save_checkpoint(engine, work, 3, extra={"step": 3}, run_id="r1")
    aside = next(work.glob("step_3.other-*"))
    assert json.loads((aside / "meta.json").read_text())["run_id"] == "someone-else"
    assert json.loads((work / "step_3" / "meta.json").read_text())["run_id"] == "r1"
