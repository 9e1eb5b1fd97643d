"""The training loop, readable top to bottom, whatever the algorithm.

``run_training``: set up the run folder and the run (or resume one), evaluate the base model,
then per step ``train_one_step`` (rollout -> rewards -> advantages -> update), log, evaluate
and save as due. One step: draw m prompts x K (the groups) -> this rank's share -> the
algorithm's rollout without grad, per-sample noise seeded from (seed, step, global sample
index) -> rewards -> all-gather -> group-relative advantages on the global batch -> this
rank's slice -> ``algorithm.update``.
Everything a step does is a function of (seed, step, restored state), so a resumed run repeats
a straight run exactly. Eval uses the ODE sampler on fixed prompts with fixed noise.

Where the rest lives: the built run, its rollouts and eval in ``trainer.run``; the commands
(sample, eval, export) in ``trainer.commands``; the run folder (lock, outputs, checkpoint
markers) in ``trainer.run_folder``; the seeds in ``trainer.seeds``; builders in
``trainer.setup``. Their entry points stay importable from here.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from flowgrpo.algorithms.base import RolloutPlan
from flowgrpo.config.loader import apply_settings, config_to_dict, rollback_config
from flowgrpo.config.record import RUN_CONFIG, check_resume, record_text
from flowgrpo.config.schema import ConfigError, flat_keys
from flowgrpo.data.prompts import check_divides, rank_slice, source_images
from flowgrpo.engine.dist import (
    all_gather_object,
    barrier,
    init_distributed,
    seed_everything,
)
from flowgrpo.functional import reward_stats, zero_std_ratio
from flowgrpo.rewards import AsyncRewardScorer
from flowgrpo.trainer import guard, setup
from flowgrpo.trainer.commands import run_eval, run_export_lora, run_sample
from flowgrpo.trainer.figures import reward_notes, save_grid
from flowgrpo.trainer.logging import RunLogger, startup_banner, wants_bar, write_final_report
from flowgrpo.trainer.preference import pairwise_rewards
from flowgrpo.trainer.refill import refill
from flowgrpo.trainer.run import (
    EvalGrid,
    Run,
    eval_images,
    evaluate,
    gather_rewards,
    marking_checkpoint,
    reward_failures,
    rollout,
)
from flowgrpo.trainer.run_folder import (
    mark_good,
    new_run_id,
    prepare_output_dir,
    release_output_dir,
    resolve_resume,
    tidy_on_start,
)
from flowgrpo.trainer.seeds import sample_seed

# train/ metrics of the importance ratio and its clipping: meaningless (not 0) on a step with
# no advantage signal, so such a step logs them as absent
RATIO_METRICS = ("train/clipfrac", "train/ratio_mean", "train/log_ratio_mean")


# -- the loop ----------------------------------------------------------------------------------


def run_training(cfg: Any) -> dict[str, Any]:
    """Train per ``cfg``; returns {"base": eval metrics, "final": eval metrics, "steps",
    "samples", "wall_s", "output_dir", paths of the figures}. The run folder is locked while
    it runs (``run_folder.lock_output_dir``), released however it ends."""
    rollback: guard.GuardRollback | None = None
    try:
        while True:
            try:
                return _run_training(cfg, rollback)
            except guard.GuardRollback as rb:  # resume from the best-gold checkpoint
                release_output_dir()
                rollback, cfg = rb, rollback_config(cfg)  # with guard.on_rollback applied
    finally:
        release_output_dir()


def _run_training(cfg: Any, rollback: guard.GuardRollback | None = None) -> dict[str, Any]:
    wall0 = time.perf_counter()
    dist = init_distributed()
    seed_everything(cfg.seed, dist.rank)
    tr = cfg.trainer
    if dist.world_size % cfg.fsdp.sp_degree == 0:  # a clear error before the folder or model
        check_divides(setup.global_batch_size(cfg), dist.world_size // cfg.fsdp.sp_degree)
    out = prepare_output_dir(cfg, dist, fresh=tr.resume in (None, "") and not rollback)
    ckpt_root = out / "checkpoints"
    resume_from = rollback.target if rollback else resolve_resume(tr.resume, ckpt_root)
    applied: dict[str, Any] = {}
    if resume_from is not None and rollback is None:  # before anything heavy loads
        applied = guard.recorded_settings(resume_from)
        if applied:  # the run rolled back before: it goes on with what the rollback set
            cfg = apply_settings(cfg, applied)
            tr = cfg.trainer
        check_resume(cfg, resume_from)
    record = record_text(cfg)  # config.yaml of the run folder and of each checkpoint
    if dist.is_main:
        (out / RUN_CONFIG).write_text(record)
    run = Run(cfg, dist)
    run.ckpt_root = ckpt_root
    if cfg.sample.refill_rounds > 0 and run.reward.pairwise_labels:
        raise ConfigError(  # a refilled group's win rates would mix two rollouts' pairs
            f"config key 'sample.refill_rounds' is {cfg.sample.refill_rounds} with pairwise "
            f"reward(s) {', '.join(run.reward.pairwise_labels)}: refill scores points, not "
            "pairs; set sample.refill_rounds=0"
        )
    from flowgrpo.engine.checkpoint import load_checkpoint, run_id_of, save_checkpoint

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
        state["run_id"] = new_run_id()
    if rollback is not None:  # the tripped run's guard record, back at the target's step
        rolled = flat_keys(cfg.guard.on_rollback)
        state["guard"] = guard.after_rollback(rollback, state["step"], rolled)
    state.setdefault("guard", guard.new_record())
    if dist.is_main:
        guard.drop_missing(state["guard"])  # checkpoints pruned or moved aside meanwhile
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
        logger.write(f"guard: this run rolled back before; it goes on with {applied}")
    if rollback is not None:
        logger.write(
            f"{rollback.line}; rollback {state['guard']['rollbacks']} of "
            f"{cfg.guard.max_rollbacks}: resumed from {resume_from} with "
            f"{flat_keys(cfg.guard.on_rollback) or 'no setting changed'}"
        )
    if run.engine.optim_changes:
        logger.write(setup.optim_changes_line(run.engine.optim_changes, state["step"] + 1))
    if state["base_eval"] is None:  # step 0: the base model
        t = time.perf_counter()
        state["base_eval"], grid = evaluate(run, "base eval")
        if run.gold is not None:
            guard.on_eval(cfg, state["guard"], 0, state["base_eval"])
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
        # rollout -> rewards -> advantages -> update
        metrics = train_one_step(run, step)
        run.checkpoint, run.rollout_ok = None, False  # new weights: not checked, not saved
        extra = int(metrics.get("refill/samples", 0))  # sample.refill_rounds' extra rollouts
        state.update(step=step, samples=state["samples"] + global_batch + extra)
        state["sampler"] = run.sampler.state_dict()
        # log
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
        # eval
        if _due(step, tr.eval_every, tr.max_steps):
            t = time.perf_counter()
            final_eval, grid = evaluate(run, f"eval at step {step}", state["base_eval"])
            if run.gold is not None:  # the guard: gold down while the reward rose?
                trip = guard.on_eval(cfg, state["guard"], step, final_eval)
            row.update(final_eval)
            row["time/eval_s"] = time.perf_counter() - t
            logger.log_eval({"step": step, "samples": state["samples"], **final_eval})
            logger.log_images("eval/images", grid.images, step, run.grid_cols, *grid[1:])
        logger.log_step(row)
        # checkpoint (a trip saves its step: a resume goes on from it, a rollback retires it)
        if _due(step, tr.save_every, tr.max_steps) or trip is not None:
            t = time.perf_counter()
            if run.gold is not None:  # the record names the checkpoint it is saved in
                guard.record_checkpoint(state["guard"], step, ckpt_root / f"step_{step}")
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
            if run.rollout_ok:  # this step's eval was finite: a good one
                mark_good(run.checkpoint, dist)
            if run.gold is not None and dist.is_main:  # best.json, KEEP markers
                guard.write_best(out, state["guard"])
        if trip is not None:  # stop (one line), or raise GuardRollback
            try:
                trip = guard.act_on_trip(cfg, state["guard"], trip, logger.write)
            except guard.GuardRollback:
                logger.close()  # run_training resumes from the target with a new logger
                raise
            if dist.is_main:  # best.json with the stop
                guard.write_best(out, state["guard"])
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


def _due(step: int, every: int, last: int) -> bool:
    """Eval / save at every ``every``-th step and at the last step (``every`` 0: the last
    step only)."""
    return step == last or (every > 0 and step % every == 0)


# -- one step: rollout -> rewards -> advantages -> update -------------------------------------


def train_one_step(run: Run, step: int) -> dict[str, Any]:
    """Step ``step`` (1-based): rollout, rewards, advantages, update. Returns its metrics."""
    cfg, dist = run.cfg, run.dist
    if dist.device.type == "cuda":  # this step's peak, not the run's
        torch.cuda.reset_peak_memory_stats(dist.device)
    t0, cpu0 = time.perf_counter(), time.process_time()
    # the step's samples (all ranks, groups of K) and this rank's share
    indices, groups, start, count = step_draw(run, step)
    mine = list(range(start, start + count))  # this rank's global sample numbers
    prompts, metadata = run.train_data.select(indices[start : start + count])
    plan = run.rollout_plan(step)
    # rollout and rewards: sampled now, or (off-policy) during the previous step
    off_policy = run.off_policy  # trainer/off_policy.py
    sampled = off_policy.take(step, run, sample_step)
    traj, local = sampled.trajectory, sampled.rewards
    reward_s = sampled.reward_s if sampled.now else 0.0  # a prefetched one: timed when sampled
    rewards = gather_rewards(run, local)
    rewards.update(pairwise_rewards(run, traj.images, prompts, metadata, groups))  # win rates
    group_ids, positions, refilled = torch.tensor(groups), torch.arange(start, start + count), {}
    if cfg.sample.refill_rounds > 0 and plan.train:  # constant groups replaced (trainer/refill.py)

        def more(plan, *a):  # another rollout of this step, scored (refill's new groups)
            with run.algorithm.rollout_weights():
                return rollout_and_score(run, plan, *a[:3], step, *a[3:])

        out = refill(run, step, traj, rewards, groups, mine, more, gather_rewards)
        traj, rewards, group_ids, positions, mine = out[:5]
        reward_s, refilled = reward_s + out.reward_s, out.metrics
    t2 = time.perf_counter()
    # advantages, on the global batch; this rank's samples of it
    combined = run.algorithm.advantages(rewards, run.reward.weights_of(rewards), group_ids)
    advantages = combined.advantages[positions].to(dist.device)
    # off-policy: step + 1's rollout, sampled by the weights before this update
    ahead = off_policy.prefetch(step, cfg.trainer.max_steps, run, sample_step)
    ahead_s, ahead_reward_s = (0.0, 0.0) if ahead is None else (ahead.wall_s, ahead.reward_s)
    # update
    train_metrics = {}
    if plan.train:  # MixGRPO's empty window trains nothing
        seeds = [sample_seed(cfg.seed, step, i) for i in mine]
        train_metrics = run.algorithm.update(traj, advantages, step=step, sample_seeds=seeds)
    t_update = time.perf_counter()
    beside = off_policy.join()  # overlapped: the next step's rollout, sampled beside the update
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
        **refilled,
        **{f"train/{k}": float(v) for k, v in train_metrics.items()},
        "train/staleness": float(sampled.staleness),  # updates the sampling weights lag
        "time/rollout_s": t2 - t0 - reward_s + ahead_s - ahead_reward_s,  # next step's too
        "time/reward_s": reward_s + ahead_reward_s,
        "time/train_s": t_update - t2 - ahead_s,
        **({"time/overlapped_rollout_s": beside} if beside else {}),  # its wall, reward included
        "time/step_s": t3 - t0,
        "time/step_cpu_s": cpu3 - cpu0,  # this process's CPU time: fair on a shared machine
        "images_per_s": len(indices) / max(t3 - t0, 1e-9),
        "images_per_s_per_gpu": len(indices) / max(t3 - t0, 1e-9) / dist.world_size,
        **{k: max(m[k] for m in memory) for k in memory[0]},
    }


def step_draw(run: Run, step: int) -> tuple[list[int], list[int], int, int]:
    """Step ``step``'s samples: (prompt indices, group ids) of all ranks in global sample
    order, and this rank's share of them as (start, count)."""
    indices, groups = run.sampler.global_step_samples(step - 1)
    start, count = rank_slice(len(indices), run.engine.dp_size, run.engine.dp_rank)
    return indices, groups, start, count


def sample_step(run: Run, step: int) -> tuple[Any, dict[str, torch.Tensor] | None, float]:
    """Step ``step``'s training rollout of this rank's samples and their rewards, with the
    weights in the model (``rollout_and_score``)."""
    indices, groups, start, count = step_draw(run, step)
    prompts, metadata = run.train_data.select(indices[start : start + count])
    locations = [run.train_data.locations[i] for i in indices[start : start + count]]
    mine = list(range(start, start + count))
    plan = run.rollout_plan(step)
    return rollout_and_score(
        run, plan, prompts, metadata, mine, step, locations, groups[start : start + count]
    )


def rollout_and_score(
    run: Run,
    plan: RolloutPlan,
    prompts: list[str],
    metadata: list[dict],
    indices: list[int],
    step: int,
    locations: list[str],
    groups: list[int] | None = None,
) -> tuple[Any, dict[str, torch.Tensor] | None, float]:
    """The training rollout (``plan``) of this rank's samples (of groups ``groups``) and their
    rewards -> (trajectory, {name: [n]}, reward seconds). The rollout marks the checkpoint
    holding these weights (``marking_checkpoint``). With ``advantage.async_reward`` chunks are
    scored in a thread while the next one samples; an SP group's other ranks sample alike but
    do not score (None, 0 s). A failing reward is a RunError naming the reward and, when only
    some samples fail, the first failing sample's prompt-file line (``locations``)."""
    images = source_images(metadata)
    if run.engine.sp_rank:  # an SP group's other ranks sample alike but do not score
        with marking_checkpoint(run):
            traj = rollout(run, prompts, indices, step, plan, groups=groups, images=images)
        return traj, None, 0.0
    if not run.cfg.advantage.async_reward:
        with marking_checkpoint(run):
            traj = rollout(run, prompts, indices, step, plan, groups=groups, images=images)
        t = time.perf_counter()
        with reward_failures(run.reward, traj.images, prompts, metadata, locations, f"step {step}"):
            rewards = run.reward(traj.images, prompts, metadata)
        return traj, rewards, time.perf_counter() - t
    futures = []
    with AsyncRewardScorer(run.reward) as scorer:
        with marking_checkpoint(run):
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
        with reward_failures(run.reward, traj.images, prompts, metadata, locations, f"step {step}"):
            parts = [f.result() for f in futures]
    rewards = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return traj, rewards, time.perf_counter() - t


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


__all__ = [
    "RATIO_METRICS",
    "EvalGrid",
    "Run",
    "evaluate",
    "peak_memory",
    "reward_failures",
    "rollout",
    "rollout_and_score",
    "run_eval",
    "run_export_lora",
    "run_sample",
    "run_training",
    "train_one_step",
]
