"""Sample images (videos) with an SDE sampler and record the trained steps the algorithms
train on (``Trajectory``).

``step_from_velocity`` is the single implementation of "guided velocity -> SDE step ->
log-prob": the rollout (``sample_trajectories``) calls it on the adapter's velocity without
grad, the training pass (``trajectory_log_prob`` via ``policy_step``, velocity + that step)
with grad on the recorded latents, so the two can only differ by the transformer's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from flowgrpo.functional.sde import SDEStepOutput, sde_step_with_logprob
from flowgrpo.functional.tree import BranchSpec
from flowgrpo.models.base import DiffusionAdapter, PromptEmbeds

Generators = torch.Generator | list[torch.Generator] | None


@dataclass(frozen=True)
class SDEWindow:
    """Flow-GRPO-Fast: SDE only on ``size`` consecutive steps whose start is drawn per sample
    uniformly in [lo, hi - size] (hi exclusive; None = the last stochastic step + 1)."""

    size: int
    lo: int = 0
    hi: int | None = None

    def drawn_once(self, available: int, *, seed: int, step: int) -> SDEWindow:
        """The window with its start drawn once for training step ``step``, uniformly in
        [lo, hi - size], from ``seed`` and ``step`` alone (every sample and rank of the step
        shares it, a resumed run draws it again): Flow-Factory's draw (one set of SDE steps
        per epoch from ``seed + epoch``), which flow_grpo's Fast pipelines make once per
        rollout batch. ``available``: the stochastic steps (hi's default)."""
        hi = available if self.hi is None else self.hi
        if self.size < 1 or self.lo < 0 or hi - self.size < self.lo:
            raise ValueError(f"sde_window {self} does not fit in {available} stochastic steps")
        g = torch.Generator().manual_seed((int(seed) * 1_000_003 + int(step)) % 2**63)
        start = int(torch.randint(self.lo, hi - self.size + 1, (1,), generator=g))
        return SDEWindow(self.size, start, start + self.size)


@dataclass
class Trajectory:
    """A rollout batch of B samples with K trained (SDE) steps each.

    latents [B, K+1, ...]: latents[:, k] before trained step k, latents[:, k+1] after it.
    log_probs, sigmas, sigmas_next, timesteps, step_indices: [B, K].
    final_latents: pipeline ``output_type="latent"`` layout; images [B, C, H, W] in [0, 1]
    (video adapters: videos [B, C, F, H, W], and ``num_frames`` = F; None for images).
    means [B, K, ...]: each trained step's Gaussian mean, when recorded (GRPO-Guard).
    branching: the tree of a branching rollout (rows = whole trees' leaves, in order: a shared
    step is recorded, identical, on every row under it); None for independent samples.
    """

    prompts: list[str]
    latents: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    sigmas_next: torch.Tensor
    timesteps: torch.Tensor
    step_indices: torch.Tensor
    prompt_embeds: PromptEmbeds
    negative_embeds: PromptEmbeds | None
    final_latents: torch.Tensor
    images: torch.Tensor | None
    sigma_max: float
    height: int
    width: int
    guidance_scale: float
    noise_level: float
    sde_type: str
    num_frames: int | None = None
    means: torch.Tensor | None = None
    branching: BranchSpec | None = None

    def __len__(self) -> int:
        return self.latents.shape[0]

    @property
    def num_train_steps(self) -> int:
        return self.log_probs.shape[1]

    def select(self, index: torch.Tensor | slice | list[int]) -> Trajectory:
        """Rows ``index`` of every per-sample field (prompt padding trimmed to the subset)."""
        if isinstance(index, list):
            index = torch.tensor(index, dtype=torch.long)
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v[index]
            elif isinstance(v, PromptEmbeds):
                v = v.select(index)
            elif f.name == "prompts":
                rows = range(len(v))[index] if isinstance(index, slice) else index.tolist()
                v = [self.prompts[i] for i in rows]
            out[f.name] = v
        return Trajectory(**out)

    def cells(self, rows: torch.Tensor, steps: torch.Tensor) -> Trajectory:
        """Trained step ``steps[i]`` of sample ``rows[i]``, for each i, as a trajectory of one
        trained step per row (latents [C, 2, ...]: before and after it): a branching update
        packs a tree's edges, whatever their step, into full micro-batches."""
        r, k = torch.as_tensor(rows).long().cpu(), torch.as_tensor(steps).long().cpu()
        per_step = ("log_probs", "sigmas", "sigmas_next", "timesteps", "step_indices", "means")
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "latents":
                rv, kv = r.to(v.device), k.to(v.device)
                v = torch.stack([v[rv, kv], v[rv, kv + 1]], dim=1)
            elif f.name in per_step and v is not None:
                v = v[r.to(v.device), k.to(v.device)][:, None]
            elif isinstance(v, torch.Tensor):
                v = v[r.to(v.device)]
            elif isinstance(v, PromptEmbeds):
                v = v.select(r)
            elif f.name == "prompts":
                v = [self.prompts[i] for i in r.tolist()]
            elif f.name == "branching":
                v = None
            out[f.name] = v
        return Trajectory(**out)

    @staticmethod
    def cat(parts: list[Trajectory]) -> Trajectory:
        """Concatenate rollout chunks along the batch (settings must agree)."""
        first = parts[0]
        out: dict[str, Any] = {}
        for f in fields(first):
            vals = [getattr(p, f.name) for p in parts]
            if f.name == "prompts":
                out[f.name] = [s for v in vals for s in v]
            elif isinstance(vals[0], torch.Tensor):
                out[f.name] = torch.cat(vals)
            elif isinstance(vals[0], PromptEmbeds):
                out[f.name] = PromptEmbeds.cat(vals)
            elif vals[0] is None:
                out[f.name] = None
            else:
                if any(v != vals[0] for v in vals):
                    raise ValueError(f"cannot concatenate trajectories with different {f.name}")
                out[f.name] = vals[0]
        return Trajectory(**out)


def policy_step(
    adapter: DiffusionAdapter,
    transformer: torch.nn.Module,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    embeds: PromptEmbeds,
    negative_embeds: PromptEmbeds | None,
    *,
    guidance_scale: float,
    noise_level: float,
    sde_type: str,
    height: int,
    width: int,
    sigma_max: float | None = None,
    prev_sample: torch.Tensor | None = None,
    generator: Generators = None,
    stochastic: torch.Tensor | None = None,
    cfg_grad: str = "both",
) -> SDEStepOutput:
    """Guided velocity at (latents, sigma [B]) then one step to sigma_next [B] with log-prob.

    With grad enabled the gradient flows through both guidance branches (``cfg_grad="both"``)
    or, opt-in, through the conditional one only (``"cond_only"``, see
    ``DiffusionAdapter.velocity``).

    ``stochastic`` [B] bool marks the samples that take an SDE step; the others take the
    deterministic Euler step (log_prob 0) and draw no noise, so a per-sample generator is only
    consumed where noise is used. None = all stochastic.
    """
    v = adapter.velocity(
        transformer,
        latents,
        sigma,
        embeds,
        negative_embeds,
        guidance_scale=guidance_scale,
        height=height,
        width=width,
        cfg_grad=cfg_grad,
    )
    return step_from_velocity(
        v,
        latents,
        sigma,
        sigma_next,
        noise_level=noise_level,
        sde_type=sde_type,
        sigma_max=sigma_max,
        prev_sample=prev_sample,
        generator=generator,
        stochastic=stochastic,
    )


def step_from_velocity(
    v: torch.Tensor,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    *,
    noise_level: float,
    sde_type: str,
    sigma_max: float | None = None,
    prev_sample: torch.Tensor | None = None,
    generator: Generators = None,
    stochastic: torch.Tensor | None = None,
) -> SDEStepOutput:
    """The second half of ``policy_step``: the step from a guided velocity ``v``, SDE for the
    ``stochastic`` samples [B] (None = all), Euler for the others."""
    step = dict(noise_level=noise_level, sde_type=sde_type, sigma_max=sigma_max)
    if stochastic is None or bool(stochastic.all()):
        return sde_step_with_logprob(
            v, latents, sigma, sigma_next, prev_sample=prev_sample, generator=generator, **step
        )
    euler = sde_step_with_logprob(v, latents, sigma, sigma_next, noise_level=0.0, sde_type="ode")
    if not bool(stochastic.any()):
        return euler
    idx = stochastic.nonzero().squeeze(1)
    gens = [generator[i] for i in idx.tolist()] if isinstance(generator, list) else generator
    sub = sde_step_with_logprob(
        v[idx],
        latents[idx],
        sigma[idx],
        sigma_next[idx],
        prev_sample=None if prev_sample is None else prev_sample[idx],
        generator=gens,
        **step,
    )
    prev, logp = euler.prev_sample.clone(), euler.log_prob.clone()
    mean, std = euler.prev_sample_mean.clone(), euler.std_dev_t.clone()
    prev[idx], logp[idx], mean[idx], std[idx] = (
        sub.prev_sample,
        sub.log_prob,
        sub.prev_sample_mean,
        sub.std_dev_t,
    )
    return SDEStepOutput(prev, logp, mean, std)


def trained_step_count(
    num_steps: int,
    *,
    window_size: int | None,
    timestep_fraction: float,
    deterministic_last_step: bool,
) -> int:
    """K, the steps of one sample that a rollout of ``num_steps`` records for training: the
    window's size, else the first ``timestep_fraction`` of the stochastic steps (rounded
    down, at least 1). What ``sample_trajectories`` trains and the memory planner counts."""
    available = num_steps - 1 if deterministic_last_step else num_steps
    if available < 1:
        raise ValueError(
            f"num_steps={num_steps} leaves no stochastic step to train "
            "(the last step is deterministic): use num_steps >= 2"
        )
    if window_size is not None:
        return window_size
    if not 0 < timestep_fraction <= 1:
        raise ValueError(f"timestep_fraction must be in (0, 1], got {timestep_fraction}")
    return max(1, int(available * timestep_fraction))


def _trained_steps(
    batch: int,
    num_steps: int,
    *,
    sde_window: SDEWindow | None,
    timestep_fraction: float,
    deterministic_last_step: bool,
    generator: Generators,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(start [B], span, K): each sample's first stochastic step, the number of stochastic
    steps from it, and K, the trained ones (the first K of them, rounded down from
    ``timestep_fraction`` of the span, at least 1: ``trained_step_count``). Without
    ``sde_window`` every sample's stochastic steps are all but the last
    (``deterministic_last_step``), from step 0; with it they are the window, its start drawn
    per sample from ``generator``, and K its size."""
    k = trained_step_count(
        num_steps,
        window_size=None if sde_window is None else sde_window.size,
        timestep_fraction=timestep_fraction,
        deterministic_last_step=deterministic_last_step,
    )
    available = num_steps - 1 if deterministic_last_step else num_steps
    if sde_window is None:
        start = torch.zeros(batch, dtype=torch.long)
        return start, available, k
    size, lo = sde_window.size, sde_window.lo
    hi = available if sde_window.hi is None else sde_window.hi
    if size < 1 or lo < 0 or hi > available or hi - size < lo:
        raise ValueError(
            f"sde_window (size={size}, lo={lo}, hi={hi}) must fit inside the {available} "
            f"stochastic steps: need 1 <= size <= hi - lo and 0 <= lo, hi <= {available}"
        )
    if isinstance(generator, list):
        start = torch.cat(
            [
                torch.randint(lo, hi - size + 1, (1,), generator=g, device=g.device)
                for g in generator
            ]
        ).cpu()
    else:
        gen_device = generator.device if generator is not None else "cpu"
        start = torch.randint(lo, hi - size + 1, (batch,), generator=generator, device=gen_device)
    return start.cpu(), size, size


@torch.no_grad()
def sample_trajectories(
    adapter: DiffusionAdapter,
    prompts: list[str],
    *,
    num_steps: int,
    guidance_scale: float,
    noise_level: float,
    sde_type: str = "sde",
    height: int,
    width: int,
    latents: torch.Tensor | None = None,
    generator: Generators = None,
    sde_window: SDEWindow | None = None,
    negative_prompts: list[str] | None = None,
    timestep_fraction: float = 1.0,
    deterministic_last_step: bool = True,
    transformer: torch.nn.Module | None = None,
    decode: bool = True,
    num_frames: int | None = None,
    sigmas: torch.Tensor | None = None,
    ode_solver: str = "euler",
    record_means: bool = False,
    init_generator: Generators = None,
    images: list[list[torch.Tensor]] | None = None,
    branching: BranchSpec | None = None,
) -> Trajectory:
    """Generate B = len(prompts) images (videos of ``num_frames`` frames for video adapters,
    whose default applies when None) and record the K trained SDE steps of each.

    Stochastic steps: the SDE window of each sample if ``sde_window`` is given, else every
    step (but the last when ``deterministic_last_step``); the first ``timestep_fraction`` of
    them are trained (recorded). Other steps are plain Euler (ODE) steps, or with
    ``ode_solver="dpm2"`` DPM-Solver++ 2M steps once no stochastic step is left (MixGRPO-Flash's
    tail; every step of an ODE rollout). ``sigmas`` [N + 1] replaces the pipeline's schedule
    (then N is its length - 1). ``record_means`` keeps each trained step's Gaussian mean
    (``Trajectory.means``, the old policy's, for GRPO-Guard). ``generator`` may be a list with
    one generator per sample: a sample is then reproducible in any batch. ``init_generator``
    (default: ``generator``) draws the initial latents when ``latents`` is None: one generator
    per group seed gives every sample of a group the same starting noise (``sample.same_latent``).
    ``images``: an editing adapter's source images, one list of [3, H, W] tensors in [0, 1]
    per prompt; encoded once with the prompts and recorded in ``prompt_embeds``.

    ``branching``: the B samples are B / L trees of L = ``branching.leaves`` leaves (rows of a
    tree consecutive, one prompt each): a tree starts from its first row's initial noise and
    its nodes split at the trained step offsets ``branching.split_steps``, so each transformer
    call serves every leaf under the node (one per node and step). A node draws its noise from
    its first leaf's generator (a split's child j from its own first leaf's), so a tree is
    reproducible in any batch. Every row records its path; ``Trajectory.branching`` says so.
    """
    if ode_solver not in ("euler", "dpm2"):
        raise ValueError(f"ode_solver must be 'euler' or 'dpm2', got {ode_solver!r}")
    transformer = transformer if transformer is not None else adapter.transformer
    batch = len(prompts)
    if isinstance(generator, list) and len(generator) != batch:
        raise ValueError(f"got {len(generator)} generators for {batch} prompts")
    num_frames = adapter.check_num_frames(num_frames)  # None for image adapters
    video = {} if num_frames is None else {"num_frames": num_frames}
    embeds, negative = adapter.encode(
        prompts, negative_prompts, guidance_scale=guidance_scale, images=images
    )
    if sigmas is None:
        schedule = adapter.schedule(num_steps, height, width)
        sigmas, timesteps = schedule.sigmas.float().cpu(), schedule.timesteps.float().cpu()
    else:
        sigmas = torch.as_tensor(sigmas).float().cpu().reshape(-1)
        num_steps = len(sigmas) - 1
        timesteps = sigmas[:-1] * adapter.pipe.scheduler.config.num_train_timesteps
    sigma_max = float(sigmas[1]) if len(sigmas) > 2 else float(sigmas[0])
    if latents is None:
        init = generator if init_generator is None else init_generator
        latents = adapter.prepare_latents(batch, height, width, init, **video)
    # trajectories are fp32 (fp64 stays fp64) whatever the transformer's dtype: a bf16 latent
    # would make the training pass recompute a different log-prob than the rollout drew
    latents = latents.to(adapter.device, torch.promote_types(latents.dtype, torch.float32))
    start, span, k = _trained_steps(
        batch,
        num_steps,
        sde_window=sde_window,
        timestep_fraction=timestep_fraction,
        deterministic_last_step=deterministic_last_step,
        generator=generator,
    )

    # the frontier: one row per node (per sample without branching); reps[j] = its first leaf
    reps, splits, span_now = torch.arange(batch), {}, 1
    if branching is not None:
        span_now = branching.leaves
        reps, splits = _tree_frontier(branching, prompts, start, k)
        latents = latents[reps.to(latents.device)]
    node_embeds, node_negative = embeds, negative
    if span_now > 1:
        node_embeds = embeds.select(reps)
        node_negative = None if negative is None else negative.select(reps)

    # with dpm2, the deterministic steps from here on (after every sample's last SDE step)
    tail_from = int((start + span).max()) if noise_level > 0 else 0
    x, prev_x0 = latents, None
    spans, all_latents, all_log_probs, all_means = [span_now], [x], [], []
    for i in range(num_steps):
        nodes = len(reps)
        sig = sigmas[i].expand(nodes).to(x.device)
        stochastic = ((start <= i) & (i < start + span))[reps].to(x.device)
        if noise_level <= 0:
            stochastic = torch.zeros_like(stochastic)
        v = adapter.velocity(
            transformer,
            x,
            sig,
            node_embeds,
            node_negative,
            guidance_scale=guidance_scale,
            height=height,
            width=width,
        )
        factor = splits.get(i, 1)
        if factor > 1:  # one velocity, ``factor`` children: each draws its own noise
            span_now //= factor
            reps = (reps[:, None] + span_now * torch.arange(factor)[None, :]).reshape(-1)
            x, v = x.repeat_interleave(factor, 0), v.repeat_interleave(factor, 0)
            stochastic = stochastic.repeat_interleave(factor, 0)
            sig = sigmas[i].expand(len(reps)).to(x.device)
            node_embeds = embeds.select(reps) if span_now > 1 else embeds
            node_negative = negative
            if negative is not None and span_now > 1:
                node_negative = negative.select(reps)
            if prev_x0 is not None:
                prev_x0 = prev_x0.repeat_interleave(factor, 0)
        sig_next = sigmas[i + 1].expand(len(reps)).to(x.device)
        gens = generator  # a node draws from its first leaf's generator
        if branching is not None and isinstance(generator, list):
            gens = [generator[r] for r in reps.tolist()]
        if ode_solver == "dpm2" and i >= tail_from:
            out = _dpm2_step(v, x, float(sigmas[i]), float(sigmas[i + 1]), prev_x0, sigmas, i)
        else:
            out = step_from_velocity(
                v,
                x,
                sig,
                sig_next,
                noise_level=noise_level,
                sde_type=sde_type,
                sigma_max=sigma_max,
                generator=gens,
                stochastic=stochastic,
            )
        if ode_solver == "dpm2":
            prev_x0 = x - float(sigmas[i]) * v  # the data prediction, DPM-Solver's history
        x = out.prev_sample
        spans.append(span_now)
        all_latents.append(x)
        all_log_probs.append(out.log_prob)
        if record_means:
            all_means.append(out.prev_sample_mean)
    if branching is not None:  # every row its path: node j covers rows j * span ...
        leaf = torch.arange(batch)
        all_latents = [t[(leaf // s).to(t.device)] for t, s in zip(all_latents, spans)]
        all_log_probs = [t[(leaf // s).to(t.device)] for t, s in zip(all_log_probs, spans[1:])]
        all_means = [t[(leaf // s).to(t.device)] for t, s in zip(all_means, spans[1:])]

    rows = torch.arange(batch)[:, None]
    steps = start[:, None] + torch.arange(k)[None, :]  # [B, K] trained step indices
    stacked = torch.stack(all_latents, dim=1)  # [B, N+1, ...]
    log_probs = torch.stack(all_log_probs, dim=1)  # [B, N]
    trajectory_latents = stacked[rows, torch.cat([steps, steps[:, -1:] + 1], dim=1)]
    means = torch.stack(all_means, dim=1)[rows, steps] if record_means else None
    return Trajectory(
        prompts=list(prompts),
        latents=trajectory_latents,
        log_probs=log_probs.cpu()[rows, steps].to(x.device),
        sigmas=sigmas[steps].to(x.device),
        sigmas_next=sigmas[steps + 1].to(x.device),
        timesteps=timesteps[steps].to(x.device),
        step_indices=steps.to(x.device),
        prompt_embeds=embeds,
        negative_embeds=negative,
        final_latents=x,
        images=adapter.decode(x, height, width) if decode else None,
        sigma_max=sigma_max,
        height=height,
        width=width,
        guidance_scale=guidance_scale,
        noise_level=noise_level,
        sde_type=sde_type,
        num_frames=num_frames,
        means=means,
        branching=branching,
    )


def _tree_frontier(
    spec: BranchSpec, prompts: list[str], start: torch.Tensor, k: int
) -> tuple[torch.Tensor, dict[int, int]]:
    """The roots' rows (each tree's first) and {step index: factor} of a branching rollout;
    ValueError when the rows are not whole trees of one prompt, the trees' SDE windows differ
    or a split falls outside the K trained steps."""
    batch, leaves = len(prompts), spec.leaves
    if batch % leaves:
        raise ValueError(
            f"a branching rollout needs whole trees: {batch} samples are not a multiple of the "
            f"tree's {leaves} leaves (sample.rollout_batch_size and each rank's share of the "
            "step must be)"
        )
    if spec.split_steps[-1] >= k:
        raise ValueError(
            f"split step {spec.split_steps[-1]} is outside the {k} trained SDE steps "
            "(sample.branching.split_steps count from the first one)"
        )
    roots = torch.arange(0, batch, leaves)
    for r in roots.tolist():
        if any(p != prompts[r] for p in prompts[r : r + leaves]):
            raise ValueError(
                f"the samples {r}..{r + leaves - 1} of one tree have different prompts"
            )
    first = int(start[0])
    if bool((start != first).any()):
        raise ValueError(
            "a branching rollout needs one SDE window for all its samples: use "
            "sample.window_draw=step"
        )
    return roots, {first + s: f for s, f in zip(spec.split_steps, spec.factors)}


def _dpm2_step(v, x, sigma, sigma_next, prev_x0, sigmas, i) -> SDEStepOutput:
    """A deterministic DPM-Solver++ 2M step (second order when the previous step's data
    prediction exists) as an SDEStepOutput with log_prob 0."""
    from flowgrpo.functional.dpm_solver import dpm_solver_2m_step

    hist = {}
    if prev_x0 is not None and i > 0:
        hist = {"prev_x0": prev_x0, "sigma_prev": float(sigmas[i - 1])}
    out = dpm_solver_2m_step(v, x, sigma, sigma_next, **hist)
    zeros = torch.zeros(x.shape[0], dtype=out.prev_sample.dtype, device=x.device)
    return SDEStepOutput(out.prev_sample, zeros, out.prev_sample, zeros)


def trajectory_log_prob(
    adapter: DiffusionAdapter,
    transformer: torch.nn.Module,
    trajectory: Trajectory,
    step: int,
    index: torch.Tensor | slice | None = None,
    *,
    cfg_grad: str = "both",
) -> SDEStepOutput:
    """Recompute log p(latents[:, step+1] | latents[:, step]) for samples ``index`` under
    ``transformer`` (grad flows when enabled, through both guidance branches unless
    ``cfg_grad="cond_only"``): the training-time twin of the rollout step."""
    traj = trajectory if index is None else trajectory.select(index)
    return policy_step(
        adapter,
        transformer,
        traj.latents[:, step],
        traj.sigmas[:, step],
        traj.sigmas_next[:, step],
        traj.prompt_embeds,
        traj.negative_embeds,
        guidance_scale=traj.guidance_scale,
        noise_level=traj.noise_level,
        sde_type=traj.sde_type,
        height=traj.height,
        width=traj.width,
        sigma_max=traj.sigma_max,
        prev_sample=traj.latents[:, step + 1],
        cfg_grad=cfg_grad,
    )
