"""A built run and what it does with its weights, for the loop and the commands alike.

``Run``: everything built once from the config (adapter, engine, algorithm, rewards, prompt
streams). ``rollout``: sampling in chunks, each sample's noise seeded from (seed, step, its
global index). ``evaluate``: the ODE eval on fixed prompts with fixed noise, scored.
``marking_checkpoint``: how a rollout went, recorded on the checkpoint holding the weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from flowgrpo.algorithms.base import RolloutPlan
from flowgrpo.data.prompts import source_images
from flowgrpo.engine.checkpoint_dirs import resume_advice
from flowgrpo.engine.dist import DistInfo, all_gather_object, all_gather_tensor
from flowgrpo.errors import RunError, TrainingDiverged
from flowgrpo.rewards.base import reward_unavailable
from flowgrpo.rollout import Trajectory, sample_trajectories
from flowgrpo.trainer import setup
from flowgrpo.trainer.figures import fitted_sources
from flowgrpo.trainer.off_policy import OffPolicy, PolicyCopy
from flowgrpo.trainer.preference import gold_metrics, pairwise_eval
from flowgrpo.trainer.quiet import quiet_known_noise
from flowgrpo.trainer.run_folder import mark_diverged, mark_good
from flowgrpo.trainer.seeds import EVAL_SALT, generators, group_generators


class Run:
    """Everything built once from the config: adapter, engine, rewards, prompt streams.
    ``purpose`` "train" builds it all; "eval" only the eval prompts and the rewards;
    "sample" and "export" neither prompts nor rewards."""

    def __init__(
        self, cfg: Any, dist: DistInfo, purpose: str = "train", prompts: tuple[str, ...] = ()
    ) -> None:
        self.cfg, self.dist = cfg, dist
        quiet_known_noise(dist.is_main)  # loading bars from rank 0, known-harmless warnings
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        self.adapter = setup.build_adapter_for(cfg, dist)
        self.engine, self.algorithm = setup.build_engine(cfg, self.adapter, dist)
        # frames per video (None: an image family), checked once; every rollout plan carries it
        self.num_frames = self.adapter.check_num_frames(cfg.model.num_frames)
        self.reward = self.eval_reward = self.train_data = self.sampler = self.eval_set = None
        self.gold = None
        # this rank's eval images of the base model: what pairwise rewards judge evals against
        self.base_images: torch.Tensor | None = None
        if purpose in ("train", "eval"):
            self.reward = setup.build_rewards(cfg.reward, dist.device)
            # eval only, the whole set at once
            self.eval_reward = setup.build_rewards(cfg.eval_reward, dist.device)
            self.gold = setup.build_rewards(cfg.eval.gold_reward, dist.device)  # never trained
            if purpose == "train":
                self.train_data, self.sampler, self.eval_set = setup.build_data(cfg)
            else:
                self.eval_set = setup.build_eval_data(cfg)
        sets = [list(prompts)]  # every prompt this run encodes reaches the embedding cache
        sets += [d.prompts for d in (self.train_data, self.eval_set) if d is not None]
        setup.prepare_prompt_cache(cfg, self.adapter, dist, sets)
        # eval images shown in grid_before/after.png: one row per prompt, one column per seed
        self.grid_index, self.grid_cols = set(), 1
        if self.eval_set is not None:
            self.grid_index, self.grid_cols = setup.grid_layout(
                len(self.eval_set), cfg.data.eval_samples_per_prompt
            )
        # the checkpoint holding the current weights (None: changed since), whether a rollout
        # from them was finite (``marking_checkpoint``), and where the run's checkpoints go
        # (None: not training)
        self.checkpoint: Path | None = None
        self.rollout_ok = False
        self.ckpt_root: Path | None = None
        # which weights sample a training step (trainer/off_policy.py); built with the engine,
        # before a checkpoint loads, so that its behaviour-policy shadow is restored
        steps = cfg.trainer.off_policy_steps if purpose == "train" else 0
        overlap = steps and cfg.trainer.off_policy_overlap
        self.off_policy = OffPolicy(self.engine, steps, PolicyCopy(self) if overlap else None)

    def ema(self, on: bool = True) -> contextlib.AbstractContextManager:
        """EMA weights inside the block when EMA is on (and ``on``)."""
        return (
            self.engine.ema_weights() if on and self.cfg.ema.enabled else contextlib.nullcontext()
        )

    def rollout_plan(self, step: int) -> RolloutPlan:
        """The training rollout of ``step``: the algorithm's plan, with the run's frame count.
        A step computes it once: its rollout samples it and its update is skipped when
        ``train`` is False."""
        return dataclasses.replace(self.algorithm.rollout_plan(step), num_frames=self.num_frames)

    def eval_plan(self) -> RolloutPlan:
        """Eval and ``flowgrpo sample`` rollouts: ODE with the eval steps and guidance."""
        s = self.cfg.sample
        return RolloutPlan(
            num_steps=s.eval_num_steps,
            guidance_scale=(
                s.guidance_scale if s.eval_guidance_scale is None else s.eval_guidance_scale
            ),
            noise_level=0.0,
            sde_type=s.sde_type,
            sde_window=None,
            timestep_fraction=1.0,
            deterministic_last_step=s.deterministic_last_step,
            num_frames=self.num_frames,
        )


# -- rollout ---------------------------------------------------------------------------------


def rollout(
    run: Run,
    prompts: list[str],
    indices: list[int],
    step: int,
    plan: RolloutPlan,
    *,
    eval: bool = False,
    on_chunk: Callable[[Trajectory, slice], None] | None = None,
    groups: list[int] | None = None,
    images: list[list[torch.Tensor]] | None = None,
) -> Trajectory:
    """Sample ``prompts`` (with their source ``images``, editing) as ``plan`` says (``run.rollout_plan(step)``, or ``run.eval_plan()``
    with ``eval``) in chunks of ``sample.rollout_batch_size``; sample i's noise comes from
    (seed, step, indices[i]), its initial noise from its group ``groups[i]`` instead with
    ``sample.same_latent`` (training only). ``on_chunk(traj, rows)`` is called as each chunk
    finishes (async reward scoring). Non-finite latents stop it (``NonFiniteRollout``):
    call it inside ``marking_checkpoint``, which marks the checkpoint and words the error."""
    s, m, parts = run.cfg.sample, run.cfg.model, []
    chunk = max(1, s.rollout_batch_size)
    for lo in range(0, len(prompts), chunk):
        rows = slice(lo, lo + chunk)
        gens = generators(run.cfg.seed, step, indices[rows], run.dist.device)
        init = None
        if not eval and s.same_latent:
            init = group_generators(run.cfg.seed, step, groups[rows], run.dist.device)
        traj = sample_trajectories(
            run.adapter,
            prompts[rows],
            height=m.height,
            width=m.width,
            generator=gens,
            negative_prompts=[s.negative_prompt] * len(gens) if s.negative_prompt else None,
            init_generator=init,
            images=None if images is None else images[rows],
            **plan.sampler_kwargs(),
        )
        if not bool(torch.isfinite(traj.final_latents).all()):
            what = "eval rollout" if eval else f"rollout of step {step}"
            raise NonFiniteRollout(what)
        if on_chunk is not None:
            on_chunk(traj, rows)
        parts.append(traj)
    return Trajectory.cat(parts)


class NonFiniteRollout(TrainingDiverged):
    """A rollout produced non-finite latents (``what``: "eval rollout", "rollout of step 3");
    ``marking_checkpoint`` turns it into the run's error line."""

    def __init__(self, what: str) -> None:
        super().__init__(f"the {what} produced non-finite latents")
        self.what = what


def diverged_message(run: Run, what: str) -> str:
    """The error line of a non-finite rollout (``what``: "eval rollout", "rollout of step 3").
    In a training run it names the checkpoint holding these weights (finite, yet their rollout
    is not: ``marking_checkpoint`` marks it diverged so that no resume takes it) and the last
    checkpoint whose rollout was finite."""
    message = (
        f"training diverged: the {what} produced non-finite latents (the weights give NaN/inf)"
    )
    if run.ckpt_root is None:  # sample / eval of a checkpoint
        return f"{message}; lower optim.lr"
    if run.checkpoint is not None:
        message += f"; {run.checkpoint} holds these weights and is marked diverged"
    return f"{message}; {resume_advice(run.ckpt_root)}"


@contextlib.contextmanager
def marking_checkpoint(run: Run) -> Iterator[None]:
    """Around a rollout of the current weights: mark the checkpoint holding them
    (``run.checkpoint``; none when they changed since the last save, or outside a training
    run) by how it went. Finite: ``run.rollout_ok`` and the ROLLOUT_OK marker (a good
    checkpoint). Non-finite (``NonFiniteRollout``): the DIVERGED marker, so that no resume
    takes it, then TrainingDiverged with the line that says what to do (``diverged_message``,
    worded once the marker is there: it names the last good checkpoint)."""
    try:
        yield
    except NonFiniteRollout as e:
        mark_diverged(run.checkpoint, run.dist)
        raise TrainingDiverged(diverged_message(run, e.what)) from None
    run.rollout_ok = True
    mark_good(run.checkpoint, run.dist)


@contextlib.contextmanager
def reward_failures(reward, images, prompts, metadata, locations, when: str):
    """Turn a reward's failure into one RunError line ending with ``(when)``: "step 3",
    "base eval", "eval at step 4". When the reward fails on some samples but not on others,
    the culprit is the data: scoring samples one at a time (at most 16) finds the first that
    fails, and its prompt-file line is named. A reward that could not be
    reached or timed out (``RewardUnavailable``) is reported at once, without that search."""
    try:
        yield
    except RuntimeError as e:
        name = getattr(e, "reward_name", None) or getattr(e.__cause__, "reward_name", None)
        if name is None:
            raise
        failed, passed = None, False
        search = 0 if reward_unavailable(e) else min(len(prompts), 16)
        for i in range(search):
            try:
                reward(images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1])
                passed = True
            except Exception:  # noqa: BLE001 - looking for the sample that fails
                failed = i if failed is None else failed
            if passed and failed is not None:
                break
        where = f" on {locations[failed]}" if passed and failed is not None else ""
        message = " ".join(str(e).split())
        raise RunError(f"{message}{where} ({when})") from e


def gather_rewards(run: Run, rewards: dict[str, torch.Tensor] | None):
    """{name: [n_local]} -> {name: [N]} over the data-parallel ranks (their order = the global
    sample order). Under sequence parallelism only an SP group's first rank scored (``None``
    on the others): its rewards stand for the group's."""
    if run.engine.dp_size == run.dist.world_size:
        return {
            k: all_gather_tensor(v.to(run.dist.device)).cpu() for k, v in sorted(rewards.items())
        }
    parts = [p for p in all_gather_object(rewards) if p is not None]
    return {k: torch.cat([p[k] for p in parts]) for k in sorted(parts[0])}


def gather_group_firsts(run: Run, obj: Any) -> list[Any]:
    """Every rank's ``obj``, one per SP group (in data-parallel order)."""
    sp = run.engine.sp_size
    return all_gather_object(obj)[::sp]


# -- eval ------------------------------------------------------------------------------------


class EvalGrid(NamedTuple):
    """The eval images of the grids (``run.grid_index``, in order): images [n, C, H, W] (videos
    [n, C, F, H, W]) on rank 0 (empty elsewhere), each one's prompt and total reward."""

    images: torch.Tensor
    prompts: list[str]
    rewards: list[float]
    #: an edit run's source images fitted to the results' size [n, 3, H, W] (rank 0), shown
    #: source | result; None for text-to-image
    sources: torch.Tensor | None = None


def eval_images(run: Run) -> tuple[list[int], int, list[str], list[dict], torch.Tensor]:
    """This rank's eval samples: (indices, how many are real, prompts, metadata, images of the
    real ones), ODE with the fixed eval noise. Marks the checkpoint holding the weights."""
    ev = run.eval_set
    idx, real = setup.padded_shard(len(ev), run.engine.dp_rank, run.engine.dp_size)
    prompts, metadata = ev.select(idx)
    with run.ema(), marking_checkpoint(run):
        images = rollout(
            run,
            prompts,
            idx,
            EVAL_SALT,
            run.eval_plan(),
            eval=True,
            images=source_images(metadata),
        ).images[:real]
    return idx, real, prompts, metadata, images


def evaluate(
    run: Run, when: str = "eval", base: dict[str, float] | None = None
) -> tuple[dict[str, float], EvalGrid]:
    """ODE samples of the fixed eval prompts with fixed noise -> (``eval/...`` metrics, the
    grid's images with their prompts and rewards). ``when`` names the eval in errors ("base
    eval", "eval at step 4"); ``base``: the base eval's metrics (the reference of
    ``eval/hacking_gap``; None at the base eval itself). A finite rollout marks the checkpoint
    holding these weights good, a non-finite one diverged (``marking_checkpoint``; none
    outside a training run). Pairwise rewards judge each image against the base model's
    (``run.base_images``, kept at the first eval); gold rewards score every image at once."""
    ev = run.eval_set
    idx, real, prompts, metadata, images = eval_images(run)
    if run.base_images is None:  # the base eval: what pairwise rewards judge later evals by
        run.base_images = images.detach().cpu().clone()
    where = [ev.locations[i] for i in idx[:real]]
    local = None
    if run.engine.sp_rank == 0:  # an SP group scores once
        with reward_failures(run.reward, images, prompts[:real], metadata[:real], where, when):
            local = run.reward(images, prompts[:real], metadata[:real])
            local.update(
                pairwise_eval(run, images, run.base_images, prompts[:real], metadata[:real])
            )
    rewards = gather_rewards(run, local)
    total = sum((run.reward.weight_of(k) or 0.0) * v for k, v in rewards.items())
    out = {"eval/reward_mean": float(total.mean())}
    out.update({f"eval/{k}_mean": float(v.mean()) for k, v in rewards.items()})
    keep = [i for i, g in enumerate(idx[:real]) if g in run.grid_index]
    shown = gather_group_firsts(run, (images[keep] * 255).round().to(torch.uint8))
    sources = None
    if run.adapter.edits and images.dim() == 4:  # an edit run's grid: source | result
        rows = [list(metadata[i].get("source_images") or []) for i in keep]
        fitted = fitted_sources(rows, *images.shape[-2:])
        sources = gather_group_firsts(run, (fitted * 255).round().to(torch.uint8))
    if run.eval_reward is not None:  # set-level scores (e.g. diversity): every image at once
        every = torch.cat(gather_group_firsts(run, images))
        with reward_failures(run.eval_reward, every, ev.prompts, ev.metadata, ev.locations, when):
            scores = run.eval_reward(every, ev.prompts, ev.metadata)
        out.update(
            {f"eval/{name.rpartition('/')[2]}": float(v.mean()) for name, v in scores.items()}
        )
    if run.gold is not None:  # gold rewards: never trained on, every image at once
        every = torch.cat(gather_group_firsts(run, images))
        with reward_failures(run.gold, every, ev.prompts, ev.metadata, ev.locations, when):
            scores = run.gold(every, ev.prompts, ev.metadata)
        out.update(gold_metrics(run.gold, scores, base, out))
    grid = torch.cat(shown).float() / 255 if run.dist.is_main else torch.empty(0)
    order = sorted(run.grid_index)  # the grid's images, in the global order of `shown`
    if sources is not None:
        sources = torch.cat(sources).float() / 255 if run.dist.is_main else torch.empty(0)
    return out, EvalGrid(
        grid, [ev.prompts[g] for g in order], [float(total[g]) for g in order], sources
    )


__all__ = [
    "EvalGrid",
    "NonFiniteRollout",
    "Run",
    "diverged_message",
    "eval_images",
    "evaluate",
    "gather_group_firsts",
    "gather_rewards",
    "marking_checkpoint",
    "reward_failures",
    "rollout",
]
