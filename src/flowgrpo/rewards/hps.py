"""``hpsv2``: Human Preference Score v2.1 in process, from the published checkpoint.

HPS v2(.1) is open_clip's ViT-H-14 fine-tuned on human preferences; its score is the cosine
of the image and prompt embeddings, ``diag(image_features @ text_features.T)`` with both
normalised (hpsv2/img_score.py:57-84 at tgxs002/HPSv2@866735e; DanceGRPO trains against
the same ``HPS_v2.1_compressed.pt`` through hpsv2's open_clip). open_clip imports torchvision, which cannot be imported
beside torch 2.13 here, so ``HPS_v2.1_compressed.pt`` (open_clip keys under
``state_dict``) is converted at load time into a transformers ``CLIPModel``
(``convert.open_clip_to_hf``; ViT-H-14's vision head width is 80, model_configs/ViT-H-14.json)
and the eval transform is reproduced in torch (``_prefs.tensor_resize_crop``: uint8 pixels,
antialiased bicubic tensor resize to 224, centre crop, OpenAI mean/std).
"""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.rewards._prefs import (
    DTYPES,
    build_from_state_dict,
    check_options,
    load_state_dict,
    normalize,
    tensor_resize_crop,
)
from flowgrpo.rewards.clip import CLIP_MEAN, CLIP_STD

# open_clip ViT-H-14 (hpsv2/src/open_clip/model_configs/ViT-H-14.json): vision heads of 80,
# text heads of 64, GELU (not QuickGELU).
VIT_H14 = dict(vision_head_width=80, text_head_width=64, hidden_act="gelu")


class HPSv2:
    """HPS v2.1 score per image [B] (cosine, ~0.2-0.35 on real images; HPS reports it x 100).

    ``path``: ``HPS_v2.1_compressed.pt`` (xswu/HPSv2 on the Hub). ``processor_path``: a
    directory with the CLIP-ViT-H-14 tokenizer (laion/CLIP-ViT-H-14-laion2B-s32B-b79K, the
    one PickScore uses). ``dtype`` float32 by default (hpsv2 scores under fp16 autocast on
    GPUs; ``dtype=float16`` or ``bfloat16`` is the cheap equivalent).
    """

    reward_name = "hpsv2"

    def __init__(
        self,
        path: str | None = None,
        processor_path: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 16,
    ) -> None:
        check_options(
            self.reward_name,
            dtype,
            path=(path, "file", "the HPS_v2.1_compressed.pt checkpoint"),
            processor_path=(processor_path, "dir", "a CLIP-ViT-H-14 tokenizer directory"),
        )
        from transformers import AutoTokenizer, CLIPModel

        from flowgrpo.rewards.convert import open_clip_config, open_clip_to_hf

        tokenizer = AutoTokenizer.from_pretrained(processor_path, local_files_only=True)
        sd = load_state_dict(path, self.reward_name)
        config = open_clip_config(
            sd,
            **VIT_H14,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        model = build_from_state_dict(CLIPModel, config, open_clip_to_hf(sd), DTYPES[dtype])
        self._attach(model, tokenizer, device, batch_size)

    def _attach(self, model: Any, tokenizer: Any, device: str, batch_size: int) -> None:
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.tokenizer = tokenizer
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.image_size = int(model.config.vision_config.image_size)
        self.context_length = int(model.config.text_config.max_position_embeddings)

    @classmethod
    def from_model(
        cls, model: Any, tokenizer: Any, *, device: str = "cpu", batch_size: int = 16
    ) -> HPSv2:
        """The reward on a converted ``CLIPModel`` already in memory (the benchmark's)."""
        self = cls.__new__(cls)
        self._attach(model, tokenizer, device, batch_size)
        return self

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] in [0, 1] -> pixel_values as open_clip's eval transform makes them."""
        x = tensor_resize_crop(images, self.image_size, self.device)
        return normalize(x, CLIP_MEAN, CLIP_STD)

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        dtype = next(self.model.parameters()).dtype
        scores = []
        for i in range(0, images.shape[0], self.batch_size):
            pix = self.preprocess(images[i : i + self.batch_size]).to(dtype)
            tok = self.tokenizer(
                list(prompts[i : i + self.batch_size]),
                padding="max_length",
                truncation=True,
                max_length=self.context_length,
                return_tensors="pt",
            ).to(self.device)
            out = self.model(
                input_ids=tok["input_ids"], attention_mask=tok["attention_mask"], pixel_values=pix
            )
            scores.append((out.image_embeds.float() * out.text_embeds.float()).sum(-1))
        return torch.cat(scores).cpu()
