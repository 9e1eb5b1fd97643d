"""Parts the tiny test doubles share: tokenizers trained in code (Qwen2 byte-level BPE, CLIP,
T5), small CLIP/T5 text encoders, the FLUX/SD3-style VAE, Qwen2.5-VL text and vision configs,
random source images. No hub, no download; every builder is deterministic per seed."""

from __future__ import annotations

import functools
import string
from typing import Any

# Words the tokenizers know whole; anything else falls back to smaller pieces.
WORDS = (
    "a an the of in on at with and or to is are photo picture image painting drawing render "
    "cat dog bird fish horse cow car bus train boat plane house tree flower sky sea mountain "
    "city street road river sun moon star cloud rain snow red green blue yellow black white "
    "orange purple pink brown gray big small tall short old new happy sad cube sphere box "
    "sign text word letter number says saying hello world holding wearing standing sitting "
    "man woman person child people table chair cup book clock one two three four five six "
    "seven eight nine ten left right top bottom front behind next beautiful detailed style"
).split()


def corpus() -> list[str]:
    text = " ".join(WORDS)  # each word with and without a leading space
    return [
        text,
        " " + text,
        " ".join(w.capitalize() for w in WORDS),
        "0 1 2 3 4 5 6 7 8 9 , . ! ? :",
    ]


@functools.cache
def train_bpe(words: tuple[str, ...], suffix: str = "") -> tuple[tuple[str, str], ...]:
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


def bpe_vocab(specials: list[str], alphabet: list[str], merges) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for token in [*specials, *alphabet, *(a + b for a, b in merges)]:
        vocab.setdefault(token, len(vocab))
    return vocab


def qwen_tokenizer():
    """Qwen2 byte-level BPE trained in code, with the Qwen chat special tokens."""
    import re

    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(specials)}, merges=[])
    pre = tok.backend_tokenizer.pre_tokenizer  # Qwen's regex split + byte-level mapping
    texts = [p for p in re.split(r"<\|im_start\|>|<\|im_end\|>|\{\}", QWEN_TEMPLATE) if p]
    words = [w for t in texts + corpus() for w, _ in pre.pre_tokenize_str(t)]
    merges = list(train_bpe(tuple(words)))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return Qwen2Tokenizer(
        vocab=bpe_vocab(specials, alphabet, merges),
        merges=merges,
        extra_special_tokens=specials[1:],
        model_max_length=32768,
    )


QWEN_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)


def clip_tokenizer():
    """CLIP byte-level BPE (``</w>`` word ends) trained in code; model_max_length 77."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    specials = ["<|startoftext|>", "<|endoftext|>"]
    tok = CLIPTokenizer(vocab={s: i for i, s in enumerate(specials)}, merges=[])
    norm, pre = tok.backend_tokenizer.normalizer, tok.backend_tokenizer.pre_tokenizer
    words = [w for t in corpus() for w, _ in pre.pre_tokenize_str(norm.normalize_str(t))]
    merges = list(train_bpe(tuple(words), suffix="</w>"))
    bytes_ = sorted(pre_tokenizers.ByteLevel.alphabet())
    alphabet = bytes_ + [b + "</w>" for b in bytes_]  # any byte may end a word
    return CLIPTokenizer(
        vocab=bpe_vocab(specials, alphabet, merges), merges=merges, model_max_length=77
    )


def t5_tokenizer():
    """T5 unigram tokenizer from an in-code vocab (<pad>=0, </s>=1, <unk>=2, no sentinels)."""
    from transformers import T5Tokenizer

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    chars = string.ascii_letters + string.digits + string.punctuation
    vocab += [(c, -6.0) for c in chars] + [("\u2581" + c, -5.0) for c in chars]
    seen = {p for p, _ in vocab}
    vocab += [("\u2581" + w, -3.0) for w in dict.fromkeys(WORDS) if "\u2581" + w not in seen]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def clip_text(cls, tok, hidden: int, proj: int | None):
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


def t5_encoder(tok, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(**t5_config(tok, d_model)))


def t5_config(tok, d_model: int) -> dict[str, Any]:
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


#: the FLUX/SD3-style tiny VAE (one downsampling: factor 2), without its scale and shift
KL_VAE: dict[str, Any] = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(8, 16),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
    sample_size=32,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=False,
)


def kl_vae(shift: float, scale: float):
    """``AutoencoderKL(**KL_VAE)`` with the family's latent shift and scale."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(**KL_VAE, scaling_factor=scale, shift_factor=shift)


def qwen25_vl_text_config(tok: Any, hidden: int, vocab_size: int) -> dict[str, Any]:
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


def qwen25_vl_vision_config(hidden: int, **extra: Any) -> dict[str, Any]:
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


def byte_bpe(cls, specials: list[str], texts: list[str], **kwargs: Any):
    """A byte-level BPE tokenizer of class ``cls`` (Qwen2's pre-tokenizer) trained in code on
    ``texts`` and the test corpus, so that the system message and test words are whole tokens."""
    from tokenizers import pre_tokenizers

    tok = cls(vocab={s: i for i, s in enumerate(specials)}, merges=[])
    pre = tok.backend_tokenizer.pre_tokenizer
    words = [w for t in texts + corpus() for w, _ in pre.pre_tokenize_str(t)]
    merges = list(train_bpe(tuple(words)))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return cls(vocab=bpe_vocab(specials, alphabet, merges), merges=merges, **kwargs)


def random_image(seed: int, height: int, width: int) -> Any:
    """A random RGB PIL image (a source image for the editing families)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
