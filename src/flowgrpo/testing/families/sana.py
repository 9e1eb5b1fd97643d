"""SANA's test double: a real ``SanaPipeline`` like Sana-1.6B (linear self-attention DiT with
cross-attention to Gemma-2 text, DC-AE, Flow-DPM-Solver) with tiny random weights: a Gemma-2
decoder and a byte-fallback BPE tokenizer trained in code (the complex human instruction's
words whole), a 4-level ``AutoencoderDC`` (factor 8; the real one 32), the stock scheduler
(``DPMSolverMultistepScheduler``, flow sigmas, shift 3). The pipeline takes multiples of 32
only (``check_inputs``): H and W multiples of 32."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from flowgrpo.testing.families._parts import bpe_vocab, corpus, train_bpe
from flowgrpo.testing.family import Family

#: the scheduler of the converted Sana checkpoints (diffusers' convert_sana_to_diffusers.py:
#: ``DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True,
#: prediction_type="flow_prediction")``, the rest diffusers' defaults: 2M, dpmsolver++)
SCHEDULER: dict[str, Any] = {
    "flow_shift": 3.0,
    "use_flow_sigmas": True,
    "prediction_type": "flow_prediction",
}
# 2 blocks, 2 self-attention heads of 8 and 2 cross-attention heads of 8 (real: 20 blocks,
# 70 x 32 and 20 x 112); captions from the tiny Gemma-2's width 32 (real 2304)
TRANSFORMER: dict[str, Any] = {
    "in_channels": 4,
    "out_channels": 4,
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "num_layers": 2,
    "num_cross_attention_heads": 2,
    "cross_attention_head_dim": 8,
    "cross_attention_dim": 16,
    "caption_channels": 32,
    "mlp_ratio": 2.5,
    "sample_size": 32,
    "patch_size": 1,
}
#: DC-AE at 4 levels of ResBlocks (factor 8), 4 latent channels
VAE: dict[str, Any] = {
    "in_channels": 3,
    "latent_channels": 4,
    "attention_head_dim": 8,
    "encoder_block_types": "ResBlock",
    "decoder_block_types": "ResBlock",
    "encoder_block_out_channels": (8, 8, 16, 16),
    "decoder_block_out_channels": (8, 8, 16, 16),
    "encoder_layers_per_block": (1, 1, 1, 1),
    "decoder_layers_per_block": (1, 1, 1, 1),
    "encoder_qkv_multiscales": ((), (), (), ()),
    "decoder_qkv_multiscales": ((), (), (), ()),
    "upsample_block_type": "interpolate",
    "downsample_block_type": "conv",
    "scaling_factor": 0.41407,  # dc-ae-f32c32-sana-1.0's
}


def gemma_tokenizer():
    """Gemma's BPE (spaces as "▁", byte fallback) trained in code on the test corpus and the
    pipeline's complex human instruction, so that both are mostly whole words."""
    from diffusers import SanaPipeline
    from transformers import GemmaTokenizer

    chi = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    texts = [*corpus(), "\n".join(chi.default)]
    words = [("▁" + w).replace("▁▁", "▁") for t in texts for w in t.replace("\n", " ").split()]
    merges = list(train_bpe(tuple(words)))
    alphabet = sorted({c for w in words for c in w} | {"\n"})
    alphabet += [f"<0x{i:02X}>" for i in range(256)]
    return GemmaTokenizer(
        vocab=bpe_vocab(specials, alphabet, merges),
        merges=merges,
        add_bos_token=True,
        padding_side="right",  # as the converted checkpoints save it (and the pipeline sets)
        model_max_length=8192,
    )


def gemma2(tok: Any, hidden: int) -> Any:
    """A 2-layer Gemma-2 decoder (``Gemma2Model``, what the pipeline loads) of width ``hidden``."""
    from transformers import Gemma2Config, Gemma2Model

    cfg = Gemma2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4096,
        max_position_embeddings=8192,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return Gemma2Model(cfg)


def build(tcfg: dict[str, Any], seeds) -> Any:
    """The tiny ``SanaPipeline`` with transformer config ``tcfg``."""
    from diffusers import (
        AutoencoderDC,
        DPMSolverMultistepScheduler,
        SanaPipeline,
        SanaTransformer2DModel,
    )

    tok = gemma_tokenizer()
    torch.manual_seed(next(seeds))
    text_encoder = gemma2(tok, hidden=tcfg["caption_channels"])
    torch.manual_seed(next(seeds))
    vae = AutoencoderDC(**VAE)
    torch.manual_seed(next(seeds))
    transformer = SanaTransformer2DModel(**tcfg)
    return SanaPipeline(
        tokenizer=tok,
        text_encoder=text_encoder,
        vae=vae,
        transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(**SCHEDULER),
    )


DOUBLES = (
    Family(
        "sana",
        ((32, 64), (64, 32)),
        size=(32, 64),
        options={"max_sequence_length": 16},
        call_options={"max_sequence_length": 16, "use_resolution_binning": False},
        ode_solver="dpm2",  # the stock Flow-DPM-Solver (DPM-Solver++ 2M)
        train_size=(32, 32),
        pipeline_class="SanaPipeline",
        build=build,
        transformer=TRANSFORMER,
        vae=VAE,
    ),
)
