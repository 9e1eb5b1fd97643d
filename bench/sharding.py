"""FSDP2 over 2 ranks (gloo, loopback) vs 1 rank: time per sample of one training step.

Both runs train the same global batch from the same tiny SD3 pipeline and trajectory; the
2-rank run gives each rank half of it and one thread, the 1-rank run one process with the
same total of threads. The ratio (2-rank time per sample / 1-rank time per sample) shows
what sharding costs (all-gathers, reduce-scatters) when compute is split evenly.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from flowgrpo.testing.ranks import free_port, rank_env


def _worker(rank: int, world: int, port: int, settings: dict, out_file: str) -> None:
    rank_env(rank, world, port, threads=max(1, settings["threads"] // world))
    from flowgrpo.config import config_from_dict
    from flowgrpo.engine import dist as fdist
    from flowgrpo.models import build_adapter
    from flowgrpo.rollout import SDEWindow, sample_trajectories
    from flowgrpo.testing.tiny import tiny_pipeline
    from flowgrpo.trainer.setup import build_engine

    info = fdist.init_distributed()
    adapter = build_adapter(tiny_pipeline("sd3"))
    batch, h, w = settings["batch"], settings["height"], settings["width"]
    traj = sample_trajectories(
        adapter,
        [f"a red cube number {i}" for i in range(batch)],
        num_steps=settings["num_steps"],
        guidance_scale=1.0,
        noise_level=0.7,
        height=h,
        width=w,
        generator=[torch.Generator().manual_seed(i) for i in range(batch)],
        sde_window=SDEWindow(
            size=settings["trained_steps"], lo=0, hi=settings["trained_steps"] + 1
        ),
        decode=False,
    )
    advantages = torch.linspace(-1, 1, batch)
    share = batch // world
    local = slice(rank * share, (rank + 1) * share)
    cfg = config_from_dict(
        {
            "lora": {"enabled": False},
            "fsdp": {"param_dtype": "fp32", "reshard_after_forward": settings.get("reshard", True)},
            "update": {"micro_batch_size": share, "num_minibatches": 1},
        }
    )
    _, algorithm = build_engine(cfg, adapter, info)
    traj_local, adv_local = traj.select(local), advantages[local]
    times = []
    for i in range(settings["warmup"] + settings["repeats"]):
        fdist.barrier()
        t0 = time.perf_counter()
        algorithm.update(traj_local, adv_local, step=i + 1, sample_seeds=list(range(share)))
        fdist.barrier()
        if i >= settings["warmup"]:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out_file).write_text(json.dumps({"step_s": statistics.median(times)}))
    fdist.cleanup()


def _run(world: int, settings: dict) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, free_port(), settings, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())["step_s"]


def bench_sharding(s, *, quick: bool = False) -> dict[str, float]:
    settings = {
        "batch": max(2, s.batch),
        "height": s.height,
        "width": s.width,
        "num_steps": s.num_steps,
        "trained_steps": s.trained_steps,
        "repeats": s.repeats,
        "warmup": s.warmup,
        "threads": s.threads,
    }
    one = _run(1, settings)
    two = _run(2, settings)
    per_sample_one = one / settings["batch"]
    per_sample_two = two / settings["batch"]
    return {
        "one_rank_step_s": one,
        "two_rank_step_s": two,
        "one_rank_per_sample_s": per_sample_one,
        "two_rank_per_sample_s": per_sample_two,
        "two_rank_per_sample_over_one_rank": per_sample_two / per_sample_one,
    }
