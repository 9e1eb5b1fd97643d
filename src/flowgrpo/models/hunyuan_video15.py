"""Adapter for diffusers' ``HunyuanVideo15Pipeline``: HunyuanVideo-1.5 text-to-video.

Mirrors ``HunyuanVideo15Pipeline.__call__`` of diffusers 0.42.1 piece by piece:

- prompts, two encoders (``encode_prompt``): the Qwen2.5-VL text model on the chat template
  with the pipeline's system message (``_get_mllm_prompt_embeds``: padded to
  ``tokenizer_max_length`` + the template's ``prompt_template_encode_start_idx`` tokens,
  hidden state -3, the template cropped: L = 1000 tokens and a mask), and ByT5 on the prompt's
  quoted texts (``_get_byt5_prompt_embeds``: ``Text "..."`` glyph strings, L2 = 256 tokens;
  zeros with an all-zero mask when the prompt quotes nothing). The Qwen embeddings are stored
  trimmed to the batch's longest prompt with their mask and zero-padded back to exactly L in
  ``forward``; the ByT5 ones travel whole in ``PromptEmbeds.pooled`` as
  ``[embeds.flatten(1), mask]``. The transformer moves valid text tokens first and zeroes the
  padded ones, so padded rows never reach a valid token. Negative prompt ``""`` (the
  pipeline's ``negative_prompt=None``; the template turns both into ``" "``).
- guidance: the pipeline's ``guider`` (``ClassifierFreeGuidance``), which the stock call takes
  its scale from; here the rollout's ``guidance_scale`` plays that role: CFG runs iff the scale
  is not 1 (``math.isclose``, as the guider; 0 with ``use_original_formulation``) and combines
  ``v_u + g (v_c - v_u)`` (original formulation: ``v_c + g (v_c - v_u)``). A guider with
  ``guidance_rescale``, a start/stop window or disabled is refused (not reproduced here).
- schedule: ``sigmas = linspace(1, 0, N + 1)[:-1]`` passed to ``set_timesteps`` (the
  scheduler's static ``shift`` applied to them; no mu) on a copy of the pipeline's
  ``FlowMatchEulerDiscreteScheduler``.
- latents [B, C, (F - 1)/4 + 1, H/16, W/16] fp32 from ``pipe.prepare_latents``; the model
  input is ``cat([latents, zeros (C), zeros (1)])``: the image-to-video condition and mask
  channels, all zero for text-to-video (``prepare_cond_latents_and_mask``), and
  ``image_embeds`` zeros [B, 729, image_embed_dim] (which makes the transformer mask them).
  F = 4k + 1 and H, W multiples of VAE x patch are checked (the pipeline floors silently).
- transformer call: inputs in the transformer's dtype, ``timestep = sigma * 1000`` cast to it
  as the pipeline casts ``t`` to the latents' dtype.
- decode: ``latents / scaling_factor`` -> ``vae.decode`` -> videos [B, 3, F, H, W],
  ``(x / 2 + 0.5).clamp(0, 1)``. flowgrpo keeps the VAE's [B, C, F, H, W] layout.
Image-to-video (``HunyuanVideo15ImageToVideoPipeline``) is not supported. Sequence
parallelism: the transformer has no diffusers ``_cp_plan``; ``HunyuanVideo15SequenceParallel``
is this family's.
"""

from __future__ import annotations

import math
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
from flowgrpo.models.parallel import SequenceParallelSpec


# -- sequence parallelism: a CP-capable dual-stream processor, a cp plan, local refiner --------
class CPHunyuanVideo15AttnProcessor:
    """diffusers' ``HunyuanVideo15AttnProcessor2_0`` (q/k RMS-norm, RoPE on the video tokens,
    [video, text] joint order) for split tokens: it gets this rank's chunk of the text mask
    (the plan splits it with the text) and masks keys only, [B, 1, 1, S_local], which diffusers'
    Ulysses attention all-gathers into the order of its gathered keys. The stock processor
    builds a [B, 1, S, S] query-and-key mask from the full text mask and the local length, which
    do not match once split; the query half only touches padded text rows, whose outputs never
    reach a valid token (their keys are masked) nor the output (the video stream)."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        if encoder_hidden_states is None or attention_mask is None:
            raise ValueError("CPHunyuanVideo15AttnProcessor is for the dual-stream blocks")

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(2, (attn.heads, -1))

        query, key, value = (heads(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        projs = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        eq, ek, ev = (heads(f(encoder_hidden_states)) for f in projs)
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        n_vid = hidden_states.shape[1]
        query, key, value = (torch.cat(p, dim=1) for p in ((query, eq), (key, ek), (value, ev)))
        text = attention_mask.bool()
        mask = torch.cat([text.new_ones(text.shape[0], n_vid), text], dim=1)[:, None, None, :]
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        video, text_out = out[:, :n_vid], out[:, n_vid:]
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(text_out)


def _local_attn_processor() -> Any:
    """diffusers' ``AttnProcessor2_0`` (the token refiner's, which attends with
    ``F.scaled_dot_product_attention`` directly), declared as taking part: it runs inside
    ``context_embedder``, before the split, on every rank's whole text."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    class HunyuanVideo15LocalAttnProcessor(AttnProcessor2_0):
        """The refiner's processor, unchanged; attends over the (unsplit) tokens it gets."""

        _attention_backend = None
        _parallel_config = None

    return HunyuanVideo15LocalAttnProcessor()


class HunyuanVideo15SequenceParallel(SequenceParallelSpec):
    """HunyuanVideo-1.5 under Ulysses SP. ``HunyuanVideo15Transformer3DModel`` (no ``_cp_plan``
    in diffusers 0.42.1) builds its text sequence inside ``forward``: the token-refined Qwen
    text, the ByT5 glyph text and the image-embedding tokens, reordered valid first, with one
    mask [B, L_txt]; the dual-stream blocks take (video [B, S, D], text, temb, mask, RoPE
    (cos, sin) [S, D]). The plan splits video and text where they enter block 0, the mask and
    RoPE at every block, and gathers after ``proj_out``, before the unpatchify.

    Padding: L_txt (image tokens + L2 + L; 729 + 256 + 1000 = 1985 for the real model) is padded
    to a multiple of sp by appending masked zero tokens to the Qwen text and its mask: the
    token refiner masks them (attention and mean pooling) and the reorder moves them among the
    invalid tokens. The refiner attends before the split and keeps diffusers' processor."""

    name = "hunyuan_video15"
    transformer_class = "HunyuanVideo15Transformer3DModel"
    text_mask_kwarg = "encoder_attention_mask"
    image_token_rule = "latent frames x h x w"

    def cp_plan(self, transformer: nn.Module) -> dict[str, Any]:
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        tokens = ContextParallelInput(split_dim=1, expected_dims=3)
        rope = ContextParallelInput(split_dim=0, expected_dims=2)
        return {
            "transformer_blocks.0": {"hidden_states": tokens, "encoder_hidden_states": tokens},
            "transformer_blocks.*": {
                "attention_mask": ContextParallelInput(split_dim=1, expected_dims=2),
                "freqs_cis": [rope, rope],
            },
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def attention_processor(self, module: nn.Module) -> Any:
        """The dual-stream blocks' attention (it has the text projections): the CP processor;
        the token refiner's: diffusers' own, local."""
        if getattr(module, "add_q_proj", None) is None:
            return _local_attn_processor()
        return CPHunyuanVideo15AttnProcessor()

    def image_tokens(self, transformer: nn.Module, hidden_states: torch.Tensor) -> int:
        """Video tokens of the [B, C, F, H, W] latents (patchified inside)."""
        c = transformer.config
        _, _, f, h, w = hidden_states.shape
        return (f // c.patch_size_t) * (h // c.patch_size) * (w // c.patch_size)

    def text_padding(self, transformer: nn.Module, kwargs: dict[str, Any], sp: int) -> int:
        """The joint text: image-embedding tokens + ByT5 tokens + Qwen tokens."""
        n = kwargs["encoder_hidden_states"].shape[1]
        for name in ("encoder_hidden_states_2", "image_embeds"):
            if kwargs.get(name) is not None:
                n += kwargs[name].shape[1]
        return (-n) % sp


class HunyuanVideo15Adapter(DiffusionAdapter):
    """Drives a ``HunyuanVideo15Pipeline``; see the module docstring for the exact mapping.

    num_frames: default frames per video (the pipeline's 121); ``sample_trajectories(...,
    num_frames=F)`` overrides it. Text lengths are the pipeline's own (``tokenizer_max_length``,
    ``tokenizer_2_max_length``, ``vision_num_semantic_tokens``), read off the instance.
    """

    # UniRL's HunyuanVideo-1.5 LoRA targets (examples/diffusion/hunyuan_video15/
    # hunyuan_video15_t2v_dancegrpo_trainside.yaml): both streams' attention and FFNs
    lora_target_modules = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )
    batch_cfg = True  # both branches padded to the same L and L2
    sequence_parallel = HunyuanVideo15SequenceParallel()
    default_negative_prompt = ""  # negative_prompt=None -> encode_prompt(None) -> [""] * B

    def __init__(self, pipe: Any, *, num_frames: int = 121):
        from diffusers import FlowMatchEulerDiscreteScheduler

        super().__init__(pipe)
        if not isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler):
            raise ValueError(
                f"HunyuanVideo15Adapter needs FlowMatchEulerDiscreteScheduler, got "
                f"{type(pipe.scheduler).__name__}"
            )
        if pipe.scheduler.config.get("use_dynamic_shifting", False):
            raise ValueError("HunyuanVideo15Pipeline passes no mu: dynamic shifting unsupported")
        guider = pipe.guider
        gc = guider.config
        if not gc.get("enabled", True) or gc.get("guidance_rescale", 0.0) > 0.0:
            raise ValueError("the pipeline's guider is disabled or rescales: not supported")
        if gc.get("start", 0.0) != 0.0 or gc.get("stop", 1.0) != 1.0:
            raise ValueError("the pipeline's guider has a start/stop window: not supported")
        self.original_formulation = bool(gc.get("use_original_formulation", False))
        self.num_train_timesteps = int(pipe.scheduler.config.num_train_timesteps)
        tcfg = pipe.transformer.config
        self.patch = (int(tcfg.patch_size_t), int(tcfg.patch_size), int(tcfg.patch_size))
        self.image_embed_dim = int(tcfg.image_embed_dim)
        self.num_frames = self.check_num_frames(num_frames)

    @property
    def dtype(self) -> torch.dtype:
        return param_dtype(self.transformer)

    # -- guidance -----------------------------------------------------------------------------
    def uses_cfg(self, guidance_scale: float) -> bool:
        """The guider's test: CFG unless the scale is 1 (0 in the original formulation)."""
        return not math.isclose(guidance_scale, 0.0 if self.original_formulation else 1.0)

    @classmethod
    def plans_cfg(cls, guidance_scale: float, options: dict[str, Any]) -> bool:
        return not math.isclose(guidance_scale, 1.0)

    def guide(
        self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """``ClassifierFreeGuidance.forward``: base + g (v_c - v_u), base v_u (or v_c)."""
        base = v_cond if self.original_formulation else v_uncond
        return base + guidance_scale * (v_cond - v_uncond)

    # -- sizes ------------------------------------------------------------------------------------
    @classmethod
    def token_counts(
        cls, configs: dict[str, Any], height: int, width: int, options: dict[str, Any]
    ) -> TokenCounts:
        """Video tokens of (frames, h, w) patches over (F - 1)/4 + 1 latent frames (default F
        121); the joint sequence adds 729 image + 256 ByT5 + 1000 Qwen tokens (padded)."""
        vae, tr = configs.get("vae", {}), configs["transformer"]
        s = int(vae.get("spatial_compression_ratio", 16))
        t = int(vae.get("temporal_compression_ratio", 4))
        channels = int(vae.get("latent_channels", 32))
        p, pt = int(tr.get("patch_size", 1)), int(tr.get("patch_size_t", 1))
        frames = options.get("num_frames") or 121
        lat_f = (frames - 1) // t + 1
        image = (lat_f // pt) * (height // (s * p)) * (width // (s * p))
        latent = channels * lat_f * (height // s) * (width // s)
        prompt = (1000, int(tr.get("text_embed_dim", 3584)))
        return TokenCounts(image, 1000 + 256 + 729, latent, prompt, frames)

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Sides multiples of VAE x patch (16 x 1); frames t·k + 1 (t: the VAE's temporal
        factor). The rotary table is computed per call: no maximum."""
        vae, tr = config("vae"), config("transformer")
        s = int(vae.get("spatial_compression_ratio", 16))
        t = int(vae.get("temporal_compression_ratio", 4))
        m = s * int(tr.get("patch_size", 1))
        return SizeRule("HunyuanVideo-1.5", (m, m), f"VAE {s} x patch", frame_step=t)

    @classmethod
    def native_size(cls, config: Callable[[str], dict]) -> tuple[int, int, int] | None:
        """(height, width, frames) the stock pipeline generates without a size: the 16:9
        bucket of the transformer's ``target_size`` (720p: 720 x 1280; 480p: 480 x 848) and
        121 frames, as ``HunyuanVideo15Pipeline.__call__`` picks them."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import (
            HunyuanVideo15ImageProcessor,
        )

        target = config("transformer").get("target_size")
        if not target:
            return None
        s = int(config("vae").get("spatial_compression_ratio", 16))
        proc = HunyuanVideo15ImageProcessor(vae_scale_factor=s)
        h, w = proc.calculate_default_height_width(9, 16, int(target))
        return int(h), int(w), 121

    def check_num_frames(self, num_frames: int | None) -> int:
        num_frames = self.num_frames if num_frames is None else num_frames
        t = self.pipe.vae_scale_factor_temporal
        if int(num_frames) != num_frames or num_frames < 1 or (num_frames - 1) % t:
            raise ValueError(f"num_frames must be {t}k + 1 (1, {t + 1}, ...), got {num_frames}")
        return int(num_frames)

    def _check_size(self, height: int, width: int) -> None:
        m = self.pipe.vae_scale_factor_spatial * self.patch[1]
        if height <= 0 or width <= 0 or height % m or width % m:
            raise ValueError(
                f"height and width must be positive multiples of {m} (VAE x patch), got "
                f"{height}x{width}"
            )

    # -- text -------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """embeds [B, n, D] (Qwen, trimmed to the longest prompt n <= L), mask [B, n]; pooled
        [B, L2 * D2 + L2]: the ByT5 embeddings flattened, then their mask."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        pipe, prompts = self.pipe, list(prompts)
        embeds, mask = pipe._get_mllm_prompt_embeds(
            tokenizer=pipe.tokenizer,
            text_encoder=pipe.text_encoder,
            prompt=prompts,
            device=self.device,
            tokenizer_max_length=pipe.tokenizer_max_length,
            system_message=pipe.system_message,
            crop_start=pipe.prompt_template_encode_start_idx,
        )
        glyph, glyph_mask = pipe._get_byt5_prompt_embeds(
            tokenizer=pipe.tokenizer_2,
            text_encoder=pipe.text_encoder_2,
            prompt=prompts,
            device=self.device,
            tokenizer_max_length=pipe.tokenizer_2_max_length,
        )
        mask = mask.long()
        n = int(mask.sum(1).max())
        if bool((mask[:, :n].sum(1) != mask.sum(1)).any()) or bool((mask.diff(dim=1) > 0).any()):
            raise ValueError("HunyuanVideo15Adapter expects right-padded text (mask 1...1 0...0)")
        pooled = torch.cat([glyph.flatten(1), glyph_mask.to(glyph.dtype)], dim=1)
        return PromptEmbeds(embeds[:, :n].contiguous(), mask[:, :n], pooled)

    def _text_inputs(self, embeds: PromptEmbeds, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The transformer's four text arguments as ``encode_prompt`` returns them: Qwen
        [B, L, D] (padded rows exact zeros) and ByT5 [B, L2, D2], masks in ``dtype``."""
        L, L2 = self.pipe.tokenizer_max_length, self.pipe.tokenizer_2_max_length
        e, m = embeds.embeds, embeds.mask
        if m is None:
            m = torch.ones(e.shape[:2], dtype=torch.long, device=e.device)
        if e.shape[1] > L:
            raise ValueError(f"{e.shape[1]} text tokens > tokenizer_max_length {L}")
        e = torch.nn.functional.pad(
            e.masked_fill(m[..., None] == 0, 0.0), (0, 0, 0, L - e.shape[1])
        )
        m = torch.nn.functional.pad(m, (0, L - m.shape[1]))
        pooled = embeds.pooled
        d2 = 0 if pooled is None else pooled.shape[1] // L2 - 1
        if pooled is None or d2 < 1 or pooled.shape[1] != L2 * (d2 + 1):
            raise ValueError("prompt embeddings lack the ByT5 part (PromptEmbeds.pooled)")
        glyph = pooled[:, : L2 * d2].unflatten(1, (L2, d2))
        return {
            "encoder_hidden_states": e.to(dtype),
            "encoder_attention_mask": m.to(dtype),
            "encoder_hidden_states_2": glyph.to(dtype),
            "encoder_attention_mask_2": pooled[:, L2 * d2 :].to(dtype),
        }

    # -- schedule and latents -----------------------------------------------------------------------
    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """``retrieve_timesteps(sigmas=linspace(1, 0, N + 1)[:-1])`` as the pipeline, on a copy."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        return self.shifted_schedule(num_steps, np.linspace(1.0, 0.0, num_steps + 1)[:-1])

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
        *,
        num_frames: int | None = None,
    ) -> torch.Tensor:
        """Noise [B, C, F', H/16, W/16] fp32, drawn by the pipeline's ``prepare_latents``."""
        self._check_size(height, width)
        frames = self.check_num_frames(num_frames)
        return self.pipe.prepare_latents(
            batch_size,
            self.pipe.num_channels_latents,
            height,
            width,
            frames,
            torch.float32,
            self.device,
            generator,
        )

    # -- the model ----------------------------------------------------------------------------------
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
        """One call of the transformer on [latents, zero condition, zero mask] -> velocity."""
        batch = latents.shape[0]
        if len(embeds) != batch:
            raise ValueError(f"{len(embeds)} prompt embeddings for a batch of {batch} latents")
        dtype = param_dtype(transformer)
        x = latents.to(dtype)
        b, _, f, h, w = x.shape
        x = torch.cat([x, torch.zeros_like(x), x.new_zeros(b, 1, f, h, w)], dim=1)
        t = (sigma.to(latents.device, torch.float32) * self.num_train_timesteps).to(dtype)
        n_img = self.pipe.vision_num_semantic_tokens
        image_embeds = x.new_zeros(b, n_img, self.image_embed_dim)
        return transformer(
            hidden_states=x,
            image_embeds=image_embeds,
            timestep=t,
            return_dict=False,
            **self._text_inputs(embeds.to(latents.device), dtype),
        )[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """[B, C, F', h, w] latents -> videos [B, 3, F, H, W] fp32 in [0, 1] on CPU, decoded
        one sample at a time whatever ``model.vae_slicing`` says: diffusers 0.42.1's
        AutoencoderKLHunyuanVideo15 fails on a batch > 1 (its mid-block attention mask has
        batch 1: "output with shape [2, 1, ...] doesn't match the broadcast shape")."""
        vae = self.pipe.vae
        x = latents.to(next(vae.parameters()).device, vae.dtype) / vae.config.scaling_factor
        videos = [
            vae.decode(x[i : i + 1], return_dict=False)[0].float().cpu() for i in range(len(x))
        ]
        return (torch.cat(videos) / 2 + 0.5).clamp(0, 1)


__all__ = ["HunyuanVideo15Adapter"]
