"""The random streams of a run: every sample's noise is seeded from (seed, step, its global
index), so a step's samples are the same whatever the batch, the rank split or a resume.
"""

from __future__ import annotations

import torch

EVAL_SALT = 0x5EED_E7A1  # stream of the fixed eval noise (independent of the step)
SAMPLE_SALT = 0x5A4D_91E0  # stream of `flowgrpo sample`
GROUP_SALT = 0x6E0_0000_0000  # per-group streams (sample.same_latent), apart from sample indices


def sample_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit seed for sample ``index`` of ``step`` (splitmix64-style mixing, no collisions
    between neighbouring (step, index) pairs in practice)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + int(index)) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**63


def generators(
    seed: int, step: int, indices: list[int], device: torch.device | str
) -> list[torch.Generator]:
    """One generator per sample, seeded from (seed, step, global sample index): a sample's
    noise is the same whatever the batch, the rank or a resume."""
    out = []
    for i in indices:
        g = torch.Generator(device=device)
        g.manual_seed(sample_seed(seed, step, i))
        out.append(g)
    return out


def group_generators(
    seed: int, step: int, groups: list[int], device: torch.device | str
) -> list[torch.Generator]:
    """One generator per sample, seeded from (seed, step, the sample's group): every sample of a
    group draws the same initial noise, whatever the batch, the rank or a resume."""
    return generators(seed, step, [GROUP_SALT + int(g) for g in groups], device)


__all__ = [
    "EVAL_SALT",
    "GROUP_SALT",
    "SAMPLE_SALT",
    "generators",
    "group_generators",
    "sample_seed",
]
