"""A full disk during a checkpoint save: one line naming the file and saying the disk is full
(torch's own writer said only "inline_container.cc:672 unexpected pos"). The full disk is the
real thing: the write goes to /dev/full, whose every write fails with ENOSPC."""

import os

import pytest
import tinymodel as tm
import torch

from flowgrpo.engine import checkpoint as ckpt_mod
from flowgrpo.engine import latest_checkpoint, load_checkpoint, save_checkpoint
from flowgrpo.errors import RunError


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_disk_names_the_file_and_says_the_disk_is_full(dist1, tiny_traj, tmp_path):
    traj, adv = tiny_traj.select([0, 1]), tm.ADVANTAGES[:2]
    cfg = tm.make_config("clip", **{"update.micro_batch_size": 2})
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    tm.train_step(engine, traj, adv)
    first = save_checkpoint(engine, tmp_path, 1)
    real_save = torch.save

    def engine_state_to_dev_full(obj, f, *args, **kwargs):
        """The engine state's bytes go to /dev/full, by the same route (a path: torch's C++
        file writer; a Python file: through Python) the checkpoint code chose."""
        if "engine_state" not in str(getattr(f, "name", f)):
            return real_save(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)):
            return real_save(obj, "/dev/full", *args, **kwargs)
        with open("/dev/full", "wb") as full:
            return real_save(obj, full, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ckpt_mod.torch, "save", engine_state_to_dev_full)
        with pytest.raises(RunError) as err:
            save_checkpoint(engine, tmp_path, 2)
    msg = str(err.value)
    assert "\n" not in msg and "inline_container" not in msg
    assert "the disk is full" in msg and "No space left on device" in msg
    assert str(tmp_path / "step_2.tmp" / "engine_state.pt") in msg  # the file
    assert not (tmp_path / "step_2.tmp").exists() and latest_checkpoint(tmp_path) == first
    assert load_checkpoint(tm.engine_for(tm.TinyAdapter(), cfg), tmp_path)[0] == 1


def _dcp_zip_writer_failure(*args, **kwargs):
    """What DCP raised when the disk filled during a real 2-rank `flowgrpo train` (CPU,
    2026-12-03): torch's zip writer's message, no errno, inside DCP's multi-rank report."""
    from torch.distributed.checkpoint.api import CheckpointException

    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    raise CheckpointException("save", {0: (err, "traceback")})


def _disk_with(free_mib: float):
    import shutil

    real = shutil.disk_usage

    def usage(path):
        total, used, _ = real(path)
        return type(real(path))(total, used, int(free_mib * 2**20))

    return usage


@pytest.mark.parametrize("free_mib, earlier", [(0.5, True), (0.5, False), (10_000, True)])
def test_an_errno_less_write_failure_on_a_full_disk_says_so_and_what_is_kept(
    dist1, tiny_traj, tmp_path, free_mib, earlier
):
    cfg = tm.make_config("clip", **{"update.micro_batch_size": 2})
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    first = save_checkpoint(engine, tmp_path, 1) if earlier else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ckpt_mod.dcp, "save", _dcp_zip_writer_failure)
        mp.setattr(ckpt_mod.shutil, "disk_usage", _disk_with(free_mib))
        with pytest.raises(RunError) as err:
            save_checkpoint(engine, tmp_path, 2)
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path / "step_2.tmp") in msg and "unexpected pos" in msg
    assert ("the disk is full (0 MiB free;" in msg) == (free_mib < 64)
    if earlier:
        assert "the previous checkpoint step_1 is kept" in msg
    else:
        assert f"no earlier checkpoint is in {tmp_path}" in msg and "previous" not in msg
    assert not (tmp_path / "step_2.tmp").exists() and latest_checkpoint(tmp_path) == first
