"""The engine in bf16 (FSDP2 mixed precision over a bf16 pipeline) stays exactly on-policy, and
its training step differentiates both guidance branches unless ``cfg_grad="cond_only"``
(issue 12, §1 and §2)."""

from __future__ import annotations

import pytest
import tinymodel as tm
import torch

from flowgrpo.functional.losses import flow_grpo_loss, kl_penalty_image
from flowgrpo.models.sd3 import SD3Adapter
from flowgrpo.rollout import sample_trajectories, trajectory_log_prob
from flowgrpo.testing.tiny import tiny_pipeline

PROMPTS = ["a red cat", "a sign saying hello", "two blue birds", "dog"]
ADVANTAGES = torch.tensor([1.0, -0.5, 0.8, -1.3])


def _rollout(adapter, transformer):
    return sample_trajectories(
        adapter,
        PROMPTS,
        num_steps=4,
        guidance_scale=4.5,
        noise_level=0.7,
        height=16,
        width=24,
        generator=[torch.Generator().manual_seed(i) for i in range(len(PROMPTS))],
        transformer=transformer,
        decode=False,
    )


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_bf16_engine_first_update_sees_ratio_one(dist1, mode):
    """Rollout with the engine's (sharded, bf16 compute) transformer, then train_step: the
    first optimizer step recomputes every log-prob exactly (approx_kl = clipfrac = 0)."""
    pipe = tiny_pipeline("sd3").to(dtype=torch.bfloat16)
    adapter = SD3Adapter(pipe, max_sequence_length=8)
    cfg = tm.make_config(mode, **{"update.micro_batch_size": 4})
    cfg.fsdp.param_dtype = "bf16"
    engine = tm.engine_for(adapter, cfg)
    with torch.no_grad():
        traj = _rollout(adapter, engine.transformer)
    assert traj.latents.dtype == torch.float32
    metrics = tm.train_step(engine, traj, ADVANTAGES)
    assert metrics["approx_kl"] == 0.0 and metrics["approx_kl_k2"] == 0.0, metrics
    assert metrics["clipfrac"] == 0.0
    assert abs(metrics["ratio_mean"] - 1.0) < 1e-12
    assert metrics["kl"] == 0.0  # the reference policy is the rollout's policy
    assert metrics["optimizer_steps"] == 1.0 and metrics["samples_trained"] == 4.0


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_bf16_quantized_base_first_update_sees_ratio_one(dist1, quant):
    """``model.base_quant``: the rollout and the update run the same quantized base (the
    transformer's frozen Linear layers and the text encoders), so the first optimizer step
    recomputes every log-prob exactly: |log r| = 0 at the rollout's split."""
    from flowgrpo.engine.quant import QuantLinear, quantize_text_encoders

    pipe = tiny_pipeline("sd3").to(dtype=torch.bfloat16)
    assert quantize_text_encoders(pipe, quant) > 0
    adapter = SD3Adapter(pipe, max_sequence_length=8)
    cfg = tm.make_config("lora", **{"update.micro_batch_size": 4, "base_quant": quant})
    cfg.fsdp.param_dtype = "bf16"
    engine = tm.engine_for(adapter, cfg)
    assert sum(isinstance(m, QuantLinear) for m in engine.model.modules()) > 20
    with torch.no_grad():
        traj = _rollout(adapter, engine.transformer)
    metrics = tm.train_step(engine, traj, ADVANTAGES)
    assert metrics["approx_kl"] == 0.0 and metrics["approx_kl_k2"] == 0.0, metrics
    assert metrics["clipfrac"] == 0.0
    assert abs(metrics["ratio_mean"] - 1.0) < 1e-12
    assert metrics["kl"] == 0.0  # the reference (adapter off) runs the same quantized base
    assert metrics["optimizer_steps"] == 1.0 and metrics["samples_trained"] == 4.0


def _engine_grads(engine, traj, adv) -> list[torch.Tensor]:
    """The gradient the engine's loss gives (one micro-batch, every trained step)."""
    from torch.distributed.tensor import DTensor

    engine.optimizer.zero_grad(set_to_none=True)
    for k in range(traj.num_train_steps):
        tm.flow_grpo(engine).step_loss(traj, adv, k)[0].backward()
    grads = [p.grad for p in engine.params]
    return [(g.full_tensor() if isinstance(g, DTensor) else g).clone() for g in grads]


def test_engine_cfg_grad_setting_reaches_the_loss(dist1):
    """The engine's default gradient differs from its cond_only gradient by O(1), and each
    equals the adapter-level formulation it names (tests/rollout/test_cfg_gradients.py)."""
    grads, traj = {}, None
    for cfg_grad in ("both", "cond_only"):
        adapter = SD3Adapter(tiny_pipeline("sd3"), max_sequence_length=8)
        engine = tm.engine_for(adapter, tm.make_config("lora", **{"flow_grpo.cfg_grad": cfg_grad}))
        if traj is None:
            with torch.no_grad():
                traj = _rollout(adapter, engine.transformer)
        grads[cfg_grad] = _engine_grads(engine, traj, ADVANTAGES)
        # the same through trajectory_log_prob directly (KL off: the engine's kl_beta is 0.05)
        engine.optimizer.zero_grad(set_to_none=True)
        for k in range(traj.num_train_steps):
            out = trajectory_log_prob(adapter, engine.model, traj, k, cfg_grad=cfg_grad)
            with torch.no_grad(), engine.reference_transformer() as ref:
                ref_mean = trajectory_log_prob(adapter, ref, traj, k).prev_sample_mean
            loss, _ = flow_grpo_loss(
                out.log_prob, traj.log_probs[:, k], ADVANTAGES, clip_range=0.5, adv_clip_max=5.0
            )
            kl = kl_penalty_image(out.prev_sample_mean, ref_mean, out.std_dev_t).mean()
            (loss + 0.05 * kl).backward()
        direct = [p.grad.full_tensor().clone() for p in engine.params]
        for a, b in zip(grads[cfg_grad], direct, strict=True):
            assert torch.equal(a, b)
    num = sum(((a - b) ** 2).sum() for a, b in zip(grads["both"], grads["cond_only"]))
    den = sum((b**2).sum() for b in grads["both"])
    assert float((num / den) ** 0.5) > 0.1
