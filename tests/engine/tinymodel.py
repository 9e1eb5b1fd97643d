"""The engine tests' cases: trajectories of the kit's transformer-only ``TinyAdapter``, the
engine + Flow-GRPO configs of the sharded/unsharded comparisons, and the spawned 2-rank job
(one spawn runs every sharded check). Rank spawning and gathering come from the kit."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowgrpo.engine.config import EngineConfig as EngineConfigBase
from flowgrpo.models.base import DiffusionAdapter
from flowgrpo.testing.compare import full_trainable
from flowgrpo.testing.models import TinyAdapter  # the engine tests use it as tm.TinyAdapter
from flowgrpo.testing.ranks import rank_env

PROMPTS = ["a", "b", "c", "d"]
SIZE = 16  # "pixels" = latent side (identity decode); 8x8 tokens with patch 2


def make_trajectory(adapter: DiffusionAdapter, seed: int = 0):
    """4 samples, 3 steps with the last deterministic -> 2 trained SDE steps, CFG 2.0."""
    from flowgrpo.rollout import sample_trajectories

    return sample_trajectories(
        adapter,
        PROMPTS,
        num_steps=3,
        guidance_scale=2.0,
        noise_level=0.7,
        height=SIZE,
        width=SIZE,
        generator=torch.Generator().manual_seed(seed),
        decode=False,
    )


ADVANTAGES = torch.tensor([1.0, -0.5, 0.8, -1.3])
# rank 1 of 2 holds only zero advantages (its groups had no reward spread)
ZERO_HALF = torch.tensor([1.0, -0.5, 0.0, 0.0])


@dataclass
class RunSections(EngineConfigBase):
    """What the engine and the Flow-GRPO algorithm read: the engine's sections plus the
    update and flow_grpo ones (the run config has them all)."""

    update: Any = None
    flow_grpo: Any = None


def make_config(case: str, **over):
    """Configs of the sharded/unsharded comparison cases (engine + Flow-GRPO sections)."""
    from flowgrpo.algorithms.base import UpdateConfig
    from flowgrpo.algorithms.flow_grpo import FlowGRPOConfig
    from flowgrpo.engine import EMAConfig, LoraConfig, OptimConfig

    lora = LoraConfig(enabled=case != "full", rank=4, alpha=8, init="gaussian")
    # clip_range 0.5 so later optimizer steps (ratio != 1) still carry gradient
    algo = FlowGRPOConfig(clip_range=0.5, kl_beta=0.05 if case in ("lora", "full") else 0.0)
    optim = OptimConfig(lr=1e-2, max_grad_norm=1e6, weight_decay=0.0)
    if case == "clip":  # eps >> |grad| makes AdamW ~ SGD, so the update scales with the clipping
        optim.max_grad_norm, optim.eps = 1e-3, 1.0
    if case == "full":  # Adam turns rounding noise of near-zero grads into ~lr-sized steps
        optim.lr = 2e-3
    if case == "lora":
        optim.lr_schedule, optim.warmup_steps, optim.total_steps = "cosine", 1, 6
    ema = EMAConfig(enabled=case == "lora", decay=0.9, update_every=1)
    update = UpdateConfig(micro_batch_size=2, num_minibatches=1)
    cfg = RunSections(lora=lora, optim=optim, ema=ema, seed=3, update=update, flow_grpo=algo)
    for k, v in over.items():
        section, _, field = k.partition(".")
        setattr(getattr(cfg, section), field, v) if field else setattr(cfg, k, v)
    return cfg


def engine_for(adapter, cfg):
    """The engine, with a reference copy when Flow-GRPO's KL needs one (as the trainer does)."""
    from flowgrpo.engine import DiffusersFSDPEngine

    return DiffusersFSDPEngine(adapter, cfg, reference=cfg.flow_grpo.kl_beta > 0)


def flow_grpo(engine):
    """The Flow-GRPO algorithm over ``engine`` (one per engine)."""
    from flowgrpo.algorithms.flow_grpo import FlowGRPO

    if not hasattr(engine, "_test_algo"):
        engine._test_algo = FlowGRPO(engine.config, engine, engine.adapter)
    return engine._test_algo


def train_step(engine, traj, advantages) -> dict:
    """One Flow-GRPO update of ``engine`` on ``traj`` (what the trainer's step calls)."""
    seeds = list(range(len(traj)))
    return flow_grpo(engine).update(traj, advantages, step=engine.step + 1, sample_seeds=seeds)


def trainable(engine) -> dict[str, torch.Tensor]:
    """Full (unsharded) trainable params, by name (collective)."""
    return full_trainable(engine.model)


def ema_values(engine) -> list[torch.Tensor]:
    return [e.full_tensor().clone() for e in engine.ema.shadow]


def run_case(
    case: str,
    traj,
    adv,
    steps: int,
    *,
    ckpt: Path | None = None,
    save_at: int = 0,
    snapshots=(),
    **over,
) -> dict:
    """Build a fresh engine, train ``steps`` calls, optionally save at ``save_at``; returns
    {"params@k": ..., "metrics": [...], "ema@k": ...} for k in ``snapshots``."""
    from flowgrpo.engine import save_checkpoint

    engine = engine_for(TinyAdapter(), make_config(case, **over))
    out: dict = {"metrics": []}
    if 0 in snapshots:
        out["params@0"] = trainable(engine)
    for k in range(1, steps + 1):
        out["metrics"].append(train_step(engine, traj, adv))
        if k in snapshots:
            out[f"params@{k}"] = trainable(engine)
            if engine.ema is not None:
                out[f"ema@{k}"] = ema_values(engine)
        if ckpt is not None and k == save_at:
            save_checkpoint(engine, ckpt, k, extra={"pos": k}, keep_last=2)
    return out


def sharded_job(rank: int, world: int, port: int, workdir: str) -> None:
    """The 2-rank half of the equivalence tests: each rank trains on its half of the batch."""
    rank_env(rank, world, port)
    from flowgrpo.engine import cleanup, init_distributed

    init_distributed()
    work = Path(workdir)
    traj = torch.load(work / "traj.pt", weights_only=False)
    per = len(traj) // world
    rows = list(range(rank * per, (rank + 1) * per))
    local, adv = traj.select(rows), ADVANTAGES[rows]
    results = {
        # LoRA + KL + EMA + cosine; activation checkpointing on here only (must not matter)
        "lora": run_case(
            "lora",
            local,
            adv,
            4,
            ckpt=work / "ckpt2",
            save_at=2,
            snapshots=(3, 4),
            **{"fsdp.activation_checkpointing": True},
        ),
        # full fine-tune + KL (frozen sharded reference copy); CPU offload here only
        "full": run_case("full", local, adv, 3, snapshots=(3,), **{"fsdp.cpu_offload": True}),
        "clip": run_case("clip", local, adv, 2, snapshots=(2,)),
        # HSDP: mesh (replicate=2, shard=1)
        "hsdp": run_case("clip", local, adv, 2, snapshots=(2,), **{"fsdp.replicate_degree": 2}),
        # zero-advantage samples dropped: rank 1 trains nothing but pads to keep FSDP in step
        "zero": run_case("lora", local, ZERO_HALF[rows], 2, snapshots=(2,)),
        "zero_mb2": run_case(
            "lora", local, ZERO_HALF[rows], 2, snapshots=(2,), **{"update.num_minibatches": 2}
        ),
    }
    from flowgrpo.engine import dist as fdist

    results["dist"] = {
        "gathered": fdist.all_gather_tensor(torch.arange(rank + 2.0)),  # uneven lengths
        "objects": fdist.all_gather_object({"rank": rank}),
        "mean": fdist.all_reduce_mean(torch.tensor([float(rank)])),
        "info": init_distributed(),
        "main": fdist.is_main_process(),
    }
    if rank == 0:
        torch.save(results, work / "sharded.pt")
    cleanup()


_INITIAL: dict = {}


def trainable_initial(case: str) -> dict[str, torch.Tensor]:
    """Trainable params of a fresh engine of ``case`` before any step (cached)."""

    if case not in _INITIAL:
        _INITIAL[case] = trainable(engine_for(TinyAdapter(), make_config(case)))
    return _INITIAL[case]
