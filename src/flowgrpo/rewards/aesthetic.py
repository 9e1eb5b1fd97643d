"""``aesthetic``: the LAION "improved aesthetic predictor" (v2) in process.

An MLP on the L2-normalised CLIP ViT-L/14 image embedding; ``sac+logos+ava1-l14-linearMSE.pth``
holds the MLP (``layers.{0,2,4,6,7}``), OpenAI's CLIP ViT-L/14 the embedding
(simple_inference.py at christophschuhmann/improved-aesthetic-predictor@6934dd8; flow_grpo
runs it on transformers' ``openai/clip-vit-large-patch14``, flow_grpo/aesthetic_scorer.py at
yifan123/flow_grpo@ac4c86e, as DDPO did). Preprocessing as ``clip.load``'s: ``Resize(224,
BICUBIC)`` + ``CenterCrop`` on the PIL image, ToTensor, CLIP mean/std (``_prefs.pil_resize_crop``).
The score is the predicted rating, ~1-10 (most generated images 4-7).
"""

from __future__ import annotations

from typing import Any

import torch

from flowgrpo.rewards._prefs import (
    DTYPES,
    check_options,
    load_state_dict,
    normalize,
    pil_resize_crop,
)
from flowgrpo.rewards.clip import CLIP_MEAN, CLIP_STD
from flowgrpo.rewards.image_reward import RewardHead, load_head


class Aesthetic:
    """LAION aesthetic score per image [B] (prompts are not used).

    ``path``: ``sac+logos+ava1-l14-linearMSE.pth`` (the predictor's repository; flow_grpo
    ships it in flow_grpo/assets). ``clip_path``: a transformers ``CLIPModel`` directory of
    OpenAI's CLIP ViT-L/14 (``openai/clip-vit-large-patch14``).
    """

    reward_name = "aesthetic"

    def __init__(
        self,
        path: str | None = None,
        clip_path: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
    ) -> None:
        check_options(
            self.reward_name,
            dtype,
            path=(path, "file", "the sac+logos+ava1-l14-linearMSE.pth MLP"),
            clip_path=(clip_path, "dir", "a CLIPModel directory of openai/clip-vit-large-patch14"),
        )
        from transformers import CLIPModel

        head = load_head(load_state_dict(path, self.reward_name), "", self.reward_name)
        clip = CLIPModel.from_pretrained(clip_path, local_files_only=True, dtype=DTYPES[dtype])
        dim = clip.config.projection_dim
        if head.layers[0].in_features != dim:
            raise ValueError(
                f"reward {self.reward_name!r}: the MLP in {path!r} takes "
                f"{head.layers[0].in_features}-d embeddings, the CLIP in {clip_path!r} "
                f"gives {dim}-d (ViT-L/14 gives 768)"
            )
        self._attach(clip, head, device, batch_size)

    def _attach(self, clip: Any, head: RewardHead, device: str, batch_size: int) -> None:
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.vision, self.projection, self.head = (
            m.to(self.device).eval().requires_grad_(False)
            for m in (clip.vision_model, clip.visual_projection, head)
        )
        self.image_size = int(clip.config.vision_config.image_size)

    @classmethod
    def from_model(
        cls, clip: Any, head: RewardHead, *, device: str = "cpu", batch_size: int = 32
    ) -> Aesthetic:
        """The reward on a CLIPModel and MLP head already in memory (the benchmark's)."""
        self = cls.__new__(cls)
        self._attach(clip, head, device, batch_size)
        return self

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] in [0, 1] -> pixel_values as CLIP's ``_transform(224)``."""
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
            emb = self.projection(self.vision(pixel_values=pix).pooler_output).float()
            norm = emb.norm(dim=-1, keepdim=True)
            emb = emb / torch.where(norm == 0, torch.ones_like(norm), norm)  # LAION normalized
            scores.append(self.head(emb)[:, 0])
        return torch.cat(scores).cpu()
