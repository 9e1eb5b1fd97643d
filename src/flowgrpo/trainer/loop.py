"""The training loop, readable top to bottom, whatever the algorithm.

One step: draw m prompts x K (the groups) -> this rank's share -> the algorithm's rollout
without grad, per-sample noise seeded from (seed, step, global sample index) -> rewards ->
all-gather -> group-relative advantages on the global batch -> this rank's slice ->
``algorithm.update``.
Everything a step does is a function of (seed, step, restored state), so a resumed run repeats
a straight run exactly. Eval uses the ODE sampler on fixed prompts with fixed noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from flowgrpo.algo import reward_stats, zero_std_ratio
from flowgrpo.algorithms.base import RolloutPlan
from flowgrpo.config.loader import config_to_dict
from flowgrpo.config.record import RUN_CONFIG, check_resume, record_text
from flowgrpo.config.schema import flat_keys
from flowgrpo.data.prompts import check_divides, rank_slice, source_images
from flowgrpo.engine.dist import (
    DistInfo,
    all_gather_object,
    all_gather_tensor,
    barrier,
    init_distributed,
    seed_everything,
)
from flowgrpo.errors import RunError, TrainingDiverged
from flowgrpo.rewards import AsyncRewardScorer
from flowgrpo.rewards.base import reward_unavailable
from flowgrpo.rollout import Trajectory, sample_trajectories
from flowgrpo.trainer import guard as guard_rule
from flowgrpo.trainer import setup
from flowgrpo.trainer.figures import fitted_sources, reward_notes, save_grid, save_images
from flowgrpo.trainer.logging import RunLogger, startup_banner, wants_bar, write_final_report
from flowgrpo.trainer.preference import gold_metrics, pairwise_eval, pairwise_rewards
from flowgrpo.trainer.quiet import quiet_known_noise
from flowgrpo.trainer.run_files import tidy_on_start

# train/ metrics of the importance ratio and its clipping: meaningless (not 0) on a step with
# no advantage signal, so such a step logs them as absent
RATIO_METRICS = ("train/clipfrac", "train/ratio_mean", "train/log_ratio_mean")


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
        # from them was finite, and where the run's checkpoints go (None: not training)
        self.checkpoint: Path | None = None
        self.rollout_ok = False
        self.ckpt_root: Path | None = None

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


# -- rollout + reward + update -----------------------------------------------------------------


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
    finishes (async reward scoring)."""
    s, m, parts = run.cfg.sample, run.cfg.model, []
    chunk = max(1, s.rollout_batch_size)
    for lo in range(0, len(prompts), chunk):
        rows = slice(lo, lo + chunk)
        gens = setup.generators(run.cfg.seed, step, indices[rows], run.dist.device)
        init = None
        if not eval and s.same_latent:
            init = setup.group_generators(run.cfg.seed, step, groups[rows], run.dist.device)
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
            raise TrainingDiverged(diverged_message(run, what))
        if on_chunk is not None:
            on_chunk(traj, rows)
        parts.append(traj)
    run.rollout_ok = True
    if run.checkpoint is not None and run.dist.is_main:  # the checkpoint is a good one
        from flowgrpo.engine.checkpoint import ROLLOUT_OK, mark_checkpoint

        mark_checkpoint(run.checkpoint, ROLLOUT_OK)
    return Trajectory.cat(parts)


def diverged_message(run: Run, what: str) -> str:
    """The error line of a non-finite rollout. The checkpoint holding these weights (finite,
    yet their rollout is not) is marked DIVERGED so that no resume takes it; the line names
    the last checkpoint whose rollout was finite."""
    from flowgrpo.engine.checkpoint import DIVERGED, mark_checkpoint, resume_advice

    message = (
        f"training diverged: the {what} produced non-finite latents (the weights give NaN/inf)"
    )
    if run.ckpt_root is None:  # sample / eval of a checkpoint
        return f"{message}; lower optim.lr"
    if run.checkpoint is not None:
        if run.dist.is_main:
            mark_checkpoint(run.checkpoint, DIVERGED)
        message += f"; {run.checkpoint} holds these weights and is marked diverged"
    return f"{message}; {resume_advice(run.ckpt_root)}"


def score(
    run: Run,
    plan: RolloutPlan,
    prompts: list[str],
    metadata: list[dict],
    indices: list[int],
    step: int,
    locations: list[str],
    groups: list[int] | None = None,
):
    """Rollout (``plan``) + rewards of this rank's samples (of groups ``groups``) -> (trajectory,
    {name: [n]}, reward seconds).
    With ``advantage.async_reward`` chunks are scored in a thread while the next one samples.
    A failing reward is a RunError naming the reward and, when only some samples fail, the
    first failing sample's prompt-file line (``locations``)."""
    images = source_images(metadata)
    if run.engine.sp_rank:  # an SP group's other ranks sample alike but do not score
        with run.algorithm.rollout_weights():
            traj = rollout(run, prompts, indices, step, plan, groups=groups, images=images)
            return traj, None, 0.0
    with run.algorithm.rollout_weights():
        if not run.cfg.advantage.async_reward:
            traj = rollout(run, prompts, indices, step, plan, groups=groups, images=images)
            t = time.perf_counter()
            with reward_failures(
                run.reward, traj.images, prompts, metadata, locations, f"step {step}"
            ):
                rewards = run.reward(traj.images, prompts, metadata)
            return traj, rewards, time.perf_counter() - t
        futures = []
        with AsyncRewardScorer(run.reward) as scorer:
            traj = rollout(
                run,
                prompts,
                indices,
                step,
                plan,
                groups=groups,
                images=images,
                on_chunk=lambda tr, rows: futures.append(
                    scorer.submit(tr.images, prompts[rows], metadata[rows])
                ),
            )
            t = time.perf_counter()
            with reward_failures(
                run.reward, traj.images, prompts, metadata, locations, f"step {step}"
            ):
                parts = [f.result() for f in futures]
    rewards = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return traj, rewards, time.perf_counter() - t


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


def train_one_step(run: Run, step: int) -> dict[str, Any]:
    """Step ``step`` (1-based): rollout, rewards, advantages, update. Returns its metrics."""
    cfg, dist = run.cfg, run.dist
    if dist.device.type == "cuda":  # this step's peak, not the run's
        torch.cuda.reset_peak_memory_stats(dist.device)
    t0, cpu0 = time.perf_counter(), time.process_time()
    indices, groups = run.sampler.global_step_samples(step - 1)  # all ranks, groups of K
    start, count = rank_slice(len(indices), run.engine.dp_size, run.engine.dp_rank)
    mine = list(range(start, start + count))  # this rank's global sample numbers
    prompts, metadata = run.train_data.select(indices[start : start + count])
    locations = [run.train_data.locations[i] for i in indices[start : start + count]]
    mine_groups = groups[start : start + count]
    plan = run.rollout_plan(step)
    traj, local, reward_s = score(run, plan, prompts, metadata, mine, step, locations, mine_groups)
    t2 = time.perf_counter()
    rewards = gather_rewards(run, local)
    rewards.update(pairwise_rewards(run, traj.images, prompts, metadata, groups))  # win rates
    group_ids = torch.tensor(groups)
    combined = run.algorithm.advantages(rewards, run.reward.weights_of(rewards), group_ids)
    advantages = combined.advantages[start : start + count].to(dist.device)
    train_metrics = {}
    if plan.train:  # MixGRPO's empty window trains nothing
        seeds = [setup.sample_seed(cfg.seed, step, i) for i in mine]
        train_metrics = run.algorithm.update(traj, advantages, step=step, sample_seeds=seeds)
    t3, cpu3 = time.perf_counter(), time.process_time()
    memory = all_gather_object(peak_memory(dist.device))  # the fullest rank's figures
    if not bool(combined.advantages.any()):  # every group's rewards were equal
        train_metrics = {
            k: v for k, v in train_metrics.items() if f"train/{k}" not in RATIO_METRICS
        }
    return {
        "reward_mean": float(combined.reward.mean()),
        "reward_std": float(combined.reward.std(unbiased=False)),
        **reward_stats(rewards, group_ids),
        "zero_std_ratio": zero_std_ratio(combined.reward, group_ids),
        "advantage_abs_mean": float(combined.advantages.abs().mean()),
        **{f"train/{k}": float(v) for k, v in train_metrics.items()},
        "time/rollout_s": t2 - t0 - reward_s,
        "time/reward_s": reward_s,
        "time/train_s": t3 - t2,
        "time/step_s": t3 - t0,
        "time/step_cpu_s": cpu3 - cpu0,  # this process's CPU time: fair on a shared machine
        "images_per_s": len(indices) / max(t3 - t0, 1e-9),
        "images_per_s_per_gpu": len(indices) / max(t3 - t0, 1e-9) / dist.world_size,
        **{k: max(m[k] for m in memory) for k in memory[0]},
    }


def peak_memory(device: torch.device) -> dict[str, float]:
    """``memory/peak_gib``: the device memory this rank's tensors peaked at since the last
    reset (CUDA only: ``torch.cuda.max_memory_allocated``; each step resets it), and
    ``memory/host_peak_gib``: this process's peak resident memory on the host (Linux/macOS).
    A step logs the largest over the ranks."""
    out = {}
    if device.type == "cuda":
        out["memory/peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
        import sys

        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB (bytes on macOS)
        out["memory/host_peak_gib"] = kib / (2**30 if sys.platform == "darwin" else 2**20)
    except ImportError:  # Windows
        pass
    return out


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
    """This rank's eval samples: (indices, how many are real, prompts, metadata, images of
    the real ones), ODE with the fixed eval noise."""
    ev = run.eval_set
    idx, real = setup.padded_shard(len(ev), run.engine.dp_rank, run.engine.dp_size)
    prompts, metadata = ev.select(idx)
    with run.ema():
        images = rollout(
            run,
            prompts,
            idx,
            setup.EVAL_SALT,
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
    eval", "eval at step 4"); ``base``: the base eval's metrics (the gold gap's reference;
    None at the base eval itself)."""
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


# -- the loop ----------------------------------------------------------------------------------


def run_training(cfg: Any) -> dict[str, Any]:
    """Train per ``cfg``; returns {"base": eval metrics, "final": eval metrics, "steps",
    "samples", "wall_s", "output_dir", paths of the figures}. The run folder is locked while
    it runs (``setup.lock_output_dir``), released however it ends."""
    from flowgrpo.config.loader import rollback_config

    rollback: GuardRollback | None = None
    try:
        while True:
            try:
                return _run_training(cfg, rollback)
            except GuardRollback as rb:  # the guard: resume from the best-gold checkpoint
                setup.release_output_dir()
                rollback, cfg = rb, rollback_config(cfg)  # with guard.on_rollback applied
    finally:
        setup.release_output_dir()


class GuardRollback(Exception):
    """The guard tripped with ``guard.action=rollback``: resume from ``target`` (the best-gold
    checkpoint at or before the peak) with ``record`` (the guard's, as it tripped)."""

    def __init__(self, target: Path, record: dict[str, Any], line: str) -> None:
        super().__init__(line)
        self.target, self.record, self.line = target, record, line


def _recorded_settings(checkpoint: Path) -> dict[str, Any]:
    """The settings earlier rollbacks applied (``guard.on_rollback``), from the checkpoint's
    trainer state: a resume after a rollback runs with them, as the run did."""
    import json

    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return {}
    return dict((state.get("guard") or {}).get("applied") or {})


def _run_training(cfg: Any, rollback: GuardRollback | None = None) -> dict[str, Any]:
    wall0 = time.perf_counter()
    dist = init_distributed()
    seed_everything(cfg.seed, dist.rank)
    tr = cfg.trainer
    if dist.world_size % cfg.fsdp.sp_degree == 0:  # a clear error before the folder or model
        check_divides(setup.global_batch_size(cfg), dist.world_size // cfg.fsdp.sp_degree)
    out = setup.prepare_output_dir(cfg, dist, fresh=tr.resume in (None, "") and not rollback)
    ckpt_root = out / "checkpoints"
    resume_from = rollback.target if rollback else setup.resolve_resume(tr.resume, ckpt_root)
    applied: dict[str, Any] = {}
    if resume_from is not None and rollback is None:  # before anything heavy loads
        applied = _recorded_settings(resume_from)
        if applied:  # the run rolled back before: it continues with what the rollback set
            from flowgrpo.config.loader import apply_settings

            cfg = apply_settings(cfg, applied)
            tr = cfg.trainer
        check_resume(cfg, resume_from)
    record = record_text(cfg)  # config.yaml of the run folder and of each checkpoint
    if dist.is_main:
        (out / RUN_CONFIG).write_text(record)
    run = Run(cfg, dist)
    run.ckpt_root = ckpt_root
    from flowgrpo.engine.checkpoint import (
        ROLLOUT_OK,
        load_checkpoint,
        mark_checkpoint,
        run_id_of,
        save_checkpoint,
    )

    state: dict[str, Any] = {"step": 0, "samples": 0, "base_eval": None}
    if resume_from is not None:
        if run.reward.pairwise_labels:  # the base model's eval images, before the weights load
            run.base_images = eval_images(run)[4].detach().cpu().clone()
        _, extra = load_checkpoint(run.engine, resume_from)
        run.checkpoint = resume_from
        state.update(extra or {})
        state.setdefault("run_id", run_id_of(resume_from))  # checkpoints from before run ids
        run.sampler.load_state_dict(state["sampler"])  # the same draw, or a clear error
    else:
        state["run_id"] = setup.new_run_id()
    if rollback is not None:  # the tripped run's record, back at the target's step
        grec = rollback.record
        guard_rule.forget_after(grec, state["step"])
        grec["rollbacks"] = int(grec.get("rollbacks", 0)) + 1
        grec["applied"] = {**grec.get("applied", {}), **flat_keys(cfg.guard.on_rollback)}
        grec["events"].append(
            {"action": "rollback", "to_step": state["step"], "line": rollback.line}
        )
        state["guard"] = grec
    state.setdefault("guard", guard_rule.new_record())
    if dist.is_main:
        guard_rule.drop_missing(state["guard"])  # checkpoints pruned meanwhile
    state["guard"] = all_gather_object(state["guard"])[0]  # rank 0's view of the disk
    # a resume (or resume=auto finding no checkpoint to take: from step 0) abandons what is later
    resumed_step = state["step"] if resume_from is not None or tr.resume == "auto" else None
    notes = tidy_on_start(out, ckpt_root, resumed_step, state["run_id"]) if dist.is_main else []
    barrier()  # later checkpoints moved aside, leftovers gone: before any rank writes
    global_batch = setup.global_batch_size(cfg)
    logger = RunLogger(
        out,
        enabled=dist.is_main,
        total_steps=tr.max_steps,
        start_step=state["step"],
        tensorboard=cfg.run.tensorboard,
        wandb=cfg.run.wandb_mode if cfg.run.wandb else None,
        wandb_project=cfg.run.wandb_project,
        run_name=cfg.run.name,
        config=config_to_dict(cfg),
        progress=wants_bar(cfg.run.progress_bar),  # a pipe or a log file: step lines
        log_every=tr.log_every,
    )
    logger.write(
        startup_banner(
            cfg,
            world_size=dist.world_size,
            device=dist.device.type,
            trainable=sum(p.numel() for p in run.engine.params),
            total=sum(p.numel() for p in run.engine.transformer.parameters()),
            output_dir=out,
            resumed_from=None if resume_from is None else f"{resume_from} (step {state['step']})",
            planned=setup.planned_memory(cfg, dist) if dist.is_main else None,
            num_frames=run.num_frames,
        )
    )
    for line in notes:
        logger.write(line)
    if applied:
        logger.write(f"guard: this run rolled back before; resuming with {applied}")
    if rollback is not None:
        n = state["guard"]["rollbacks"]
        logger.write(
            f"{rollback.line}; rollback {n} of {cfg.guard.max_rollbacks}: resumed from "
            f"{resume_from} with {flat_keys(cfg.guard.on_rollback) or 'no setting changed'}"
        )
    if run.engine.optim_changes:
        logger.write(setup.optim_changes_line(run.engine.optim_changes, state["step"] + 1))
    if state["base_eval"] is None:  # step 0: the base model
        t = time.perf_counter()
        state["base_eval"], grid = evaluate(run, "base eval")
        _record_eval(run, state, 0, state["base_eval"])
        logger.log_eval({"step": 0, "samples": 0, **state["base_eval"]})  # deterministic
        logger.write(f"base eval: {time.perf_counter() - t:.1f} s")
        if dist.is_main:
            notes = reward_notes(grid.rewards)
            save_grid(
                grid.images,
                out / "grid_before.png",
                run.grid_cols,
                grid.prompts,
                notes,
                grid.sources,
            )
            logger.log_images("eval/images", grid.images, 0, run.grid_cols, *grid[1:])
    final_eval, grid, checkpoint_s, trip = None, None, None, None
    while state["step"] < tr.max_steps and trip is None:
        step = state["step"] + 1
        metrics = train_one_step(run, step)
        run.checkpoint, run.rollout_ok = None, False  # new weights: not checked, not saved
        state.update(step=step, samples=state["samples"] + global_batch)
        state["sampler"] = run.sampler.state_dict()
        row = {"step": step, "samples": state["samples"], **metrics}
        if checkpoint_s is not None:  # the checkpoint written after the previous step
            row["time/checkpoint_s"], checkpoint_s = checkpoint_s, None
        if metrics["advantage_abs_mean"] == 0:
            logger.warn(
                f"step {step}: every group's rewards were equal, so every advantage is 0 and "
                "the policy gradient is 0 (ratio/clip metrics are not logged for this step); "
                "if this repeats, the reward cannot tell this group's samples apart: see "
                "zero_std_ratio in metrics.jsonl"
            )
        if _due(step, tr.eval_every, tr.max_steps):
            t = time.perf_counter()
            final_eval, grid = evaluate(run, f"eval at step {step}", state["base_eval"])
            trip = _record_eval(run, state, step, final_eval)
            row.update(final_eval)
            row["time/eval_s"] = time.perf_counter() - t
            logger.log_eval({"step": step, "samples": state["samples"], **final_eval})
            logger.log_images("eval/images", grid.images, step, run.grid_cols, *grid[1:])
        logger.log_step(row)
        # a trip saves its step: a resume continues from it, a rollback retires it
        if _due(step, tr.save_every, tr.max_steps) or trip is not None:
            t = time.perf_counter()
            if run.gold is not None:  # the record names the checkpoint it is saved in
                guard_rule.record_checkpoint(state["guard"], step, ckpt_root / f"step_{step}")
            run.checkpoint = save_checkpoint(
                run.engine,
                ckpt_root,
                step,
                extra=dict(state),
                keep_last=tr.keep_last,
                run_id=state["run_id"],
                files={RUN_CONFIG: record},
            )
            checkpoint_s = time.perf_counter() - t
            if run.rollout_ok and dist.is_main:  # this step's eval was finite: a good one
                mark_checkpoint(run.checkpoint, ROLLOUT_OK)
            if run.gold is not None and dist.is_main:  # best.json, KEEP markers
                guard_rule.write_best(out, state["guard"])
        if trip is not None:
            trip = _act_on_trip(cfg, state, trip, logger)
            if dist.is_main:  # best.json with the stop
                guard_rule.write_best(out, state["guard"])
    if final_eval is None:  # resumed at the end already: evaluate the final weights again
        final_eval, grid = evaluate(run, f"eval at step {state['step']}", state["base_eval"])
    summary: dict[str, Any] = {
        # the guard: the line it stopped the run with (None: it did not), its rollbacks
        "guard": {
            "stopped": trip,
            "rollbacks": int(state["guard"].get("rollbacks", 0)),
            "events": list(state["guard"].get("events", [])),
        },
        "base": state["base_eval"],
        "final": final_eval,
        "steps": state["step"],
        "samples": state["samples"],
        "wall_s": time.perf_counter() - wall0,
        "output_dir": str(out),
        "resumed_from": None if resume_from is None else str(resume_from),
    }
    if dist.is_main:  # grid_after.png, reward_curve.png and the base-vs-final table
        summary.update(write_final_report(out, grid, run.grid_cols, summary, logger))
        if checkpoint_s is not None:
            logger.write(f"the last checkpoint took {checkpoint_s:.1f} s to write")
    logger.close()
    barrier()
    return summary


def _record_eval(run: Run, state: dict[str, Any], step: int, metrics: dict) -> Any:
    """Add the eval to the guard record (runs with gold rewards) -> the guard's Trip, or
    None (no trip, or no guard)."""
    from flowgrpo.trainer.preference import GOLD_SCORE

    if run.gold is None:
        return None
    rec = state["guard"]
    guard_rule.record_eval(rec, step, metrics["eval/reward_mean"], metrics[GOLD_SCORE])
    drop = run.cfg.guard.max_gold_drop
    return None if drop is None or step == 0 else guard_rule.check(rec, drop)


def _act_on_trip(cfg: Any, state: dict[str, Any], trip: Any, logger: RunLogger) -> str:
    """The guard tripped (its step is saved): stop with one line, or raise GuardRollback to
    resume from the best-gold checkpoint at or before the peak. Returns the stop line."""
    rec, g = state["guard"], cfg.guard
    target = guard_rule.best_checkpoint(rec, "gold", up_to=trip.peak.step)
    if g.action == "rollback" and target is not None and rec["rollbacks"] < g.max_rollbacks:
        line = guard_rule.trip_line(trip, "rolling back", target)
        logger.close()
        raise GuardRollback(Path(target.checkpoint), rec, line)
    if g.action == "rollback" and target is None:
        what = "stopped: no checkpoint to roll back to"
    elif g.action == "rollback":
        what = f"stopped after {rec['rollbacks']} rollbacks (guard.max_rollbacks)"
    else:
        what, target = "stopped", guard_rule.best_checkpoint(rec, "gold")
    line = guard_rule.trip_line(trip, what, target)
    rec["events"].append({"action": "stop", "step": trip.now.step, "line": line})
    logger.write(line)
    return line


def _due(step: int, every: int, last: int) -> bool:
    """Eval / save at every ``every``-th step and at the last step (``every`` 0: the last
    step only)."""
    return step == last or (every > 0 and step % every == 0)


# -- sample / eval / export from a checkpoint --------------------------------------------------


def _restored(
    cfg: Any, checkpoint: str | Path | None, purpose: str, prompts: tuple[str, ...] = ()
) -> Run:
    run = Run(cfg, init_distributed(), purpose, prompts)
    if checkpoint is not None:
        from flowgrpo.engine.checkpoint import load_checkpoint

        if run.reward is not None and run.reward.pairwise_labels:  # judged against the base
            run.base_images = eval_images(run)[4].detach().cpu().clone()

        load_checkpoint(run.engine, setup.resolve_checkpoint(checkpoint))
    return run


#: beside an edit's ``flowgrpo sample`` outputs: each prompt's source | result
EDIT_GRID = "grid.png"


def run_sample(
    cfg: Any,
    checkpoint: str | Path | None,
    prompts: list[str],
    out_dir: str | Path,
    images: list[list[torch.Tensor]] | None = None,
) -> list[Path]:
    """ODE samples (eval steps/guidance) of ``prompts`` from the base model or a checkpoint,
    one PNG each in ``out_dir`` (GIF for videos) and ``prompts.jsonl`` saying which prompt
    made which file; sample i's noise comes from (seed, i). ``images``: each prompt's source
    images (editing models); then ``grid.png`` shows each prompt's source | result."""
    if not prompts:
        raise ValueError("run_sample needs at least one prompt")
    run = _restored(cfg, checkpoint, "sample", tuple(prompts))  # prompts reach the cache
    with run.ema():
        plan = run.eval_plan()
        result = rollout(
            run,
            list(prompts),
            list(range(len(prompts))),
            setup.SAMPLE_SALT,
            plan,
            eval=True,
            images=images,
        ).images
    if not run.dist.is_main:
        return []
    paths = save_images(result, out_dir, prompts=list(prompts))
    if images is not None and result.dim() == 4:  # an edit: source | result, a prompt a row
        fitted = fitted_sources(images, *result.shape[-2:])
        save_grid(result, Path(out_dir) / EDIT_GRID, 1, list(prompts), sources=fitted)
    return paths


def run_eval(cfg: Any, checkpoint: str | Path | None) -> dict[str, float]:
    """Eval metrics (``eval/...``) of the base model or a checkpoint on the eval prompts."""
    return evaluate(_restored(cfg, checkpoint, "eval"))[0]


def run_export_lora(
    cfg: Any, checkpoint: str | Path, out_file: str | Path, *, full: bool = False, raw: bool = False
) -> Path:
    """Write the checkpoint's LoRA as a diffusers-loadable safetensors file, or with ``full``
    the whole transformer (LoRA merged) as a diffusers ``save_pretrained`` directory. A run
    with EMA exports its EMA weights (what eval and sample use) unless ``raw``."""
    if not full and not cfg.lora.enabled:
        raise ValueError(
            "this run is a full fine-tune (lora.enabled=false): there is no LoRA to export; "
            "add --full to write the whole transformer with save_pretrained"
        )
    run = _restored(cfg, checkpoint, "export")
    ema, steps = run.engine.ema, run.engine.optimizer_steps
    if not raw and ema is not None and steps < ema.update_every and run.dist.is_main:
        print(  # the EMA still holds the initial weights: an export of them changes nothing
            f"flowgrpo: warning: the EMA has not been updated yet ({steps} optimizer steps, "
            f"ema.update_every={ema.update_every}): it holds the initial weights, so this "
            "export equals the untrained model; --raw exports the trained weights",
            file=sys.stderr,
        )
    with run.ema(not raw):
        return Path(run.engine.save_full(out_file) if full else run.engine.export_lora(out_file))
