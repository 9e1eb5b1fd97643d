"""DiffusionNFT (Zheng et al., arXiv 2509.16117; NVlabs/DiffusionNFT): negative-aware
fine-tuning on the forward process.

The rollout is an ODE (DPM-Solver++ 2M by default) run with the *old* policy, CFG-free, and
keeps only the clean samples x0; no log-probs. Rewards become an optimality probability per
sample (from the group advantage). Training re-noises x0 at the rollout's sigmas with fresh
noise and contrasts the implicit positive and negative policies around the old one
(``flowgrpo.algo.nft.nft_loss``); after each update the old policy moves toward the current
one with the authors' decay schedule. docs/algorithms.md states the math.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flowgrpo.algo.nft import forward_noising, nft_loss, old_policy_decay, optimality_probability
from flowgrpo.algorithms.base import Algorithm, RolloutPlan
from flowgrpo.rollout import Trajectory
from flowgrpo.settings import ge, gt, need, one_of, optional, setting

KEYS = ("loss", "policy_loss", "unweighted_policy_loss", "old_deviate", "kl")
NOISE_SALT = 0x4E_F7  # the stream of the training noise, apart from the rollout's
SHADOW = "nft_old"  # the engine's name for the old policy (checkpointed)


@dataclass
class NFTConfig:
    """DiffusionNFT's settings (the authors' SD3.5 defaults)."""

    beta: float = setting(
        1.0,
        "How far the implicit policies sit from the old one (the authors: 1 for GenEval / "
        "PickScore / HPSv2, 0.1 for OCR and multi-reward).",
        check=gt(0),
    )
    adv_clip_max: float = setting(
        5.0, "Advantages are clamped to +-this before they become probabilities.", check=gt(0)
    )
    kl_beta: float = setting(
        0.0,
        "Weight of mean (v_theta - v_ref)^2 to the reference policy (the authors: 1e-4).",
        check=ge(0),
    )
    old_policy_schedule: int = setting(
        1,
        "The old policy's decay d (old <- d old + (1 - d) new after each update): 0 = always "
        "the current policy, 1 = min(0.001 s, 0.5) (the authors' default), 2 = the OCR one.",
        check=one_of(0, 1, 2),
    )
    guidance_scale: float = setting(
        1.0, "CFG scale of the rollouts (DiffusionNFT is CFG-free: 1).", check=ge(0)
    )
    ode_solver: str = setting(
        "dpm2",
        "The rollout's ODE solver: `dpm2` (DPM-Solver++ 2M, the authors') or `euler`.",
        check=one_of("euler", "dpm2"),
    )
    timesteps: int | None = setting(
        None,
        "Noise levels trained per sample and update, drawn at random (per sample and step) "
        "from the rollout's schedule; null = all of them (the authors: 9 of 10).",
        check=optional(ge(1)),
    )


class DiffusionNFT(Algorithm):
    name = "nft"

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse the sample settings NFT's deterministic old-policy rollouts cannot honour:
        the SDE window, ``timestep_fraction`` (``nft.timesteps`` picks the trained noise
        levels), the SDE type (no SDE step is taken) and EMA rollouts (the old policy samples)."""
        s = cfg.sample
        why = "with algorithm=nft (its rollouts are ODE"
        need(s.window_size == 0, "sample.window_size", f"0 {why}: no SDE window)", s.window_size)
        need(
            s.timestep_fraction == 1.0,
            "sample.timestep_fraction",
            "1 with algorithm=nft (nft.timesteps sets the noise levels trained)",
            s.timestep_fraction,
        )
        need(
            s.sde_type == "sde", "sample.sde_type", f"left at 'sde' {why}: no SDE step)", s.sde_type
        )
        need(
            not s.use_ema_for_rollout,
            "sample.use_ema_for_rollout",
            "false with algorithm=nft (its rollouts sample with the old policy)",
            s.use_ema_for_rollout,
        )

    @classmethod
    def eval_guidance_scale(cls, cfg) -> float:
        """NFT trains a guidance-free policy, and its authors evaluate it at guidance 1.0: eval
        runs at ``nft.guidance_scale`` unless ``sample.eval_guidance_scale`` says otherwise."""
        return cfg.nft.guidance_scale

    def __init__(self, cfg, engine, adapter) -> None:
        super().__init__(cfg, engine, adapter)
        self.old = engine.shadow(SHADOW)  # created now so that checkpoints restore it

    def rollout_plan(self, step: int) -> RolloutPlan:
        plan = super().rollout_plan(step)
        plan.noise_level, plan.sde_window, plan.timestep_fraction = 0.0, None, 1.0
        plan.guidance_scale = self.settings.guidance_scale
        plan.ode_solver = self.settings.ode_solver
        return plan

    def rollout_weights(self) -> contextlib.AbstractContextManager:
        """Rollouts sample with the old policy."""
        return self.old.swapped()

    def update(
        self,
        trajectory: Trajectory,
        advantages: torch.Tensor,
        *,
        step: int,
        sample_seeds: Sequence[int],
    ) -> dict[str, float]:
        """Optimizer steps on this rank's samples, each term one (sample, schedule sigma) pair;
        then the old policy moves toward the new one."""
        adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
        if adv.numel() != len(trajectory) or len(sample_seeds) != len(trajectory):
            raise ValueError(
                f"got {adv.numel()} advantages and {len(sample_seeds)} seeds for "
                f"{len(trajectory)} samples"
            )
        r = optimality_probability(adv, self.settings.adv_clip_max).to(trajectory.latents.device)
        seeds = torch.as_tensor(list(sample_seeds), dtype=torch.long)
        levels = self.noise_levels(seeds, trajectory.num_train_steps)  # [B, n]

        def micro_loss(sub, index, scale, k):
            return self.step_loss(sub, r[index.to(r.device)], seeds[index], levels[index, k], k)

        rows = torch.arange(len(trajectory))
        steps, total = self.update_loop(trajectory, rows, KEYS, micro_loss, levels.shape[1])
        out = self.summarize(steps, KEYS)
        decay = old_policy_decay(self.engine.optimizer_steps, self.settings.old_policy_schedule)
        self.old.blend_(1.0 - decay)
        out.update(samples_trained=float(total), old_policy_decay=decay)
        return out

    def noise_levels(self, seeds: torch.Tensor, available: int) -> torch.Tensor:
        """[B, n]: which of the rollout's ``available`` sigmas each sample trains on: all, in
        order, or ``timesteps`` of them drawn from the sample's seed."""
        n = self.settings.timesteps
        if n is None or n >= available:
            return torch.arange(available).expand(len(seeds), available)
        out = []
        for s in seeds.tolist():
            g = torch.Generator().manual_seed((s * 2_000_003 + NOISE_SALT) % 2**63)
            out.append(torch.randperm(available, generator=g)[:n])
        return torch.stack(out)

    def noise(self, seeds: torch.Tensor, k: int, like: torch.Tensor) -> torch.Tensor:
        """Fresh noise for training term k of each sample, from the sample's own seed: the
        same whatever the batch, the rank or a resume."""
        out = []
        for s in seeds.tolist():
            g = torch.Generator().manual_seed((s * 1_000_003 + k * 7919 + NOISE_SALT) % 2**63)
            out.append(torch.randn(like.shape[1:], generator=g, dtype=torch.float32))
        return torch.stack(out).to(like.device, like.dtype)

    def step_loss(
        self, sub: Trajectory, r: torch.Tensor, seeds: torch.Tensor, level: torch.Tensor, k: int
    ) -> list[torch.Tensor]:
        """[loss, policy_loss, unweighted_policy_loss, old_deviate, kl] of the k-th trained
        term: each sample at its ``level`` [b]-th sigma of the rollout's schedule (means over
        the micro-batch)."""
        s, engine = self.settings, self.engine
        rows = torch.arange(len(sub), device=sub.sigmas.device)
        x0, sigma = sub.final_latents, sub.sigmas[rows, level.to(rows.device)]
        x_t = forward_noising(x0, self.noise(seeds, k, x0), sigma)
        kw = dict(guidance_scale=sub.guidance_scale, height=sub.height, width=sub.width)

        def velocity(model):
            return self.adapter.velocity(
                model, x_t, sigma, sub.prompt_embeds, sub.negative_embeds, **kw
            )

        with torch.no_grad():  # the old policy first: its weights swap in and back out
            with self.old.swapped():
                v_old = velocity(engine.model)
            v_ref = None
            if s.kl_beta > 0:
                with engine.reference_transformer() as ref:
                    v_ref = velocity(ref)
        v = velocity(engine.model)
        loss, m = nft_loss(
            v,
            v_old,
            x_t,
            x0,
            sigma,
            r,
            beta=s.beta,
            adv_clip_max=s.adv_clip_max,
            kl_beta=s.kl_beta,
            v_ref=v_ref,
        )
        kl = m.get("kl_div", torch.zeros((), device=loss.device))
        return [loss, m["policy_loss"], m["unweighted_policy_loss"], m["old_deviate"], kl]


__all__ = ["DiffusionNFT", "NFTConfig"]
