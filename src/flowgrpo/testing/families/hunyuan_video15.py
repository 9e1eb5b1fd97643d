"""HunyuanVideo-1.5's test double: a real ``HunyuanVideo15Pipeline`` like the 480p t2v model
with tiny random weights: a Qwen2.5-VL text model (hidden state -3 of 3 layers), a ByT5 glyph
encoder, the 1.5 video VAE (spatial x8 here, temporal x4 as the real one), CFG through the
pipeline's ``ClassifierFreeGuidance`` guider; short text lengths (``TINY_HUNYUAN15_LENGTHS``)."""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.testing.families._parts import bpe_vocab, corpus, t5_config, train_bpe
from flowgrpo.testing.family import Family, SequenceParallelCase

#: hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v (shift 5: UniRL's 480p recipe)
SCHEDULER: dict[str, Any] = {"num_train_timesteps": 1000, "shift": 5.0}
# 2 dual-stream blocks, 1 refiner block, patch 1; in_channels = 2 x 4 latent channels + 1 mask
# channel (the pipeline's [latents, cond zeros, mask zeros])
TRANSFORMER: dict[str, Any] = {
    "in_channels": 9,
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "mlp_ratio": 2.0,
    "patch_size": 1,
    "patch_size_t": 1,
    "text_embed_dim": 32,  # = the Qwen2.5-VL text model's hidden size
    "text_embed_2_dim": 32,  # = the ByT5 encoder's d_model
    "image_embed_dim": 16,
    "rope_axes_dim": (8, 12, 12),  # sums to attention_head_dim
    "task_type": "t2v",
}
#: the VAE's layout (its latent channels follow ``out_channels``)
VAE: dict[str, Any] = dict(
    block_out_channels=(8, 8, 8, 8),
    layers_per_block=1,
    spatial_compression_ratio=8,
    temporal_compression_ratio=4,
    scaling_factor=1.03682,  # the real VAE's
)

_QWEN_CHAT_TEMPLATE = (  # Qwen2.5's chat template for text-only messages
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: tiny HunyuanVideo-1.5 text lengths (the pipeline's 1000 Qwen tokens, 256 ByT5 tokens and
#: 729 image tokens would make every tiny call a ~2,000-token sequence)
TINY_HUNYUAN15_LENGTHS = {
    "tokenizer_max_length": 24,
    "tokenizer_2_max_length": 16,
    "vision_num_semantic_tokens": 4,
}


def _hunyuan15_qwen_tokenizer(system_message: str):
    """Qwen2 byte-level BPE trained in code on HunyuanVideo-1.5's system message (its prefix
    encodes to about as many tokens as the real tokenizer's 108), with Qwen's chat template."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(specials)}, merges=[])
    pre = tok.backend_tokenizer.pre_tokenizer
    texts = ["system\n", "user\n", "assistant\n", system_message, *corpus()]
    words = [w for t in texts for w, _ in pre.pre_tokenize_str(t)]
    merges = list(train_bpe(tuple(words)))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Qwen2Tokenizer(
        vocab=bpe_vocab(specials, alphabet, merges),
        merges=merges,
        extra_special_tokens=specials[1:],
        model_max_length=32768,
    )
    tok.chat_template = _QWEN_CHAT_TEMPLATE
    return tok


def build(tcfg: dict[str, Any], seeds) -> Any:
    """``HunyuanVideo15Pipeline`` like HunyuanVideo-1.5-480p t2v: a Qwen2.5-VL text model
    (hidden state -3 of 3 layers), a ByT5 glyph encoder, the 1.5 video VAE (spatial x8 here,
    temporal x4 as the real one), CFG through the pipeline's ``ClassifierFreeGuidance`` guider.
    The tiny text lengths (``TINY_HUNYUAN15_LENGTHS``) and the template's crop are set on the
    instance, where the pipeline keeps them (its ``__init__`` constants)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    system_message = HunyuanVideo15Pipeline._get_mllm_prompt_embeds.__defaults__[2]
    tok = _hunyuan15_qwen_tokenizer(system_message)
    hidden = tcfg["text_embed_dim"]
    half = hidden // 4  # head_dim / 2 with 2 heads; M-RoPE sections (t, h, w) sum to it
    mrope = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    torch.manual_seed(next(seeds))
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=3,  # the pipeline reads hidden_states[-3]: a layer's output
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=2048,
            rope_scaling={"mrope_section": mrope, "rope_type": "default"},
            rope_theta=1000000.0,
            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tok.pad_token_id,
        )
    )
    tok2 = ByT5Tokenizer()  # byte-level: no vocabulary file
    torch.manual_seed(next(seeds))
    text_encoder_2 = T5EncoderModel(T5Config(**t5_config(tok2, tcfg["text_embed_2_dim"])))
    torch.manual_seed(next(seeds))
    vae = AutoencoderKLHunyuanVideo15(**VAE, latent_channels=tcfg["out_channels"])
    torch.manual_seed(next(seeds))
    transformer = HunyuanVideo15Transformer3DModel(**tcfg)
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tok2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    for name, value in TINY_HUNYUAN15_LENGTHS.items():
        setattr(pipe, name, value)
    prefix = f"<|im_start|>system\n{system_message}<|im_end|>\n<|im_start|>user\n"
    pipe.prompt_template_encode_start_idx = len(tok(prefix).input_ids)
    return pipe


def _guider_scale(pipe: Any, guidance_scale: float) -> dict[str, Any]:
    """A pipeline guided by its ``guider`` component: the scale is the guider's, not an
    argument of the call."""
    pipe.guider.guidance_scale = guidance_scale
    return {}


def _load_transformer_lora(pipe: Any, folder: Any) -> None:
    """A pipeline without a LoRA loader: the export's file into its transformer by diffusers'
    ``load_lora_adapter`` (``weight_name`` given: only then does it read the file's peft
    config, alpha included)."""
    pipe.transformer.load_lora_adapter(
        folder, weight_name="pytorch_lora_weights.safetensors", prefix="transformer"
    )


def _odd_text(pipe) -> None:
    """The SP tests' text length: 25 prompt tokens, so the joint text is odd."""
    pipe.tokenizer_max_length = 25


DOUBLES = (
    Family(
        "hunyuan_video15",
        ((32, 48), (48, 32)),
        size=(32, 48),
        prompts=("a red cat", 'a sign that says "hello world"', "dog", 'a "STOP" sign'),
        num_frames=5,
        sde_window=(1, 0, 3),
        x0_seed=3,
        train_size=(32, 48),
        load_lora=_load_transformer_lora,
        stock_guidance=_guider_scale,
        pipeline_class="HunyuanVideo15Pipeline",
        # an odd joint text (4 + 16 + 25 tokens, as the real model's 729 + 256 + 1000): padded
        sp=SequenceParallelCase(prepare=_odd_text, padded_text="encoder_hidden_states"),
        build=build,
        transformer=TRANSFORMER,
        vae=VAE,
    ),
)
