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
