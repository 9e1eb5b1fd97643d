"""Checkpoint directory handling: crash safety, the COMPLETE marker, keep_last."""

import pytest
import tinymodel as tm
import torch

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

    traj, adv = tiny_traj.select([0, 1]), tm.ADVANTAGES[:2]
    cfg = tm.make_config("clip", **{"update.micro_batch_size": 2})
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    tm.train_step(engine, traj, adv)
    saved = tm.trainable(engine)
    first = save_checkpoint(engine, tmp_path, 1, extra={"epoch": 1})
    assert first == tmp_path / "step_1" and (first / ckpt_mod.MARKER).is_file()
    tm.train_step(engine, traj, adv)

    class Killed(BaseException):  # a kill -9 mid-save: nothing gets to clean up
        pass

    def boom(_):
        raise Killed

    monkeypatch.setattr(ckpt_mod, "_write_marker", boom)
    with pytest.raises(Killed):
        save_checkpoint(engine, tmp_path, 2)
    monkeypatch.undo()
    assert (tmp_path / "step_2.tmp").is_dir()  # the half-written save is there ...
    assert not (tmp_path / "step_2").exists()
    assert latest_checkpoint(tmp_path) == first  # ... but never taken as complete
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(engine, tmp_path / "step_2.tmp")

    fresh = tm.engine_for(tm.TinyAdapter(), cfg)
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

    engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("clip"))
    save_checkpoint(engine, tmp_path, 0)
    full = tm.engine_for(tm.TinyAdapter(), tm.make_config("full", **{"flow_grpo.kl_beta": 0.0}))
    with pytest.raises(ValueError, match="lora"):
        load_checkpoint(full, tmp_path)


class _Payload:
    """Unpickling this runs a shell command that creates ``marker`` (a tampered checkpoint)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("name", ["engine_state.pt", "rng/rank_0.pt", ".metadata"])
def test_tampered_checkpoint_is_refused_and_runs_nothing(dist1, tiny_traj, tmp_path, name):
    import pickle

    import torch

    cfg = tm.make_config("clip", **{"update.micro_batch_size": 2})
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    tm.train_step(engine, tiny_traj.select([0, 1]), tm.ADVANTAGES[:2])
    ckpt = save_checkpoint(engine, tmp_path / "ckpt", 1)
    marker = tmp_path / "pwned"
    with open(ckpt / name, "wb") as f:
        if name.endswith(".pt"):
            torch.save({"step": _Payload(marker)}, f)
        else:  # DCP writes .metadata with plain pickle
            pickle.dump(_Payload(marker), f)

    fresh = tm.engine_for(tm.TinyAdapter(), cfg)
    before = tm.trainable(fresh)
    with pytest.raises(ValueError) as err:
        load_checkpoint(fresh, ckpt)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"refusing to load {ckpt / name}")
    assert "system" in msg  # names what it refused
    assert not marker.exists()
    after = tm.trainable(fresh)  # refused before the engine was touched
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_tampered_dcp_entry_is_refused(dist1, tiny_traj, tmp_path):
    """DCP stores non-tensor state (the optimizer's hyper-parameters) as pickles of its own,
    which its default planner loads with weights_only=False."""

    cfg = tm.make_config("clip", **{"update.micro_batch_size": 2})
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    tm.train_step(engine, tiny_traj.select([0, 1]), tm.ADVANTAGES[:2])
    marker = tmp_path / "pwned"
    engine.optimizer.param_groups[0]["eps"] = _Payload(marker)
    ckpt = save_checkpoint(engine, tmp_path / "ckpt", 0)
    assert not marker.exists()
    with pytest.raises(ValueError, match=r"refusing to load .*step_0 \(entry 'optim\..*eps'\)"):
        load_checkpoint(tm.engine_for(tm.TinyAdapter(), cfg), ckpt)
    assert not marker.exists()


def test_rng_file_of_older_checkpoints_still_loads(dist1, tmp_path):
    """Before weights-only loading, rng files held python's tuple and numpy's ndarray."""
    import random

    import numpy as np
    import torch

    engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("clip"))
    ckpt = save_checkpoint(engine, tmp_path, 0)
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    old = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    torch.save(old, ckpt / "rng" / "rank_0.pt")
    load_checkpoint(engine, ckpt)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


def test_disk_full_is_one_line_and_keeps_the_previous_checkpoint(dist1, tiny_traj, tmp_path):
    """ENOSPC injected into the checkpoint writer (torch.save of the RNG state): one-line
    RunError naming the folder and the cause, the partial .tmp removed, the previous
    checkpoint complete and loadable."""
    import errno
    from unittest import mock

    from flowgrpo.errors import RunError

    traj, adv = tiny_traj.select([0, 1]), tm.ADVANTAGES[:2]
    cfg = tm.make_config("clip", **{"update.micro_batch_size": 2})
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    tm.train_step(engine, traj, adv)
    first = save_checkpoint(engine, tmp_path, 1, extra={"epoch": 1})
    tm.train_step(engine, traj, adv)
    real_save = torch.save

    def full(obj, f, *a, **k):
        if "rng" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *a, **k)

    with mock.patch.object(ckpt_mod.torch, "save", full), pytest.raises(RunError) as err:
        save_checkpoint(engine, tmp_path, 2)
    msg = str(err.value)
    assert "\n" not in msg and "No space left on device" in msg and "step_2.tmp" in msg
    assert not (tmp_path / "step_2.tmp").exists() and not (tmp_path / "step_2").exists()
    assert latest_checkpoint(tmp_path) == first
    assert load_checkpoint(tm.engine_for(tm.TinyAdapter(), cfg), tmp_path)[0] == 1


def test_pruning_never_touches_another_runs_checkpoints(dist1, tiny_traj, tmp_path):

    engine = tm.engine_for(
        tm.TinyAdapter(), tm.make_config("clip", **{"update.micro_batch_size": 2})
    )
    for step in (3, 4):
        save_checkpoint(engine, tmp_path, step, keep_last=1, run_id="old")
    for step in (1, 2):
        save_checkpoint(engine, tmp_path, step, keep_last=1, run_id="new")
    left = sorted(d.name for d in tmp_path.iterdir())
    assert left == ["step_2", "step_4"]  # each run kept its own newest one
    assert ckpt_mod.run_id_of(tmp_path / "step_2") == "new"


def test_resume_applies_the_configured_optimizer_settings(dist1, tiny_traj, tmp_path):
    """A resume with a new optim.lr / weight_decay / betas / eps: the next step uses them (the
    restored optimizer and scheduler carried the checkpoint's), with the cosine schedule still
    at its step. Checked against AdamW's update written out from the step's moments."""
    import math

    traj, adv = tiny_traj.select([0, 1]), tm.ADVANTAGES[:2]
    engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("lora"))  # lr 1e-2, cosine 1 / 6
    for _ in range(2):
        tm.train_step(engine, traj, adv)
    save_checkpoint(engine, tmp_path, 2)
    new = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.8, 0.95), "eps": 1e-6}
    cfg = tm.make_config("lora", **{f"optim.{k}": v for k, v in new.items()})
    fresh = tm.engine_for(tm.TinyAdapter(), cfg)
    load_checkpoint(fresh, tmp_path / "step_2")
    assert fresh.optim_changes == {
        "lr": (1e-2, 1e-3),
        "weight_decay": (0.0, 0.1),
        "betas": ((0.9, 0.999), (0.8, 0.95)),
        "eps": (1e-8, 1e-6),
    }
    lr = 1e-3 * 0.5 * (1 + math.cos(math.pi * (2 - 1) / (6 - 1)))  # cosine at optimizer step 2
    before = tm.trainable(fresh)
    metrics = tm.train_step(fresh, traj, adv)
    assert metrics["lr"] == pytest.approx(lr, rel=1e-12)
    after = tm.trainable(fresh)
    named = dict(zip(fresh.param_names, fresh.params, strict=True))
    (b1, b2), t = new["betas"], 3
    for name, p in named.items():
        state = fresh.optimizer.state[p]
        assert float(state["step"]) == t
        m, v = state["exp_avg"].full_tensor(), state["exp_avg_sq"].full_tensor()
        denom = v.sqrt() / math.sqrt(1 - b2**t) + new["eps"]
        want = before[name] * (1 - lr * new["weight_decay"]) - lr / (1 - b1**t) * m / denom
        torch.testing.assert_close(after[name], want, rtol=1e-5, atol=1e-8)
    same = tm.engine_for(tm.TinyAdapter(), tm.make_config("lora"))
    load_checkpoint(same, tmp_path / "step_2")
    assert same.optim_changes == {}  # unchanged settings: nothing said, nothing changed


def test_state_dict_round_trip_resumes_exactly_without_files(dist1, tiny_traj):
    """``engine.state_dict()`` into a fresh engine's ``load_state_dict`` (no checkpoint files):
    the next two steps equal the original engine's bit for bit (weights, EMA, LR schedule,
    shuffle order, counters); a state without ``ema`` starts the EMA from the loaded weights."""
    import copy

    traj, adv = tiny_traj, tm.ADVANTAGES
    cfg = tm.make_config("lora")  # LoRA + KL + EMA every step + cosine LR
    engine = tm.engine_for(tm.TinyAdapter(), cfg)
    tm.train_step(engine, traj, adv)
    state = copy.deepcopy(engine.state_dict())  # its tensors are the engine's own: a copy
    assert sorted(state) == ["ema", "engine", "model", "optim"]
    assert (state["engine"]["step"], state["engine"]["optimizer_steps"]) == (1, 1)
    fresh = tm.engine_for(tm.TinyAdapter(), cfg)
    fresh.load_state_dict(state)
    want = [tm.train_step(engine, traj, adv)["lr"] for _ in range(2)]
    got = [tm.train_step(fresh, traj, adv)["lr"] for _ in range(2)]
    assert got == want and want[0] != want[1]  # the cosine schedule went on from step 1
    a, b = tm.trainable(engine), tm.trainable(fresh)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(tm.ema_values(engine), tm.ema_values(fresh)))
    assert torch.equal(engine.generator.get_state(), fresh.generator.get_state())
    assert (fresh.step, fresh.optimizer_steps) == (engine.step, engine.optimizer_steps) == (3, 3)

    no_ema = copy.deepcopy(engine.state_dict())
    del no_ema["ema"]
    other = tm.engine_for(tm.TinyAdapter(), cfg)
    other.load_state_dict(no_ema)
    loaded = tm.trainable(other)
    assert all(torch.equal(x, loaded[k]) for x, k in zip(tm.ema_values(other), other.param_names))
    assert all(torch.equal(a[k], loaded[k]) for k in a)


def test_pruning_keeps_checkpoints_marked_keep(dist1, tiny_traj, tmp_path):
    """A checkpoint the trainer marked KEEP (a best checkpoint, a rollback's target) outlives
    keep_last; unmarked, it goes at the next save."""
    from flowgrpo.engine.checkpoint_dirs import KEEP

    engine = tm.engine_for(
        tm.TinyAdapter(), tm.make_config("clip", **{"update.micro_batch_size": 2})
    )
    save_checkpoint(engine, tmp_path, 1, keep_last=1, run_id="r")
    (tmp_path / "step_1" / KEEP).write_text("best")
    for step in (2, 3):
        save_checkpoint(engine, tmp_path, step, keep_last=1, run_id="r")
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step_1", "step_3"]
    (tmp_path / "step_1" / KEEP).unlink()
    save_checkpoint(engine, tmp_path, 4, keep_last=1, run_id="r")
    assert sorted(d.name for d in tmp_path.iterdir()) == ["step_4"]
