"""Z-Image's test double: a real ``ZImagePipeline`` (Z-Image / Z-Image-Turbo) with tiny random
weights: a Qwen3 text model (its second-to-last hidden states), the FLUX.1-style VAE of factor
2, 2x2 patches: H and W multiples of 4."""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.testing.families._parts import KL_VAE, kl_vae, qwen_tokenizer
from flowgrpo.testing.family import Family, SequenceParallelCase

#: Tongyi-MAI/Z-Image-Turbo: a static shift 3 (the pipeline's mu is ignored)
SCHEDULER: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "use_dynamic_shifting": False,
    "shift": 3.0,
}
# 1 noise + 1 context refiner block, 2 main blocks, 2 heads of 32 (RoPE 8/12/12)
TRANSFORMER: dict[str, Any] = {
    "all_patch_size": (2,),
    "all_f_patch_size": (1,),
    "in_channels": 4,  # = the tiny VAE's latent channels (real: 16)
    "dim": 64,
    "n_layers": 2,
    "n_refiner_layers": 1,
    "n_heads": 2,
    "n_kv_heads": 2,
    "cap_feat_dim": 32,  # = the Qwen3 text encoder's hidden size
    "axes_dims": (8, 12, 12),
    "axes_lens": (1024, 512, 512),
}
#: Qwen3's chat template for one user turn with ``add_generation_prompt`` (the pipeline asks
#: ``enable_thinking=True``: no empty think block)
_QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def build(tcfg: dict[str, Any], seeds) -> Any:
    """Z-Image(-Turbo): a tiny Qwen3 (its second-to-last hidden states), the FLUX-style VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tok = qwen_tokenizer()
    tok.chat_template = _QWEN3_CHAT_TEMPLATE
    hidden = tcfg["cap_feat_dim"]
    torch.manual_seed(next(seeds))
    text_encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=hidden // 2,
            max_position_embeddings=2048,
            rope_theta=1000000.0,
            bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tok.pad_token_id,
        )
    )
    torch.manual_seed(next(seeds))
    vae = kl_vae(shift=0.1159, scale=0.3611)  # Z-Image ships the FLUX.1 VAE
    torch.manual_seed(next(seeds))
    transformer = ZImageTransformer2DModel(**tcfg)
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    )


DOUBLES = (
    Family(
        "z_image",
        ((32, 48), (24, 16)),
        options={"max_sequence_length": 64},
        call_options={"max_sequence_length": 64},
        pipeline_class="ZImagePipeline",
        sp=SequenceParallelCase(output_module="all_final_layer.2-1", first_block="layers.0"),
        build=build,
        transformer=TRANSFORMER,
        vae=KL_VAE,
    ),
)
