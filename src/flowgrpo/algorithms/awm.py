"""Advantage Weighted Matching (Xue et al., arXiv 2509.25050; scxue/advantage_weighted_matching):
the pretraining flow-matching loss, weighted by the sample's advantage.

The rollout keeps only the clean samples x0 (no log-probs are trained on). Training re-noises
x0 at ``train_timesteps`` of the rollout's own noise levels (one per stratum of the first
``timestep_fraction`` of the schedule) with fresh noise; the "log-probability" of a sample is
minus its (robustly weighted) flow-matching error, and the loss is a PPO-style surrogate on it
(on-policy: its gradient is -A times the gradient of that log-probability). Two velocity
penalties keep the policy close: to the base model (``kl_beta``) and to a slowly moving copy
of the policy (``ema_kl_beta``, the authors' "KL-EMA, mimic TRPO"). docs/math.md states the
math.

Transcribed from the authors' code, scxue/advantage_weighted_matching @ be51372 (the newest
commit: "update default kl beta of geneval config"), ``scripts/train_sd3_awm.py`` (line numbers
below are that file's; the settings are ``config/dgx_awm.py``):

    x_t    = (1 − t)·x0 + t·ε,   ε ~ N(0, I) fresh per (sample, t)              :1268
    mse    = mean_d (v_θ(x_t, t) − (ε − x0))²          (float64)                  :238-239
    log p  = −((mse + 1e-10)^p − 1e-10^p)·t / p         ("ghuber", p = 0.25)       :248-249
    A      = clamp(A, ±adv_clip_max) / adv_clip_max · advantage_max              :1293-1299
    ratio  = exp(log p − sg(log p_old))      (= 1 on-policy: log p_old = sg(log p))  :1306-1308
    L_pol  = mean max(−A·ratio, −A·clamp(ratio, 1 − c, 1 + c))                    :1318-1327
    KL     = mean mean_d (v_θ − v_ref)²,  KL_ema = mean mean_d (v_θ − v_ema)²      :1330-1349
    loss   = L_pol + β·KL + β_ema·KL_ema          (KL_ema only when β > 0, as there)

After each rollout's update the EMA policy moves toward the current one:
ema ← d·ema + (1 − d)·θ with d = min(kl_ema_decay, 0.001·optimizer_steps) (:1408-1418).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flowgrpo.algorithms.base import Algorithm, RolloutPlan
from flowgrpo.rollout import Trajectory, trained_step_count
from flowgrpo.settings import between, ge, gt, need, one_of, setting

# -- the math -----------------------------------------------------------------------------------

WEIGHTINGS = ("ghuber", "uniform", "t", "t2", "huber")
TIME_TYPES = ("discrete_wo_init", "discrete")
KL_WEIGHTS = ("uniform", "elbo")
EMA_DECAY_TYPES = ("linear", "constant")
_EPS = 1e-10  # the authors' offset inside the (generalized) Huber root


def awm_log_prob(
    v: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    *,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
) -> torch.Tensor:
    """[B]: minus the weighted flow-matching error of velocity ``v`` against the target
    ``noise - x0`` at noise level ``sigma`` [B] (train_sd3_awm.py:236-252, ``compute_log_prob_awm``).
    Computed in float64 as the authors do (``noise_pred.double()``)."""
    if not (v.shape == x0.shape == noise.shape):
        raise ValueError(
            f"v {tuple(v.shape)}, x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} differ"
        )
    t = torch.as_tensor(sigma, device=v.device).double().reshape(-1)
    if t.numel() != v.shape[0]:
        raise ValueError(f"sigma has {t.numel()} entries for a batch of {v.shape[0]}")
    err = -((v.double() - (noise.double() - x0.double())) ** 2)
    lp = err.mean(dim=tuple(range(1, err.ndim)))
    if weighting == "uniform":
        return lp
    if weighting == "t":
        return lp * t
    if weighting == "t2":
        return lp * t**2
    if weighting == "huber":
        return -(torch.sqrt(-lp + _EPS) - 1e-5) * t
    if weighting == "ghuber":
        p = ghuber_power
        floor = torch.pow(torch.tensor(_EPS, dtype=lp.dtype, device=lp.device), p)
        return -(torch.pow(-lp + _EPS, p) - floor) * t / p
    raise ValueError(f"unknown weighting {weighting!r}; one of {', '.join(WEIGHTINGS)}")


def elbo_std(sigma: torch.Tensor) -> torch.Tensor:
    """The authors' per-level std for the ``elbo`` KL weight: sqrt(t / (1 − clamp(t, 0, 0.99)))·0.7
    (train_sd3_awm.py:236), in sigma's own dtype (fp32 there) as the authors compute it."""
    t = torch.as_tensor(sigma)
    return torch.sqrt(t / (1 - torch.clamp(t, 0, 0.99))) * 0.7


def _velocity_gap(
    v: torch.Tensor, other: torch.Tensor, sigma: torch.Tensor, weight: str
) -> torch.Tensor:
    """[B]: mean_d (v − other)², divided by 2·std² with the ``elbo`` weight (:1334-1348)."""
    gap = (v.double() - other.detach().double()) ** 2
    gap = gap.mean(dim=tuple(range(1, gap.ndim)))
    if weight == "uniform":
        return gap
    if weight == "elbo":
        return gap / (2 * elbo_std(sigma.to(gap.device).reshape(-1)) ** 2)
    raise ValueError(f"unknown KL weight {weight!r}; one of {', '.join(KL_WEIGHTS)}")


def awm_advantages(
    advantages: torch.Tensor, adv_clip_max: float = 5.0, advantage_max: float = 1.0
) -> torch.Tensor:
    """clamp(A, ±adv_clip_max) / adv_clip_max · advantage_max (train_sd3_awm.py:1293-1299)."""
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0, got {adv_clip_max}")
    a = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    return a / adv_clip_max * advantage_max


def awm_loss(
    v: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    advantages: torch.Tensor,
    *,
    old_log_prob: torch.Tensor | None = None,
    v_ref: torch.Tensor | None = None,
    v_ema: torch.Tensor | None = None,
    weighting: str = "ghuber",
    ghuber_power: float = 0.25,
    adv_clip_max: float = 5.0,
    advantage_max: float = 1.0,
    clip_range: float = 1.0,
    kl_beta: float = 0.0,
    kl_weight: str = "uniform",
    ema_kl_beta: float = 0.0,
    ema_kl_weight: str = "uniform",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The AWM loss of one micro-batch at one noise level each (train_sd3_awm.py:1291-1352).

    v: the current policy's velocity at x_t = (1 − sigma)·x0 + sigma·noise [B, ...] (the only
    input that gets a gradient); sigma [B]; advantages [B] (the group advantages, clipped and
    scaled here); old_log_prob [B]: ``awm_log_prob`` of the policy that sampled (None: on-policy,
    the detached current one, as the authors' single optimizer step per rollout uses);
    v_ref / v_ema: the reference's and the EMA policy's velocities (needed when their betas
    are > 0). The EMA term is added only when ``kl_beta > 0``, as in the authors' code.
    Returns the float64 loss and detached metrics named as the authors log them."""
    if advantages.shape != (v.shape[0],):
        raise ValueError(f"advantages must be [B] = [{v.shape[0]}], got {tuple(advantages.shape)}")
    if kl_beta > 0 and v_ref is None:
        raise ValueError("kl_beta > 0 needs v_ref (the reference policy's velocity)")
    if kl_beta > 0 and ema_kl_beta > 0 and v_ema is None:
        raise ValueError("ema_kl_beta > 0 needs v_ema (the EMA policy's velocity)")
    lp = awm_log_prob(v, x0, noise, sigma, weighting=weighting, ghuber_power=ghuber_power)
    old = lp.detach() if old_log_prob is None else old_log_prob.detach().to(lp)
    adv = awm_advantages(advantages.to(lp.device), adv_clip_max, advantage_max)
    ratio = torch.exp(lp - old)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped, clipped))
    loss = policy_loss
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    kl = ema_kl = zero
    if kl_beta > 0:
        kl = _velocity_gap(v, v_ref, sigma, kl_weight).mean()
        loss = loss + kl_beta * kl
        if ema_kl_beta > 0:
            ema_kl = _velocity_gap(v, v_ema, sigma, ema_kl_weight).mean()
            loss = loss + ema_kl_beta * ema_kl
    with torch.no_grad():
        metrics = {
            "policy_loss": policy_loss.detach(),
            "kl_loss": kl.detach(),
            "ema_kl_loss": ema_kl.detach(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).double().mean(),
            "log_prob": lp.detach().mean(),
        }
    return loss, metrics


def awm_timestep_indices(
    num_steps: int,
    train_timesteps: int,
    timestep_fraction: float,
    rand_u: torch.Tensor,
    time_type: str = "discrete_wo_init",
) -> torch.Tensor:
    """[train_timesteps] indices into the rollout's schedule: one per stratum of
    [first, int(num_steps·fraction)) (first = 1 for ``discrete_wo_init``: never the pure-noise
    level; 0 for ``discrete``), at ``rand_u`` [train_timesteps] in [0, 1)
    (train_sd3_awm.py:1172-1205)."""
    if time_type not in TIME_TYPES:
        raise ValueError(f"unknown time_type {time_type!r}; one of {', '.join(TIME_TYPES)}")
    first = 1 if time_type == "discrete_wo_init" else 0
    top = int(num_steps * timestep_fraction)
    bounds = torch.linspace(first, top, steps=train_timesteps + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (rand_u * (upper - lower)).long()


def ema_kl_decay(step: int, kl_ema_decay: float = 0.3, decay_type: str = "linear") -> float:
    """d in ema <- d·ema + (1 − d)·θ after ``step`` optimizer steps: min(kl_ema_decay,
    0.001·step) (``linear``) or kl_ema_decay (``constant``) (train_sd3_awm.py:1408-1413)."""
    if decay_type == "constant":
        return kl_ema_decay
    if decay_type == "linear":
        return min(kl_ema_decay, 0.001 * step)
    raise ValueError(f"unknown decay type {decay_type!r}; one of {', '.join(EMA_DECAY_TYPES)}")


# -- the algorithm ----------------------------------------------------------------------------

KEYS = ("loss", "policy_loss", "kl", "ema_kl", "clipfrac", "log_prob")
SALT = 0xA3_57  # the stream of the training noise and noise levels, apart from the rollout's
SHADOW = "awm_ema"  # the engine's name for the EMA policy of the KL-EMA term (checkpointed)


@dataclass
class AWMConfig:
    """Advantage Weighted Matching's settings: the authors' SD3.5-M GenEval defaults
    (scxue/advantage_weighted_matching @ be51372, config/dgx_awm.py ``geneval_sd3_no_cfg_1node``)."""

    train_timesteps: int = setting(
        6, "Noise levels trained per sample and update (one per stratum).", check=ge(1)
    )
    timestep_fraction: float = setting(
        0.9,
        "The trained noise levels come from the first int(num_steps x this) of the schedule.",
        check=between(0, 1, lo_open=True),
    )
    time_type: str = setting(
        "discrete_wo_init",
        "`discrete_wo_init`: strata start at the 2nd level (GenEval, OCR); `discrete`: at the "
        "1st (PickScore).",
        check=one_of(*TIME_TYPES),
    )
    weighting: str = setting(
        "ghuber",
        "The flow-matching error's weighting: `ghuber` (generalized Huber x t), `huber`, "
        "`uniform`, `t` or `t2`.",
        check=one_of(*WEIGHTINGS),
    )
    ghuber_power: float = setting(0.25, "The generalized Huber's power p.", check=gt(0))
    adv_clip_max: float = setting(5.0, "Advantages are clamped to +-this ...", check=gt(0))
    advantage_max: float = setting(1.0, "... then scaled to +-this.", check=gt(0))
    clip_range: float = setting(
        1.0, "The PPO clip of the ratio (never bites on-policy).", check=gt(0)
    )
    kl_beta: float = setting(
        0.001,
        "Weight of mean (v_theta - v_ref)^2 to the base model (GenEval 0.001, OCR 0.003, "
        "PickScore 1e-4); 0 also turns the EMA term off, as in the authors' code.",
        check=ge(0),
    )
    kl_weight: str = setting(
        "uniform", "The KL's per-level weight: `uniform` or `elbo`.", check=one_of(*KL_WEIGHTS)
    )
    ema_kl_beta: float = setting(
        1.0, "Weight of mean (v_theta - v_ema)^2 to the EMA policy.", check=ge(0)
    )
    ema_kl_weight: str = setting(
        "uniform", "The EMA term's per-level weight.", check=one_of(*KL_WEIGHTS)
    )
    ema_kl_decay: float = setting(
        0.3, "The EMA policy's decay cap d (ema <- d ema + (1 - d) new).", check=between(0, 1)
    )
    ema_kl_decay_type: str = setting(
        "linear",
        "`linear`: d = min(ema_kl_decay, 0.001 x optimizer steps); `constant`: ema_kl_decay.",
        check=one_of(*EMA_DECAY_TYPES),
    )
    noise_level: float = setting(
        0.4,
        "Rollout stochasticity (the authors' SA-Solver tau, 0.4 for GenEval/OCR, 0 for "
        "PickScore); here the sample section's SDE at this level, 0 = ODE.",
        check=ge(0),
    )
    guidance_scale: float = setting(
        1.0, "CFG scale of rollouts, training and eval (the authors: 1, no CFG).", check=ge(0)
    )
    ode_solver: str = setting(
        "dpm2",
        "The solver of the rollout's deterministic steps: `dpm2` or `euler`.",
        check=one_of("euler", "dpm2"),
    )


class AWM(Algorithm):
    #: refused: its "old" log p is recomputed from the live weights before the update (or
    #: taken equal to the new one), i.e. it assumes the rollout was made by them; its log p is
    #: a flow-matching error, not the sampler's density, so no behaviour log-prob is recorded
    #: to correct a lagging rollout with
    off_policy_refusal = (
        "its ratio's old log p is recomputed from the live weights: it assumes an on-policy "
        "rollout and the sampler records no log p of its own"
    )
    name = "awm"
    settings_class = AWMConfig
    shadows = (SHADOW,)  # the EMA policy of the KL-EMA term

    @staticmethod
    def needs_reference(settings) -> bool:
        return settings.kl_beta > 0

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse the sample settings AWM's rollouts would ignore: the SDE window,
        ``timestep_fraction`` (``awm.timestep_fraction`` picks the trained levels) and EMA
        rollouts (the authors sample with the live policy)."""
        s = cfg.sample
        need(s.window_size == 0, "sample.window_size", "0 with algorithm=awm", s.window_size)
        need(
            s.timestep_fraction == 1.0,
            "sample.timestep_fraction",
            "1 with algorithm=awm (awm.timestep_fraction sets the levels trained)",
            s.timestep_fraction,
        )
        need(
            not s.use_ema_for_rollout,
            "sample.use_ema_for_rollout",
            "false with algorithm=awm (the authors' rollouts are on-policy)",
            s.use_ema_for_rollout,
        )
        a = cfg.awm
        first = 1 if a.time_type == "discrete_wo_init" else 0
        top = int(s.num_steps * a.timestep_fraction)  # as awm_timestep_indices strata them
        levels = f"int(sample.num_steps {s.num_steps} x awm.timestep_fraction) = {top}"
        need(
            top > first,
            "awm.timestep_fraction",
            f"large enough to leave a level to train: {levels}, but the strata start at level "
            f"{first} (awm.time_type {a.time_type}; level 0 is pure noise)",
            a.timestep_fraction,
        )
        need(
            a.train_timesteps <= top - first,
            "awm.train_timesteps",
            f"<= {top - first}, the levels in [{first}, {top}) ({levels}): more would train "
            "the same levels twice",
            a.train_timesteps,
        )

    @classmethod
    def eval_guidance_scale(cls, cfg) -> float:
        """Eval at ``awm.guidance_scale`` unless ``sample.eval_guidance_scale`` says otherwise."""
        return cfg.awm.guidance_scale

    def __init__(self, cfg, engine, adapter) -> None:
        super().__init__(cfg, engine, adapter)
        self.ema_policy = engine.shadow(SHADOW)  # created now so that checkpoints restore it

    @classmethod
    def rollout_guidance_scale(cls, cfg) -> float:
        """Rollouts sample at ``awm.guidance_scale``."""
        return cfg.awm.guidance_scale

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
        plan.noise_level, plan.sde_window, plan.timestep_fraction = (
            self.settings.noise_level,
            None,
            1.0,
        )
        plan.ode_solver = self.settings.ode_solver
        return plan

    def rollout_weights(self) -> contextlib.AbstractContextManager:
        """On-policy: the live weights (the authors' ``off_policy=False``)."""
        return contextlib.nullcontext()

    def update(
        self,
        trajectory: Trajectory,
        advantages: torch.Tensor,
        *,
        step: int,
        sample_seeds: Sequence[int],
    ) -> dict[str, float]:
        """Optimizer steps on this rank's samples, each term one (sample, noise level) pair;
        then the EMA policy moves toward the new one."""
        adv, seeds = self.per_sample_inputs(trajectory, advantages, sample_seeds)
        levels = self.noise_levels(seeds, self.cfg.sample.num_steps, trajectory.num_train_steps)
        old = None
        if self.cfg.update.num_minibatches > 1:  # later steps see the sampling policy's log p
            old = self.old_log_probs(trajectory, seeds, levels)

        def micro_loss(sub, index, scale, k):
            o = None if old is None else old[index.to(old.device), k]
            return self.step_loss(
                sub, adv[index.to(adv.device)], seeds[index], levels[index, k], k, o
            )

        rows = torch.arange(len(trajectory))
        steps, total = self.update_loop(trajectory, rows, KEYS, micro_loss, levels.shape[1])
        out = self.summarize(steps, KEYS)
        s = self.settings
        decay = ema_kl_decay(self.engine.optimizer_steps, s.ema_kl_decay, s.ema_kl_decay_type)
        self.ema_policy.blend_(1.0 - decay)
        out.update(samples_trained=float(total), ema_kl_decay=decay)
        return out

    def noise_levels(self, seeds: torch.Tensor, num_steps: int, available: int) -> torch.Tensor:
        """[B, train_timesteps]: the schedule indices each sample trains on, stratified as the
        authors draw them, from the sample's own seed (the authors draw one set per
        micro-batch; per sample keeps 2 ranks = 1 process)."""
        s = self.settings
        out = []
        for seed in seeds.tolist():
            g = torch.Generator().manual_seed((seed * 2_000_003 + SALT) % 2**63)
            u = torch.rand(s.train_timesteps, generator=g)
            out.append(
                awm_timestep_indices(
                    num_steps, s.train_timesteps, s.timestep_fraction, u, s.time_type
                )
            )
        idx = torch.stack(out)
        if int(idx.max()) >= available:
            raise ValueError(
                f"awm trains schedule index {int(idx.max())} but the rollout recorded "
                f"{available} levels: lower awm.timestep_fraction"
            )
        return idx

    def noise(self, seeds: torch.Tensor, k: int, like: torch.Tensor) -> torch.Tensor:
        """Fresh noise for term k of each sample, from the sample's own seed."""
        out = []
        for s in seeds.tolist():
            g = torch.Generator().manual_seed((s * 1_000_003 + k * 7919 + SALT) % 2**63)
            out.append(torch.randn(like.shape[1:], generator=g, dtype=torch.float32))
        return torch.stack(out).to(like.device, torch.promote_types(like.dtype, torch.float32))

    def _inputs(self, sub: Trajectory, seeds: torch.Tensor, level: torch.Tensor, k: int):
        rows = torch.arange(len(sub), device=sub.sigmas.device)
        x0 = sub.final_latents.to(torch.promote_types(sub.final_latents.dtype, torch.float32))
        sigma = sub.sigmas[rows, level.to(rows.device)]
        eps = self.noise(seeds, k, x0)
        t = sigma.to(x0).view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1 - t) * x0 + t * eps
        kw = dict(guidance_scale=sub.guidance_scale, height=sub.height, width=sub.width)

        def velocity(model):
            return self.adapter.velocity(
                model, x_t, sigma, sub.prompt_embeds, sub.negative_embeds, **kw
            )

        return x0, eps, sigma, velocity

    @torch.no_grad()
    def old_log_probs(
        self, trajectory: Trajectory, seeds: torch.Tensor, levels: torch.Tensor
    ) -> torch.Tensor:
        """[B, n]: log p of the sampling (pre-update) policy for every term (the authors'
        "old log_probs" pass)."""
        s, mb = self.settings, self.cfg.update.micro_batch_size
        out = torch.zeros(levels.shape, dtype=torch.float64)
        for lo in range(0, len(trajectory), mb):
            index = torch.arange(lo, min(lo + mb, len(trajectory)))
            sub = trajectory.select(index)
            for k in range(levels.shape[1]):
                x0, eps, sigma, velocity = self._inputs(sub, seeds[index], levels[index, k], k)
                lp = awm_log_prob(
                    velocity(self.engine.model),
                    x0,
                    eps,
                    sigma,
                    weighting=s.weighting,
                    ghuber_power=s.ghuber_power,
                )
                out[index, k] = lp.cpu()
        return out

    def step_loss(
        self,
        sub: Trajectory,
        adv: torch.Tensor,
        seeds: torch.Tensor,
        level: torch.Tensor,
        k: int,
        old: torch.Tensor | None,
    ) -> list[torch.Tensor]:
        """[loss, policy_loss, kl, ema_kl, clipfrac, log_prob] of the k-th trained term."""
        s, engine = self.settings, self.engine
        x0, eps, sigma, velocity = self._inputs(sub, seeds, level, k)
        v_ref = v_ema = None
        with torch.no_grad():
            if s.kl_beta > 0:
                with engine.reference_transformer() as ref:
                    v_ref = velocity(ref)
                if s.ema_kl_beta > 0:
                    with self.ema_policy.swapped():
                        v_ema = velocity(engine.model)
        v = velocity(engine.model)
        loss, m = awm_loss(
            v,
            x0,
            eps,
            sigma,
            adv,
            old_log_prob=None if old is None else old.to(v.device),
            v_ref=v_ref,
            v_ema=v_ema,
            weighting=s.weighting,
            ghuber_power=s.ghuber_power,
            adv_clip_max=s.adv_clip_max,
            advantage_max=s.advantage_max,
            clip_range=s.clip_range,
            kl_beta=s.kl_beta,
            kl_weight=s.kl_weight,
            ema_kl_beta=s.ema_kl_beta,
            ema_kl_weight=s.ema_kl_weight,
        )
        return [
            loss,
            m["policy_loss"],
            m["kl_loss"],
            m["ema_kl_loss"],
            m["clipfrac"],
            m["log_prob"],
        ]


__all__ = [
    "AWM",
    "AWMConfig",
    "awm_advantages",
    "awm_log_prob",
    "awm_loss",
    "awm_timestep_indices",
    "ema_kl_decay",
    "elbo_std",
]
