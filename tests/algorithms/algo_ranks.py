"""Run one update of an algorithm on a tiny pipeline, in 1 process or as one rank of 2 (the
algorithm tests' worker; a spawned job runs every case in one process per rank)."""

from __future__ import annotations

import os

import torch

from flowgrpo.algorithms import ALGORITHMS as REGISTERED
from flowgrpo.testing.compare import full_trainable
from flowgrpo.testing.conformance import FAMILIES, family
from flowgrpo.testing.families import core, cross, rows_setting
from flowgrpo.testing.ranks import rank_env

PROMPTS = ["a handwritten 1", "a handwritten 2", "a handwritten 3", "a handwritten 4"]
ADVANTAGES = torch.tensor([1.0, -0.5, 0.8, -1.3])
# dpo trains pairs (+1 winner, -1 loser of one prompt): both pairs cross the 2 ranks' split
DPO_PROMPTS = ["a handwritten 1", "a handwritten 2", "a handwritten 1", "a handwritten 2"]
DPO_TAGS = torch.tensor([1.0, -1.0, -1.0, 1.0])
# every family of the conformance suite, at its training size (videos: 5 frames = 2 latent)
# (FLOWGRPO_TEST_KINDS=a,b narrows a local run to those families; CI runs every one)
_ONLY = {k for k in os.environ.get("FLOWGRPO_TEST_KINDS", "").split(",") if k}
KINDS = tuple(f.kind for f in FAMILIES if not _ONLY or f.kind in _ONLY)
SIZES = {f.kind: f.train_size for f in FAMILIES}
FRAMES = {f.kind: f.num_frames for f in FAMILIES if f.num_frames is not None}
# (FLOWGRPO_TEST_ALGORITHMS=a,b narrows a local run to those algorithms)
_ONLY_ALGORITHMS = {a for a in os.environ.get("FLOWGRPO_TEST_ALGORITHMS", "").split(",") if a}
ALGORITHMS = tuple(a for a in REGISTERED if not _ONLY_ALGORITHMS or a in _ONLY_ALGORITHMS)


def pipeline(kind: str):
    """The family's fresh tiny pipeline (the toy: random weights, seed 0)."""
    return family(kind).pipeline()


def config(algorithm: str, kind: str, mode: str, **over):
    from flowgrpo.config import config_from_dict

    h, w = SIZES[kind]
    data = {
        "algorithm": algorithm,
        "seed": 3,
        "model": {"height": h, "width": w, "num_frames": FRAMES.get(kind)},
        "sample": {"num_steps": 4, "guidance_scale": family(kind).guidance},
        "update": {"micro_batch_size": 2, "num_minibatches": 1},
        "lora": {"enabled": mode == "lora", "rank": 4, "alpha": 8},
        # eps >> |grad|: AdamW's first step ~ lr * grad (Adam's sign-like step would turn the
        # rounding of near-zero gradients into lr-sized differences)
        "optim": {"lr": 1.0, "eps": 1.0, "weight_decay": 0.0, "max_grad_norm": 1e6},
        "fsdp": {"param_dtype": "fp32"},
        "flow_grpo": {"clip_range": 0.5, "kl_beta": 0.05},
        "mix_grpo": {"clip_range": 0.5, "window_size": 2, "shift_interval": 1},
        "grpo_guard": {"clip_range": 0.5, "bias_reduce": "sample"},
        "nft": {"kl_beta": 0.05},
        "awm": {"train_timesteps": 2},  # the 2 levels of 4 steps (int(4 x 0.9) = 3, from 1)
    }
    for key, value in over.items():
        section, _, field = key.partition(".")
        data.setdefault(section, {})[field] = value
    return config_from_dict(data)


def run(
    algorithm: str,
    kind: str,
    mode: str,
    rank: int = 0,
    world: int = 1,
    advantages: torch.Tensor = ADVANTAGES,
    **over,
) -> dict:
    """One rollout of step 1 (each rank its share, per-sample noise by global index) and one
    update: the trainable params after it, the metrics and the rollout's trained steps."""
    from flowgrpo.engine import init_distributed
    from flowgrpo.models import build_adapter
    from flowgrpo.rollout import sample_trajectories
    from flowgrpo.trainer.seeds import sample_seed
    from flowgrpo.trainer.setup import build_engine

    cfg = config(algorithm, kind, mode, **over)
    dist = init_distributed()
    adapter = build_adapter(pipeline(kind), **family(kind).train_options, **frames_option(kind))
    engine, algo = build_engine(cfg, adapter, dist)
    prompts = PROMPTS
    if algorithm == "dpo" and advantages is ADVANTAGES:
        prompts, advantages = DPO_PROMPTS, DPO_TAGS
    share = len(PROMPTS) // world
    mine = list(range(rank * share, (rank + 1) * share))
    plan = algo.rollout_plan(1)
    gens = [torch.Generator().manual_seed(sample_seed(cfg.seed, 1, i)) for i in mine]
    with torch.no_grad(), algo.rollout_weights():
        traj = sample_trajectories(
            adapter,
            [prompts[i] for i in mine],
            num_steps=plan.num_steps,
            guidance_scale=plan.guidance_scale,
            noise_level=plan.noise_level,
            sde_type=plan.sde_type,
            height=cfg.model.height,
            width=cfg.model.width,
            generator=gens,
            sde_window=plan.sde_window,
            sigmas=plan.sigmas,
            ode_solver=plan.ode_solver,
            record_means=plan.record_means,
            decode=False,
            images=edit_images(kind, mine),
        )
    seeds = [sample_seed(cfg.seed, 1, i) for i in mine]
    metrics = algo.update(traj, advantages[mine], step=1, sample_seeds=seeds)
    return {
        "params": full_trainable(engine.model),
        "metrics": metrics,
        "steps": traj.step_indices.cpu(),
    }


def edit_images(kind: str, rows: list[int]):
    """An editing family's source images of samples ``rows`` (its conformance sources)."""
    fam = family(kind)
    return fam.source_images([fam.prompts[i] for i in rows])


def frames_option(kind: str) -> dict[str, int]:
    return {"num_frames": FRAMES[kind]} if kind in FRAMES else {}


def run_initial(algorithm: str, kind: str, mode: str) -> dict[str, torch.Tensor]:
    """The trainable params of the case before any update."""
    from flowgrpo.engine import init_distributed
    from flowgrpo.models import build_adapter
    from flowgrpo.trainer.setup import build_engine

    cfg = config(algorithm, kind, mode)
    adapter = build_adapter(pipeline(kind), **family(kind).train_options, **frames_option(kind))
    engine, _ = build_engine(cfg, adapter, init_distributed())
    return full_trainable(engine.model)


# CI time decides the matrix (each case trains 1 process and 2 ranks): every family under
# Flow-GRPO, LoRA and full on the core families and one of them on each other family
# (flowgrpo.testing.families.cross); every other algorithm on the families of the "core" cost tier (their
# test doubles say so: the toy, SD3, FLUX, Qwen-Image, Wan2.2's two experts) in one mode each,
# LoRA and full alternating along the algorithm's row and the family's column (each algorithm
# trains both, each core family both under the algorithms): what the engine does with LoRA or
# full weights is the same for every algorithm, and Flow-GRPO covers it on every family. Wan2.1
# runs Flow-GRPO only (Wan2.2 runs the same transformer class as two experts). A family's or an
# algorithm's whole row, both modes (against the algorithms / families registered then), was run
# once when it was added (the closing notes; FLOWGRPO_TEST_ALGORITHMS=NAME FLOWGRPO_TEST_ROWS=all
# runs it).
_ALL_ROWS = rows_setting() == "all"
MODES = ("lora", "full")


_FLOW_GRPO = set(cross(KINDS, MODES))


def _in_matrix(i: int, algorithm: str, j: int, kind: str, mode: str) -> bool:
    if _ALL_ROWS:
        return True
    if algorithm == "flow_grpo":
        return (kind, mode) in _FLOW_GRPO
    return core(kind) and mode == MODES[(i + j) % 2]


CASES = [
    (a, k, m)
    for i, a in enumerate(ALGORITHMS)
    for j, k in enumerate(KINDS)
    for m in MODES
    if _in_matrix(i, a, j, k, m)
]


def job(rank: int, world: int, port: int, out: str) -> None:
    rank_env(rank, world, port)
    from flowgrpo.engine import cleanup

    results = {}
    for case in CASES:
        try:
            results[case] = run(*case, rank=rank, world=world)
        except Exception as e:  # noqa: BLE001 - reported by the test, not a hang
            results[case] = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        torch.save(results, out)
    cleanup()


# update.num_minibatches > 1: each optimizer step must train on the same global samples at
# any number of ranks (the split is global); two of the algorithms whose update_loop plans it
MINIBATCH_CASES = [("flow_grpo", "toy", "lora"), ("nft", "toy", "full")]
MINIBATCHES = {"update.num_minibatches": 2, "update.micro_batch_size": 1}


def job_minibatches(rank: int, world: int, port: int, out: str) -> None:
    rank_env(rank, world, port)
    from flowgrpo.engine import cleanup

    results = {}
    for case in MINIBATCH_CASES:
        try:
            results[case] = run(*case, rank=rank, world=world, **MINIBATCHES)
        except Exception as e:  # noqa: BLE001 - reported by the test, not a hang
            results[case] = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        torch.save(results, out)
    cleanup()


# branching rollouts (sample.branching): 2 trees of 4 leaves, one per rank at 2 ranks; each
# algorithm that takes them, its edges trained once with the tree's advantages
TREE_CASES = [
    c
    for c in [
        ("flow_grpo", "toy", "full"),
        ("grpo_guard", "toy", "lora"),
        ("mix_grpo", "toy", "full"),
        ("flow_dppo", "toy", "full"),
    ]
    if c[0] in ALGORITHMS  # FLOWGRPO_TEST_ALGORITHMS narrows them too
]
TREE = {
    "sample.group_size": 4,
    "sample.branching": {"split_steps": [0, 1], "factors": [2, 2]},
    "mix_grpo.shift_interval": 1000,  # its window stays [0, 2): the tree's two splits fit
}
TREE_PROMPTS = [PROMPTS[0]] * 4 + [PROMPTS[1]] * 4
LEAF_ADVANTAGES = torch.tensor([1.0, -0.5, 0.8, -1.3, 0.2, 0.2, -0.9, 0.5])


def run_tree(algorithm: str, kind: str, mode: str, rank: int = 0, world: int = 1) -> dict:
    """One branching rollout of step 1 (each rank its trees, noise by global sample index) and
    one update: the trainable params after it, the metrics and the rollout."""
    from flowgrpo.engine import init_distributed
    from flowgrpo.models import build_adapter
    from flowgrpo.rollout import sample_trajectories
    from flowgrpo.trainer.setup import build_engine, sample_seed

    cfg = config(algorithm, kind, mode, **TREE)
    dist = init_distributed()
    adapter = build_adapter(pipeline(kind), **family(kind).train_options)
    engine, algo = build_engine(cfg, adapter, dist)
    share = len(TREE_PROMPTS) // world
    mine = list(range(rank * share, (rank + 1) * share))
    plan = algo.rollout_plan(1)
    gens = [torch.Generator().manual_seed(sample_seed(cfg.seed, 1, i)) for i in mine]
    with torch.no_grad(), algo.rollout_weights():
        traj = sample_trajectories(
            adapter,
            [TREE_PROMPTS[i] for i in mine],
            height=cfg.model.height,
            width=cfg.model.width,
            generator=gens,
            decode=False,
            **plan.sampler_kwargs(),
        )
    seeds = [sample_seed(cfg.seed, 1, i) for i in mine]
    metrics = algo.update(traj, LEAF_ADVANTAGES[mine], step=1, sample_seeds=seeds)
    return {"params": full_trainable(engine.model), "metrics": metrics, "traj": traj}


def job_tree(rank: int, world: int, port: int, out: str) -> None:
    rank_env(rank, world, port)
    from flowgrpo.engine import cleanup

    results = {}
    for case in TREE_CASES:
        try:
            got = run_tree(*case, rank=rank, world=world)
            results[case] = {k: got[k] for k in ("params", "metrics")}
        except Exception as e:  # noqa: BLE001 - reported by the test, not a hang
            results[case] = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        torch.save(results, out)
    cleanup()
