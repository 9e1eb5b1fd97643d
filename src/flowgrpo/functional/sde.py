"""One reverse step of a flow-matching sampler with the exact log-density of the drawn sample.

Time runs from sigma = 1 (noise) to sigma = 0 (data); ``dt = sigma_next - sigma < 0``.
All math is in fp32 whatever the input dtype (bf16 overflows in the variance terms); fp64
inputs are computed in fp64 (tests use it to compare formulations without fp32 rounding).
See docs/math.md for the formulas; the symbols below follow it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

#: the step types ``sde_step_with_logprob`` takes
SDE_TYPES = ("sde", "cps", "ode")
#: the stochastic ones, which a rollout can record and train
ROLLOUT_SDE_TYPES = ("sde", "cps")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


class SDEStepOutput(NamedTuple):
    """prev_sample: x_next in the input dtype; log_prob [B] (mean over non-batch dims);
    prev_sample_mean: the Gaussian's mean (fp32); std_dev_t: std_t [B] (without sqrt(-dt) for
    "sde"; the full step std for "cps"; zeros for "ode")."""

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    prev_sample_mean: torch.Tensor
    std_dev_t: torch.Tensor


def _per_sample(
    value: float | torch.Tensor, batch: int, ndim: int, device, dtype=torch.float32
) -> torch.Tensor:
    """Scalar or [B] sigma -> tensor of ``dtype`` broadcastable against a [B, ...] sample."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.ndim == 0:
        t = t.expand(batch)
    t = t.reshape(-1)
    if t.numel() != batch:
        raise ValueError(f"sigma has {t.numel()} entries, expected 1 or batch size {batch}")
    return t.view(batch, *([1] * (ndim - 1)))


def _randn_like(x: torch.Tensor, generator) -> torch.Tensor:
    """Standard normal noise shaped like x; ``generator`` may be one Generator or one per sample,
    so a sample's noise does not depend on which batch it sits in."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != x.shape[0]:
            raise ValueError(f"got {len(generator)} generators for a batch of {x.shape[0]}")
        return torch.stack(
            [
                torch.randn(x.shape[1:], generator=g, dtype=torch.float32, device=g.device).to(
                    x.device
                )
                for g in generator
            ]
        )
    device = generator.device if generator is not None else x.device
    return torch.randn(x.shape, generator=generator, dtype=torch.float32, device=device).to(
        x.device
    )


def sde_step_with_logprob(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    *,
    noise_level: float,
    sde_type: str = "sde",
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    sigma_max: float | torch.Tensor | None = None,
) -> SDEStepOutput:
    """Step x_t -> x_{t+dt} with velocity ``model_output`` and return log p(x_{t+dt} | x_t).

    model_output, sample: [B, ...] (same shape). sigma, sigma_next: float or [B].
    noise_level: the "a" of the paper (0 => plain Euler). Given ``prev_sample``, no noise is
    drawn and its log-probability is returned (the training-time recomputation).
    sigma_max: replaces sigma in the "sde" noise scale where sigma == 1 (1 - sigma would be 0).
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde_type {sde_type!r}; expected one of {SDE_TYPES}")
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    if model_output.shape != sample.shape:
        raise ValueError(
            f"model_output shape {tuple(model_output.shape)} != sample shape {tuple(sample.shape)}"
        )
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"prev_sample shape {tuple(prev_sample.shape)} != sample shape {tuple(sample.shape)}"
        )
    batch, ndim, dtype = sample.shape[0], sample.ndim, sample.dtype
    compute = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    sig = _per_sample(sigma, batch, ndim, sample.device, compute)
    sig_next = _per_sample(sigma_next, batch, ndim, sample.device, compute)
    if bool((sig_next > sig).any()):
        raise ValueError("sigma_next must be <= sigma (time runs from noise to data)")

    x = sample.to(compute)
    v = model_output.to(compute)
    dt = sig_next - sig
    reduce_dims = tuple(range(1, ndim))

    if sde_type == "ode" or noise_level == 0:
        mean = x + v * dt
        std = torch.zeros_like(sig)
        out = mean if prev_sample is None else prev_sample.to(compute)
        # A Dirac has no density; report 0 so that ratios of deterministic steps are exactly 1.
        log_prob = torch.zeros(batch, dtype=compute, device=sample.device)
        return SDEStepOutput(out.to(dtype), log_prob, mean, std.view(batch))

    if sde_type == "sde":
        sig_for_std = sig
        if sigma_max is not None:
            smax = _per_sample(sigma_max, batch, ndim, sample.device, compute)
            sig_for_std = torch.where(sig >= 1.0, smax, sig)
        if bool((sig_for_std >= 1.0).any()):
            raise ValueError(
                "sigma == 1 makes the 'sde' noise scale infinite: pass sigma_max < 1 (the "
                "schedule's second sigma; a one-step schedule has none: use >= 2 steps)"
            )
        std_t = noise_level * torch.sqrt(sig / (1 - sig_for_std))
        mean = x * (1 + std_t**2 / (2 * sig) * dt) + v * (1 + std_t**2 * (1 - sig) / (2 * sig)) * dt
        step_std = std_t * torch.sqrt(-dt)
        reported_std = std_t
    else:  # cps: coefficients-preserving sampling
        step_std = sig_next * math.sin(noise_level * math.pi / 2)
        x0_hat = x - sig * v
        x1_hat = x + (1 - sig) * v
        mean = x0_hat * (1 - sig_next) + x1_hat * torch.sqrt(sig_next**2 - step_std**2)
        reported_std = step_std

    if prev_sample is None:
        noise = _randn_like(x, generator).to(compute)
        out = mean + step_std * noise
    else:
        out = prev_sample.to(compute)

    if sde_type == "sde":
        log_density = (
            -((out.detach() - mean) ** 2) / (2 * step_std**2) - torch.log(step_std) - _LOG_SQRT_2PI
        )
    else:  # the reference's CPS log-prob: no normalising constants (ratios are unchanged)
        log_density = -((out.detach() - mean) ** 2)
    log_prob = log_density.mean(dim=reduce_dims)
    return SDEStepOutput(out.to(dtype), log_prob, mean, reported_std.reshape(batch))
