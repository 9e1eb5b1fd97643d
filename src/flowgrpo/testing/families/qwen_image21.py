"""Qwen-Image 2.1's test double: a real ``QwenImage21Pipeline`` with tiny random weights:
single-stream block-causal transformer, latents unpatched (4 tiny VAE channels, real 64); a
Qwen3-VL processor and text model built in code; the 2.1 VAE with 4 downsamplings (x16 as the
real one) and 2x2 image slots: H and W multiples of 32."""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.testing.families._parts import bpe_vocab, corpus, train_bpe
from flowgrpo.testing.family import Family, SequenceParallelCase

#: the QwenImage21Pipeline's own calculate_shift defaults (the scheduler's config keys)
SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}
TRANSFORMER: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 4,  # = the tiny VAE's z_dim
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "context_in_dim": 32,  # = the Qwen3-VL text hidden size
    "mlp_ratio": 3,
    "axes_dims_rope": (8, 12, 12),  # sums to attention_head_dim
    "causal_condition": True,
}
#: the VAE's layout (its latent statistics follow ``in_channels``): 4 downsamplings
VAE: dict[str, Any] = dict(
    base_dim=8,
    decoder_base_dim=8,
    dim_mult=[1, 1, 1, 1, 1],
    num_res_blocks=1,
    temperal_downsample=[False, False, False, False],
)

_QWEN3_VL_CHAT_TEMPLATE = (  # Qwen3-VL's template, text parts only (what the pipeline asks)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen3_vl_processor():
    """Qwen3-VL processor: the Qwen BPE (trained in code) with the vision special tokens.

    Without its video processor (which needs torchvision): text-to-image never reads it
    (``flowgrpo.models.qwen_image.vl_processor``, as the adapter loads it).
    """
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor

    from flowgrpo.models.qwen_image import vl_processor

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(specials)}, merges=[])
    pre = tok.backend_tokenizer.pre_tokenizer
    texts = ["system\nComprehend and analyze the provided prompt.", "user\n", "assistant\n"]
    words = [w for t in texts + corpus() for w, _ in pre.pre_tokenize_str(t)]
    merges = list(train_bpe(tuple(words)))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Qwen2Tokenizer(
        vocab=bpe_vocab(specials + vision, alphabet, merges),
        merges=merges,
        extra_special_tokens=specials[1:] + vision,
        model_max_length=32768,
    )
    image_processor = Qwen2VLImageProcessor(patch_size=16, merge_size=2)
    return vl_processor(image_processor, tok, Qwen3VLProcessor, _QWEN3_VL_CHAT_TEMPLATE)


def build(tcfg: dict[str, Any], seeds) -> Any:
    from diffusers import (
        AutoencoderKLQwenImage21,
        FlowMatchEulerDiscreteScheduler,
        QwenImage21Pipeline,
        QwenImage21Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    processor = _qwen3_vl_processor()
    tok = processor.tokenizer
    hidden = tcfg["context_in_dim"]
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")}
    torch.manual_seed(next(seeds))
    text_cfg = Qwen3VLConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": hidden,
            "intermediate_size": 2 * hidden,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": hidden // 2,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 5000000.0,
                "mrope_section": [2, 3, 3],  # sums to head_dim / 2
                "mrope_interleaved": True,
            },
            "pad_token_id": tok.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": hidden,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=tok.convert_tokens_to_ids("<|vision_start|>"),
        vision_end_token_id=tok.convert_tokens_to_ids("<|vision_end|>"),
    )
    text_encoder = Qwen3VLForConditionalGeneration(text_cfg)
    torch.manual_seed(next(seeds))
    z = tcfg["in_channels"]
    vae = AutoencoderKLQwenImage21(  # 4 downsamplings: x16 as the real one
        **VAE,
        z_dim=z,
        latents_mean=[0.1 * i for i in range(z)],
        latents_std=[1.0 + 0.5 * i for i in range(z)],
    )
    torch.manual_seed(next(seeds))
    transformer = QwenImage21Transformer2DModel(**tcfg)
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        processor=processor,
        transformer=transformer,
    )


DOUBLES = (
    Family(  # the first two prompts of equal token length: the stock batch has no padding
        "qwen_image21",
        ((32, 64), (64, 32)),
        size=(32, 64),
        prompts=("a red cat", "a blue dog", "a photo of a big old house with a tree", "dog"),
        negative=" ",
        guidance_arg="true_cfg_scale",
        train_size=(32, 32),
        saves=False,  # its Qwen3-VL processor has no video processor: save_pretrained fails
        pipeline_class="QwenImage21Pipeline",
        # prompts cut to odd lengths: its text is padded after the image under SP
        sp=SequenceParallelCase(padded_text="encoder_hidden_states", odd_text=True),
        build=build,
        transformer=TRANSFORMER,
        vae=VAE,
    ),
)
