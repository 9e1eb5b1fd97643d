"""Offline tiny random diffusers pipelines for tests, benchmarks and docs.

``tiny_pipeline(kind)`` returns a REAL ``QwenImagePipeline``, ``StableDiffusion3Pipeline`` or
``FluxPipeline`` whose every component (tokenizers included) is built in code from a seed:
no hub, no download. Weights are random, so images are noise, but every code path of the
real pipeline runs and shapes/semantics match the real models:

- VAE scale factor 2 (a single downsampling) and patch size 2, so an image of H x W pixels has
  (H/4) x (W/4) transformer tokens. Valid sizes: H and W divisible by 4 (``TINY_MULTIPLE``).
  ``tiny_size(kind)`` gives a small non-square test size (32 x 48 -> 96 tokens); the benchmark
  size is 128 x 128 (1024 tokens).
- Schedulers carry the real models' scheduler configs (``SCHEDULER_CONFIGS``).
- Qwen-Image: the Qwen2 BPE tokenizer encodes the pipeline's prompt-template prefix to exactly
  34 tokens (the pipeline drops ``prompt_template_encode_start_idx = 34``).
- SD3 mimics SD3.5-Medium (qk RMS-norm, a dual-attention first layer); FLUX mimics FLUX.1-dev
  (``guidance_embeds=True``).
- Video (``TINY_VIDEO_KINDS``): ``"wan"`` is a ``WanPipeline`` like Wan2.1-T2V (UMT5, Wan VAE
  with the real temporal x4 and a spatial x4, patch (1, 2, 2)); ``"wan22"`` adds a second expert
  ``transformer_2`` (next seed) and ``boundary_ratio`` 0.875, as Wan2.2-T2V-A14B. Scheduler:
  ``FlowMatchEulerDiscreteScheduler(shift=3)`` (Wan's 480p ``flow_shift``; the hub ships UniPC).
  H, W multiples of 16 (the pipeline's check), F = 4k + 1 frames: a video of F x H x W has
  ((F - 1)/4 + 1) x (H/8) x (W/8) transformer tokens.

Construction is deterministic per ``seed`` and leaves the global torch RNG untouched.
"""

from __future__ import annotations

import functools
import string
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

TINY_KINDS = ("qwen_image", "sd3", "flux")  # image pipelines
#: image pipelines with their own size rule (``tiny_size`` and TINY_MULTIPLE do not apply):
#: QwenImage21Pipeline, H and W multiples of 32 (VAE x16 as the real one, 2x2 image slots)
TINY_OTHER_KINDS = ("qwen_image21",)
TINY_VIDEO_KINDS = ("wan", "wan22", "hunyuan_video15")  # Wan2.1, Wan2.2 (two experts), HV-1.5
TINY_MULTIPLE = 4  # vae_scale_factor (2) * patch size (2): H and W must be multiples of this

# The real models' scheduler/scheduler_config.json (num_train_timesteps=1000 for all).
SCHEDULER_CONFIGS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen-Image
    "qwen_image": {
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 0.9,
        "base_image_seq_len": 256,
        "max_image_seq_len": 8192,
        "shift_terminal": 0.02,
        "time_shift_type": "exponential",
    },
    # the QwenImage21Pipeline's own calculate_shift defaults (the scheduler's config keys)
    "qwen_image21": {
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 0.9,
        "base_image_seq_len": 256,
        "max_image_seq_len": 8192,
        "shift_terminal": 0.02,
        "time_shift_type": "exponential",
    },
    # stabilityai/stable-diffusion-3.5-medium (and SD3-medium)
    "sd3": {"num_train_timesteps": 1000, "shift": 3.0},
    # Wan-AI/Wan2.1-T2V-*-Diffusers ship UniPC with flow_shift 3.0 (480p); the Euler equivalent
    "wan": {"num_train_timesteps": 1000, "shift": 3.0},
    "wan22": {"num_train_timesteps": 1000, "shift": 3.0},
    # Tongyi-MAI/Z-Image-Turbo: a static shift 3 (the pipeline's mu is ignored)
    "z_image": {"num_train_timesteps": 1000, "use_dynamic_shifting": False, "shift": 3.0},
    # hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v (shift 5: UniRL's 480p recipe)
    "hunyuan_video15": {"num_train_timesteps": 1000, "shift": 5.0},
    # black-forest-labs/FLUX.1-dev
    "flux": {
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
    },
    # black-forest-labs/FLUX.2-dev and FLUX.2-klein: dynamic shifting; mu is the pipelines'
    # compute_empirical_mu (sequence length and step count), base/max shift are unused
    "flux2": {
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": True,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
    },
}

# Tiny transformer configs: 2 blocks (FLUX: 1 double + 1 single), 2 heads of 32 (inner dim 64).
# One forward at 1024 image tokens, batch 4, 2 CPU threads: Qwen-Image ~40-50 ms (32-128 text
# tokens), SD3 ~55-80 ms (77 + 128..256 T5 tokens), FLUX ~50-85 ms (128..512 T5 tokens).
TRANSFORMER_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen_image": {
        "patch_size": 2,
        "in_channels": 16,  # 4 latent channels x 2x2 patch
        "out_channels": 4,
        "num_layers": 2,
        "attention_head_dim": 32,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,  # = text encoder hidden size
        "guidance_embeds": False,
        "axes_dims_rope": (8, 12, 12),  # sums to attention_head_dim
    },
    "sd3": {
        "sample_size": 32,
        "patch_size": 2,
        "in_channels": 4,
        "num_layers": 2,
        "attention_head_dim": 32,
        "num_attention_heads": 2,
        "joint_attention_dim": 64,  # = T5 d_model (>= 16 + 32 CLIP hidden sizes)
        "caption_projection_dim": 64,  # = inner dim
        "pooled_projection_dim": 48,  # = 16 + 32 CLIP projection dims
        "out_channels": 4,
        "pos_embed_max_size": 64,  # latent side up to 128 -> images up to 256 px
        "dual_attention_layers": (0,),
        "qk_norm": "rms_norm",
    },
    "flux": {
        "patch_size": 1,
        "in_channels": 16,  # 4 latent channels x 2x2 packing
        "num_layers": 1,
        "num_single_layers": 1,
        "attention_head_dim": 32,
        "num_attention_heads": 2,
        "joint_attention_dim": 32,  # = T5 d_model
        "pooled_projection_dim": 32,  # = CLIP hidden size (pooler_output)
        "guidance_embeds": True,
        "axes_dims_rope": (8, 12, 12),
    },
    "wan": {
        "patch_size": (1, 2, 2),
        "num_attention_heads": 2,
        "attention_head_dim": 32,  # RoPE split t/h/w = 12/10/10
        "in_channels": 4,  # = the tiny VAE's z_dim (real Wan2.1/2.2-A14B: 16)
        "out_channels": 4,
        "text_dim": 32,  # = UMT5 d_model
        "freq_dim": 32,
        "ffn_dim": 128,
        "num_layers": 2,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    },
}
TRANSFORMER_CONFIGS["wan22"] = dict(TRANSFORMER_CONFIGS["wan"])  # each expert
# FLUX.2: 1 double + 1 single block, 2 heads of 32, RoPE over (t, h, w, l); text = 3 stacked
# encoder layers of width 16; dev has the distilled guidance embedding, klein has none
TRANSFORMER_CONFIGS["flux2"] = {
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
TRANSFORMER_CONFIGS["flux2_klein"] = {**TRANSFORMER_CONFIGS["flux2"], "guidance_embeds": False}
# Z-Image: 1 noise + 1 context refiner block, 2 main blocks, 2 heads of 32 (RoPE 8/12/12).
TRANSFORMER_CONFIGS["z_image"] = {
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
# Qwen-Image 2.1: single-stream block-causal, latents unpatched (4 tiny VAE channels, real 64)
TRANSFORMER_CONFIGS["qwen_image21"] = {
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
# HunyuanVideo-1.5 (480p t2v): 2 dual-stream blocks, 1 refiner block, patch 1; in_channels =
# 2 x 4 latent channels + 1 mask channel (the pipeline's [latents, cond zeros, mask zeros])
TRANSFORMER_CONFIGS["hunyuan_video15"] = {
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

# Words the tokenizers know whole; anything else falls back to smaller pieces.
_WORDS = (
    "a an the of in on at with and or to is are photo picture image painting drawing render "
    "cat dog bird fish horse cow car bus train boat plane house tree flower sky sea mountain "
    "city street road river sun moon star cloud rain snow red green blue yellow black white "
    "orange purple pink brown gray big small tall short old new happy sad cube sphere box "
    "sign text word letter number says saying hello world holding wearing standing sitting "
    "man woman person child people table chair cup book clock one two three four five six "
    "seven eight nine ten left right top bottom front behind next beautiful detailed style"
).split()


def _corpus() -> list[str]:
    text = " ".join(_WORDS)  # each word with and without a leading space
    return [
        text,
        " " + text,
        " ".join(w.capitalize() for w in _WORDS),
        "0 1 2 3 4 5 6 7 8 9 , . ! ? :",
    ]


@functools.cache
def _train_bpe(words: tuple[str, ...], suffix: str = "") -> tuple[tuple[str, str], ...]:
    """Deterministic BPE merges (ties broken lexicographically) until every word is one token.

    ``words`` are pre-tokenized (byte-level mapped) pieces; ``suffix`` marks a word's last
    symbol (CLIP's ``</w>``). The tokenizers library trainer is not deterministic across runs
    on ties, hence this small trainer (cached: ~0.1 s per call).
    """
    counts: dict[tuple[str, ...], int] = {}
    for w in words:
        symbols = tuple(w[:-1]) + (w[-1] + suffix,)
        counts[symbols] = counts.get(symbols, 0) + 1
    merges: list[tuple[str, str]] = []
    while True:
        pairs: dict[tuple[str, str], int] = {}
        for symbols, n in counts.items():
            for pair in zip(symbols[:-1], symbols[1:]):
                pairs[pair] = pairs.get(pair, 0) + n
        if not pairs:
            return tuple(merges)
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged: dict[tuple[str, ...], int] = {}
        for symbols, n in counts.items():
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        counts = merged


def _bpe_vocab(specials: list[str], alphabet: list[str], merges) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token in [*specials, *alphabet, *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    return vocab


def _qwen_tokenizer():
    """Qwen2 byte-level BPE trained in code, with the Qwen chat special tokens."""
    import re

    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(specials)}, merges=[])
    pre = tok.backend_tokenizer.pre_tokenizer  # Qwen's regex split + byte-level mapping
    texts = [p for p in re.split(r"<\|im_start\|>|<\|im_end\|>|\{\}", _QWEN_TEMPLATE) if p]
    words = [w for t in texts + _corpus() for w, _ in pre.pre_tokenize_str(t)]
    merges = list(_train_bpe(tuple(words)))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return Qwen2Tokenizer(
        vocab=_bpe_vocab(specials, alphabet, merges),
        merges=merges,
        extra_special_tokens=specials[1:],
        model_max_length=32768,
    )


_QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)


def _clip_tokenizer():
    """CLIP byte-level BPE (``</w>`` word ends) trained in code; model_max_length 77."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    tok = CLIPTokenizer(vocab={s: i for i, s in enumerate(specials)}, merges=[])
    norm, pre = tok.backend_tokenizer.normalizer, tok.backend_tokenizer.pre_tokenizer
    words = [w for t in _corpus() for w, _ in pre.pre_tokenize_str(norm.normalize_str(t))]
    merges = list(_train_bpe(tuple(words), suffix="</w>"))
    bytes_ = sorted(pre_tokenizers.ByteLevel.alphabet())
    alphabet = bytes_ + [b + "</w>" for b in bytes_]  # any byte may end a word
    return CLIPTokenizer(
        vocab=_bpe_vocab(specials, alphabet, merges), merges=merges, model_max_length=77
    )


def _t5_tokenizer():
    """T5 unigram tokenizer from an in-code vocab (<pad>=0, </s>=1, <unk>=2, no sentinels)."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    chars = string.ascii_letters + string.digits + string.punctuation
    vocab += [(c, -6.0) for c in chars] + [("\u2581" + c, -5.0) for c in chars]
    seen = {p for p, _ in vocab}
    vocab += [("\u2581" + w, -3.0) for w in dict.fromkeys(_WORDS) if "\u2581" + w not in seen]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def _clip_text(cls, tok, hidden: int, proj: int | None):
    from transformers import CLIPTextConfig

    cfg = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        projection_dim=proj or hidden,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=77,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        hidden_act="gelu",
    )
    return cls(cfg)


def _t5_encoder(tok, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**_t5_config(tok, d_model)))


def _t5_config(tok, d_model: int) -> dict[str, Any]:
    """The tiny T5-family encoder config shared by the T5 (SD3, FLUX) and UMT5 (Wan) ones."""
    return dict(
        vocab_size=len(tok),
        d_model=d_model,
        d_kv=d_model // 2,
        d_ff=2 * d_model,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )


def _kl_vae(shift: float, scale: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
        scaling_factor=scale,
        shift_factor=shift,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )


def _qwen25_vl_text_config(tok: Any, hidden: int, vocab_size: int) -> dict[str, Any]:
    """A 2-layer, 2-head Qwen2.5-VL language model of width ``hidden`` for ``tok``."""
    half = hidden // 4  # head_dim / 2 with 2 heads; M-RoPE sections (t, h, w) must sum to it
    mrope = [half - 2 * (3 * half // 8), 3 * half // 8, 3 * half // 8]
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 2048,
        "rope_scaling": {"mrope_section": mrope, "rope_type": "default"},
        "rope_theta": 1000000.0,
        "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tok.pad_token_id,
    }


def _qwen25_vl_vision_config(hidden: int, **extra: Any) -> dict[str, Any]:
    """A one-block vision tower projecting to ``hidden``; ``extra``: its patch/window sizes."""
    return {
        "depth": 1,
        "hidden_size": 16,
        "intermediate_size": 16,
        "num_heads": 2,
        "out_hidden_size": hidden,
        "fullatt_block_indexes": [0],
        **extra,
    }


def _build_qwen_image(tcfg: dict[str, Any], seeds) -> Any:
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = _qwen_tokenizer()
    hidden = tcfg["joint_attention_dim"]
    torch.manual_seed(next(seeds))
    text_cfg = Qwen2_5_VLConfig(
        # + 4 vision placeholder ids the tokenizer never emits
        text_config=_qwen25_vl_text_config(tok, hidden, vocab_size=len(tok) + 4),
        vision_config=_qwen25_vl_vision_config(hidden),
        image_token_id=len(tok),
        video_token_id=len(tok) + 1,
        vision_start_token_id=len(tok) + 2,
        vision_end_token_id=len(tok) + 3,
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(text_cfg)
    torch.manual_seed(next(seeds))
    vae = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=4,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[False],
        latents_mean=[-0.2, 0.1, 0.0, 0.3],
        latents_std=[1.5, 2.0, 2.5, 3.0],
    )
    torch.manual_seed(next(seeds))
    transformer = QwenImageTransformer2DModel(**tcfg)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS["qwen_image"])
    pipe = QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    )
    prefix = pipe.prompt_template_encode.split("{}")[0]
    n = len(tok(prefix).input_ids)
    if n != pipe.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"tiny Qwen tokenizer encodes the prompt-template prefix to {n} tokens, "
            f"the pipeline drops {pipe.prompt_template_encode_start_idx}"
        )
    return pipe


def _build_sd3(tcfg: dict[str, Any], seeds) -> Any:
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    tok1, tok2, tok3 = _clip_tokenizer(), _clip_tokenizer(), _t5_tokenizer()
    torch.manual_seed(next(seeds))
    te1 = _clip_text(CLIPTextModelWithProjection, tok1, hidden=16, proj=16)
    torch.manual_seed(next(seeds))
    te2 = _clip_text(CLIPTextModelWithProjection, tok2, hidden=32, proj=32)
    torch.manual_seed(next(seeds))
    te3 = _t5_encoder(tok3, d_model=tcfg["joint_attention_dim"])
    torch.manual_seed(next(seeds))
    vae = _kl_vae(shift=0.0609, scale=1.5305)  # SD3/SD3.5 VAE factors
    torch.manual_seed(next(seeds))
    transformer = SD3Transformer2DModel(**tcfg)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS["sd3"]),
        vae=vae,
        text_encoder=te1,
        tokenizer=tok1,
        text_encoder_2=te2,
        tokenizer_2=tok2,
        text_encoder_3=te3,
        tokenizer_3=tok3,
    )


def _build_flux(tcfg: dict[str, Any], seeds) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tok1, tok2 = _clip_tokenizer(), _t5_tokenizer()
    torch.manual_seed(next(seeds))
    te1 = _clip_text(CLIPTextModel, tok1, hidden=tcfg["pooled_projection_dim"], proj=None)
    torch.manual_seed(next(seeds))
    te2 = _t5_encoder(tok2, d_model=tcfg["joint_attention_dim"])
    torch.manual_seed(next(seeds))
    vae = _kl_vae(shift=0.1159, scale=0.3611)  # FLUX.1 VAE factors
    torch.manual_seed(next(seeds))
    transformer = FluxTransformer2DModel(**tcfg)
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS["flux"]),
        vae=vae,
        text_encoder=te1,
        tokenizer=tok1,
        text_encoder_2=te2,
        tokenizer_2=tok2,
        transformer=transformer,
    )


def _build_wan(tcfg: dict[str, Any], seeds, two_experts: bool = False) -> Any:
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    tok = _t5_tokenizer()
    d = tcfg["text_dim"]
    torch.manual_seed(next(seeds))
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            **_t5_config(tok, d),
            relative_attention_max_distance=32,
            decoder_start_token_id=tok.pad_token_id,
        )
    )
    torch.manual_seed(next(seeds))
    z = tcfg["in_channels"]
    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=z,
        dim_mult=[1, 1, 1],  # two down/up stages: spatial x4
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[True, True],  # temporal x4, as the real Wan VAE
        latents_mean=[0.1 * ((i % 5) - 2) for i in range(z)],
        latents_std=[1.5 + 0.5 * (i % 4) for i in range(z)],
        scale_factor_spatial=4,  # config values the pipeline reads: must match the layout
        scale_factor_temporal=4,
    )
    experts = []
    for _ in range(2 if two_experts else 1):
        torch.manual_seed(next(seeds))
        experts.append(WanTransformer3DModel(**tcfg))
    kind = "wan22" if two_experts else "wan"
    return WanPipeline(
        tokenizer=tok,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS[kind]),
        transformer=experts[0],
        transformer_2=experts[1] if two_experts else None,
        boundary_ratio=0.875 if two_experts else None,  # Wan2.2-T2V-A14B's model_index.json
    )


def _build_wan22(tcfg: dict[str, Any], seeds) -> Any:
    return _build_wan(tcfg, seeds, two_experts=True)


# -- FLUX.2 (dev: Mistral-3 text encoder; klein: Qwen3) ---------------------------------------
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


def _byte_bpe(cls, specials: list[str], texts: list[str], **kwargs: Any):
    """A byte-level BPE tokenizer of class ``cls`` (Qwen2's pre-tokenizer) trained in code on
    ``texts`` and the test corpus, so that the system message and test words are whole tokens."""
    from tokenizers import pre_tokenizers

    tok = cls(vocab={s: i for i, s in enumerate(specials)}, merges=[])
    pre = tok.backend_tokenizer.pre_tokenizer
    words = [w for t in texts + _corpus() for w, _ in pre.pre_tokenize_str(t)]
    merges = list(_train_bpe(tuple(words)))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return cls(vocab=_bpe_vocab(specials, alphabet, merges), merges=merges, **kwargs)


def _mistral_tokenizer():
    """FLUX.2-dev's text tokenizer: a byte-level BPE with Mistral's control tokens and chat
    template. The hub ships a ``PixtralProcessor`` around it, which needs torchvision (not a
    dependency); for text-only prompts its ``apply_chat_template`` is the tokenizer's."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import Qwen2TokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]"]
    specials += ["[/SYSTEM_PROMPT]", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    return _byte_bpe(
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
    return _byte_bpe(
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
    """``AutoencoderKLFlux2`` with one downsampling (factor 2) and non-trivial batch-norm
    statistics (the pipelines de-normalize packed latents with them before decoding)."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=8,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )
    with torch.no_grad():
        n = vae.bn.running_mean.numel()
        vae.bn.running_mean.copy_(0.2 * torch.randn(n))
        vae.bn.running_var.copy_(0.5 + torch.rand(n))
    return vae


def _build_flux2(tcfg: dict[str, Any], seeds) -> Any:
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
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS["flux2"]),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    )


def _build_flux2_klein(tcfg: dict[str, Any], seeds) -> Any:
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
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS["flux2"]),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
        is_distilled=False,
    )


#: Qwen3's chat template for one user turn with ``add_generation_prompt`` (the pipeline asks
#: ``enable_thinking=True``: no empty think block)
_QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)


def _build_z_image(tcfg: dict[str, Any], seeds) -> Any:
    """Z-Image(-Turbo): a tiny Qwen3 (its second-to-last hidden states), the FLUX-style VAE."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    tok = _qwen_tokenizer()
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
    vae = _kl_vae(shift=0.1159, scale=0.3611)  # Z-Image ships the FLUX.1 VAE
    torch.manual_seed(next(seeds))
    transformer = ZImageTransformer2DModel(**tcfg)
    return ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS["z_image"]),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
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

    Without its video processor (which needs torchvision): text-to-image never reads it.
    """
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor

    class Qwen3VLProcessorNoVideo(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(specials)}, merges=[])
    pre = tok.backend_tokenizer.pre_tokenizer
    texts = ["system\nComprehend and analyze the provided prompt.", "user\n", "assistant\n"]
    words = [w for t in texts + _corpus() for w, _ in pre.pre_tokenize_str(t)]
    merges = list(_train_bpe(tuple(words)))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Qwen2Tokenizer(
        vocab=_bpe_vocab(specials + vision, alphabet, merges),
        merges=merges,
        extra_special_tokens=specials[1:] + vision,
        model_max_length=32768,
    )
    return Qwen3VLProcessorNoVideo(
        image_processor=Qwen2VLImageProcessor(patch_size=16, merge_size=2),
        tokenizer=tok,
        video_processor=None,
        chat_template=_QWEN3_VL_CHAT_TEMPLATE,
    )


def _build_qwen_image21(tcfg: dict[str, Any], seeds) -> Any:
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
        base_dim=8,
        decoder_base_dim=8,
        z_dim=z,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, False, False, False],
        latents_mean=[0.1 * i for i in range(z)],
        latents_std=[1.0 + 0.5 * i for i in range(z)],
    )
    torch.manual_seed(next(seeds))
    transformer = QwenImage21Transformer2DModel(**tcfg)
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS["qwen_image21"]),
        vae=vae,
        text_encoder=text_encoder,
        processor=processor,
        transformer=transformer,
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
    texts = ["system\n", "user\n", "assistant\n", system_message, *_corpus()]
    words = [w for t in texts for w, _ in pre.pre_tokenize_str(t)]
    merges = list(_train_bpe(tuple(words)))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Qwen2Tokenizer(
        vocab=_bpe_vocab(specials, alphabet, merges),
        merges=merges,
        extra_special_tokens=specials[1:],
        model_max_length=32768,
    )
    tok.chat_template = _QWEN_CHAT_TEMPLATE
    return tok


def _build_hunyuan_video15(tcfg: dict[str, Any], seeds) -> Any:
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
    text_encoder_2 = T5EncoderModel(T5Config(**_t5_config(tok2, tcfg["text_embed_2_dim"])))
    torch.manual_seed(next(seeds))
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=tcfg["out_channels"],
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        scaling_factor=1.03682,  # the real VAE's
    )
    torch.manual_seed(next(seeds))
    transformer = HunyuanVideo15Transformer3DModel(**tcfg)
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS["hunyuan_video15"]),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tok2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    for name, value in TINY_HUNYUAN15_LENGTHS.items():
        setattr(pipe, name, value)
    prefix = f"<|im_start|>system\n{system_message}<|im_end|>\n<|im_start|>user\n"
    pipe.prompt_template_encode_start_idx = len(tok(prefix).input_ids)
    return pipe


def _qwen_vl_processor(tok: Any) -> Any:
    """Qwen2.5-VL's processor built in code: the PIL image processor (patch 14, merge 2, at
    most 4 x 56² pixels: a few vision tokens per image) and ``tok``; no video processor
    (``qwen_image_edit.vl_processor``)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from flowgrpo.models.qwen_image_edit import vl_processor

    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": 56 * 56, "longest_edge": 4 * 56 * 56},
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
    )
    return vl_processor(image_processor, tok)


def _build_qwen_image_edit(tcfg: dict[str, Any], seeds, plus: bool = False) -> Any:
    """Qwen-Image-Edit(-Plus): the Qwen-Image tiny with the vision tokens in the tokenizer, a
    one-block vision tower, the VL processor, and a VAE of spatial factor 32 (5 downsamplings,
    no residual blocks): the pipelines resize every source image to ~1024² pixels, which this
    VAE encodes in ~1.5 s on one CPU thread into 32 x 32 latents (256 source tokens). Sizes:
    multiples of 64."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageEditPipeline,
        QwenImageEditPlusPipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = _qwen_tokenizer()
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_tokens(vision, special_tokens=True)
    ids = {t: tok.convert_tokens_to_ids(t) for t in vision}
    hidden = tcfg["joint_attention_dim"]
    torch.manual_seed(next(seeds))
    text_cfg = Qwen2_5_VLConfig(
        text_config=_qwen25_vl_text_config(tok, hidden, vocab_size=len(tok)),
        vision_config=_qwen25_vl_vision_config(
            hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(text_cfg)
    torch.manual_seed(next(seeds))
    vae = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1, 1, 1, 1, 1],
        num_res_blocks=0,
        temperal_downsample=[False] * 5,
        latents_mean=[-0.2, 0.1, 0.0, 0.3],
        latents_std=[1.5, 2.0, 2.5, 3.0],
    )
    torch.manual_seed(next(seeds))
    transformer = QwenImageTransformer2DModel(**tcfg)
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS["qwen_image"])
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    return cls(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        processor=_qwen_vl_processor(tok),
        transformer=transformer,
    )


def _build_qwen_image_edit_plus(tcfg: dict[str, Any], seeds) -> Any:
    return _build_qwen_image_edit(tcfg, seeds, plus=True)


TRANSFORMER_CONFIGS["qwen_image_edit"] = dict(TRANSFORMER_CONFIGS["qwen_image"])
TRANSFORMER_CONFIGS["qwen_image_edit_plus"] = dict(TRANSFORMER_CONFIGS["qwen_image"])
#: editing pipelines (source images are conditioning); sizes: multiples of 64
TINY_EDIT_KINDS = ("qwen_image_edit", "qwen_image_edit_plus", "flux_kontext")


def _build_flux_kontext(tcfg: dict[str, Any], seeds) -> Any:
    """FLUX.1 Kontext: the FLUX tiny's text encoders and transformer with a VAE of spatial
    factor 32 (5 downsamplings, 4 channels, no residual blocks): the pipeline resizes every
    source image to a preferred Kontext resolution (~1024² pixels), which this VAE encodes in
    ~0.1 s on one CPU thread into 32 x 32 latents (256 source tokens). Sizes: multiples of 64."""
    from diffusers import AutoencoderKL, FluxKontextPipeline

    flux = _build_flux(tcfg, seeds)
    torch.manual_seed(next(seeds))
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 6,
        up_block_types=("UpDecoderBlock2D",) * 6,
        block_out_channels=(4,) * 6,
        layers_per_block=0,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=0.3611,  # FLUX.1 VAE factors
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )
    return FluxKontextPipeline(**{**flux.components, "vae": vae})


TRANSFORMER_CONFIGS["flux_kontext"] = dict(TRANSFORMER_CONFIGS["flux"])

# Chroma (lodestones/Chroma1-HD): FLUX.1's blocks (1 double + 1 single), T5 only, the
# modulation approximator at 2 layers of 32 (real: 5 of 5120, 64 input channels)
TRANSFORMER_CONFIGS["chroma"] = {
    "patch_size": 1,
    "in_channels": 16,  # 4 latent channels x 2x2 packing
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 32,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,  # = T5 d_model
    "axes_dims_rope": (8, 12, 12),
    "approximator_num_channels": 16,
    "approximator_hidden_dim": 32,
    "approximator_layers": 2,
}
SCHEDULER_CONFIGS["chroma"] = SCHEDULER_CONFIGS["flux"]  # FLUX.1's dynamic shift


def _build_chroma(tcfg: dict[str, Any], seeds) -> Any:
    """ChromaPipeline: the T5 tokenizer and encoder of the FLUX tiny, FLUX.1's VAE factors."""
    from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler

    tok = _t5_tokenizer()
    torch.manual_seed(next(seeds))
    text_encoder = _t5_encoder(tok, d_model=tcfg["joint_attention_dim"])
    torch.manual_seed(next(seeds))
    vae = _kl_vae(shift=0.1159, scale=0.3611)
    torch.manual_seed(next(seeds))
    transformer = ChromaTransformer2DModel(**tcfg)
    return ChromaPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIGS["chroma"]),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        transformer=transformer,
    )


_BUILDERS = {
    "qwen_image": _build_qwen_image,
    "sd3": _build_sd3,
    "flux": _build_flux,
    "wan": _build_wan,
    "wan22": _build_wan22,
    "flux2": _build_flux2,
    "flux2_klein": _build_flux2_klein,
    "z_image": _build_z_image,
    "hunyuan_video15": _build_hunyuan_video15,
    "qwen_image_edit": _build_qwen_image_edit,
    "qwen_image_edit_plus": _build_qwen_image_edit_plus,
}
_BUILDERS["qwen_image21"] = _build_qwen_image21
_BUILDERS["flux_kontext"] = _build_flux_kontext
_BUILDERS["chroma"] = _build_chroma
_ALL_KINDS = (
    TINY_KINDS + TINY_VIDEO_KINDS + TINY_EDIT_KINDS + TINY_OTHER_KINDS + ("z_image", "chroma")
)


def tiny_pipeline(kind: str, seed: int = 0, **overrides: Any) -> DiffusionPipeline:
    """A real diffusers pipeline of family ``kind`` with tiny random weights, built offline.

    ``overrides`` replace entries of the transformer config (``TRANSFORMER_CONFIGS[kind]``),
    e.g. ``num_layers=1``; text encoders follow ``joint_attention_dim``/``pooled_projection_dim``
    (Wan: UMT5 follows ``text_dim``, the VAE's latent channels ``in_channels``).
    All modules are fp32, on CPU, in eval mode with ``requires_grad`` left on, as
    ``from_pretrained`` returns them. The global torch RNG is left untouched.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {_ALL_KINDS}")
    tcfg = dict(TRANSFORMER_CONFIGS[kind])
    unknown = sorted(set(overrides) - set(tcfg))
    if unknown:
        raise ValueError(
            f"unknown transformer option(s) {unknown} for tiny {kind!r}; known: {sorted(tcfg)}"
        )
    tcfg.update(overrides)
    if kind == "sd3" and tcfg["pooled_projection_dim"] != 48:
        raise ValueError("tiny sd3: pooled_projection_dim is fixed at 48 (16 + 32 CLIP dims)")
    seeds = iter(range(seed * 1000, seed * 1000 + 100))
    with torch.random.fork_rng(devices=[]):
        pipe = _BUILDERS[kind](tcfg, seeds)
    for _, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            module.eval()  # like from_pretrained: eval mode, parameters keep requires_grad
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_size(kind: str) -> tuple[int, int]:
    """A small valid (height, width) in pixels for tests: 32 x 48 (8 x 12 = 96 tokens).

    Any H, W that are multiples of ``TINY_MULTIPLE`` (4) work for every image kind; the
    benchmark size is 128 x 128 (32 x 32 = 1024 tokens). Non-square on purpose, to catch H/W
    mix-ups. Wan kinds need multiples of 16: 32 x 48 gives 4 x 6 tokens per latent frame.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny pipeline kind {kind!r}; expected one of {_ALL_KINDS}")
    if kind in TINY_EDIT_KINDS:  # VAE factor 32 x 2x2 packing
        return 64, 128
    return 32, 48
