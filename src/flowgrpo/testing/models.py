"""Tiny models for tests: the real tiny diffusers pipelines (``flowgrpo.testing.tiny``), a
transformer-only SD3 adapter for engine tests (no text encoder, no VAE: a forward costs a few
milliseconds) and a saved random-weight toy for runs that must not depend on the shipped asset."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from flowgrpo.models.base import DiffusionAdapter, PromptEmbeds, Schedule
from flowgrpo.testing.tiny import kinds, tiny_pipeline, tiny_size

__all__ = [
    "TinyAdapter",
    "kinds",
    "random_toy_path",
    "tiny_pipeline",
    "tiny_size",
]


class _Pipe:
    """Just enough of a pipeline for the adapter base class."""

    def __init__(self, transformer: torch.nn.Module):
        self.transformer = transformer


class TinyAdapter(DiffusionAdapter):
    """An SD3Transformer2DModel (2 blocks, 4 latent channels) whose prompt embeddings come from a
    fixed random table and whose "decode" is the identity: the engine's tests train it, where
    the text encoder and VAE of ``tiny_pipeline("sd3")`` would only cost time."""

    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out")

    def __init__(self, seed: int = 0):
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

        g = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            transformer = SD3Transformer2DModel(
                sample_size=8,
                patch_size=2,
                in_channels=4,
                out_channels=4,
                num_layers=2,
                num_attention_heads=2,
                attention_head_dim=8,
                joint_attention_dim=16,
                caption_projection_dim=16,
                pooled_projection_dim=16,
                pos_embed_max_size=8,
            )
        super().__init__(_Pipe(transformer))
        self.table = torch.randn(64, 3, 16, generator=g)  # [vocab, L, D]
        self.pooled = torch.randn(64, 16, generator=g)
        self.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        ids = torch.tensor([sum(map(ord, p)) % 64 for p in prompts])
        return PromptEmbeds(self.table[ids], None, self.pooled[ids])

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        self.scheduler.set_timesteps(num_steps)
        return Schedule(self.scheduler.sigmas.float().clone(), self.scheduler.timesteps.float())

    def prepare_latents(self, batch_size, height, width, generator=None) -> torch.Tensor:
        return torch.randn(batch_size, 4, height, width, generator=generator)

    def forward(self, transformer, latents, sigma, embeds, *, height, width, guidance_scale):
        return transformer(
            hidden_states=latents,
            timestep=sigma * 1000.0,
            encoder_hidden_states=embeds.embeds,
            pooled_projections=embeds.pooled,
            return_dict=False,
        )[0]

    def decode(self, latents, height, width) -> torch.Tensor:
        return latents.float().cpu()


_RANDOM_TOY: str | None = None


def random_toy_path() -> str:
    """A saved toy pipeline with random weights (seed 0), made once per process: runs that must
    not depend on the shipped pretrained asset point ``model.path`` at it."""
    global _RANDOM_TOY
    if _RANDOM_TOY is None:
        from flowgrpo.toy.pipeline import ToyDigitsPipeline

        path = Path(tempfile.mkdtemp(prefix="flowgrpo-random-toy-")) / "toy"
        ToyDigitsPipeline.from_config(seed=0).save_pretrained(path)
        _RANDOM_TOY = str(path)
    return _RANDOM_TOY
