"""Online Diffusion-DPO against a transcription of its authors' code (yifan123/flow_grpo @
ac4c86e8cae021841f1fde853d340e0db67690dd: ``scripts/train_sd3_dpo.py`` lines 884-937 for the
loss and the noise-level draw, ``flow_grpo/stat_tracking.py`` lines 42-56 for the pairs), and one
update on the toy checked against the DPO gradient at the reference computed by hand."""

from __future__ import annotations

import algo_ranks as ar
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flowgrpo.algorithms.dpo import (
    diffusion_dpo_loss,
    dpo_pairs,
    logit_normal_sigmas,
    scheduler_sigmas,
)

# -- transcriptions of the authors' code (kept as written there) --------------------------------


def authors_loss(model_pred, model_pred_ref, target, beta):
    """train_sd3_dpo.py:924-938: the batch is [winners; losers] along dim 0."""
    bsz = model_pred.shape[0] // 2
    theta_mse = (
        ((model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
    )
    ref_mse = (
        ((model_pred_ref.float() - target.float()) ** 2).reshape(target.shape[0], -1).mean(dim=1)
    )
    model_w_err = theta_mse[:bsz]
    model_l_err = theta_mse[bsz:]
    ref_w_err = ref_mse[:bsz]
    ref_l_err = ref_mse[bsz:]
    w_diff = model_w_err - ref_w_err
    l_diff = model_l_err - ref_l_err
    w_l_diff = w_diff - l_diff
    inside_term = -0.5 * beta * w_l_diff
    loss = -F.logsigmoid(inside_term)
    loss = torch.mean(loss)
    implicit_acc = (inside_term > 0).sum().float() / inside_term.size(0)
    return loss, implicit_acc


def authors_dpo_advantages(prompts, rewards):
    """stat_tracking.py:11-58 with type='dpo' (per prompt: argmax -> 1, argmin -> -1)."""
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    unique = np.unique(prompts)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in unique:
        prompt_rewards = rewards[prompts == prompt]
        prompt_advantages = torch.tensor(prompt_rewards)
        max_idx = torch.argmax(prompt_advantages)
        min_idx = torch.argmin(prompt_advantages)
        if max_idx == min_idx:
            min_idx = 0
            max_idx = 1
        result = torch.zeros_like(prompt_advantages).float()
        result[max_idx] = 1.0
        result[min_idx] = -1.0
        advantages[prompts == prompt] = result.numpy()
    return advantages


# -- the math ------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [100.0, 2.5])
def test_loss_and_gradient_equal_the_authors(beta):
    g = torch.Generator().manual_seed(0)
    shape = (3, 4, 2, 2)  # 3 pairs of [4, 2, 2] latents
    pred = torch.randn((6, *shape[1:]), generator=g, dtype=torch.float64)
    ref = pred + 0.05 * torch.randn(pred.shape, generator=g, dtype=torch.float64)
    target = torch.randn(pred.shape, generator=g, dtype=torch.float64)
    mine_pred = pred.clone().requires_grad_(True)
    theirs_pred = pred.clone().requires_grad_(True)
    loss, m = diffusion_dpo_loss(
        mine_pred[:3], mine_pred[3:], ref[:3], ref[3:], target[:3], target[3:], beta=beta
    )
    expected, acc = authors_loss(theirs_pred, ref, target, beta)
    loss.backward()
    expected.backward()
    assert loss.dtype == torch.float32  # MSE in fp32, as theirs
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=1e-6)
    assert float(m["implicit_acc"]) == float(acc)
    torch.testing.assert_close(mine_pred.grad, theirs_pred.grad, rtol=1e-5, atol=1e-9)
    assert float(theirs_pred.grad.abs().max()) > 1e-3


def test_loss_by_hand_for_one_pair():
    """err_w: theta 1, ref 0.5; err_l: theta 0.25, ref 1 -> inside = -0.5 b (0.5 - (-0.75))."""
    one = torch.ones(1, 4)
    v_w, ref_w = one * 1.0, one * (0.5**0.5)
    v_l, ref_l = one * 0.5, one * 1.0
    zero = torch.zeros(1, 4)
    loss, m = diffusion_dpo_loss(v_w, v_l, ref_w, ref_l, zero, zero, beta=2.0)
    inside = -0.5 * 2.0 * (0.5 - (-0.75))
    assert float(loss) == pytest.approx(float(-F.logsigmoid(torch.tensor(inside))), rel=1e-6)
    assert float(m["implicit_acc"]) == 0.0


def test_loss_rejects_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="beta"):
        diffusion_dpo_loss(x, x, x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="share one shape"):
        diffusion_dpo_loss(x, x[:1], x, x, x, x, beta=1.0)


def test_pairs_equal_the_authors_rule_with_ties_and_constant_groups():
    prompts = ["a", "b", "a", "c", "b", "a", "c", "b", "c"]
    rewards = [0.3, 1.0, 0.9, 0.5, 1.0, 0.3, 0.5, 0.2, 0.5]  # c: all equal; ties in a and b
    expected = authors_dpo_advantages(prompts, rewards)
    got = dpo_pairs(torch.tensor(rewards), prompts)
    assert got.tolist() == expected.tolist()
    assert got.tolist() == [-1, 1, 1, -1, 0, 0, 1, -1, 0]  # c: 1st loses, 2nd wins
    assert dpo_pairs(torch.tensor([0.1, 0.7]), [0, 1]).tolist() == [0, 0]  # groups of one


def test_noise_levels_equal_the_authors_draw():
    """diffusers' logit-normal density draw indexes a fresh shift-3 scheduler's sigmas
    (train_sd3_dpo.py:890-902); the same normal draws give the same sigmas here."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    torch.testing.assert_close(scheduler_sigmas(3.0), scheduler.sigmas.float(), rtol=0, atol=0)
    torch.manual_seed(7)
    u = compute_density_for_timestep_sampling(
        weighting_scheme="logit_normal", batch_size=256, logit_mean=0, logit_std=1, mode_scale=1.29
    )
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices]
    step_indices = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    theirs = scheduler.sigmas[step_indices].float()
    torch.manual_seed(7)
    z = torch.normal(0.0, 1.0, size=(256,))
    torch.testing.assert_close(logit_normal_sigmas(z, shift=3.0), theirs, rtol=0, atol=0)
    assert 0.3 < float(theirs.median()) < 0.9  # shift 3 pushes the logit-normal's 0.5 up


# -- one update on the toy ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dist1():
    from flowgrpo.engine import init_distributed

    return init_distributed()


def _setup(mode: str, **over):
    from flowgrpo.engine import init_distributed
    from flowgrpo.models import build_adapter
    from flowgrpo.trainer.setup import build_engine

    cfg = ar.config("dpo", "toy", mode, **over)
    adapter = build_adapter(ar.pipeline("toy"))
    engine, algo = build_engine(cfg, adapter, init_distributed())
    return cfg, adapter, engine, algo


def _rollout(cfg, adapter, algo, step: int = 1):
    from flowgrpo.rollout import sample_trajectories
    from flowgrpo.trainer.seeds import sample_seed

    seeds = [sample_seed(cfg.seed, step, i) for i in range(len(ar.DPO_PROMPTS))]
    plan = algo.rollout_plan(step)
    with torch.no_grad(), algo.rollout_weights():
        traj = sample_trajectories(
            adapter, list(ar.DPO_PROMPTS), height=cfg.model.height, width=cfg.model.width,
            generator=[torch.Generator().manual_seed(s) for s in seeds], decode=False,
            **plan.sampler_kwargs(),
        )  # fmt: skip
    return traj, seeds


def _trainable(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_update_gradient_is_the_dpo_gradient_at_the_reference(dist1, mode):
    """At theta = reference the loss is log 2 and its gradient is 0.25 b mean over pairs and
    terms of grad(err_w - err_l), with one noise and one noise level per pair and term (both
    drawn from the pair's seed), CFG-free; the captured gradient equals that computed by hand.
    Afterwards the weights moved, and rollout_weights() still samples the reference."""
    beta = 3.0
    cfg, adapter, engine, algo = _setup(mode, **{"dpo.beta": beta})
    traj, seeds = _rollout(cfg, adapter, algo)
    initial = _trainable(engine)
    captured, step_fn = {}, engine.optimizer_step

    def capture(*a, **k):
        captured.update({n: p.grad.detach().clone() for n, p in engine.model.named_parameters()
                         if p.requires_grad})  # fmt: skip
        return step_fn(*a, **k)

    engine.optimizer_step = capture
    metrics = algo.update(traj, ar.DPO_TAGS, step=1, sample_seeds=seeds)
    engine.optimizer_step = step_fn
    terms = int(cfg.sample.num_steps * cfg.dpo.timestep_fraction)
    assert terms == 3 and metrics["pairs_trained"] == 2.0 and metrics["optimizer_steps"] == 1.0
    assert metrics["loss"] == pytest.approx(float(np.log(2.0)), rel=1e-6)
    assert metrics["implicit_acc"] == 0.0
    moved = _trainable(engine)
    assert max(float((moved[n] - initial[n]).abs().max()) for n in initial) > 1e-4

    # by hand at the initial weights: winners are rows 0 (p1) and 3 (p2), losers 2 and 1
    params = dict(engine.model.named_parameters())
    with torch.no_grad():
        for n, value in initial.items():
            params[n].copy_(value)
    engine.model.zero_grad(set_to_none=True)
    win, lose = traj.select([0, 3]), traj.select([2, 1])
    pair_seeds = torch.tensor([seeds[0], seeds[3]])
    total = 0.0
    for k in range(terms):
        eps, sigma = algo.draws(pair_seeds, k, win.final_latents)
        t = sigma.view(-1, 1, 1, 1)
        errs = []
        for sub in (win, lose):
            x0 = sub.final_latents
            v = adapter.velocity(engine.model, (1 - t) * x0 + t * eps, sigma, sub.prompt_embeds,
                                 None, guidance_scale=1.0, height=8, width=8)  # fmt: skip
            errs.append(((v - (eps - x0)) ** 2).flatten(1).mean(1))
        total = total + 0.25 * beta * (errs[0] - errs[1]).mean() / terms
    total.backward()
    for n, g in captured.items():
        torch.testing.assert_close(g, params[n].grad, rtol=1e-4, atol=1e-8)
    assert max(float(g.abs().max()) for g in captured.values()) > 1e-4

    with torch.no_grad():  # the trained weights back: rollouts still come from the reference
        for n, value in moved.items():
            params[n].copy_(value)
    again, _ = _rollout(cfg, adapter, algo)
    torch.testing.assert_close(again.final_latents, traj.final_latents, rtol=0, atol=0)


def test_policy_rollouts_sample_the_current_weights(dist1):
    cfg, adapter, engine, algo = _setup("full", **{"dpo.rollout_policy": "policy"})
    traj, seeds = _rollout(cfg, adapter, algo)
    algo.update(traj, ar.DPO_TAGS, step=1, sample_seeds=seeds)
    again, _ = _rollout(cfg, adapter, algo)
    assert float((again.final_latents - traj.final_latents).abs().max()) > 1e-4


def test_update_refuses_real_valued_advantages(dist1):
    cfg, adapter, engine, algo = _setup("full")
    traj, seeds = _rollout(cfg, adapter, algo)
    with pytest.raises(ValueError, match="pair tags"):
        algo.update(traj, ar.ADVANTAGES, step=1, sample_seeds=seeds)


def test_config_refuses_groups_of_one():
    from flowgrpo.settings import ConfigError

    with pytest.raises(ConfigError, match="sample.group_size"):
        ar.config("dpo", "toy", "full", **{"sample.group_size": 1}).check()
