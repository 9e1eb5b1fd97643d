"""Qwen-Image (diffusers ``QwenImagePipeline``): true CFG with a per-token norm rescale.

Mirrors ``QwenImagePipeline.__call__`` of diffusers 0.42.1 piece by piece:

- prompts go through the chat template and Qwen2.5-VL; the template's first 34 tokens are
  dropped; embeddings are right-padded with a mask (``max_sequence_length`` 512, the call's
  default). The pipeline passes ``mask=None`` when no prompt is padded; so does ``forward``.
- schedule: sigmas = linspace(1, 1/N, N), dynamic shift ``mu = calculate_shift(image tokens,
  scheduler config)``, then the scheduler's own shifting/stretching (``retrieve_timesteps``).
- latents are packed 2x2 patches [B, (H/16)(W/16), 64] (tiny: [B, (H/4)(W/4), 16]).
- the transformer gets ``timestep / 1000`` (i.e. sigma), ``img_shapes`` and the text mask.
- guidance is "true CFG": comb = v_neg + g (v_pos - v_neg), v = comb * |v_pos| / |comb|, the
  norms over the channel (last) dim per token. ``guidance_scale`` is the pipeline's
  ``true_cfg_scale``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from flowgrpo.models.base import DiffusionAdapter, PromptEmbeds, Schedule, SizeRule, param_dtype
from flowgrpo.models.parallel import SequenceParallelSpec


class QwenImageSequenceParallel(SequenceParallelSpec):
    """Qwen-Image under Ulysses SP: diffusers' ``_cp_plan`` and processor; the transformer
    honours its own text mask, which padding extends."""

    name = "qwen_image"
    transformer_class = "QwenImageTransformer2DModel"
    text_mask_kwarg = "encoder_hidden_states_mask"
    image_token_rule = "latent h/2 x w/2, plus the source images' tokens of an edit model"

    def image_tokens(self, transformer: nn.Module, hidden_states: torch.Tensor) -> int:
        """Every image token of the call: the noised ones and, for Qwen-Image-Edit(-Plus),
        the source images' tokens that ride along them (``QwenImageEditAdapter.forward``
        concatenates them along the sequence; ``img_shapes`` lists both). diffusers' plan
        splits them all together (hidden states and their RoPE), so the sum must divide."""
        return hidden_states.shape[1]


class QwenImageAdapter(DiffusionAdapter):
    """Adapter for ``diffusers.QwenImagePipeline``.

    ``batch_cfg`` stays True: in diffusers 0.42.1 the transformer honours
    ``encoder_hidden_states_mask`` (padded text keys are masked out of the joint attention, text
    RoPE positions start at 0 for every prompt, and every other text op is per token), so a
    negative/positive batch padded to a common length gives the unpadded velocities: garbage in
    padded positions changes nothing (bit-identical), padded vs unpadded differ by fp32 rounding
    of the masked vs unmasked attention kernel (<= 5e-7 for |v| ~ 2.5; see
    tests/models/test_qwen_image.py). Micro-batches re-padded to their own longest prompt are
    therefore batch invariant.
    """

    lora_target_modules = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    )
    batch_cfg = True
    sequence_parallel = QwenImageSequenceParallel()
    #: what the Flow-GRPO Qwen-Image reference passes as negative prompt when none is given
    default_negative_prompt = " "

    prompt_trimmed = True  # encode_prompt pads to the batch's longest prompt, with a mask

    def __init__(self, pipe: Any, *, max_sequence_length: int = 512):
        super().__init__(pipe)
        if max_sequence_length > 1024:
            raise ValueError(f"max_sequence_length must be <= 1024, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length

    # -- text ---------------------------------------------------------------------------------
    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Qwen2.5-VL hidden states -> embeds [B, L, D] and mask [B, L] (long, left-aligned)."""
        if not prompts:
            raise ValueError("encode_prompts needs at least one prompt")
        device = next(self.pipe.text_encoder.parameters()).device
        embeds, mask = self.pipe.encode_prompt(
            list(prompts), device=device, max_sequence_length=self.max_sequence_length
        )
        if mask is None:  # the pipeline drops an all-ones mask; keep it so batches can be padded
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return PromptEmbeds(embeds.to(self.device), mask.to(self.device), None)

    # -- schedule and latents -----------------------------------------------------------------
    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        """Unpacked latent height/width (even), as the pipeline rounds them."""
        f = self.pipe.vae_scale_factor
        return 2 * (int(height) // (f * 2)), 2 * (int(width) // (f * 2))

    @classmethod
    def prompt_tokens(cls, max_sequence_length: int | None) -> tuple[int, int]:
        """Qwen2.5-VL hidden states: 512 tokens by default, 3584 wide."""
        return max_sequence_length or 512, 3584

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule:
        """Multiples of VAE factor x 2 (16): the latents are packed 2x2."""
        f = 2 ** len(config("vae").get("temperal_downsample", (False, True, True)))
        return SizeRule("Qwen-Image", (2 * f, 2 * f), f"VAE {f} x 2x2 packing")

    def _check_size(self, height: int, width: int) -> None:
        m = self.pipe.vae_scale_factor * 2
        if height % m or width % m or height <= 0 or width <= 0:
            raise ValueError(
                f"height and width must be positive multiples of {m}, got {height}x{width}"
            )

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """sigmas [N+1] (final 0 included) and timesteps [N], exactly as the pipeline."""
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        lh, lw = self._latent_hw(height, width)
        sigmas = np.linspace(1.0, 1 / num_steps, num_steps)
        return self.shifted_schedule(num_steps, sigmas, image_seq_len=(lh // 2) * (lw // 2))

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Packed noise [B, (h/2)(w/2), 4 C] drawn as the pipeline draws it (same generator use)."""
        self._check_size(height, width)
        channels = self.transformer.config.in_channels // 4
        return self.pipe.prepare_latents(  # fp32 whatever the weights' dtype
            batch_size, channels, height, width, torch.float32, self.device, generator
        )

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
        """One transformer call on packed latents [B, S, 4C] at sigma [B] -> velocity [B, S, 4C]."""
        lh, lw = self._latent_hw(height, width)
        batch = latents.shape[0]
        if len(embeds) != batch:
            raise ValueError(f"{len(embeds)} prompt embeddings for a batch of {batch} latents")
        config = getattr(transformer, "config", self.transformer.config)
        dtype = param_dtype(transformer)  # inputs in the transformer's dtype
        # The scheduler's timestep is sigma * 1000 in fp32; the pipeline casts it to the latents'
        # dtype and divides by 1000. Done the same way so the transformer sees the same number.
        t = (sigma.float() * self.pipe.scheduler.config.num_train_timesteps).to(dtype)
        mask = embeds.mask
        if mask is not None and bool(mask.all()):
            mask = None  # as the pipeline: no padding, no mask (the unmasked attention kernel)
        guidance = None
        if config.guidance_embeds:  # guidance-distilled variants (the pipeline's guidance_scale)
            guidance = torch.full([batch], guidance_scale, device=latents.device)
        return transformer(
            hidden_states=latents.to(dtype),
            timestep=t / 1000,
            guidance=guidance,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds.embeds.to(dtype),
            img_shapes=[[(1, lh // 2, lw // 2)]] * batch,
            return_dict=False,
        )[0]

    def guide(
        self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float
    ) -> torch.Tensor:
        """True CFG with the per-token rescale to the conditional norm (grad flows via |v_pos|)."""
        comb = v_uncond + guidance_scale * (v_cond - v_uncond)
        cond_norm = torch.norm(v_cond, dim=-1, keepdim=True)
        comb_norm = torch.norm(comb, dim=-1, keepdim=True)
        return comb * (cond_norm / comb_norm)

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents -> images [B, 3, H, W] fp32 in [0, 1] on CPU (as output_type="pt")."""
        vae = self.pipe.vae
        x = self.pipe._unpack_latents(latents, height, width, self.pipe.vae_scale_factor)
        x = x.to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(x.device, x.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
        x = x / inv_std.to(x.device, x.dtype) + mean
        with torch.no_grad():
            image = vae.decode(x, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1).cpu()


# -- the Qwen VL processors of Qwen-Image-Edit (Qwen2.5-VL) and Qwen-Image 2.1 (Qwen3-VL) ------


def vl_processor(
    image_processor: Any,
    tokenizer: Any,
    processor_cls: type | None = None,
    chat_template: str | None = None,
) -> Any:
    """A Qwen VL processor (``processor_cls``, Qwen2-VL's by default: the class the edit
    pipelines declare) of ``image_processor`` and ``tokenizer`` without its video processor:
    transformers 5 makes that one with torchvision, which this project does not install
    (DESIGN.md), and the pipelines pass images only. Its ``save_pretrained`` writes the image
    processor, the tokenizer and the chat template, which ``load_vl_processor`` reads back."""
    from pathlib import Path
    from unittest import mock

    if processor_cls is None:
        from transformers import Qwen2VLProcessor as processor_cls

    # the class check resolves the video processor's class, which imports torchvision
    with mock.patch.object(
        processor_cls, "check_argument_for_proper_class", lambda self, name, arg: None
    ):
        proc = processor_cls(
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
        )

    def save_pretrained(folder: Any, **kwargs: Any) -> None:
        image_processor.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if proc.chat_template:
            (Path(folder) / "chat_template.jinja").write_text(proc.chat_template)

    proc.save_pretrained = save_pretrained  # diffusers' save_pretrained calls this
    return proc


def load_vl_processor(root: Any, processor_cls: type) -> dict[str, Any]:
    """{"processor": ``vl_processor``} from the pipeline folder's ``processor/`` files (its
    image processor, tokenizer and chat template; a video processor's files are left unread:
    loading them needs torchvision), or {} without that folder."""
    import json
    from pathlib import Path

    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    folder = Path(root) / "processor"
    if not folder.is_dir():
        return {}
    image_processor = Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    template = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    elif (folder / "chat_template.json").is_file():
        template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return {"processor": vl_processor(image_processor, tokenizer, processor_cls, template)}


__all__ = ["QwenImageAdapter", "load_vl_processor", "vl_processor"]
