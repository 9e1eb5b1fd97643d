"""Advantage Weighted Matching: our loss against an independent plain-torch transcription of
the authors' lines (scxue/advantage_weighted_matching @ be51372, scripts/train_sd3_awm.py),
batched the authors' way ([T x B] rows, one forward for all trained levels); their stratified
level draw; the EMA-KL decay; bf16; and a resumed toy run equal to a straight one."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.algorithms.awm import (
    awm_log_prob,
    awm_loss,
    awm_timestep_indices,
    ema_kl_decay,
)

# -- the authors' lines, transcribed (not imported: the reference must not share our code) ----


def authors_compute_log_prob(noise_pred, timestep, clean_latents, random_noise, cfg):
    """train_sd3_awm.py:236-252 (`compute_log_prob_awm`, after the transformer call)."""
    sigma = timestep
    std_dev_t = torch.sqrt(sigma / (1 - torch.clamp(sigma, 0, 0.99))) * 0.7
    model_output = noise_pred.double()
    log_prob = -((model_output - (random_noise.double() - clean_latents.double())) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    w = cfg.weighting
    if w == "t":
        log_prob = log_prob * timestep.view(-1)
    elif w == "t**2":
        log_prob = log_prob * timestep.view(-1) ** 2
    elif w == "Uniform":
        log_prob = log_prob
    elif w == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * timestep.view(-1)
    elif w == "ghuber":
        p = cfg.ghuber_power
        log_prob = (
            -(
                torch.pow(-log_prob + 1e-10, p)
                - torch.pow(torch.tensor(1e-10, device=log_prob.device, dtype=log_prob.dtype), p)
            )
            * timestep.view(-1)
            / p
        )
    return log_prob, model_output, std_dev_t


def authors_loss(out, out_ref, out_ema, timesteps, clean, noise, adv, cfg, old_log_probs=None):
    """train_sd3_awm.py:1271-1352 for one micro-batch: rows are [T x B] (level-major)."""
    T, B = cfg.train_timesteps, cfg.batch_size
    log_prob, model_output, std_dev_t = authors_compute_log_prob(out, timesteps, clean, noise, cfg)
    _, model_output_ref, _ = authors_compute_log_prob(out_ref, timesteps, clean, noise, cfg)
    _, model_output_ema, _ = authors_compute_log_prob(out_ema, timesteps, clean, noise, cfg)
    sample = {}
    if old_log_probs is None:  # on-policy: i < gradient_accumulation_steps (:1282-1284)
        sample["old_log_probs"] = log_prob.reshape(T, B).detach()
    else:
        sample["old_log_probs"] = old_log_probs.reshape(T, B)
    sample["log_probs"] = log_prob.reshape(T, B)
    sample["model_output"] = model_output.reshape(T, B, *model_output.shape[1:])
    sample["model_output_ref"] = model_output_ref.reshape(T, B, *model_output_ref.shape[1:])
    sample["model_output_ema"] = model_output_ema.reshape(T, B, *model_output_ema.shape[1:])
    sample["std_dev_t"] = std_dev_t.reshape(T, B, *std_dev_t.shape[1:])
    advantages = torch.clamp(adv, -cfg.adv_clip_max, cfg.adv_clip_max)
    advantages = advantages / cfg.adv_clip_max * cfg.advantage_max
    log_probs = sample["log_probs"].view(-1)  # exp_first
    old = sample["old_log_probs"].view(-1)
    ratio = torch.exp(log_probs - old.detach())
    advantages = advantages.unsqueeze(0).repeat(T, 1).view(-1)
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - cfg.clip_range, 1.0 + cfg.clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    if cfg.beta > 0:
        mo, ref, std = sample["model_output"], sample["model_output_ref"], sample["std_dev_t"]
        if cfg.kl_weight == "ELBO":
            kl_loss = ((mo - ref) ** 2).mean(dim=(2, 3, 4), keepdim=True) / (2 * std**2)
        else:
            kl_loss = ((mo - ref) ** 2).mean(dim=(2, 3, 4), keepdim=True)
        kl_loss = kl_loss.mean(dim=0).mean()
        if cfg.ema_beta > 0:
            ema = sample["model_output_ema"]
            if cfg.kl_ema_weight == "ELBO":
                ema_kl_loss = ((mo - ema) ** 2).mean(dim=(2, 3, 4), keepdim=True) / (2 * std**2)
            else:
                ema_kl_loss = ((mo - ema) ** 2).mean(dim=(2, 3, 4), keepdim=True)
            ema_kl_loss = ema_kl_loss.mean(dim=0).mean()
            return policy_loss + cfg.beta * kl_loss + cfg.ema_beta * ema_kl_loss
        return policy_loss + cfg.beta * kl_loss
    return policy_loss


def authors_indices(num_steps, fraction, T, rand_u, time_type):
    """train_sd3_awm.py:1172-1205 (`discrete` / `discrete_wo_init`), given rand_u."""
    first = 1 if time_type == "discrete_wo_init" else 0
    boundaries = torch.linspace(first, int(num_steps * fraction), steps=T + 1)
    lower_bounds = boundaries[:-1].long()
    upper_bounds = boundaries[1:].long()
    return lower_bounds + (rand_u * (upper_bounds - lower_bounds)).long()


OURS = {"ghuber": "ghuber", "Uniform": "uniform", "t": "t", "t**2": "t2", "huber": "huber"}


def _case(seed, T=3, B=4, weighting="ghuber", beta=0.003, ema_beta=1.0, kl="Uniform", clip=1.0):
    g = torch.Generator().manual_seed(seed)
    shape = (T * B, 4, 6, 6)
    out = torch.randn(shape, generator=g)
    cfg = SimpleNamespace(
        train_timesteps=T,
        batch_size=B,
        weighting=weighting,
        ghuber_power=0.25,
        adv_clip_max=5.0,
        advantage_max=1.0,
        clip_range=clip,
        beta=beta,
        kl_weight=kl,
        ema_beta=ema_beta,
        kl_ema_weight=kl,
    )
    return dict(
        out=out,
        out_ref=out + 0.3 * torch.randn(shape, generator=g),
        out_ema=out + 0.1 * torch.randn(shape, generator=g),
        t=torch.rand(T, generator=g).repeat_interleave(B).view(-1, 1, 1, 1) * 0.9 + 0.05,
        clean=torch.randn(shape, generator=g),
        noise=torch.randn(shape, generator=g),
        adv=torch.randn(B, generator=g) * 4,  # some beyond +-5: the clamp bites
        cfg=cfg,
    )


def _ours(c, v, old=None):
    """Our loss, one call per trained level (as the update's terms), averaged over levels."""
    cfg, T, B = c["cfg"], c["cfg"].train_timesteps, c["cfg"].batch_size
    total = 0.0
    for k in range(T):
        rows = slice(k * B, (k + 1) * B)
        loss, _ = awm_loss(
            v[rows],
            c["clean"][rows],
            c["noise"][rows],
            c["t"][rows].reshape(-1),
            c["adv"],
            old_log_prob=None if old is None else old[rows],
            v_ref=c["out_ref"][rows],
            v_ema=c["out_ema"][rows],
            weighting=OURS[cfg.weighting],
            ghuber_power=cfg.ghuber_power,
            adv_clip_max=cfg.adv_clip_max,
            advantage_max=cfg.advantage_max,
            clip_range=cfg.clip_range,
            kl_beta=cfg.beta,
            kl_weight=cfg.kl_weight.lower(),
            ema_kl_beta=cfg.ema_beta,
            ema_kl_weight=cfg.kl_ema_weight.lower(),
        )
        total = total + loss / T
    return total


@pytest.mark.parametrize(
    "kw",
    [
        {},  # the authors' SD3.5-M defaults: ghuber 0.25, beta 0.003, ema_beta 1, Uniform
        {"weighting": "Uniform", "beta": 0.0},
        {"weighting": "t", "kl": "ELBO"},
        {"weighting": "t**2", "ema_beta": 0.0},
        {"weighting": "huber", "beta": 0.4},
    ],
)
def test_loss_and_gradient_equal_the_authors_lines_on_policy(kw):
    c = _case(0, **kw)
    v1 = c["out"].clone().requires_grad_(True)
    ref = authors_loss(v1, c["out_ref"], c["out_ema"], c["t"], c["clean"], c["noise"],
                       c["adv"], c["cfg"])  # fmt: skip
    ref.backward()
    v2 = c["out"].clone().requires_grad_(True)
    ours = _ours(c, v2)
    ours.backward()
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(v2.grad, v1.grad, rtol=1e-6, atol=1e-10)  # fp32 grads
    assert v1.grad.abs().max() > 1e-4  # the comparison can fail


@pytest.mark.parametrize("clip", [1.0, 0.05])
def test_off_policy_ratio_and_clip_equal_the_authors_lines(clip):
    """With an old log p (the authors' off-policy pass), the ratio and its clip bite alike."""
    c = _case(1, clip=clip)
    cfg = c["cfg"]
    old_v = c["out"] + 0.2 * torch.randn_like(c["out"])
    old = authors_compute_log_prob(old_v, c["t"], c["clean"], c["noise"], cfg)[0]
    v1 = c["out"].clone().requires_grad_(True)
    ref = authors_loss(v1, c["out_ref"], c["out_ema"], c["t"], c["clean"], c["noise"],
                       c["adv"], cfg, old_log_probs=old)  # fmt: skip
    ref.backward()
    v2 = c["out"].clone().requires_grad_(True)
    ours = _ours(c, v2, old=old)
    ours.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(v2.grad, v1.grad, rtol=1e-6, atol=1e-10)  # fp32 grads


def test_on_policy_gradient_is_minus_advantage_times_log_prob_gradient():
    """On-policy the surrogate's value is -mean(A') and its gradient -mean(A' grad log p)."""
    c = _case(2, beta=0.0)
    B = c["cfg"].batch_size
    v = c["out"][:B].clone().requires_grad_(True)
    t = c["t"][:B].reshape(-1)
    loss, _ = awm_loss(v, c["clean"][:B], c["noise"][:B], t, c["adv"])
    loss.backward()
    a = torch.clamp(c["adv"], -5, 5) / 5
    assert loss.item() == pytest.approx(-a.double().mean().item(), abs=1e-12)
    v2 = c["out"][:B].clone().requires_grad_(True)
    lp = awm_log_prob(v2, c["clean"][:B], c["noise"][:B], t)
    (-(a.double() * lp).mean()).backward()
    torch.testing.assert_close(v.grad, v2.grad, rtol=1e-9, atol=1e-14)


@pytest.mark.parametrize("time_type", ["discrete_wo_init", "discrete"])
@pytest.mark.parametrize("num_steps,fraction,T", [(14, 0.9, 6), (10, 0.9, 3), (4, 0.9, 6)])
def test_timestep_strata_equal_the_authors_draw(time_type, num_steps, fraction, T):
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        u = torch.rand(T, generator=g)
        ours = awm_timestep_indices(num_steps, T, fraction, u, time_type)
        assert torch.equal(ours, authors_indices(num_steps, fraction, T, u, time_type))
    # SD3.5-M (14 steps, 0.9, 6 levels, wo_init): one level in each of {1} {2,3} .. {10,11}
    lo = awm_timestep_indices(14, 6, 0.9, torch.zeros(6))
    hi = awm_timestep_indices(14, 6, 0.9, torch.full((6,), 0.999))
    assert lo.tolist() == [1, 2, 4, 6, 8, 10] and hi.tolist() == [1, 3, 5, 7, 9, 11]


def test_ema_kl_decay_by_hand():
    assert ema_kl_decay(0) == 0.0 and ema_kl_decay(120) == pytest.approx(0.12)
    assert ema_kl_decay(300) == pytest.approx(0.3) and ema_kl_decay(5000) == pytest.approx(0.3)
    assert ema_kl_decay(7, 0.3, "constant") == 0.3
    with pytest.raises(ValueError):
        ema_kl_decay(1, 0.3, "cosine")


def test_bf16_velocity_computes_in_float64():
    c = _case(4)
    B = c["cfg"].batch_size
    args = (c["clean"][:B], c["noise"][:B], c["t"][:B].reshape(-1), c["adv"])
    kw = dict(v_ref=c["out_ref"][:B], v_ema=c["out_ema"][:B], kl_beta=0.003, ema_kl_beta=1.0)
    v16 = c["out"][:B].bfloat16()
    loss16, m16 = awm_loss(v16, *args, **kw)
    loss32, m32 = awm_loss(v16.float(), *args, **kw)
    assert loss16.dtype == torch.float64
    assert loss16.item() == loss32.item() and m16["kl_loss"].item() == m32["kl_loss"].item()


def test_rejects_missing_reference_and_bad_shapes():
    c = _case(5)
    B = c["cfg"].batch_size
    v, x0, eps, t = c["out"][:B], c["clean"][:B], c["noise"][:B], c["t"][:B].reshape(-1)
    with pytest.raises(ValueError, match="v_ref"):
        awm_loss(v, x0, eps, t, c["adv"], kl_beta=0.1)
    with pytest.raises(ValueError, match="v_ema"):
        awm_loss(v, x0, eps, t, c["adv"], v_ref=v, kl_beta=0.1, ema_kl_beta=1.0)
    with pytest.raises(ValueError, match="advantages"):
        awm_loss(v, x0, eps, t, c["adv"][:2])
    with pytest.raises(ValueError, match="weighting"):
        awm_log_prob(v, x0, eps, t, weighting="l1")


# -- the whole algorithm in the trainer: a resumed run equals a straight one -----------------


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_resume_matches_straight_run(tmp_path):
    """algorithm=awm on the shrunk toy: 1 step, resume=auto, 1 more == 2 straight (metrics
    and eval): the EMA policy (lagging from step 1) and the per-sample noise survive the
    checkpoint."""
    from flowgrpo.config import load_config
    from flowgrpo.testing.models import random_toy_path
    from flowgrpo.trainer.logging import deterministic_view, read_jsonl
    from flowgrpo.trainer.loop import run_training

    small = [
        f"model.path={random_toy_path()}",
        "algorithm=awm",
        "sample.prompts_per_step=2",
        "sample.group_size=4",
        "sample.num_steps=4",
        "sample.eval_num_steps=4",
        "data.eval_num_prompts=2",
        "data.eval_samples_per_prompt=2",
        "update.micro_batch_size=4",
        "trainer.eval_every=2",
        "trainer.save_every=1",
        "trainer.keep_last=2",
        "run.progress_bar=false",
        "awm.ema_kl_decay_type=constant",  # the EMA policy lags from step 1: resume must keep it
        "awm.kl_beta=0.01",
        "awm.train_timesteps=2",  # the 2 levels of 4 steps x 0.9 (from the 2nd)
    ]

    def train(out, *extra):
        return run_training(load_config("toy-digits", [*small, f"run.output_dir={out}", *extra]))

    first = tmp_path / "first"
    train(first, "trainer.max_steps=1")
    resumed = tmp_path / "resumed"
    shutil.copytree(first, resumed)
    summary = train(resumed, "trainer.max_steps=2", "trainer.resume=auto")
    assert summary["resumed_from"].endswith("step_1")
    straight = tmp_path / "straight"
    train(straight, "trainer.max_steps=2")
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]

    def view(rows):  # the 1-step run's end-of-run eval also sits in its step-1 row
        return [{k: v for k, v in deterministic_view(r).items() if "eval" not in k} for r in rows]

    assert view(a) == view(b)
    assert deterministic_view(a[1]) == deterministic_view(b[1])
    assert all(r["train/ema_kl"] > 0 for r in a[1:])  # the EMA term is live after step 1
    # the 1-step run also evaluated at its end (step 1): compare the evals both runs made
    ea, eb = read_jsonl(straight / "eval.jsonl"), read_jsonl(resumed / "eval.jsonl")
    assert [e["step"] for e in ea] == [0, 2]
    assert ea == [e for e in eb if e["step"] in (0, 2)]


# -- the update on the engine: the EMA policy and the loss at the weights by hand -------------


def test_update_blends_the_ema_policy_and_its_term_uses_those_weights(dist1):
    """After update(): ema = d·ema + (1 − d)·θ (d = min(0.3, 0.001·steps)); the next update's
    EMA term is mean (v_θ − v_ema)² with v_ema recomputed by hand at exactly those weights, and
    its policy term on-policy is −mean A' (clamped and scaled advantages)."""
    import algo_ranks as ar
    from test_algorithm_updates import _load_params, _params, _rollout, _setup, _velocity

    cfg, adapter, engine, algo = _setup("awm", **{"awm.kl_beta": 0.01})
    engine.optimizer_steps = 200  # d = min(0.3, 0.001·201) = 0.201: a real blend
    before = _params(engine)
    _, traj, seeds = _rollout(cfg, adapter, algo)
    metrics = algo.update(traj, ar.ADVANTAGES, step=1, sample_seeds=seeds)
    theta = _params(engine)
    d = ema_kl_decay(201)
    assert metrics["ema_kl_decay"] == pytest.approx(d) and d == pytest.approx(0.201)
    assert metrics["ema_kl"] == 0.0  # the EMA policy was still the initial weights
    a = torch.clamp(ar.ADVANTAGES, -5, 5) / 5
    assert metrics["policy_loss"] == pytest.approx(-a.double().mean().item(), abs=1e-9)
    expected = {n: d * before[n] + (1 - d) * theta[n] for n in theta}
    assert max((theta[n] - before[n]).abs().max().item() for n in theta) > 1e-4

    _, nxt, seeds = _rollout(cfg, adapter, algo, step=2)
    sub, sd = nxt.select([0, 1]), torch.as_tensor(seeds[:2])
    level = algo.noise_levels(sd, cfg.sample.num_steps, nxt.num_train_steps)[:, 0]
    x0, eps, sigma, _ = algo._inputs(sub, sd, level, 0)
    x_t = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * eps
    with torch.no_grad():
        v = _velocity(adapter, engine, sub, x_t, sigma)
        _load_params(engine, expected)
        v_ema = _velocity(adapter, engine, sub, x_t, sigma)
        _load_params(engine, theta)
        terms = algo.step_loss(sub, ar.ADVANTAGES[:2], sd, level, 0, None)
    assert float((v - v_ema).abs().max()) > 1e-5
    by_hand = ((v.double() - v_ema.double()) ** 2).mean()
    assert float(terms[3]) == pytest.approx(float(by_hand), rel=1e-4)
