"""Qwen-Image 2.1 (diffusers ``QwenImage21Pipeline``): a Qwen-Image adapter with 2.1's pieces.

Mirrors ``QwenImage21Pipeline.__call__`` of diffusers 0.42.1 (text-to-image) piece by piece;
what differs from Qwen-Image (``qwen_image.py``, subclassed for the rest):

- prompts: a raw Qwen3-VL template (system "Comprehend and analyze the provided prompt."),
  left-padded tokens, the last decoder layer's hidden states before the final norm, the system
  turn dropped; the pipeline's ``encode_prompt`` does all of it. No ``max_sequence_length``.
- latents are unpatched: [B, h w, C] with h = 2 (H // 32), w = 2 (W // 32), C = the VAE's
  ``z_dim`` (64); each of the text encoder's image slots stands for 2x2 latent tokens.
- schedule: the pipeline's ``sample_sigmas`` when its length is the step count, else
  linspace(1, 1/N, N); ``mu = calculate_shift(h w, scheduler config)`` (every latent token,
  not Qwen-Image's 2x2 patches).
- the transformer (single stream, block-causal) gets ``timestep / 1000``, ``img_shapes``
  [(1, h, w)], ``img_mask`` (text slots False, then h w / 4 image slots True) and returns the
  joint sequence, of which the last h w tokens are the velocity.
- guidance: plain true CFG, ``v_u + g (v_c - v_u)`` (no norm rescale); off by default
  (``true_cfg_scale=1``: the model is meant to be sampled without guidance).
- the VAE is RGBA (4 channels); ``decode`` returns RGB (the alpha channel is dropped).

Text padding moves the image: the rotary frame position of the target image is the length
of the (padded) text before it, so the stock pipeline's rows depend on the batch's longest
prompt. ``forward`` runs each group of equal-length prompts unpadded (as the pipeline run on
those prompts alone): batch invariant, and equal to the stock pipeline whenever its batch
has no padding (tests/models/test_qwen_image21.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from flowgrpo.models.base import (
    DiffusionAdapter,
    PromptEmbeds,
    Schedule,
    SizeRule,
    TokenCounts,
    param_dtype,
)
from flowgrpo.models.parallel import SequenceParallelSpec, pad_tokens
from flowgrpo.models.qwen_image import QwenImageAdapter, load_vl_processor


# -- sequence parallelism: a block-causal CP processor, a cp plan, trailing text padding -------
def block_causal_mask(
    segments: list[tuple[int, int, bool]],
    key_valid: torch.Tensor | None,
    seq_len: int,
    device: torch.device,
) -> torch.Tensor:
    """The dense boolean form [B or 1, 1, S, S] (True = attend) of Qwen-Image 2.1's attention
    over the whole joint sequence: ``(q >= k) or same image block``, keys where ``key_valid``.

    ``segments`` are the model's prefix runs (``_qwenimage21_prefix_segments``: text runs causal,
    condition-image runs bidirectional); the target image after the prefix sees every key.
    Padding appended after the target (``QwenImage21SequenceParallel.pad_text``: the trailing
    keys ``key_valid`` marks invalid) is counted in the model's prefix length, whose last run
    then holds the target's first tokens: the prefix is shortened by that padding, found on the
    device (no sync). Padded queries are causal (they see every real key: no empty row)."""
    idx = torch.arange(seq_len, device=device)
    prefix = torch.tensor(segments[-1][1] if segments else 0, device=device)
    pad = torch.zeros((), dtype=torch.long, device=device)
    if key_valid is not None:
        last = torch.where(key_valid.any(0), idx, -1).max()
        pad = seq_len - 1 - last
    prefix = prefix - pad
    end = idx + 1  # keys [0, end) per query: causal by default (text, trailing padding)
    for start, stop, is_text in segments:
        if not is_text:  # a condition image sees its whole block (not the miscounted run)
            end[start:stop] = torch.where(start < prefix, stop, end[start:stop])
    target = (idx >= prefix) & (idx < seq_len - pad)
    end = torch.where(target, seq_len, end)
    mask = (idx[None, :] < end[:, None])[None, None]
    if key_valid is not None:
        mask = mask & key_valid.bool()[:, None, None, :]
    return mask


class CPQwenImage21AttnProcessor:
    """``QwenImage21AttnProcessor``'s prefill (the same projections, norms and RoPE:
    diffusers' ``_qwenimage21_prepare_qkv``) as one ``dispatch_attention_fn`` call with the
    block-causal structure as a dense mask (``block_causal_mask``), so that diffusers' Ulysses
    attention, which gathers the whole sequence for a share of the heads, applies it. The stock
    processor slices the joint sequence by global positions, which a rank's chunk does not
    have. No KV cache."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: Any | None = None,
        rotary_emb: torch.Tensor | None = None,
        layer_cache: Any | None = None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: list[tuple[int, int, bool]] | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.transformers.transformer_qwenimage21 import (
            _qwenimage21_prepare_qkv,
        )

        if layer_cache is not None or kv_cache_mode is not None or segments is None:
            raise ValueError("Qwen-Image 2.1 under sequence parallelism: no KV cache, no flex mask")
        query, key, value, _ = _qwenimage21_prepare_qkv(
            attn, hidden_states, rotary_emb, None, None, None
        )
        cp = getattr(self._parallel_config, "context_parallel_config", None)
        world = 1 if cp is None else cp._flattened_mesh.size()
        mask = block_causal_mask(
            segments, key_valid, hidden_states.shape[1] * world, hidden_states.device
        )
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class QwenImage21SequenceParallel(SequenceParallelSpec):
    """Qwen-Image 2.1 under Ulysses SP. ``QwenImage21Transformer2DModel`` (no ``_cp_plan`` in
    diffusers 0.42.1) builds one joint sequence [text, target image] inside ``forward``; every
    block gets it with its RoPE [S, D/2], its per-token modulation rows (``target_token_mask``
    [S]) and the full-length key mask. The plan splits the sequence where it enters block 0,
    RoPE and the modulation mask at every block and at ``norm_out``, and gathers after
    ``proj_out``; ``CPQwenImage21AttnProcessor`` applies the block-causal mask densely.

    Padding: the target image's RoPE frame position is the text length before it, so text
    cannot be padded in place. The padding goes after the target image instead: ``img_mask``
    gains trailing text slots, ``encoder_hidden_states`` zeros, and
    ``encoder_hidden_states_mask`` (given in ``img_mask``'s layout, which the model reads it
    in) marks them invalid keys. The model's output then has the padding after the image: the
    adapter reads the image at ``[text, text + image)``."""

    name = "qwen_image21"
    transformer_class = "QwenImage21Transformer2DModel"
    image_token_rule = "latent h x w, unpatched"

    def cp_plan(self, transformer: nn.Module) -> dict[str, Any]:
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        seq = ContextParallelInput(split_dim=0, expected_dims=1)  # [S] modulation rows
        return {
            "transformer_blocks.0": {
                "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)
            },
            "transformer_blocks.*": {
                "rotary_emb": ContextParallelInput(split_dim=0, expected_dims=2),
                "target_token_mask": seq,
            },
            "norm_out": {"target_token_mask": seq},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def attention_processor(self, module: nn.Module) -> CPQwenImage21AttnProcessor:
        return CPQwenImage21AttnProcessor()

    def pad_text(self, kwargs: dict[str, Any], pad: int) -> dict[str, Any]:
        """``pad`` masked text tokens after the target image (see the class docstring)."""
        if kwargs.get("kv_cache") is not None:
            raise ValueError("Qwen-Image 2.1 under sequence parallelism: no KV cache")
        kwargs = dict(kwargs)
        ehs, img_mask = kwargs["encoder_hidden_states"], kwargs["img_mask"]
        batch, n = ehs.shape[:2]
        mask = kwargs.get("encoder_hidden_states_mask")
        if mask is None:
            mask = torch.ones(batch, n, dtype=torch.bool, device=ehs.device)
        slots = img_mask.shape[1] - n  # the target image's slots
        kwargs["encoder_hidden_states"] = pad_tokens(ehs, pad, 1)
        kwargs["img_mask"] = pad_tokens(img_mask, pad, 1)
        kwargs["encoder_hidden_states_mask"] = pad_tokens(mask.bool(), slots + pad, 1)
        return kwargs


class QwenImage21Adapter(QwenImageAdapter):
    """Adapter for ``diffusers.QwenImage21Pipeline`` (text-to-image)."""

    lora_target_modules = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "img_mlp.proj",
        "img_mlp.gate_layer",
        "img_mlp.out",
    )
    batch_cfg = True  # ``forward`` groups rows by text length, so any batch is exact
    sequence_parallel = QwenImage21SequenceParallel()
    default_negative_prompt = " "  # the pipeline encodes "" as " " anyway

    def __init__(self, pipe: Any):
        DiffusionAdapter.__init__(self, pipe)

    @classmethod
    def load_components(cls, root: Any) -> dict[str, Any]:
        """The Qwen3-VL ``processor`` from the folder's image processor, tokenizer and chat
        template (``load_vl_processor``): loading it whole needs torchvision for its video
        processor, which the pipeline never uses."""
        from transformers import Qwen3VLProcessor

        return load_vl_processor(root, Qwen3VLProcessor)

    # -- text ---------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Qwen3-VL hidden states -> embeds [B, L, D] and mask [B, L] (long, left-aligned)."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        device = next(self.pipe.text_encoder.parameters()).device
        embeds, mask, _ = self.pipe.encode_prompt(list(prompts), device=device)
        if mask is None:  # the pipeline drops an all-ones mask; keep it so batches can be padded
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return PromptEmbeds(embeds.to(self.device), mask.to(self.device), None)

    # -- schedule and latents -----------------------------------------------------------------
    @classmethod
    def prompt_tokens(cls, max_sequence_length: int | None) -> tuple[int, int]:
        """Qwen3-VL hidden states: ~512 tokens planned (no truncation), 4096 wide."""
        return max_sequence_length or 512, 4096

    @classmethod
    def token_counts(
        cls, configs: dict[str, Any], height: int, width: int, options: dict[str, Any]
    ) -> TokenCounts:
        """A single-stream transformer on the joint sequence text + h w latent tokens (the
        text's image slots expand into the latents): every block's Linears see all of them, so
        the planner counts them as one sequence (``image``; ``text`` 0). Latents unpatched,
        h = H / 16, ``z_dim`` channels."""
        vae = configs.get("vae", {})
        f = int(vae.get("scale_factor_spatial", 16))
        channels = int(vae.get("z_dim", 64))
        prompt = cls.prompt_tokens(options.get("max_sequence_length"))
        tokens = (height // f) * (width // f)
        return TokenCounts(tokens + prompt[0], 0, channels * tokens, prompt)

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Multiples of 32: the VAE's x16 and the 2x2 latent groups of an image slot."""
        return SizeRule("Qwen-Image 2.1", (32, 32), "VAE 16 x 2x2 image slots")

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """sigmas [N+1] (final 0 included) and timesteps [N], exactly as the pipeline."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        lh, lw = self._latent_hw(height, width)
        sigmas = self.pipe.config.get("sample_sigmas")
        if sigmas is None or len(sigmas) != num_steps:
            sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        return self.shifted_schedule(num_steps, sigmas, image_seq_len=lh * lw)

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Noise [B, h w, C] drawn as the pipeline draws it (same generator use), fp32,
        contiguous."""
        self._check_size(height, width)
        latents, _ = self.pipe.prepare_latents(
            None,
            batch_size,
            self.transformer.config.in_channels,
            height,
            width,
            torch.float32,
            self.device,
            generator,
        )
        # the pipeline's packing is a transposed view: a contiguous copy (same values), so that
        # the rollout's log-prob reductions run in the layout of the stored trajectory
        return latents.contiguous()

    # -- the model ----------------------------------------------------------------------------
    def forward(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeds: PromptEmbeds,
        *,
        height: int,
        width: int,
        guidance_scale: float,
    ) -> torch.Tensor:
        """Transformer calls on latents [B, S, C] at sigma [B] -> velocity [B, S, C]: one per
        text length, each on its rows' unpadded text (no mask, as the pipeline)."""
        lh, lw = self._latent_hw(height, width)
        batch, seq = latents.shape[:2]
        if len(embeds) != batch:
            raise ValueError(f"{len(embeds)} prompt embeddings for a batch of {batch} latents")
        dtype = param_dtype(transformer)
        # sigma * 1000 cast to the latents' dtype, then / 1000, as the pipeline's timestep
        t = (sigma.float() * self.pipe.scheduler.config.num_train_timesteps).to(dtype)
        text = embeds.embeds.to(dtype)
        full = text.shape[1]
        lengths = embeds.mask.sum(1) if embeds.mask is not None else torch.full([batch], full)
        out: torch.Tensor | None = None
        for n in sorted({int(x) for x in lengths.tolist()}):
            rows = (lengths == n).nonzero().flatten().to(latents.device)
            every = len(rows) == batch
            img_mask = torch.cat(
                [
                    torch.zeros(len(rows), n, dtype=torch.bool, device=latents.device),
                    torch.ones(len(rows), seq // 4, dtype=torch.bool, device=latents.device),
                ],
                dim=1,
            )
            v = transformer(
                hidden_states=(latents if every else latents[rows]).to(dtype),
                timestep=(t if every else t[rows]) / 1000,
                encoder_hidden_states=(text if every else text[rows])[:, :n],
                encoder_hidden_states_mask=None,
                img_shapes=[[(1, lh, lw)]] * len(rows),
                img_mask=img_mask,
                return_dict=False,
            )[0][:, n : n + seq]  # [text, image] (+ SP's padding after the image)
            if every:
                return v
            if out is None:
                out = v.new_zeros(batch, *v.shape[1:])
            out = out.index_copy(0, rows, v)
        assert out is not None
        return out

    def guide(
        self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float
    ) -> torch.Tensor:
        """Plain true CFG, as the 2.1 pipeline (no per-token norm rescale)."""
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents -> RGB images [B, 3, H, W] fp32 in [0, 1] on CPU (the VAE's alpha dropped)."""
        return super().decode(latents, height, width)[:, :3]


__all__ = ["QwenImage21Adapter"]
