"""DiffusionNFT (Zheng et al., arXiv 2509.16117; NVlabs/DiffusionNFT): negative-aware
fine-tuning on the forward (noising) process.

The rollout is an ODE (DPM-Solver++ 2M by default) run with the *old* policy, CFG-free, and
keeps only the clean samples x0; no log-probs, no SDE. Rewards become an optimality probability
per sample (from the group advantage). Training re-noises x0 at the rollout's sigmas with fresh
noise and contrasts the implicit positive and negative policies around the old one
(``nft_loss``); after each update the old policy moves toward the current one with the
authors' decay schedule. docs/math.md states the math.

Transcribed from the authors' code, NVlabs/DiffusionNFT @ 24af555, ``scripts/train_nft_sd3.py``
(line numbers below are that file's):

    r      = clamp(clamp(A, ±A_max) / A_max / 2 + 0.5, 0, 1)        optimality probability
    x_t    = (1 − t)·x0 + t·ε,   ε ~ N(0, I) fresh per (sample, t)
    v⁺     = β·v_θ + (1 − β)·sg(v_old),    v⁻ = (1 + β)·sg(v_old) − β·v_θ
    x̂0±    = x_t − t·v±
    w±     = sg(mean_d |x̂0± − x0|) clipped below at 1e-5            (computed in float64)
    L±     = mean_d (x̂0± − x0)² / w±
    loss   = A_max · mean_b [ (r·L⁺ + (1 − r)·L⁻) / β ]  +  β_kl · mean_b mean_d (v_θ − v_ref)²

After each epoch's optimizer steps the old policy moves toward the current one:
old ← d·old + (1 − d)·θ with d = ``old_policy_decay(optimizer_steps_so_far, schedule)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from flowgrpo.algorithms.base import Algorithm, RolloutPlan
from flowgrpo.rollout import Trajectory, trained_step_count
from flowgrpo.settings import ge, gt, need, one_of, optional, setting

# -- the math: optimality probability, forward noising, the loss, the old policy's decay -------

# decay_type -> (flat, uprate, uphold), train_nft_sd3.py:169-189 (`return_decay`).
# 0: always on-policy; 1: geneval/pickscore/hpsv2/multi_reward; 2: ocr (config/nft.py).
OLD_POLICY_SCHEDULES: dict[int, tuple[int, float, float]] = {
    0: (0, 0.0, 0.0),
    1: (0, 0.001, 0.5),
    2: (75, 0.0075, 0.999),
}


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """float or [B] -> [B, 1, ...] in ``like``'s dtype, broadcastable against ``like`` [B, ...]."""
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    batch = like.shape[0]
    if t.ndim == 0:
        t = t.expand(batch)
    t = t.reshape(-1)
    if t.numel() != batch:
        raise ValueError(f"sigma has {t.numel()} entries, expected 1 or batch size {batch}")
    return t.view(batch, *([1] * (like.ndim - 1)))


def optimality_probability(advantages: torch.Tensor, adv_clip_max: float = 5.0) -> torch.Tensor:
    """r = clamp(clamp(A, -A_max, A_max) / A_max / 2 + 0.5, 0, 1), [B] -> [B] (fp32 or fp64).

    Maps the group advantage to the probability that the sample is "optimal": A = 0 gives 0.5,
    A >= A_max gives 1. train_nft_sd3.py:910-929 (adv_mode="all", the only mode the configs use).
    """
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    adv = advantages.to(torch.promote_types(advantages.dtype, torch.float32))
    adv = torch.clamp(adv, -adv_clip_max, adv_clip_max)
    return torch.clamp((adv / adv_clip_max) / 2.0 + 0.5, 0.0, 1.0)


def forward_noising(
    x0: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor
) -> torch.Tensor:
    """x_t = (1 - sigma)·x0 + sigma·noise; x0, noise [B, ...], sigma float or [B].

    The rectified-flow forward process (train_nft_sd3.py:868-870); computed in fp32 (fp64 for
    fp64 inputs), as the authors draw fp32 noise.
    """
    if x0.shape != noise.shape:
        raise ValueError(f"x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} differ")
    compute = torch.promote_types(x0.dtype, torch.float32)
    x0, noise = x0.to(compute), noise.to(compute)
    t = _per_sample(sigma, x0)
    return (1 - t) * x0 + t * noise


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma: float | torch.Tensor,
    r: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float = 5.0,
    kl_beta: float = 0.0,
    v_ref: torch.Tensor | None = None,
    weight_min: float = 1e-5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DiffusionNFT loss on one micro-batch at one noise level (train_nft_sd3.py:872-978).

    v_theta: current policy's velocity at x_t [B, ...] (the only input that gets a gradient);
    v_old: old policy's velocity [B, ...] (detached here, as the authors compute it under
    no_grad); x_t: ``forward_noising(x0, eps, sigma)``; x0: the rollout's clean latent;
    sigma: float or [B] (the authors' t = timestep / 1000); r: ``optimality_probability`` [B];
    beta: the NFT beta (``config.beta``: 1.0 for geneval/pickscore/hpsv2, 0.1 for ocr and
    multi_reward); adv_clip_max: the final scale (the authors multiply by
    ``config.train.adv_clip_max`` = 5). kl_beta (``config.train.beta``, 1e-4 in every config,
    always on) adds kl_beta * mean_b mean_d (v_theta - v_ref)^2 against the frozen base model's
    velocity v_ref (detached). The adaptive weights w± are detached and computed in float64,
    as the authors do; the returned loss is fp32 (fp64 for fp64 inputs).

    Returns (loss, metrics); metrics are detached scalars named as the authors log them.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0 (the loss divides by it), got {beta}")
    if not (v_theta.shape == v_old.shape == x_t.shape == x0.shape):
        raise ValueError(
            "v_theta, v_old, x_t and x0 must share one shape, got "
            f"{tuple(v_theta.shape)}, {tuple(v_old.shape)}, {tuple(x_t.shape)}, {tuple(x0.shape)}"
        )
    if r.shape != (v_theta.shape[0],):
        raise ValueError(f"r must be [B] = [{v_theta.shape[0]}], got {tuple(r.shape)}")
    if kl_beta > 0 and v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref (the reference policy's velocity)")
    if v_ref is not None and v_ref.shape != v_theta.shape:
        raise ValueError(f"v_ref {tuple(v_ref.shape)} and v_theta {tuple(v_theta.shape)} differ")

    compute = torch.promote_types(v_theta.dtype, torch.float32)
    v = v_theta.to(compute)
    v_old = v_old.detach().to(compute)
    x_t, x0 = x_t.to(compute), x0.to(compute)
    t = _per_sample(sigma, x0)
    r = r.detach().to(compute)
    dims = tuple(range(1, x0.ndim))

    # Implicit positive and negative policies around the old one (:934-937).
    v_pos = beta * v + (1 - beta) * v_old
    v_neg = (1.0 + beta) * v_old - beta * v
    x0_pos = x_t - t * v_pos
    x0_neg = x_t - t * v_neg

    # Adaptive weights: the detached mean absolute x0 error, in float64 (:939-957). Dividing an
    # fp32 tensor by them promotes the per-sample losses to float64, as in the authors' code.
    with torch.no_grad():
        w_pos = (x0_pos.double() - x0.double()).abs().mean(dim=dims, keepdim=True)
        w_neg = (x0_neg.double() - x0.double()).abs().mean(dim=dims, keepdim=True)
        w_pos, w_neg = w_pos.clip(min=weight_min), w_neg.clip(min=weight_min)
    loss_pos = ((x0_pos - x0) ** 2 / w_pos).mean(dim=dims)
    loss_neg = ((x0_neg - x0) ** 2 / w_neg).mean(dim=dims)

    per_sample = r * loss_pos / beta + (1.0 - r) * loss_neg / beta  # :959
    policy_loss = (per_sample * adv_clip_max).mean()  # :960
    loss = policy_loss
    if v_ref is not None:
        kl_div = ((v - v_ref.detach().to(compute)) ** 2).mean(dim=dims).mean()  # :966-970
        if kl_beta > 0:
            loss = loss + kl_beta * kl_div
    loss = loss.to(compute)

    with torch.no_grad():
        deviate = (v - v_old) ** 2
        metrics = {
            "policy_loss": policy_loss.to(compute),
            "unweighted_policy_loss": per_sample.mean().to(compute),
            "old_deviate": deviate.mean(),
            "old_deviate_max": deviate.max(),
            "x0_norm": (x0**2).mean(),
        }
        if v_ref is not None:
            ref = v_ref.detach().to(compute)
            metrics["kl_div"] = kl_div.detach()
            metrics["old_kl_div"] = ((v_old - ref) ** 2).mean(dim=dims).mean()
    return loss, metrics


def old_policy_decay(step: int, schedule: int = 1) -> float:
    """d in old <- d·old + (1 - d)·θ after ``step`` optimizer steps (train_nft_sd3.py:169-189).

    schedule is the authors' ``decay_type``: 0 -> d = 0 (on-policy); 1 (default, geneval,
    pickscore, hpsv2, multi_reward) -> min(0.001·step, 0.5); 2 (ocr) -> 0 for step < 75, then
    min(0.0075·(step - 75), 0.999). The authors apply it once per epoch, after that epoch's
    optimizer steps, with step = optimizer steps so far (:1034-1039).
    """
    if schedule not in OLD_POLICY_SCHEDULES:
        raise ValueError(
            f"unknown old-policy schedule {schedule!r}; expected one of {sorted(OLD_POLICY_SCHEDULES)}"
        )
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    flat, uprate, uphold = OLD_POLICY_SCHEDULES[schedule]
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


@torch.no_grad()
def update_old_policy_(
    old_params: Iterable[torch.Tensor], params: Iterable[torch.Tensor], decay: float
) -> None:
    """In place: old <- decay·old + (1 - decay)·new for each pair (train_nft_sd3.py:1036-1039)."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1], got {decay}")
    old_params, params = list(old_params), list(params)
    if len(old_params) != len(params):
        raise ValueError(f"got {len(old_params)} old tensors for {len(params)} current ones")
    for old, new in zip(old_params, params):
        old.copy_(old * decay + new.detach() * (1.0 - decay))


# -- the algorithm ---------------------------------------------------------------------------

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
        check=one_of(*OLD_POLICY_SCHEDULES),
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
    settings_class = NFTConfig
    shadows = (SHADOW,)  # the old policy
    #: off-policy rollouts (``trainer.off_policy_steps=1``) are right as is: the loss has no
    #: importance ratio and reads nothing of the sampler but the clean x0 and their rewards; it
    #: is defined around the old policy as it is at training time, whichever policy drew x0
    #: (the authors' sampling policy already lags the trained one: the decayed old policy).
    #: The behaviour policy is the old policy before the previous update.
    off_policy_refusal = None

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

    @classmethod
    def rollout_guidance_scale(cls, cfg) -> float:
        """Rollouts sample at ``nft.guidance_scale``."""
        return cfg.nft.guidance_scale

    @classmethod
    def trained_steps(cls, cfg) -> int:
        """The whole trajectory: no window, every stochastic step (``rollout_plan``)."""
        s = cfg.sample
        return trained_step_count(
            s.num_steps,
            window_size=None,
            timestep_fraction=1.0,
            deterministic_last_step=s.deterministic_last_step,
        )

    def rollout_plan(self, step: int) -> RolloutPlan:
        plan = super().rollout_plan(step)
        plan.noise_level, plan.sde_window, plan.timestep_fraction = 0.0, None, 1.0
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
        adv, seeds = self.per_sample_inputs(trajectory, advantages, sample_seeds)
        r = optimality_probability(adv, self.settings.adv_clip_max)
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


__all__ = [
    "DiffusionNFT",
    "NFTConfig",
    "forward_noising",
    "nft_loss",
    "old_policy_decay",
    "optimality_probability",
    "update_old_policy_",
]
