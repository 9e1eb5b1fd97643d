"""Test doubles of the ``geneval`` reward: tiny random OWLv2 and CLIP models with char-level
tokenizers, built offline, and a few of flow_grpo's GenEval records verbatim."""

from __future__ import annotations

from pathlib import Path

import torch

# Four records of yifan123/flow_grpo @ ac4c86e dataset/geneval/test_metadata.jsonl (lines 1-3
# and 284), verbatim: the form the loader must take as it is.
FLOW_GRPO_RECORDS = """\
{"tag": "counting", "include": [{"class": "wine glass", "count": 2}], "exclude": [{"class": "wine glass", "count": 3}], "prompt": "a photo of two wine glasses"}
{"tag": "color_attr", "include": [{"class": "handbag", "count": 1, "color": "pink"}, {"class": "scissors", "count": 1, "color": "black"}], "prompt": "a photo of a pink handbag and a black scissors"}
{"tag": "color_attr", "include": [{"class": "dining table", "count": 1, "color": "yellow"}, {"class": "dog", "count": 1, "color": "pink"}], "prompt": "a photo of a yellow dining table and a pink dog"}
{"tag": "position", "include": [{"class": "teddy bear", "count": 1}, {"class": "dog", "count": 1, "position": ["right of", 0]}], "prompt": "a photo of a dog right of a teddy bear"}
"""


def _char_vocab() -> dict[str, int]:
    vocab = {"!": 0, "<|startoftext|>": 1, "<|endoftext|>": 2}  # OWLv2: pad id 0, BOS > 0
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789-":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    return vocab


def save_tiny_owlv2(path: str | Path, image_size: int = 32) -> str:
    """A random Owlv2ForObjectDetection (2 layers, width 32) with a char-level CLIPTokenizer."""
    from transformers import CLIPTokenizer, Owlv2Config, Owlv2ForObjectDetection

    vocab = _char_vocab()
    CLIPTokenizer(
        vocab=vocab, merges=[], model_max_length=16, pad_token="!",
        bos_token="<|startoftext|>", eos_token="<|endoftext|>",
    ).save_pretrained(path)  # fmt: skip
    text = dict(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=16, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        image_size=image_size, patch_size=8,
    )  # fmt: skip
    torch.manual_seed(0)
    cfg = Owlv2Config(text_config=text, vision_config=vision, projection_dim=32)  # = text width
    Owlv2ForObjectDetection(cfg).save_pretrained(path)
    return str(path)


def save_tiny_clip(path: str | Path) -> str:
    """A random CLIPModel (image size 32) with a char-level CLIPTokenizer."""
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    vocab = _char_vocab()
    CLIPTokenizer(
        vocab=vocab, merges=[], model_max_length=77, pad_token="!",
        bos_token="<|startoftext|>", eos_token="<|endoftext|>",
    ).save_pretrained(path)  # fmt: skip
    text = dict(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )  # fmt: skip
    vision = dict(
        hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        image_size=32, patch_size=8,
    )  # fmt: skip
    torch.manual_seed(1)
    CLIPModel(
        CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    ).save_pretrained(path)
    return str(path)


class FixedDetector:
    """A detector of your own, as ``detector="package.module:factory"`` builds one: here it
    finds one ``name`` box per image, in the middle of the image, with score ``score``."""

    def __init__(self, name: str = "dog", score: float = 0.95) -> None:
        self.name, self.score = name, float(score)

    def detect(self, images: list, classnames: list[str]) -> list[dict]:
        import numpy as np

        out = []
        for im in images:
            w, h = im.size
            box = np.array([w / 4, h / 4, 3 * w / 4, 3 * h / 4, self.score], np.float32)
            out.append({self.name: [(box, None)]})
        return out
