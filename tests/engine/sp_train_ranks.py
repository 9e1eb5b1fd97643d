"""Rollout and one Flow-GRPO update through the engine with sequence parallelism (sp = 2 over
2 ranks) or without it (1 process): the worker of tests/engine/test_sp_training.py."""

from __future__ import annotations

from pathlib import Path

import tinymodel
import torch

from flowgrpo.testing.families import cross, double, kinds, sequence_parallel
from flowgrpo.testing.ranks import rank_env

HERE = Path(__file__).resolve().parent
PROMPTS = ["a red cat", "a photo of a big old house with a tree"]
ADVANTAGES = torch.tensor([1.0, -0.5])
#: every family that runs under SP (its adapter's declaration or diffusers' plan), each driven
#: as its test double's ``sp`` case says (flowgrpo.testing.family.SequenceParallelCase)
KINDS = kinds(sequence_parallel)
MODES = ("lora", "full")
#: LoRA and full on the core families, one of them on each other family
CASES = cross(KINDS, MODES)


def padded_forward(adapter, model, case) -> dict:
    """One forward whose text does not divide by 2 (``case.odd_text``: every prompt cut to an
    odd length; else the family's text is odd as its case builds it, e.g. HunyuanVideo-1.5's
    joint text 4 + 16 + 25 tokens, like the real model's 729 + 256 + 1000): the velocity and
    the text length each transformer call got."""
    embeds = case.text(adapter.encode_prompts(PROMPTS))
    texts: list[int] = []
    key = case.padded_text
    hook = adapter.transformer.register_forward_pre_hook(  # after the engine's padding hook
        lambda module, args, kwargs: texts.append(kwargs[key].shape[1]), with_kwargs=True
    )
    lat = adapter.prepare_latents(len(PROMPTS), 32, 32, torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.7, 0.4])
    with torch.no_grad():
        v = adapter.forward(model, lat, sigma, embeds, height=32, width=32, guidance_scale=4.0)
    hook.remove()
    return {"pad_v": v.cpu(), "pad_text": texts}


def source_images(case) -> list[list[torch.Tensor]] | None:
    """An editing family's random [3, H, W] source images in [0, 1] per prompt (8-bit
    values), at its case's sizes."""
    if case.edit is None:
        return None
    g = torch.Generator().manual_seed(7)
    return [
        [torch.randint(0, 256, (3, h, w), generator=g).float() / 255 for h, w in case.edit[2]]
        for _ in PROMPTS
    ]


def run(kind: str, mode: str, sp: int) -> dict:
    from flowgrpo.config import config_from_dict
    from flowgrpo.engine import init_distributed
    from flowgrpo.rollout import sample_trajectories, trajectory_log_prob
    from flowgrpo.trainer.setup import build_engine

    cfg = config_from_dict(
        {
            "seed": 1,
            "fsdp": {"param_dtype": "fp32", "sp_degree": sp},
            "lora": {"enabled": mode == "lora", "rank": 4, "alpha": 8},
            "optim": {"lr": 1.0, "eps": 1.0, "weight_decay": 0.0, "max_grad_norm": 1e6},
            "update": {"micro_batch_size": 2, "num_minibatches": 1},
            "flow_grpo": {"clip_range": 0.5, "kl_beta": 0.05},
        }
    )
    fam = double(kind)
    case = fam.sp
    adapter = fam.sp_adapter()
    images = source_images(case)
    if case.edit is not None and case.edit[3] is not None:
        adapter.vae_area = case.edit[3]
    engine, algo = build_engine(cfg, adapter, init_distributed())
    seen: list[int] = []  # tokens reaching proj_out on this rank (halved under SP: the
    # output is gathered after it)
    parts = getattr(adapter.transformer, "sequence_parallel_parts", None)  # Wan2.2's experts
    for transformer in parts() if parts else [adapter.transformer]:
        transformer.get_submodule(case.output_module).register_forward_pre_hook(
            lambda module, args: seen.append(args[0].shape[1])
        )
    height, width = case.edit[:2] if case.edit is not None else case.hw
    kw = dict(num_steps=3, guidance_scale=case.guidance, height=height, width=width, decode=False)
    kw["images"] = images

    def gens():
        return [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]

    with torch.no_grad():
        ode = sample_trajectories(adapter, PROMPTS, noise_level=0.0, generator=gens(), **kw)
        traj = sample_trajectories(adapter, PROMPTS, noise_level=0.8, generator=gens(), **kw)
        recomputed = torch.stack(
            [
                trajectory_log_prob(adapter, engine.model, traj, k).log_prob
                for k in range(traj.num_train_steps)
            ],
            dim=1,
        )
    padded = padded_forward(adapter, engine.model, case) if case.padded_text else {}
    metrics = algo.update(traj, ADVANTAGES, step=1, sample_seeds=[0, 1])
    params = tinymodel.trainable(engine)
    return {
        "final": ode.final_latents.cpu(),
        "log_probs": traj.log_probs.cpu(),
        "log_ratio": (recomputed - traj.log_probs).abs().max().item(),
        "params": params,
        "metrics": metrics,
        "tokens": max(seen),
        "dp_size": engine.dp_size,
        **padded,
    }


def job(rank: int, world: int, port: int, out: str) -> None:
    rank_env(rank, world, port)
    from flowgrpo.engine import cleanup

    results = {(k, m): run(k, m, sp=world) for k, m in CASES}
    if rank == 0:
        torch.save(results, out)
    cleanup()
