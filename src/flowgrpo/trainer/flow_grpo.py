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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flowgrpo.algo import reward_stats, zero_std_ratio
from flowgrpo.algorithms.base import RolloutPlan
from flowgrpo.engine import dist as D
from flowgrpo.errors import RunError, TrainingDiverged
from flowgrpo.rewards import AsyncRewardScorer
from flowgrpo.rewards.base import reward_unavailable
from flowgrpo.rollout import Trajectory, sample_trajectories
from flowgrpo.trainer import setup as S
from flowgrpo.trainer.logging import (
    RunLogger,
    save_grid,
    save_images,
    write_final_report,
)


class Run:
    """Everything built once from the config: adapter, engine, rewards, prompt streams."""

    def __init__(self, cfg: Any, dist: D.DistInfo) -> None:
        self.cfg, self.dist = cfg, dist
        if cfg.run.num_threads:
            torch.set_num_threads(cfg.run.num_threads)
        self.adapter = S.build_adapter_for(cfg, dist)
        self.engine, self.algorithm = S.build_engine(cfg, self.adapter, dist)
        self.reward = S.build_rewards(cfg.reward)
        self.eval_reward = S.build_rewards(cfg.eval_reward)  # eval only, the whole set at once
        self.train_data, self.sampler, self.eval_set = S.build_data(cfg)
        # eval images shown in grid_before/after.png: one row per prompt, one column per seed
        self.grid_index, self.grid_cols = S.grid_layout(
            len(self.eval_set), cfg.data.eval_samples_per_prompt
        )

    def ema(self, on: bool = True) -> contextlib.AbstractContextManager:
        """EMA weights inside the block when EMA is on (and ``on``)."""
        return (
            self.engine.ema_weights() if on and self.cfg.ema.enabled else contextlib.nullcontext()
        )


# -- rollout + reward + update -----------------------------------------------------------------


def rollout(
    run: Run,
    prompts: list[str],
    indices: list[int],
    step: int,
    *,
    eval: bool = False,
    on_chunk: Callable[[Trajectory, slice], None] | None = None,
) -> Trajectory:
    """Sample ``prompts`` in chunks of ``sample.rollout_batch_size``; sample i's noise comes
    from (seed, step, indices[i]). Training: as the algorithm's ``rollout_plan(step)`` says;
    eval: ODE with the eval steps/guidance. ``on_chunk(traj, rows)`` is called as each chunk
    finishes (async reward scoring)."""
    s, m, parts = run.cfg.sample, run.cfg.model, []
    if eval:
        plan = RolloutPlan(
            num_steps=s.eval_num_steps,
            guidance_scale=(
                s.guidance_scale if s.eval_guidance_scale is None else s.eval_guidance_scale
            ),
            noise_level=0.0,
            sde_type=s.sde_type,
            sde_window=None,
            timestep_fraction=1.0,
            deterministic_last_step=s.deterministic_last_step,
        )
    else:
        plan = run.algorithm.rollout_plan(step)
    chunk = max(1, s.rollout_batch_size)
    for lo in range(0, len(prompts), chunk):
        rows = slice(lo, lo + chunk)
        gens = S.generators(run.cfg.seed, step, indices[rows], run.dist.device)
        traj = sample_trajectories(
            run.adapter,
            prompts[rows],
            height=m.height,
            width=m.width,
            generator=gens,
            negative_prompts=[s.negative_prompt] * len(gens) if s.negative_prompt else None,
            **plan.sampler_kwargs(),
        )
        if not bool(torch.isfinite(traj.final_latents).all()):
            what = "eval rollout" if eval else f"rollout of step {step}"
            raise TrainingDiverged(
                f"training diverged: the {what} produced non-finite latents (the weights give "
                "NaN/inf); the last good checkpoint is kept; lower optim.lr"
            )
        if on_chunk is not None:
            on_chunk(traj, rows)
        parts.append(traj)
    return Trajectory.cat(parts)


def score(
    run: Run,
    prompts: list[str],
    metadata: list[dict],
    indices: list[int],
    step: int,
    locations: list[str],
):
    """Rollout + rewards of this rank's samples -> (trajectory, {name: [n]}, reward seconds).
    With ``advantage.async_reward`` chunks are scored in a thread while the next one samples.
    A failing reward is a RunError naming the reward and, when only some samples fail, the
    first failing sample's prompt-file line (``locations``)."""
    if run.engine.sp_rank:  # an SP group's other ranks sample alike but do not score
        with run.algorithm.rollout_weights():
            return rollout(run, prompts, indices, step), None, 0.0
    with run.algorithm.rollout_weights():
        if not run.cfg.advantage.async_reward:
            traj = rollout(run, prompts, indices, step)
            t = time.perf_counter()
            with reward_failures(run.reward, traj.images, prompts, metadata, locations, step):
                rewards = run.reward(traj.images, prompts, metadata)
            return traj, rewards, time.perf_counter() - t
        futures = []
        with AsyncRewardScorer(run.reward) as scorer:
            traj = rollout(
                run,
                prompts,
                indices,
                step,
                on_chunk=lambda tr, rows: futures.append(
                    scorer.submit(tr.images, prompts[rows], metadata[rows])
                ),
            )
            t = time.perf_counter()
            with reward_failures(run.reward, traj.images, prompts, metadata, locations, step):
                parts = [f.result() for f in futures]
    rewards = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return traj, rewards, time.perf_counter() - t


@contextlib.contextmanager
def reward_failures(reward, images, prompts, metadata, locations, step: int):
    """Turn a reward's failure into one RunError line. When the reward fails on some samples
    but not on others, the culprit is the data: scoring samples one at a time (at most 16)
    finds the first that fails, and its prompt-file line is named. A reward that could not
    be reached or timed out (``RewardUnavailable``) is reported at once, without that search."""
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
        raise RunError(f"{message}{where} (step {step})") from e


def gather_rewards(run: Run, rewards: dict[str, torch.Tensor] | None):
    """{name: [n_local]} -> {name: [N]} over the data-parallel ranks (their order = the global
    sample order). Under sequence parallelism only an SP group's first rank scored (``None``
    on the others): its rewards stand for the group's."""
    if run.engine.dp_size == run.dist.world_size:
        return {
            k: D.all_gather_tensor(v.to(run.dist.device)).cpu() for k, v in sorted(rewards.items())
        }
    parts = [p for p in D.all_gather_object(rewards) if p is not None]
    return {k: torch.cat([p[k] for p in parts]) for k in sorted(parts[0])}


def gather_group_firsts(run: Run, obj: Any) -> list[Any]:
    """Every rank's ``obj``, one per SP group (in data-parallel order)."""
    sp = run.dist.world_size // run.engine.dp_size
    return D.all_gather_object(obj)[::sp]


def train_one_step(run: Run, step: int) -> dict[str, Any]:
    """Step ``step`` (1-based): rollout, rewards, advantages, update. Returns its metrics."""
    cfg, dist = run.cfg, run.dist
    t0 = time.perf_counter()
    indices, groups = run.sampler.global_step_samples(step - 1)  # all ranks, groups of K
    start, count = S.shard(len(indices), run.engine.dp_rank, run.engine.dp_size)
    mine = list(range(start, start + count))  # this rank's global sample numbers
    prompts, metadata = run.train_data.select(indices[start : start + count])
    locations = [run.train_data.locations[i] for i in indices[start : start + count]]
    traj, local, reward_s = score(run, prompts, metadata, mine, step, locations)
    t2 = time.perf_counter()
    rewards = gather_rewards(run, local)
    group_ids = torch.tensor(groups)
    combined = run.reward.combine(
        rewards, group_ids, mode=cfg.advantage.mode, global_std=cfg.advantage.global_std
    )
    advantages = combined.advantages[start : start + count].to(dist.device)
    train_metrics = {}
    if run.algorithm.rollout_plan(step).train:  # MixGRPO's empty window trains nothing
        seeds = [S.sample_seed(cfg.seed, step, i) for i in mine]
        train_metrics = run.algorithm.update(traj, advantages, step=step, sample_seeds=seeds)
    t3 = time.perf_counter()
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
        "images_per_s": len(indices) / max(t3 - t0, 1e-9),
    }


# -- eval ------------------------------------------------------------------------------------


def evaluate(run: Run) -> tuple[dict[str, float], torch.Tensor]:
    """ODE samples of the fixed eval prompts with fixed noise -> (``eval/...`` metrics, the
    images of ``run.grid_index`` [n, C, H, W] on rank 0, empty elsewhere)."""
    ev = run.eval_set
    idx, real = S.padded_shard(len(ev), run.engine.dp_rank, run.engine.dp_size)
    prompts, metadata = ev.select(idx)
    with run.ema():
        images = rollout(run, prompts, idx, S.EVAL_SALT, eval=True).images[:real]
    where = [ev.locations[i] for i in idx[:real]]
    local = None
    if run.engine.sp_rank == 0:  # an SP group scores once
        with reward_failures(run.reward, images, prompts[:real], metadata[:real], where, -1):
            local = run.reward(images, prompts[:real], metadata[:real])
    rewards = gather_rewards(run, local)
    total = sum((run.reward.weight_of(k) or 0.0) * v for k, v in rewards.items())
    out = {"eval/reward_mean": float(total.mean())}
    out.update({f"eval/{k}_mean": float(v.mean()) for k, v in rewards.items()})
    keep = [i for i, g in enumerate(idx[:real]) if g in run.grid_index]
    shown = gather_group_firsts(run, (images[keep] * 255).round().to(torch.uint8))
    if run.eval_reward is not None:  # set-level scores (e.g. diversity): every image at once
        every = torch.cat(gather_group_firsts(run, images))
        with reward_failures(run.eval_reward, every, ev.prompts, ev.metadata, ev.locations, -1):
            scores = run.eval_reward(every, ev.prompts, ev.metadata)
        out.update(
            {f"eval/{name.rpartition('/')[2]}": float(v.mean()) for name, v in scores.items()}
        )
    grid = torch.cat(shown).float() / 255 if run.dist.is_main else torch.empty(0)
    return out, grid


# -- the loop ----------------------------------------------------------------------------------


def run_training(cfg: Any) -> dict[str, Any]:
    """Train per ``cfg``; returns {"base": eval metrics, "final": eval metrics, "steps",
    "samples", "wall_s", "output_dir", paths of the figures}."""
    wall0 = time.perf_counter()
    dist = D.init_distributed()
    D.seed_everything(cfg.seed, dist.rank)
    tr = cfg.trainer
    if dist.world_size % cfg.fsdp.sp_degree == 0:  # a clear error before the folder or model
        S.shard(S.global_batch_size(cfg), 0, dist.world_size // cfg.fsdp.sp_degree)
    out = S.prepare_output_dir(cfg, dist, fresh=tr.resume in (None, ""))
    run = Run(cfg, dist)
    ckpt_root = out / "checkpoints"
    from flowgrpo.engine.checkpoint import load_checkpoint, run_id_of, save_checkpoint

    state: dict[str, Any] = {"step": 0, "samples": 0, "base_eval": None}
    resume_from = S.resolve_resume(tr.resume, ckpt_root)
    if resume_from is not None:
        _, extra = load_checkpoint(run.engine, resume_from)
        state.update(extra or {})
        state.setdefault("run_id", run_id_of(resume_from))  # checkpoints from before run ids
        run.sampler.load_state_dict(state["sampler"])  # the same draw, or a clear error
    else:
        state["run_id"] = S.new_run_id()
    global_batch = S.global_batch_size(cfg)
    logger = RunLogger(
        out,
        enabled=dist.is_main,
        total_steps=tr.max_steps,
        start_step=state["step"],
        tensorboard=cfg.run.tensorboard,
        wandb=cfg.run.wandb_mode if cfg.run.wandb else None,
        wandb_project=cfg.run.wandb_project,
        run_name=cfg.run.name,
        config=S.config_dict(cfg),
        progress=cfg.run.progress_bar,
        log_every=tr.log_every,
    )
    if resume_from is not None:
        logger.write(f"resumed from {resume_from} at step {state['step']}")
    if state["base_eval"] is None:  # step 0: the base model
        state["base_eval"], grid = evaluate(run)
        logger.log_eval({"step": 0, "samples": 0, **state["base_eval"]})
        if dist.is_main:
            save_grid(grid, out / "grid_before.png", nrow=run.grid_cols)
            logger.log_images("eval/images", grid, 0, nrow=run.grid_cols)
    final_eval, grid = None, None
    while state["step"] < tr.max_steps:
        step = state["step"] + 1
        metrics = train_one_step(run, step)
        state.update(step=step, samples=state["samples"] + global_batch)
        state["sampler"] = run.sampler.state_dict()
        row = {"step": step, "samples": state["samples"], **metrics}
        if _due(step, tr.eval_every, tr.max_steps):
            final_eval, grid = evaluate(run)
            row.update(final_eval)
            logger.log_eval({"step": step, "samples": state["samples"], **final_eval})
            logger.log_images("eval/images", grid, step, nrow=run.grid_cols)
        logger.log_step(row)
        if _due(step, tr.save_every, tr.max_steps):
            save_checkpoint(
                run.engine,
                ckpt_root,
                step,
                extra=dict(state),
                keep_last=tr.keep_last,
                run_id=state["run_id"],
            )
    if final_eval is None:  # resumed at the end already: evaluate the final weights again
        final_eval, grid = evaluate(run)
    summary: dict[str, Any] = {
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
    logger.close()
    D.barrier()
    return summary


def _due(step: int, every: int, last: int) -> bool:
    """Eval / save at every ``every``-th step and at the last step (``every`` 0: the last
    step only)."""
    return step == last or (every > 0 and step % every == 0)


# -- sample / eval / export from a checkpoint --------------------------------------------------


def _restored(cfg: Any, checkpoint: str | Path | None) -> Run:
    run = Run(cfg, D.init_distributed())
    if checkpoint is not None:
        from flowgrpo.engine.checkpoint import load_checkpoint

        load_checkpoint(run.engine, S.resolve_checkpoint(checkpoint))
    return run


def run_sample(
    cfg: Any, checkpoint: str | Path | None, prompts: list[str], out_dir: str | Path
) -> list[Path]:
    """ODE samples (eval steps/guidance) of ``prompts`` from the base model or a checkpoint,
    one PNG each in ``out_dir``; sample i's noise comes from (seed, i)."""
    if not prompts:
        raise ValueError("run_sample needs at least one prompt")
    run = _restored(cfg, checkpoint)
    with run.ema():
        images = rollout(run, list(prompts), list(range(len(prompts))), S.SAMPLE_SALT, eval=True)
    return save_images(images.images, out_dir) if run.dist.is_main else []


def run_eval(cfg: Any, checkpoint: str | Path | None) -> dict[str, float]:
    """Eval metrics (``eval/...``) of the base model or a checkpoint on the eval prompts."""
    return evaluate(_restored(cfg, checkpoint))[0]


def run_export_lora(
    cfg: Any, checkpoint: str | Path, out_file: str | Path, *, full: bool = False
) -> Path:
    """Write the checkpoint's LoRA as a diffusers-loadable safetensors file, or with ``full``
    the whole transformer (LoRA merged) as a diffusers ``save_pretrained`` directory."""
    if not full and not cfg.lora.enabled:
        raise ValueError(
            "this run is a full fine-tune (lora.enabled=false): there is no LoRA to export; "
            "add --full to write the whole transformer with save_pretrained"
        )
    engine = _restored(cfg, checkpoint).engine
    return Path(engine.save_full(out_file) if full else engine.export_lora(out_file))
