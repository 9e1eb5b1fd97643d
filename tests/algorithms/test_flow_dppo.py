"""Flow-DPPO: its loss against the authors' lines transcribed independently (verl-omni's
``FlowDPPOLoss.compute_loss`` and UniRL's ``_flowdppo_kl_adv_loss``), by hand, in bf16, the
second optimizer step of a rollout against an independent recomputation, and a resumed toy run
equal to a straight one."""

from __future__ import annotations

import math
import shutil

import algo_ranks as ar
import pytest
import test_algorithm_updates as upd
import torch

from flowgrpo.algorithms.flow_dppo import flow_dppo_loss

TAU = 1e-5

# -- the authors' lines, transcribed in plain torch ---------------------------------------------


def verl_omni_lines(old_log_prob, log_prob, advantages, old_prev_sample_mean, prev_sample_mean,
                    std_dev_t, sqrt_dt, kl_mask_threshold, add_kl_coefficient=True):  # fmt: skip
    """verl-omni a1139ba, verl_omni/trainer/diffusion/diffusion_algos.py, FlowDPPOLoss
    .compute_loss (std_dev_t [B, 1, 1, 1], sqrt_dt [B])."""
    advantages = advantages.detach()
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)
    if add_kl_coefficient:
        sigma_t = std_dev_t * sqrt_dt.reshape(sqrt_dt.shape[0], *([1] * (std_dev_t.ndim - 1)))
        kl_per_elem = mean_diff_sq / (2 * sigma_t.pow(2))
    else:
        kl_per_elem = mean_diff_sq / 2
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(1, kl_per_elem.ndim)))
    high_kl_mask = kl_per_sample >= kl_mask_threshold
    pos_rm_mask = high_kl_mask & (ratio > 1.0) & (advantages > 0)
    neg_rm_mask = high_kl_mask & (ratio < 1.0) & (advantages < 0)
    rm_mask = pos_rm_mask | neg_rm_mask
    keep_mask = (~rm_mask).detach()
    zero = torch.zeros((), dtype=unclipped_loss.dtype, device=unclipped_loss.device)
    per_elem_loss = torch.where(keep_mask, unclipped_loss, zero)
    return torch.mean(per_elem_loss), kl_per_sample, rm_mask


def unirl_lines(new_logp, old_logp, new_means, old_means, advantages, sigmas, target_steps, eta,
                kl_mask_threshold):  # fmt: skip
    """UniRL 1a7b501, unirl/algorithms/flowdppo.py: ``_compute_sigma_t`` then
    ``_flowdppo_kl_adv_loss`` and the caller's ``loss_per_elem.mean()`` ([B, S'] tensors)."""
    idx = torch.tensor(target_steps, dtype=torch.long)
    s, s_next = sigmas[idx], sigmas[idx + 1]
    dt = s_next - s
    std_dev_t = torch.sqrt(s / (1.0 - torch.clamp(s, max=0.99))) * eta
    sigma_t = (std_dev_t * torch.sqrt(-dt)).reshape(1, -1, 1, 1, 1)
    log_diff = new_logp - old_logp
    ratio = torch.exp(log_diff)
    adv = advantages.detach()
    unclipped_loss = -adv * ratio
    kl_per_elem = (new_means - old_means) ** 2 / (2 * sigma_t**2)
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(2, kl_per_elem.ndim)))
    kl_mask = kl_per_sample < kl_mask_threshold
    pos_rm_mask = (~kl_mask) & (ratio > 1.0) & (adv > 0)
    neg_rm_mask = (~kl_mask) & (ratio < 1.0) & (adv < 0)
    keep_adv_mask = (~(pos_rm_mask | neg_rm_mask)).detach()
    zero = torch.zeros((), dtype=unclipped_loss.dtype, device=unclipped_loss.device)
    return torch.where(keep_adv_mask, unclipped_loss, zero).mean()


def _case(batch: int = 64, seed: int = 0, step_std: float = 0.1):
    """Random inputs whose KL straddles TAU (per-sample drift scales 0.1..10 x the threshold's)
    and whose ratios straddle 1."""
    g = torch.Generator().manual_seed(seed)
    old_mean = torch.randn(batch, 4, 8, 8, generator=g)
    scale = torch.logspace(-1, 1, batch)[torch.randperm(batch, generator=g)]
    drift = (
        torch.randn(batch, 4, 8, 8, generator=g)
        * (scale * step_std * math.sqrt(2 * TAU))[:, None, None, None]
    )
    old_lp = torch.randn(batch, generator=g)
    lp = (old_lp + 0.05 * torch.randn(batch, generator=g)).requires_grad_()
    adv = torch.randn(batch, generator=g)
    return old_lp, lp, old_mean, old_mean + drift, adv


@pytest.mark.parametrize("add_kl_coefficient", [True, False])
def test_loss_and_gradient_equal_verl_omnis_lines(add_kl_coefficient):
    old_lp, lp, old_mean, mean, adv = _case()
    std = torch.full((64,), 0.4) + 0.1 * torch.rand(64)
    dt = -torch.full((64,), 0.0625) * (1 + torch.rand(64))
    thr = TAU if add_kl_coefficient else TAU * 0.01**2
    ours, m = flow_dppo_loss(lp, old_lp, mean, old_mean, std, dt, adv, kl_mask_threshold=thr,
                             add_kl_coefficient=add_kl_coefficient)  # fmt: skip
    (g_ours,) = torch.autograd.grad(ours, lp)
    ref, kl, rm = verl_omni_lines(old_lp, lp, adv, old_mean, mean, std.view(-1, 1, 1, 1),
                                  (-dt).sqrt(), thr, add_kl_coefficient)  # fmt: skip
    (g_ref,) = torch.autograd.grad(ref, lp)
    assert 0.1 < float(rm.float().mean()) < 0.6  # the case masks some samples, not all
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-6, abs=1e-7)
    assert torch.allclose(g_ours, g_ref, rtol=1e-6, atol=1e-8)
    assert float(m["masked_fraction"]) == float(rm.float().mean())
    assert float(m["kl_new_old_mean"]) == pytest.approx(float(kl.mean()), rel=1e-6)


def test_loss_over_steps_equals_unirls_lines():
    """UniRL's one loss over [B, S'] = the mean over trained steps of ours per step (what the
    update loop computes), with sigma_t from the sigmas (no step at sigma = 1 here)."""
    sigmas, eta, steps, batch = torch.linspace(0.9, 0.0, 11), 0.7, [1, 2, 4], 32
    cases = [_case(batch, seed=s, step_std=0.07) for s in range(len(steps))]
    new_logp = torch.stack([c[1] for c in cases], 1)
    old_logp = torch.stack([c[0] for c in cases], 1)
    new_means = torch.stack([c[3] for c in cases], 1)
    old_means = torch.stack([c[2] for c in cases], 1)
    adv = cases[0][4]
    ref = unirl_lines(new_logp, old_logp, new_means, old_means, adv[:, None].expand_as(new_logp),
                      sigmas, steps, eta, TAU)  # fmt: skip
    ours, masked = [], []
    for j, k in enumerate(steps):
        s, s_next = float(sigmas[k]), float(sigmas[k + 1])
        std = eta * math.sqrt(s / (1 - s))  # sde_step_with_logprob's std_t
        loss, m = flow_dppo_loss(cases[j][1], cases[j][0], cases[j][3], cases[j][2], std,
                                 s_next - s, adv, kl_mask_threshold=TAU)  # fmt: skip
        ours.append(loss)
        masked.append(float(m["masked_fraction"]))
    assert 0 < sum(masked) / len(masked) < 1
    assert float(torch.stack(ours).mean()) == pytest.approx(float(ref), rel=1e-6, abs=1e-7)


def test_hand_values_verl_omnis_own_case():
    """verl-omni's test case: ratios 1.2, 0.8, 1.2, 0.8, A = 10, -10, -8, 8, drift 0.2 on
    std 0.5 x sqrt_dt 0.5 (D = 0.04 / 0.125 = 0.32 >> 1e-5): samples 1 (pushing a good one
    further) and 2 (suppressing a bad one further) are dropped, 3 and 4 (corrective) kept:
    loss = (0 + 0 + 8 * 1.2 - 8 * 0.8) / 4 = 0.8."""
    old_lp = torch.zeros(4)
    lp = torch.log(torch.tensor([1.2, 0.8, 1.2, 0.8])).requires_grad_()
    adv = torch.tensor([10.0, -10.0, -8.0, 8.0])
    old_mean = torch.zeros(4, 2, 2, 2)
    loss, m = flow_dppo_loss(lp, old_lp, old_mean + 0.2, old_mean, 0.5, -0.25, adv,
                             kl_mask_threshold=1e-5)  # fmt: skip
    assert float(loss) == pytest.approx(0.8, rel=1e-6)
    assert float(m["kl_new_old_mean"]) == pytest.approx(0.32, rel=1e-6)
    assert float(m["masked_fraction"]) == 0.5
    assert float(m["pos_rm_fraction"]) == float(m["neg_rm_fraction"]) == 0.25
    (grad,) = torch.autograd.grad(loss, lp)  # d(-A r)/d log p = -A r / 4 for the kept ones
    assert torch.allclose(grad, torch.tensor([0.0, 0.0, 8 * 1.2 / 4, -8 * 0.8 / 4]))
    # inside the trust region nothing is dropped: the plain -A r
    loss, m = flow_dppo_loss(lp, old_lp, old_mean + 0.2, old_mean, 0.5, -0.25, adv,
                             kl_mask_threshold=1.0)  # fmt: skip
    assert float(loss) == pytest.approx((-12 + 8 + 9.6 - 6.4) / 4, rel=1e-6)
    assert float(m["masked_fraction"]) == 0.0


def test_bf16_inputs_compute_in_fp32():
    old_lp, lp, old_mean, mean, adv = _case()
    args = (old_mean, 0.45, -0.07, adv)
    loss16, _ = flow_dppo_loss(lp.bfloat16(), old_lp.bfloat16(), mean.bfloat16(), *args,
                               kl_mask_threshold=TAU)  # fmt: skip
    loss32, _ = flow_dppo_loss(lp.bfloat16().float(), old_lp.bfloat16().float(),
                               mean.bfloat16().float(), *args, kl_mask_threshold=TAU)  # fmt: skip
    assert loss16.dtype == torch.float32 and float(loss16) == float(loss32)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kl_mask_threshold": 0.0}, "kl_mask_threshold"),
        ({"dt": 0.1}, "dt < 0"),
        ({"advantages": torch.zeros(3)}, "advantages"),
    ],
)
def test_bad_input_raises(kwargs, match):
    x = torch.zeros(4, 2)
    args = {"log_prob": torch.zeros(4), "old_log_prob": torch.zeros(4), "mean": x,
            "old_mean": x, "std_dev_t": 0.5, "dt": -0.1, "advantages": torch.zeros(4),
            "kl_mask_threshold": 1e-5}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        flow_dppo_loss(**{**args, **kwargs})


def test_config_refuses_cps():
    from flowgrpo.config import config_from_dict
    from flowgrpo.settings import ConfigError

    with pytest.raises(ConfigError, match="sde_type"):
        config_from_dict({"algorithm": "flow_dppo", "sample": {"sde_type": "cps"}}, check=True)


# -- on the engine ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_bf16_first_update_is_on_policy_and_trains(dist1, mode):
    """In bf16 compute the first optimizer step sees the rollout's policy exactly: ratio 1,
    KL 0, nothing masked; it takes a step with a non-zero gradient."""
    out = ar.run("flow_dppo", "toy", mode, **{"fsdp.param_dtype": "bf16"})
    m = out["metrics"]
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    assert m["kl_new_old_mean"] == 0.0 and m["masked_fraction"] == 0.0
    assert math.isfinite(m["loss"]) and m["optimizer_steps"] == 1.0
    assert m["grad_norm"] > 1e-3 and m["skipped"] == 0.0


@pytest.mark.slow
def test_second_optimizer_step_masks_what_an_independent_recomputation_masks(dist1):
    """2 optimizer steps per rollout: the first at the rollout's weights (nothing masked), the
    second after an update. Its KL, ratio and masked fraction equal a recomputation at the
    weights after step 1 (sde_step_with_logprob on the adapter's velocity)."""
    from flowgrpo.functional.sde import sde_step_with_logprob

    tau = 1e-9
    over = {"flow_dppo.kl_mask_threshold": tau, "update.num_minibatches": 2,
            "update.micro_batch_size": 2}  # fmt: skip
    cfg, adapter, engine, algo = upd._setup("flow_dppo", **over)
    _, traj, seeds = upd._rollout(cfg, adapter, algo)
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
            after_first.update(upd._params(engine))
        return out

    algo.summarize, engine.plan, engine.optimizer_step = capture_rows, capture_plan, capture_step
    algo.update(traj, ar.ADVANTAGES, step=1, sample_seeds=seeds)
    assert len(rows_seen) == 2 and rows_seen[1]["skipped"] == 0.0
    first, second = rows_seen
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["masked_fraction"] == 0.0 and first["kl_new_old_mean"] == 0.0

    upd._load_params(engine, after_first)
    rows = torch.cat([m.rows for m in plans[0][1].micro])
    sub, adv = traj.select(rows), ar.ADVANTAGES[rows].double()
    ratios, kls = [], []
    with torch.no_grad():
        for k in range(traj.num_train_steps):
            v = upd._velocity(adapter, engine, sub, sub.latents[:, k], sub.sigmas[:, k])
            out = sde_step_with_logprob(
                v, sub.latents[:, k], sub.sigmas[:, k], sub.sigmas_next[:, k],
                noise_level=sub.noise_level, sigma_max=sub.sigma_max,
                prev_sample=sub.latents[:, k + 1],
            )  # fmt: skip
            ratios.append((out.log_prob - sub.log_probs[:, k]).double().exp())
            s2 = out.std_dev_t.double() ** 2 * (sub.sigmas[:, k] - sub.sigmas_next[:, k]).double()
            d2 = ((out.prev_sample_mean - sub.means[:, k]).double() ** 2).flatten(1).mean(1)
            kls.append(d2 / (2 * s2))
    r, kl = torch.stack(ratios), torch.stack(kls)  # [K, B]
    drop = (kl >= tau) & (((r > 1) & (adv > 0)) | ((r < 1) & (adv < 0)))
    assert 0 < float(drop.double().mean()) < 1  # the mask bites, and not everywhere
    assert second["masked_fraction"] == pytest.approx(float(drop.double().mean()), abs=1e-9)
    assert second["kl_new_old_mean"] == pytest.approx(float(kl.mean()), rel=1e-4)
    assert second["ratio_mean"] == pytest.approx(float(r.mean()), rel=1e-5, abs=1e-9)
    expected = float(torch.where(drop, torch.zeros(()), -adv * r).mean())
    assert second["policy_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-9)


# -- resume ----------------------------------------------------------------------------------

SMALL = [
    "algorithm=flow_dppo",
    "sample.prompts_per_step=2",
    "sample.group_size=4",
    "sample.num_steps=4",
    "sample.eval_num_steps=4",
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=2",
    "update.micro_batch_size=2",
    "update.num_minibatches=2",  # the second optimizer step sees a KL: the mask's state
    "trainer.eval_every=1",
    "trainer.save_every=1",
    "run.progress_bar=false",
]


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_resume_matches_straight_run(tmp_path):
    """2 steps straight == 1 step, resume=auto, 1 more: metrics, evals and weights."""
    from flowgrpo.config import load_config
    from flowgrpo.testing.models import random_toy_path
    from flowgrpo.trainer.logging import deterministic_view, read_jsonl
    from flowgrpo.trainer.loop import run_training

    def train(out, *extra):
        args = [f"model.path={random_toy_path()}", *SMALL, f"run.output_dir={out}", *extra]
        return run_training(load_config("toy-digits", args, command="train"))

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, "trainer.max_steps=2")
    train(resumed, "trainer.max_steps=1")
    shutil.copytree(resumed / "checkpoints" / "step_1", tmp_path / "step_1")
    assert train(resumed, "trainer.max_steps=2", "trainer.resume=auto")["resumed_from"]
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert a[1]["train/kl_new_old_mean"] > 0  # the second optimizer step saw a moved policy
    assert [deterministic_view(r) for r in a] == [deterministic_view(r) for r in b]
    assert read_jsonl(straight / "eval.jsonl") == read_jsonl(resumed / "eval.jsonl")
    wa = upd_weights(straight / "checkpoints/step_2")
    wb = upd_weights(resumed / "checkpoints/step_2")
    w1 = upd_weights(tmp_path / "step_1")
    assert wa.keys() == wb.keys() and len(wa) > 10
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(w1[k], wb[k]) for k in wb)  # step 2 moved the weights


def upd_weights(ckpt) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint directory (via a torch.save conversion)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(dst))
    return torch.load(dst, weights_only=False)["model"]
