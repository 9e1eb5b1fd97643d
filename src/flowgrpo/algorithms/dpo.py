"""Online Diffusion-DPO (Wallace et al., arXiv 2311.12908) on each step's rollout, as flow_grpo
ships it: each prompt group's best and worst samples form a preference pair, and the policy is
trained with the Diffusion-DPO loss against the frozen reference.

Transcribed from the authors' code, yifan123/flow_grpo @ ac4c86e (the newest commit in the
mirror; DPO added in 2d76907), ``scripts/train_sd3_dpo.py`` (line numbers below are that
file's), ``flow_grpo/stat_tracking.py`` (the pairs) and ``config/dpo.py`` (the settings):

    pairs  winner = argmax, loser = argmin of the group's rewards; all equal -> loser = the
           group's 1st sample, winner = its 2nd                    stat_tracking.py:42-56
    ε      ~ N(0, I), the SAME for winner and loser                 :884-886
    t      u = sigmoid(N(0, 1)) (logit-normal), i = int(1000·u), σ = the training scheduler's
           σ_i (SD3.5: shift 3), the SAME for winner and loser      :890-902
    x_t    = (1 − σ)·x0 + σ·ε,  target = ε − x0                      :903, :924
    err    = mean_d (v − target)², fp32, for θ and the reference (no grad)        :926-927
    loss   = −logsigmoid(−0.5·β·((err_θ,w − err_ref,w) − (err_θ,l − err_ref,l)))  :929-937

Training is CFG-free (the conditional velocity alone, :906-921); rollouts keep the sample
section's CFG and SDE (authors: guidance 4.5, noise 0.7, :617-631). A rollout's ``num_steps ×
timestep_fraction`` terms (fresh ε and t each) accumulate into one update (:871-952). β = 100
(config/dpo.py). The reference is never updated (``ref_update_step`` = 1e7 there): the LoRA
disabled, or the frozen initial weights of a full fine-tune. The authors' rollouts sample with
the reference (``set_adapter("ref")``, :618), so with the reference never updated their data
come from the base model; ``dpo.rollout_policy=policy`` samples with the current weights instead.

One departure: the authors' code keeps ``latents[-1]`` of the stacked [B, T+1, ...] latents
(:652), the last sample's trajectory rather than every sample's final latent; this file trains
on the final latents (``Trajectory.final_latents``), which is what the comment there and
Diffusion-DPO intend. docs/algorithms.md says when to use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from flowgrpo.algorithms.base import Algorithm
from flowgrpo.engine.dist import all_gather_object
from flowgrpo.functional.advantages import CombinedRewards, _group_index
from flowgrpo.models.base import PromptEmbeds
from flowgrpo.rollout import Trajectory
from flowgrpo.settings import between, gt, need, one_of, setting

# -- the math -----------------------------------------------------------------------------------


def dpo_pairs(rewards: torch.Tensor, group_ids: Sequence[Hashable] | torch.Tensor) -> torch.Tensor:
    """[N] tags: +1 for each group's winner (the first argmax of its rewards), -1 for its loser
    (the first argmin), 0 otherwise; a group whose rewards are all equal gets loser = its 1st
    sample and winner = its 2nd (the authors' rule, stat_tracking.py:47-50); a group of one
    sample gets no pair. Groups are in first-appearance order; "1st" is batch order."""
    r = torch.as_tensor(rewards).detach().double().reshape(-1).cpu()
    idx = _group_index(group_ids, r.numel())
    tags = torch.zeros(r.numel(), dtype=torch.float32)
    for g in idx.unique().tolist():
        members = torch.nonzero(idx == g).reshape(-1)
        if len(members) < 2:
            continue
        values = r[members]
        hi, lo = int(torch.argmax(values)), int(torch.argmin(values))
        if hi == lo:  # every reward equal
            lo, hi = 0, 1
        tags[members[hi]], tags[members[lo]] = 1.0, -1.0
    return tags


def scheduler_sigmas(shift: float, num_train_timesteps: int = 1000) -> torch.Tensor:
    """[num_train_timesteps] fp32: a fresh FlowMatchEulerDiscreteScheduler's ``sigmas`` (its
    __init__: s = linspace(1, T, T)[::-1] / T, then shift·s / (1 + (shift − 1)·s)), the table the
    authors index with the logit-normal draw (:897-902, ``get_sigmas``)."""
    if shift <= 0 or num_train_timesteps < 1:
        raise ValueError(
            f"need shift > 0 and num_train_timesteps >= 1, got {shift}, {num_train_timesteps}"
        )
    t = np.linspace(1, num_train_timesteps, num_train_timesteps, dtype=np.float32)[::-1].copy()
    s = torch.from_numpy(t).to(torch.float32) / num_train_timesteps
    return shift * s / (1 + (shift - 1) * s)


def logit_normal_sigmas(
    z: torch.Tensor,
    *,
    shift: float = 3.0,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    num_train_timesteps: int = 1000,
) -> torch.Tensor:
    """The authors' noise level from standard normal draws ``z`` [n]: u = sigmoid(mean + std·z)
    (diffusers' ``compute_density_for_timestep_sampling("logit_normal")``), index int(T·u) into
    ``scheduler_sigmas(shift, T)`` (:890-902). [n] fp32."""
    u = torch.sigmoid(logit_mean + logit_std * z.to(torch.float32))
    index = (u * num_train_timesteps).long().clamp(max=num_train_timesteps - 1)
    return scheduler_sigmas(shift, num_train_timesteps)[index.cpu()].to(z.device)


def diffusion_dpo_loss(
    v_w: torch.Tensor,
    v_l: torch.Tensor,
    ref_w: torch.Tensor,
    ref_l: torch.Tensor,
    target_w: torch.Tensor,
    target_l: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The Diffusion-DPO loss of a micro-batch of pairs (train_sd3_dpo.py:924-937).

    v_w, v_l: the policy's velocities for the winners and the losers [P, ...] (the only inputs
    that get a gradient); ref_w, ref_l: the reference's (detached here); target_w, target_l:
    ε − x0 of each. Errors are per-sample means of squares in fp32, as the authors compute them.
    Returns (mean over the pairs of −logsigmoid(−0.5·β·((θ_w − ref_w) − (θ_l − ref_l))), metrics
    named as the authors log them)."""
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    shapes = {tuple(t.shape) for t in (v_w, v_l, ref_w, ref_l, target_w, target_l)}
    if len(shapes) != 1:
        raise ValueError(
            f"winner, loser, reference and target tensors must share one shape, got {sorted(shapes)}"
        )

    def err(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((v.float() - target.float()) ** 2).reshape(v.shape[0], -1).mean(dim=1)

    model_w, model_l = err(v_w, target_w), err(v_l, target_l)
    ref_w_err, ref_l_err = err(ref_w.detach(), target_w), err(ref_l.detach(), target_l)
    w_diff, l_diff = model_w - ref_w_err, model_l - ref_l_err
    inside = -0.5 * beta * (w_diff - l_diff)
    loss = -F.logsigmoid(inside).mean()
    with torch.no_grad():
        metrics = {
            "model_w_err": model_w.mean(),
            "model_l_err": model_l.mean(),
            "ref_w_err": ref_w_err.mean(),
            "ref_l_err": ref_l_err.mean(),
            "w_l_diff": (w_diff - l_diff).mean(),
            "inside_term": inside.mean(),
            "implicit_acc": (inside > 0).float().mean(),
        }
    return loss, metrics


# -- the algorithm ----------------------------------------------------------------------------


def _moved(traj: Trajectory, device: torch.device | str) -> Trajectory:
    """``traj`` with every tensor (and the prompt embeddings) on ``device``."""
    out = {}
    for f in dataclasses.fields(traj):
        v = getattr(traj, f.name)
        if isinstance(v, (torch.Tensor, PromptEmbeds)):
            v = v.to(device)
        out[f.name] = v
    return Trajectory(**out)


KEYS = ("loss", "model_w_err", "model_l_err", "ref_w_err", "ref_l_err", "implicit_acc")
SALT = 0xD9_0C  # the stream of the training noise and noise levels, apart from the rollout's
SHADOW = "dpo_reference"  # a full fine-tune's rollouts from the reference (initial weights)


@dataclass
class DPOConfig:
    """Online Diffusion-DPO's settings: the authors' SD3.5-M values (yifan123/flow_grpo @
    ac4c86e, config/dpo.py ``geneval_sd3`` / ``pickscore_sd3``)."""

    beta: float = setting(100.0, "The DPO temperature beta (the authors: 100).", check=gt(0))
    timestep_fraction: float = setting(
        0.99,
        "Terms per pair and update: int(sample.num_steps x this), each a fresh noise and noise "
        "level (the authors: 0.99 of 40 steps = 39).",
        check=between(0, 1, lo_open=True),
    )
    time_shift: float = setting(
        3.0,
        "Shift of the training scheduler whose sigmas the logit-normal draw indexes "
        "(SD3.5's scheduler: 3).",
        check=gt(0),
    )
    logit_mean: float = setting(0.0, "Mean of the logit-normal noise-level draw.")
    logit_std: float = setting(1.0, "Std of the logit-normal noise-level draw.", check=gt(0))
    rollout_policy: str = setting(
        "reference",
        "Which weights sample the rollouts: `reference` (the authors': the never-updated "
        "reference, so the pairs come from the base model) or `policy` (the current weights).",
        check=one_of("reference", "policy"),
    )


class DPO(Algorithm):
    #: off-policy rollouts (``trainer.off_policy_steps=1``) are right as is: Diffusion-DPO has
    #: no importance ratio; it contrasts the policy with the frozen reference on preference
    #: pairs, whoever sampled them (its offline form trains on a fixed data set), and the
    #: authors' rollouts already come from another policy (the reference).
    off_policy_refusal = None
    name = "dpo"
    settings_class = DPOConfig
    shadows = (SHADOW,)  # used by a full fine-tune with rollout_policy=reference

    @staticmethod
    def needs_reference(settings) -> bool:
        return True  # the loss is relative to the reference

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuse groups of one (no pair) and a term count of zero."""
        s = cfg.sample
        need(
            s.group_size >= 2,
            "sample.group_size",
            ">= 2 with algorithm=dpo (a pair per group)",
            s.group_size,
        )
        terms = int(s.num_steps * cfg.dpo.timestep_fraction)
        need(
            terms >= 1,
            "dpo.timestep_fraction",
            f"large enough that int(sample.num_steps {s.num_steps} x it) >= 1",
            cfg.dpo.timestep_fraction,
        )

    def __init__(self, cfg, engine, adapter) -> None:
        super().__init__(cfg, engine, adapter)
        self.reference = None
        if self.settings.rollout_policy == "reference" and not engine.use_lora:
            self.reference = engine.shadow(SHADOW)  # the initial weights, never blended

    def advantages(
        self,
        rewards: Mapping[str, torch.Tensor],
        weights: Mapping[str, float],
        group_ids: Sequence[Hashable] | torch.Tensor,
    ) -> CombinedRewards:
        """The weighted reward, and as "advantages" the pair tags (``dpo_pairs``): +1 winner,
        -1 loser, 0 not trained."""
        combined = super().advantages(rewards, weights, group_ids)
        return CombinedRewards(combined.reward, dpo_pairs(combined.reward, group_ids))

    @classmethod
    def overlap_refusal(cls, cfg) -> str | None:
        """LoRA reference rollouts switch the LoRA off in the trained model (a flag, not
        param values): a copy of the model would not see it."""
        if cfg.dpo.rollout_policy == "reference" and cfg.lora.enabled:
            return (
                "with LoRA its reference rollouts switch the LoRA off in the trained model, "
                "which the copy does not see; dpo.rollout_policy=policy can overlap"
            )
        return None

    def rollout_weights(self) -> contextlib.AbstractContextManager:
        """``reference``: the reference samples (LoRA disabled, or the initial weights swapped
        in); ``policy``: the live weights (or their EMA with ``sample.use_ema_for_rollout``)."""
        if self.settings.rollout_policy == "policy":
            return super().rollout_weights()
        if self.reference is not None:
            return self.reference.swapped()
        return self.engine.reference_transformer()

    # -- pairs over the ranks --------------------------------------------------------------------
    def pairs(
        self, trajectory: Trajectory, tags: torch.Tensor, seeds: torch.Tensor
    ) -> tuple[Trajectory | None, Trajectory | None, torch.Tensor, torch.Tensor]:
        """(winners, losers, pair seeds, this rank's pair rows): every pair of the global batch
        (winner and loser may sit on different ranks: the tagged samples are all-gathered), in
        global order, and the contiguous share of them this rank trains. A winner and a loser of
        the same prompt pair up in order (the authors key groups by prompt)."""
        if not bool(((tags == 0) | (tags == 1) | (tags == -1)).all()):
            raise ValueError("dpo's update takes pair tags (+1 winner, -1 loser, 0) as advantages")
        rows = torch.nonzero(tags != 0).reshape(-1).cpu()
        # only what the loss reads travels: the final latents, the prompts and their embeddings
        local = dataclasses.replace(
            trajectory.select(rows), latents=trajectory.latents[rows, :1], images=None, means=None
        )
        mine = (local, tags[rows.to(tags.device)].cpu(), seeds[rows])
        parts = [mine]
        if self.engine.dp_size > 1:  # an SP group's ranks hold the same samples: one each
            parts = all_gather_object((_moved(local, "cpu"), *mine[1:]))[:: self.engine.sp_size]
        parts = [p for p in parts if len(p[0])]
        if not parts:
            return None, None, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        every = _moved(Trajectory.cat([p[0] for p in parts]), trajectory.latents.device)
        all_tags = torch.cat([p[1] for p in parts])
        all_seeds = torch.cat([p[2] for p in parts])
        winners, losers, by_prompt = [], [], {}
        for i, (prompt, tag) in enumerate(zip(every.prompts, all_tags.tolist(), strict=True)):
            by_prompt.setdefault(prompt, ([], []))[0 if tag > 0 else 1].append(i)
        for w, lo in by_prompt.values():
            winners += w[: len(lo)]
            losers += lo[: len(w)]
        n = len(winners)
        per = -(-n // self.engine.dp_size)  # contiguous shares keep the global pair order
        start = min(n, self.engine.dp_rank * per)
        share = torch.arange(start, min(n, start + per))
        return every.select(winners), every.select(losers), all_seeds[winners], share

    def update(
        self,
        trajectory: Trajectory,
        advantages: torch.Tensor,
        *,
        step: int,
        sample_seeds: Sequence[int],
    ) -> dict[str, float]:
        """Optimizer steps over this rank's share of the batch's pairs, each term one (pair,
        noise, noise level)."""
        tags, seeds = self.per_sample_inputs(trajectory, advantages, sample_seeds)
        winners, losers, pair_seeds, share = self.pairs(trajectory, tags, seeds)
        terms = int(self.cfg.sample.num_steps * self.settings.timestep_fraction)
        if winners is None:
            return {**self.summarize([], KEYS), "pairs_trained": 0.0}

        def micro_loss(sub, index, scale, k):
            return self.pair_loss(
                sub, losers.select(index), pair_seeds[index.to(pair_seeds.device)], k
            )

        steps, total = self.update_loop(winners, share, KEYS, micro_loss, terms)
        out = self.summarize(steps, KEYS)
        out["pairs_trained"] = float(total)
        return out

    def draws(
        self, seeds: torch.Tensor, k: int, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(noise [P, ...], sigma [P]) of term k of each pair, from the pair's seed (the
        winner's sample seed): the same whatever the batch, the rank or a resume."""
        s, noise, z = self.settings, [], []
        for seed in seeds.tolist():
            g = torch.Generator().manual_seed((seed * 1_000_003 + k * 7919 + SALT) % 2**63)
            z.append(torch.randn((), generator=g, dtype=torch.float32))
            noise.append(torch.randn(like.shape[1:], generator=g, dtype=torch.float32))
        sigma = logit_normal_sigmas(
            torch.stack(z), shift=s.time_shift, logit_mean=s.logit_mean, logit_std=s.logit_std
        )
        dtype = torch.promote_types(like.dtype, torch.float32)
        return torch.stack(noise).to(like.device, dtype), sigma.to(like.device)

    def pair_loss(
        self, win: Trajectory, lose: Trajectory, seeds: torch.Tensor, k: int
    ) -> list[torch.Tensor]:
        """[loss, model_w_err, model_l_err, ref_w_err, ref_l_err, implicit_acc] of term k of
        the micro-batch's pairs: one noise and one noise level per pair, shared by both."""
        engine = self.engine
        x_w = win.final_latents.to(torch.promote_types(win.final_latents.dtype, torch.float32))
        x_l = lose.final_latents.to(x_w.dtype)
        eps, sigma = self.draws(seeds, k, x_w)
        t = sigma.to(x_w).view(-1, *([1] * (x_w.ndim - 1)))

        def velocities(model):  # CFG-free: the conditional velocity alone (guidance 1)
            out = []
            for sub, x0 in ((win, x_w), (lose, x_l)):
                x_t = (1 - t) * x0 + t * eps
                out.append(
                    self.adapter.velocity(
                        model,
                        x_t,
                        sigma,
                        sub.prompt_embeds,
                        None,
                        guidance_scale=1.0,
                        height=sub.height,
                        width=sub.width,
                    )  # fmt: skip
                )
            return out

        with torch.no_grad(), engine.reference_transformer() as ref:
            ref_w, ref_l = velocities(ref)
        v_w, v_l = velocities(engine.model)
        loss, m = diffusion_dpo_loss(
            v_w, v_l, ref_w, ref_l, eps - x_w, eps - x_l, beta=self.settings.beta
        )
        return [loss, *(m[key] for key in KEYS[1:])]


__all__ = [
    "DPO",
    "DPOConfig",
    "diffusion_dpo_loss",
    "dpo_pairs",
    "logit_normal_sigmas",
    "scheduler_sigmas",
]
