"""``image_reward``: ImageReward (BLIP + an MLP head) in process, from ``ImageReward.pt``.

ImageReward encodes the image with BLIP's ViT-L/16, lets BLIP's BERT read the prompt with
cross-attention to it, and maps the [CLS] feature through an MLP; the score is
``(mlp(feature) - 0.16717362830052426) / 1.0333394966054072``
(ImageReward/ImageReward.py ``score``/``inference_rank`` at
THUDM/ImageReward@c1392c6dd0fd6ecd6d416c96959ab744a6d0a8fb; flow_grpo's ``imagereward``
reward calls ``inference_rank``, flow_grpo/imagereward_scorer.py at yifan123/flow_grpo@ac4c86e).
The ``image-reward`` package imports torchvision and timm, so ``ImageReward.pt`` (BLIP keys
under ``blip.`` + ``mlp.layers.*``) is converted at load time into transformers'
``BlipVisionModel`` and ``BlipTextModel`` (``convert.blip_to_hf``), and its preprocessing,
``Resize(224, BICUBIC)`` + ``CenterCrop`` on the PIL image, ToTensor, CLIP mean/std, is
reproduced (``_prefs.pil_resize_crop``). Prompts: BLIP's BERT tokenizer ([DEC], [ENC] added),
``padding="max_length", truncation=True, max_length=35``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flowgrpo.rewards._prefs import (
    DTYPES,
    build_from_state_dict,
    check_options,
    load_state_dict,
    normalize,
    pil_resize_crop,
)
from flowgrpo.rewards.clip import CLIP_MEAN, CLIP_STD

MEAN, STD = 0.16717362830052426, 1.0333394966054072  # ImageReward.py: ImageReward.__init__
MAX_LENGTH = 35  # ImageReward.py: score / inference_rank


class RewardHead(nn.Module):
    """ImageReward's (and LAION's) ``MLP``: five Linears, no activations, dropouts in
    between (identity at inference); ``layers.{0,2,4,6,7}`` as in the checkpoints."""

    def __init__(self, input_size: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def load_head(sd: dict[str, torch.Tensor], prefix: str, name: str) -> RewardHead:
    """The MLP head under ``prefix`` in ``sd`` (fp32), strict: one line if it is not there."""
    head_sd = {k[len(prefix) :]: v.float() for k, v in sd.items() if k.startswith(prefix)}
    if "layers.0.weight" not in head_sd:
        raise ValueError(f"reward {name!r}: checkpoint has no {prefix}layers.0.weight (MLP head)")
    head = RewardHead(head_sd["layers.0.weight"].shape[1])
    head.load_state_dict(head_sd, strict=True)
    return head.eval().requires_grad_(False)


class ImageReward:
    """ImageReward score per image [B] (standardised: ~0 mean, ~1 std on its test set).

    ``path``: ``ImageReward.pt`` (THUDM/ImageReward, "ImageReward-v1.0"). ``processor_path``:
    a ``bert-base-uncased`` tokenizer directory (BLIP's tokenizer; [DEC] and [ENC] are
    added here as BLIP's ``init_tokenizer`` does).
    """

    reward_name = "image_reward"

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
            path=(path, "file", "the ImageReward.pt checkpoint"),
            processor_path=(processor_path, "dir", "a bert-base-uncased tokenizer directory"),
        )
        from transformers import AutoTokenizer
        from transformers.models.blip.modeling_blip import BlipVisionModel
        from transformers.models.blip.modeling_blip_text import BlipTextModel

        from flowgrpo.rewards.convert import blip_configs, blip_to_hf

        tok = AutoTokenizer.from_pretrained(processor_path, local_files_only=True)
        tok.add_special_tokens({"bos_token": "[DEC]"})  # BLIP blip.py init_tokenizer
        tok.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
        sd = load_state_dict(path, self.reward_name)
        vision_cfg, text_cfg = blip_configs(sd)
        if len(tok) > text_cfg.vocab_size:
            raise ValueError(
                f"reward {self.reward_name!r}: tokenizer in {processor_path!r} has {len(tok)} "
                f"tokens, more than the checkpoint's {text_cfg.vocab_size} (not BLIP's BERT?)"
            )
        vision_sd, text_sd = blip_to_hf(sd)
        dt = DTYPES[dtype]
        vision = build_from_state_dict(BlipVisionModel, vision_cfg, vision_sd, dt)
        text = build_from_state_dict(BlipTextModel, text_cfg, text_sd, dt, add_pooling_layer=False)
        self._attach(vision, text, load_head(sd, "mlp.", self.reward_name), tok, device, batch_size)

    def _attach(
        self, vision: Any, text: Any, mlp: Any, tokenizer: Any, device: str, batch_size: int
    ) -> None:
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.tokenizer = tokenizer
        self.vision, self.text, self.mlp = (
            m.to(self.device).eval().requires_grad_(False) for m in (vision, text, mlp)
        )
        self.image_size = int(vision.config.image_size)

    @classmethod
    def from_model(
        cls,
        vision: Any,
        text: Any,
        mlp: RewardHead,
        tokenizer: Any,
        *,
        device: str = "cpu",
        batch_size: int = 16,
    ) -> ImageReward:
        """The reward on converted BLIP towers and head already in memory (the benchmark's)."""
        self = cls.__new__(cls)
        self._attach(vision, text, mlp, tokenizer, device, batch_size)
        return self

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] in [0, 1] -> pixel_values as ImageReward's ``_transform(224)``."""
        x = pil_resize_crop(images, self.image_size).to(self.device)
        return normalize(x, CLIP_MEAN, CLIP_STD)

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        dtype = next(self.vision.parameters()).dtype
        scores = []
        for i in range(0, images.shape[0], self.batch_size):
            pix = self.preprocess(images[i : i + self.batch_size]).to(dtype)
            tok = self.tokenizer(
                list(prompts[i : i + self.batch_size]),
                padding="max_length",
                truncation=True,
                max_length=MAX_LENGTH,
                return_tensors="pt",
            ).to(self.device)
            emb = self.vision(pixel_values=pix).last_hidden_state
            atts = torch.ones(emb.shape[:-1], dtype=torch.long, device=self.device)
            hidden = self.text(
                input_ids=tok["input_ids"],
                attention_mask=tok["attention_mask"],
                encoder_hidden_states=emb,
                encoder_attention_mask=atts,
            ).last_hidden_state
            reward = self.mlp(hidden[:, 0, :].float())[:, 0]
            scores.append((reward - MEAN) / STD)
        return torch.cat(scores).cpu()
