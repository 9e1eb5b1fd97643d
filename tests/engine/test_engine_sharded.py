"""2 ranks (gloo, spawned once) vs 1 process on the same global batch: LoRA and full
fine-tuning, grad clipping, and checkpoints written by 2 ranks resumed in 1."""

import math

import pytest
import tinymodel as tm
import torch

from flowgrpo.testing.ranks import spawn

pytestmark = pytest.mark.slow  # spawns 2 ranks
TOL = 1e-5


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_traj):
    work = tmp_path_factory.mktemp("engine_sharded")
    torch.save(tiny_traj, work / "traj.pt")
    return work


@pytest.fixture(scope="module")
def runs(dist1, tiny_traj, work):
    """Every 2-rank run in one spawn (imports cost seconds per process), running while this
    process does the 1-process runs."""
    ctx = spawn(tm.sharded_job, 2, str(work), join=False)
    try:
        adv = tm.ADVANTAGES
        single = {
            "lora": tm.run_case(
                "lora", tiny_traj, adv, 4, ckpt=work / "ckpt1", save_at=2, snapshots=(3, 4)
            ),
            "full": tm.run_case("full", tiny_traj, adv, 3, snapshots=(3,)),
            "clip": tm.run_case("clip", tiny_traj, adv, 2, snapshots=(0, 1, 2)),
            "zero": tm.run_case("lora", tiny_traj, tm.ZERO_HALF, 2, snapshots=(2,)),
            "zero_mb2": tm.run_case(
                "lora", tiny_traj, tm.ZERO_HALF, 2, snapshots=(2,), **{"update.num_minibatches": 2}
            ),
        }
    finally:
        while not ctx.join():
            pass
    return torch.load(work / "sharded.pt", weights_only=False), single


@pytest.fixture(scope="module")
def sharded(runs):
    return runs[0]


@pytest.fixture(scope="module")
def single(runs):
    return runs[1]


@pytest.mark.parametrize("case", ["lora", "full"])
def test_two_ranks_equal_one_process(sharded, single, case):
    s, one = sharded[case], single[case]
    diff = _max_diff(s["params@3"], one["params@3"])
    moved = _max_diff(one["params@3"], tm.trainable_initial(case))
    print(f"{case}: max |2 ranks - 1 process| after 3 optimizer steps = {diff:.2e}")
    assert moved > 1e-3  # the weights really moved
    assert diff < TOL
    for ms, mo in zip(s["metrics"], one["metrics"], strict=True):
        assert ms["skipped"] == mo["skipped"] == 0
        for key in ("loss", "policy_loss", "kl", "approx_kl", "ratio_mean", "grad_norm", "lr"):
            assert ms[key] == pytest.approx(mo[key], rel=1e-4, abs=1e-7), key
    if case == "lora":  # KL really entered the loss; the cosine LR moved
        assert one["metrics"][-1]["kl"] > 0
        assert one["metrics"][-1]["lr"] < one["metrics"][1]["lr"]
        ema_diff = max((a - b).abs().max().item() for a, b in zip(s["ema@3"], one["ema@3"]))
        assert ema_diff < TOL


def test_grad_clipping_uses_global_norm(sharded, single):
    s, one = sharded["clip"], single["clip"]
    max_norm, lr = 1e-3, 1e-2
    for ms, mo in zip(s["metrics"], one["metrics"], strict=True):
        # a per-shard norm would be ~1/sqrt(2) of the global one
        assert ms["grad_norm"] == pytest.approx(mo["grad_norm"], rel=1e-5)
        assert mo["grad_norm"] > 3 * max_norm  # clipping engaged
    # eps = 1 makes AdamW's first update ~ lr * g: its norm is lr * max_norm once clipped
    step = math.sqrt(
        sum(((one["params@1"][k] - one["params@0"][k]) ** 2).sum() for k in one["params@0"])
    )
    assert step == pytest.approx(lr * max_norm, rel=0.02)
    assert _max_diff(s["params@2"], one["params@2"]) < TOL


@pytest.mark.parametrize("case", ["zero", "zero_mb2"])
def test_zero_advantage_rank_still_steps_and_matches(sharded, single, case):
    """Rank 1's samples all have advantage 0: dropped, it runs zero-weight padding micro-
    batches so FSDP's collectives line up, and the loss is the mean over the kept samples of
    all ranks, as in 1 process."""
    s, one = sharded[case], single[case]
    assert _max_diff(s["params@2"], one["params@2"]) < TOL
    assert _max_diff(one["params@2"], tm.trainable_initial("lora")) > 1e-3
    for ms, mo in zip(s["metrics"], one["metrics"], strict=True):
        assert ms["samples_trained"] == mo["samples_trained"] == 2.0
        assert ms["samples_dropped"] == mo["samples_dropped"] == 2.0
        assert ms["optimizer_steps"] == mo["optimizer_steps"] == (2.0 if "mb2" in case else 1.0)
        for key in ("loss", "policy_loss", "kl", "grad_norm"):
            assert ms[key] == pytest.approx(mo[key], rel=1e-4, abs=1e-7), key


def test_hsdp_replicated_mesh_matches(sharded, single):
    diff = _max_diff(sharded["hsdp"]["params@2"], single["clip"]["params@2"])
    assert diff < TOL
    assert sharded["hsdp"]["metrics"][0]["grad_norm"] == pytest.approx(
        single["clip"]["metrics"][0]["grad_norm"], rel=1e-5
    )


@pytest.mark.parametrize("source", ["ckpt1", "ckpt2"])
def test_resume_equals_uninterrupted(dist1, tiny_traj, work, sharded, single, source):
    """Saved after 2 steps (ckpt1: 1 process, ckpt2: 2 ranks), loaded into a fresh 1-process
    engine, 2 more steps == 4 uninterrupted steps (params, EMA, LR, counters)."""
    from flowgrpo.engine import latest_checkpoint, load_checkpoint

    ckpt = latest_checkpoint(work / source)
    assert ckpt is not None and ckpt.name == "step_2"
    engine = tm.engine_for(tm.TinyAdapter(), tm.make_config("lora"))
    step, extra = load_checkpoint(engine, work / source)
    assert (step, extra, engine.step, engine.optimizer_steps) == (2, {"pos": 2}, 2, 2)
    metrics = [tm.train_step(engine, tiny_traj, tm.ADVANTAGES) for _ in range(2)]
    want = single["lora"]
    diff = _max_diff(tm.trainable(engine), want["params@4"])
    print(f"resume from {source}: max diff vs uninterrupted = {diff:.2e}")
    assert diff < TOL
    assert _max_diff(tm.trainable(engine), sharded["lora"]["params@4"]) < TOL
    ema_diff = max((a - b).abs().max().item() for a, b in zip(tm.ema_values(engine), want["ema@4"]))
    assert ema_diff < TOL
    assert metrics[-1]["lr"] == pytest.approx(want["metrics"][-1]["lr"], rel=1e-7)
    assert engine.optimizer_steps == 4


def test_dist_helpers_on_two_ranks(sharded):
    d = sharded["dist"]
    assert d["gathered"].tolist() == [0.0, 1.0, 0.0, 1.0, 2.0]
    assert d["objects"] == [{"rank": 0}, {"rank": 1}]
    assert d["mean"].item() == 0.5
    info = d["info"]
    assert (info.rank, info.world_size, info.local_rank, info.backend) == (0, 2, 0, "gloo")
    assert d["main"]


def test_single_process_group_needs_no_env(dist1):
    assert (dist1.rank, dist1.world_size, dist1.device.type) == (0, 1, "cpu")
    from flowgrpo.engine import dist as fdist

    assert fdist.all_gather_tensor(torch.ones(2)).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="replicate_degree"):
        fdist.build_mesh(1, replicate_degree=2)
