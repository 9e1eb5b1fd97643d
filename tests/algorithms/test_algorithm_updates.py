"""The algorithms after an update, checked against independent computations: the second
optimizer step of a rollout sees a ratio != 1 and clipping (Flow-GRPO, GRPO-Guard), Flash's grid,
DPM tail and x0 hand-off, DiffusionNFT's old policy after ``update()``, MixGRPO's fixed-shift grid
and Flash on the grids the adapters produce, and same-latent groups in the trainer's rollout."""

from __future__ import annotations

import math

import algo_ranks as ar
import pytest
import torch

from flowgrpo.testing.families import kinds, params

PROMPTS = ar.PROMPTS


@pytest.fixture(scope="module")
def dist1():
    from flowgrpo.engine import init_distributed

    return init_distributed()


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: _local(p).detach().clone() for n, p in engine.model.named_parameters()
            if p.requires_grad}  # fmt: skip


def _load_params(engine, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in engine.model.named_parameters():
            if n in values:
                _local(p).copy_(values[n])


def _setup(algorithm: str, kind: str = "toy", mode: str = "full", **over):
    from flowgrpo.models import build_adapter
    from flowgrpo.trainer.setup import build_engine

    cfg = ar.config(algorithm, kind, mode, **over)
    from flowgrpo.engine import init_distributed

    adapter = build_adapter(ar.pipeline(kind), **ar.frames_option(kind))
    engine, algo = build_engine(cfg, adapter, init_distributed())
    return cfg, adapter, engine, algo


def _rollout(cfg, adapter, algo, step: int = 1, prompts=PROMPTS):
    from flowgrpo.rollout import sample_trajectories
    from flowgrpo.trainer.seeds import sample_seed

    plan = algo.rollout_plan(step)
    gens = [
        torch.Generator().manual_seed(sample_seed(cfg.seed, step, i)) for i in range(len(prompts))
    ]
    with torch.no_grad(), algo.rollout_weights():
        traj = sample_trajectories(
            adapter,
            list(prompts),
            height=cfg.model.height,
            width=cfg.model.width,
            generator=gens,
            decode=False,
            **plan.sampler_kwargs(),
        )
    seeds = [sample_seed(cfg.seed, step, i) for i in range(len(prompts))]
    return plan, traj, seeds


def _velocity(adapter, engine, traj, x, sigma):
    return adapter.velocity(
        engine.model,
        x,
        sigma,
        traj.prompt_embeds,
        traj.negative_embeds,
        guidance_scale=traj.guidance_scale,
        height=traj.height,
        width=traj.width,
    )


# -- several optimizer steps per rollout -------------------------------------------------------


@pytest.mark.parametrize("algorithm, clip", [("flow_grpo", 1e-4), ("grpo_guard", 2e-6)])
def test_second_optimizer_step_sees_its_ratio_and_clips(dist1, algorithm, clip):
    """2 optimizer steps per rollout: the first at the rollout's weights (ratio 1, nothing
    clipped), the second after an update. Its ratio mean and clip fraction equal an independent
    recomputation at the weights after step 1: Flow-GRPO's exp(log p - log p_old); GRPO-Guard's
    exp((log p - log p_old + mean_d(delta^2)/(2 s^2)) s) with s = std_t sqrt(-dt), per sample."""
    from flowgrpo.functional.sde import sde_step_with_logprob

    over = {f"{algorithm}.clip_range": clip, f"{algorithm}.kl_beta": 0.0,
            "update.num_minibatches": 2, "update.micro_batch_size": 2}  # fmt: skip
    cfg, adapter, engine, algo = _setup(algorithm, **over)
    _, traj, seeds = _rollout(cfg, adapter, algo)
    rows_seen, plans, after_first = [], [], {}
    summarize, plan_fn, step_fn = algo.summarize, engine.plan, engine.optimizer_step

    def capture_rows(rows, keys):
        rows_seen.extend(rows)
        return summarize(rows, keys)

    def capture_plan(*a, **k):
        plans.append(plan_fn(*a, **k))
        return plans[-1]

    def capture_step(*a, **k):
        out = step_fn(*a, **k)
        if not after_first:
            after_first.update(_params(engine))
        return out

    algo.summarize, engine.plan, engine.optimizer_step = capture_rows, capture_plan, capture_step
    algo.update(traj, ar.ADVANTAGES, step=1, sample_seeds=seeds)
    assert len(rows_seen) == 2 and rows_seen[1]["skipped"] == 0.0
    first, second = rows_seen
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and first["clipfrac"] == 0.0

    _load_params(engine, after_first)  # the weights the second optimizer step saw
    rows = torch.cat([m.rows for m in plans[0][1].micro])
    sub = traj.select(rows)
    ratios = []
    with torch.no_grad():
        for k in range(traj.num_train_steps):
            v = _velocity(adapter, engine, sub, sub.latents[:, k], sub.sigmas[:, k])
            out = sde_step_with_logprob(
                v, sub.latents[:, k], sub.sigmas[:, k], sub.sigmas_next[:, k],
                noise_level=sub.noise_level, sigma_max=sub.sigma_max,
                prev_sample=sub.latents[:, k + 1],
            )  # fmt: skip
            log_ratio = (out.log_prob - sub.log_probs[:, k]).double()
            if algorithm == "grpo_guard":
                s = (
                    out.std_dev_t.double()
                    * (sub.sigmas[:, k] - sub.sigmas_next[:, k]).double().sqrt()
                )
                delta2 = ((out.prev_sample_mean - sub.means[:, k]).double() ** 2).flatten(1).mean(1)
                log_ratio = (log_ratio + delta2 / (2 * s**2)) * s
            ratios.append(log_ratio.exp())
    r = torch.stack(ratios)
    assert (r - 1).abs().max() > 10 * clip  # the update moved the policy past the clip
    assert second["ratio_mean"] == pytest.approx(float(r.mean()), rel=1e-5, abs=1e-9)
    expected_clipfrac = float(((r - 1).abs() > clip).double().mean())
    assert expected_clipfrac > 0
    assert second["clipfrac"] == pytest.approx(expected_clipfrac, abs=1e-9)


# -- MixGRPO-Flash -----------------------------------------------------------------------------


def test_mix_grpo_flash_grid_dpm_tail_and_x0_hand_off(dist1):
    """Window [0, 4) of 10 steps, ratio 0.8: the rollout runs on flash_schedule's grid (the head
    of the adapter's grid, then 5 points to 0); the final latents equal the window's last latent
    carried through the tail by hand with DPM-Solver++ 2M, whose first step takes the last SDE
    step's x0 = x - sigma v as its history (without it the result differs)."""
    from flowgrpo.algorithms.mix_grpo import flash_schedule
    from flowgrpo.functional.dpm_solver import dpm_solver_2m_step

    over = {"mix_grpo.flash": True, "mix_grpo.window_size": 4, "mix_grpo.compress_ratio": 0.8,
            "sample.num_steps": 10, "mix_grpo.kl_beta": 0.0}  # fmt: skip
    cfg, adapter, engine, algo = _setup("mix_grpo", **over)
    plan, traj, _ = _rollout(cfg, adapter, algo)
    grid = flash_schedule(adapter.schedule(10, 8, 8).sigmas, 4, compress_ratio=0.8, shift=3.0)
    assert plan.ode_solver == "dpm2" and len(grid) == 4 + 5  # sigma_0..sigma_3, 5 tail points
    torch.testing.assert_close(plan.sigmas, grid.float(), rtol=0, atol=0)
    assert traj.step_indices.tolist() == [[0, 1, 2, 3]] * 4
    torch.testing.assert_close(traj.sigmas[0], grid[:4].float(), rtol=0, atol=0)

    sig = [float(s) for s in grid.float()]
    with torch.no_grad():
        ones = torch.ones(len(traj))
        x_last = traj.latents[:, 3]  # the input of the last SDE step, at sigma_3
        prev_x0 = x_last - sig[3] * _velocity(adapter, engine, traj, x_last, sig[3] * ones)

        def tail(history: bool) -> torch.Tensor:
            x, hist = traj.latents[:, 4], prev_x0 if history else None
            for i in range(4, len(sig) - 1):
                v = _velocity(adapter, engine, traj, x, sig[i] * ones)
                kw = {"prev_x0": hist, "sigma_prev": sig[i - 1]} if hist is not None else {}
                x, hist = dpm_solver_2m_step(v, x, sig[i], sig[i + 1], **kw)
            return x

        by_hand, no_history = tail(True), tail(False)
    torch.testing.assert_close(traj.final_latents, by_hand, rtol=0, atol=1e-5)
    assert (no_history - by_hand).abs().max() > 1e-3


def test_mix_grpo_flash_every_step_of_the_toy_run_samples_to_zero(dist1):
    """The toy's MixGRPO-Flash (window 4 moved every 10 steps, 40 steps) crashed at step 31:
    its window ends at 7 of 10, leaving a one-point tail. Every step's plan now builds, ends at
    sigma = 0, and the step-31 rollout samples."""
    from flowgrpo.config import load_config
    from flowgrpo.models import build_adapter
    from flowgrpo.trainer.setup import build_engine

    cfg = load_config(None, ["algorithm=mix_grpo", "mix_grpo.flash=true"], check_paths=False)
    adapter = build_adapter(ar.pipeline("toy"))
    engine, algo = build_engine(cfg, adapter, dist1)
    for step in range(1, cfg.trainer.max_steps + 1):
        plan = algo.rollout_plan(step)
        assert plan.sigmas[-1] == 0 and bool((plan.sigmas.diff() < 0).all())
    plan, traj, _ = _rollout(cfg, adapter, algo, step=31, prompts=PROMPTS[:2])
    assert plan.sigmas.tolist()[-2:] == [
        pytest.approx(float(adapter.schedule(10, 8, 8).sigmas[7])),
        0.0,
    ]
    assert traj.step_indices.tolist() == [[3, 4, 5, 6]] * 2
    assert bool(torch.isfinite(traj.final_latents).all())


@pytest.mark.parametrize("kind", params(kinds()))
def test_flash_schedule_on_the_grids_the_adapters_produce(kind):
    """On each adapter's own grid (FLUX and Qwen-Image: a resolution-dependent shift, not the
    authors' 3) and on the fixed-shift grid: the head is the grid itself, the tail starts at
    sigma_{L+1} exactly, falls strictly to 0, and has n = max(int((N - L) 0.4), 2) points that
    lie on the shift-3 curve through sigma_{L+1}."""
    from flowgrpo.algorithms.mix_grpo import flash_schedule
    from flowgrpo.functional.time_shift import time_shift_grid
    from flowgrpo.models import build_adapter

    adapter = build_adapter(ar.pipeline(kind), **ar.frames_option(kind))
    h, w = ar.SIZES[kind]
    for n in (10, 25):
        for grid in (adapter.schedule(n, h, w).sigmas.double(), time_shift_grid(n, 3.0)):
            for end in range(1, n - 1):
                out = flash_schedule(grid, end, compress_ratio=0.4, shift=3.0)
                points = max(int((n - end + 1) * 0.4), 2)  # L = end - 1
                assert len(out) == end + points
                torch.testing.assert_close(out[:end], grid[:end], rtol=0, atol=0)
                assert float(out[end]) == float(grid[end])  # the tail starts at sigma_{L+1}
                assert bool((out.diff() < 0).all()) and float(out[-1]) == 0.0
                t = out[end:] / (3.0 - 2.0 * out[end:])  # unshift: evenly spaced
                torch.testing.assert_close(
                    t.diff(), t.diff()[:1].expand(points - 1), atol=1e-12, rtol=0
                )


def test_time_shift_puts_training_rollouts_on_the_fixed_grid(dist1):
    """sample.time_shift=3: the rollout's sigmas are 3t / (1 + 2t) at t = linspace(1, 0, N + 1)
    (the MixGRPO authors' sd3_time_shift), not the pipeline's; Flash compresses that grid."""
    t = torch.linspace(1, 0, 11, dtype=torch.float64)
    expected = (3 * t / (1 + 2 * t)).float()
    cfg, adapter, engine, algo = _setup("flow_grpo", kind="flux", **{"sample.num_steps": 10,
                                                                  "sample.time_shift": 3.0})  # fmt: skip
    plan, traj, _ = _rollout(cfg, adapter, algo, prompts=PROMPTS[:2])
    assert (plan.sigmas - adapter.schedule(10, 16, 16).sigmas).abs().max() > 1e-2
    torch.testing.assert_close(plan.sigmas, expected, rtol=0, atol=0)
    torch.testing.assert_close(traj.sigmas[0], expected[:9], rtol=0, atol=0)
    over = {"sample.num_steps": 10, "sample.time_shift": 3.0, "mix_grpo.flash": True}
    cfg, adapter, engine, algo = _setup("mix_grpo", kind="flux", **over)
    plan = algo.rollout_plan(1)
    torch.testing.assert_close(plan.sigmas[:3], expected[:3], rtol=0, atol=0)


# -- DiffusionNFT's old policy -----------------------------------------------------------------


def test_nft_old_policy_after_update_is_the_decayed_blend_and_samples_the_next_rollout(dist1):
    """After update(): old = d old + (1 - d) theta (d from the authors' schedule at the number of
    optimizer steps taken); the next rollout samples with exactly those weights, and v_old in the
    loss is theirs (old_deviate = mean (v_theta - v_old)^2 recomputed by hand)."""
    from flowgrpo.algorithms.nft import old_policy_decay

    over = {"nft.kl_beta": 0.0, "nft.old_policy_schedule": 1, "update.num_minibatches": 2}
    cfg, adapter, engine, algo = _setup("nft", **over)
    engine.optimizer_steps = 600  # decay min(0.001 s, 0.5): 0.5 from here, a real blend
    before = _params(engine)
    _, traj, seeds = _rollout(cfg, adapter, algo)
    metrics = algo.update(traj, ar.ADVANTAGES, step=1, sample_seeds=seeds)
    theta = _params(engine)
    d = old_policy_decay(602, 1)
    assert metrics["old_policy_decay"] == d == 0.5
    expected_old = {n: d * before[n] + (1 - d) * theta[n] for n in theta}
    assert max((theta[n] - before[n]).abs().max().item() for n in theta) > 1e-4
    with algo.rollout_weights():
        inside = _params(engine)
    for n in theta:
        torch.testing.assert_close(inside[n], expected_old[n], rtol=0, atol=1e-7)
        torch.testing.assert_close(_params(engine)[n], theta[n], rtol=0, atol=0)

    # the next rollout: under rollout_weights() == with the expected old weights loaded by hand
    _, nxt, seeds = _rollout(cfg, adapter, algo, step=2)
    from flowgrpo.rollout import sample_trajectories
    from flowgrpo.trainer.seeds import sample_seed

    plan = algo.rollout_plan(2)

    def by_hand(weights):
        _load_params(engine, weights)
        gens = [torch.Generator().manual_seed(sample_seed(cfg.seed, 2, i)) for i in range(4)]
        with torch.no_grad():
            return sample_trajectories(adapter, list(PROMPTS), height=8, width=8, generator=gens,
                                       decode=False, **plan.sampler_kwargs()).final_latents  # fmt: skip

    # (the blend by hand and the engine's lerp differ by float rounding, ~1e-7 in the weights)
    torch.testing.assert_close(nxt.final_latents, by_hand(expected_old), rtol=0, atol=1e-5)
    assert (nxt.final_latents - by_hand(theta)).abs().max() > 1e-3  # not the current weights
    _load_params(engine, expected_old)

    # v_old in the loss: old_deviate against velocities at theta and at the expected old weights
    sub = nxt.select([0, 1])
    level = torch.zeros(2, dtype=torch.long)
    sd = torch.as_tensor(seeds[:2])
    x0, sigma = sub.final_latents, sub.sigmas[:, 0]
    from flowgrpo.algorithms.nft import forward_noising

    x_t = forward_noising(x0, algo.noise(sd, 0, x0), sigma)
    with torch.no_grad():
        v_old = _velocity(adapter, engine, sub, x_t, sigma)
        _load_params(engine, theta)
        v = _velocity(adapter, engine, sub, x_t, sigma)
        terms = algo.step_loss(sub, torch.full((2,), 0.5), sd, level, 0)
    assert float((v - v_old).abs().max()) > 1e-5
    assert float(terms[3]) == pytest.approx(float(((v - v_old) ** 2).mean()), rel=1e-5)


# -- same-latent groups in the trainer's rollout -----------------------------------------------


def test_same_latent_groups_share_their_initial_noise_in_any_split(dist1, tmp_path):
    """sample.same_latent: the trainer's rollout starts every sample of a group from the group's
    noise (its SDE noise stays per sample); a different chunking (another rank split) gives the
    same samples; without it each sample has its own start."""
    from flowgrpo.config import load_config
    from flowgrpo.trainer.loop import Run, rollout

    def run_for(same: bool, chunk: int) -> Run:
        over = ["trainer.max_steps=1", f"sample.same_latent={str(same).lower()}",
                f"sample.rollout_batch_size={chunk}", f"run.output_dir={tmp_path}/r"]  # fmt: skip
        return Run(load_config(None, over, check_paths=False), dist1)

    prompts = ["a handwritten 1"] * 3 + ["a handwritten 2"] * 3
    groups, idx = [0, 0, 0, 1, 1, 1], list(range(6))
    run = run_for(True, 6)
    plan = run.rollout_plan(1)  # the same for each run: chunking and same_latent are not in it
    with torch.no_grad():
        whole = rollout(run, prompts, idx, 1, plan, groups=groups)
        split = rollout(run_for(True, 2), prompts[3:], idx[3:], 1, plan, groups=groups[3:])
        own = rollout(run_for(False, 6), prompts, idx, 1, plan, groups=groups)
    start = whole.latents[:, 0]
    assert torch.equal(start[0], start[1]) and torch.equal(start[0], start[2])
    assert torch.equal(start[3], start[5]) and not torch.equal(start[0], start[3])
    assert not torch.equal(whole.final_latents[0], whole.final_latents[1])  # SDE noise differs
    torch.testing.assert_close(split.final_latents, whole.final_latents[3:], rtol=0, atol=1e-6)
    assert not torch.equal(own.latents[0, 0], own.latents[1, 0])
    assert math.isfinite(float(whole.final_latents.sum()))
