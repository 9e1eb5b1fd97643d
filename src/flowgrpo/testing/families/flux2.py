"""FLUX.2's test doubles: real ``Flux2Pipeline`` (dev: a Mistral-3 text encoder, the distilled
guidance embedding) and ``Flux2KleinPipeline`` (klein: Qwen3, true CFG) with tiny random
weights; ``AutoencoderKLFlux2`` with one downsampling and non-trivial batch-norm statistics;
2x2 patchify: H and W multiples of 4."""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.testing.families._parts import byte_bpe
from flowgrpo.testing.family import Family, SequenceParallelCase

#: black-forest-labs/FLUX.2-dev and FLUX.2-klein: dynamic shifting; mu is the pipelines'
#: compute_empirical_mu (sequence length and step count), base/max shift are unused
SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
# 1 double + 1 single block, 2 heads of 32, RoPE over (t, h, w, l); text = 3 stacked encoder
# layers of width 16; dev has the distilled guidance embedding, klein has none
TRANSFORMER: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 16,  # 4 latent channels x 2x2 patchify
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "joint_attention_dim": 48,  # 3 x the text encoder's hidden size
    "timestep_guidance_channels": 32,
    "axes_dims_rope": (8, 8, 8, 8),
    "guidance_embeds": True,
}
KLEIN_TRANSFORMER: dict[str, Any] = {**TRANSFORMER, "guidance_embeds": False}
#: the VAE's layout (its latent channels follow ``in_channels``)
VAE: dict[str, Any] = dict(
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(8, 16),
    layers_per_block=1,
    norm_num_groups=8,
    sample_size=32,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=False,
)

#: FLUX.2-dev's tokenizer chat template (Mistral-Small-3.1's, text and image blocks)
_MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = namespace(v='') %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{%- set text.v = text.v + block['text'] %}"
    "{%- elif block['type'] == 'image' %}{%- set text.v = text.v + '[IMG]' %}{%- endif %}"
    "{%- endfor %}{%- set text = text.v %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{- text + eos_token }}{%- endif %}{%- endfor %}"
)
#: Qwen3's chat template as FLUX.2-klein renders it (no system turn, thinking switched off)
_QWEN3_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def _mistral_tokenizer():
    """FLUX.2-dev's text tokenizer: a byte-level BPE with Mistral's control tokens and chat
    template. The hub ships a ``PixtralProcessor`` around it, which needs torchvision (not a
    dependency); for text-only prompts its ``apply_chat_template`` is the tokenizer's."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import Qwen2TokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]"]
    specials += ["[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    return byte_bpe(
        Qwen2TokenizerFast,
        specials,
        [SYSTEM_MESSAGE],
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens=specials[4:],
        chat_template=_MISTRAL_TEMPLATE,
        model_max_length=131072,
    )


def _qwen3_tokenizer():
    """FLUX.2-klein's Qwen2 tokenizer with Qwen3's chat template (``enable_thinking``)."""
    from transformers import Qwen2TokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    return byte_bpe(
        Qwen2TokenizerFast,
        specials,
        ["user\n", "assistant\n", "\n\n"],
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        extra_special_tokens=specials[1:],
        chat_template=_QWEN3_TEMPLATE,
        model_max_length=32768,
    )


def _flux2_vae(latent_channels: int, seed: int):
    """``AutoencoderKLFlux2(**VAE)`` with non-trivial batch-norm statistics (the pipelines
    de-normalize packed latents with them before decoding)."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(**VAE, latent_channels=latent_channels)
    with torch.no_grad():
        n = vae.bn.running_mean.numel()
        vae.bn.running_mean.copy_(0.2 * torch.randn(n))
        vae.bn.running_var.copy_(0.5 + torch.rand(n))
    return vae


def build(tcfg: dict[str, Any], seeds) -> Any:
    """FLUX.2-dev: Mistral-3 text encoder whose hidden states 10, 20, 30 (the pipeline's
    default layers) are stacked, so the tiny encoder keeps 30 (narrow) layers."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    tok = _mistral_tokenizer()
    hidden = tcfg["joint_attention_dim"] // 3
    torch.manual_seed(next(seeds))
    text_cfg = Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": len(tok),
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": 30,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": hidden // 2,
            "max_position_embeddings": 2048,
            "rope_theta": 1000000000.0,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "patch_size": 4,
            "image_size": 32,
        },
        image_token_index=tok.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=1,
    )
    text_encoder = Mistral3ForConditionalGeneration(text_cfg)
    vae = _flux2_vae(tcfg["in_channels"] // 4, next(seeds))
    torch.manual_seed(next(seeds))
    transformer = Flux2Transformer2DModel(**tcfg)
    return Flux2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    )


def build_klein(tcfg: dict[str, Any], seeds) -> Any:
    """FLUX.2-klein (the undistilled base: true CFG): Qwen3 whose hidden states 9, 18, 27 are
    stacked (the pipeline's default layers), so the tiny encoder keeps 27 (narrow) layers."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = _qwen3_tokenizer()
    hidden = tcfg["joint_attention_dim"] // 3
    torch.manual_seed(next(seeds))
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=27,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=hidden // 2,
            max_position_embeddings=2048,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            bos_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    vae = _flux2_vae(tcfg["in_channels"] // 4, next(seeds))
    torch.manual_seed(next(seeds))
    transformer = Flux2Transformer2DModel(**tcfg)
    return Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
        is_distilled=False,
    )


def _flux2_stock_layout(pipe: Any, latents: torch.Tensor, size: tuple[int, int]):
    """Flux2Pipeline's ``output_type="latent"``: packed [B, S, 4C] (``_pack_latents``)."""
    return pipe._pack_latents(latents)


def _flux2_klein_stock_layout(pipe: Any, latents: torch.Tensor, size: tuple[int, int]):
    """Flux2KleinPipeline's ``output_type="latent"``: de-normalized with the VAE's batch-norm
    statistics and unpatchified (its own steps after the loop)."""
    bn, eps = pipe.vae.bn, pipe.vae.config.batch_norm_eps
    mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(latents.device, latents.dtype)
    return pipe._unpatchify_latents(latents * std + mean)


#: text and image tokens both split over sp = 2
_SP = SequenceParallelCase(options={"max_sequence_length": 64})

DOUBLES = (
    Family(
        "flux2",
        ((32, 48), (24, 16)),
        options={"max_sequence_length": 64},
        call_options={"max_sequence_length": 64},
        guidance=4.0,
        train_options={"max_sequence_length": 64},
        train_size=(8, 8),  # LoRA steps of 16 x 16 move < 1e-4 (the algorithm tests' floor)
        stock_layout=_flux2_stock_layout,
        pipeline_class="Flux2Pipeline",
        sp=_SP,
        build=build,
        transformer=TRANSFORMER,
        vae=VAE,
    ),
    Family(
        "flux2_klein",
        ((32, 48), (24, 16)),
        options={"max_sequence_length": 64},
        call_options={"max_sequence_length": 64},
        guidance=4.0,
        train_options={"max_sequence_length": 64},
        train_size=(8, 8),  # LoRA steps of 16 x 16 move < 1e-4 (the algorithm tests' floor)
        stock_layout=_flux2_klein_stock_layout,
        stock_negative=False,  # the pipeline's negative prompt is always ""
        pipeline_class="Flux2KleinPipeline",
        sp=_SP,
        build=build_klein,
        transformer=KLEIN_TRANSFORMER,
        vae=VAE,
    ),
)
