"""CLIP-family rewards from a local path: ``clip_score`` and ``pickscore``.

Both load a transformers ``CLIPModel`` and its tokenizer from disk (never the network) and
preprocess images in torch (resize shortest side bicubic, centre crop, CLIP mean/std), so no
torchvision is needed. Score = logit_scale.exp() * cos(text, image) / divisor, with the
divisors of the Flow-GRPO reference (30 for CLIP score, 26 for PickScore) so rewards are ~1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _side(value: Any, keys: tuple[str, ...]) -> int | None:
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        for k in keys:
            if k in value:
                return int(value[k])
    return None


def image_transform(proc_dir: Path, image_size: int) -> tuple[int, int, torch.Tensor, torch.Tensor]:
    """(resize, crop, mean, std) of the image processor in ``proc_dir``
    (preprocessor_config.json; CLIP's defaults at ``image_size`` without one)."""
    cfg_file = Path(proc_dir) / "preprocessor_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    resize = _side(cfg.get("size"), ("shortest_edge", "height")) or image_size
    crop = _side(cfg.get("crop_size"), ("height",)) or image_size
    crop = crop if cfg.get("do_center_crop", True) else resize
    mean = torch.tensor(cfg.get("image_mean", CLIP_MEAN)).view(1, 3, 1, 1)
    std = torch.tensor(cfg.get("image_std", CLIP_STD)).view(1, 3, 1, 1)
    return resize, crop, mean, std


def preprocess_images(
    images: torch.Tensor, resize: int, crop: int, mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """[B, C, H, W] in [0, 1] -> pixel_values [B, 3, crop, crop]: shortest side to ``resize``
    (bicubic, antialiased), centre crop, (x - mean) / std. In torch: no torchvision."""
    x = images.float()
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    h, w = x.shape[-2:]
    scale = resize / min(h, w)
    size = (max(crop, round(h * scale)), max(crop, round(w * scale)))
    if size != (h, w):
        x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
        x = x.clamp(0, 1)
    top, left = (size[0] - crop) // 2, (size[1] - crop) // 2
    x = x[..., top : top + crop, left : left + crop]
    return (x - mean) / std


def check_model_options(
    name: str, path: str | None, processor_path: str | None, dtype: str, what: str
) -> None:
    """One line naming reward ``name`` when ``path`` is missing, a path is not a local
    directory, or ``dtype`` is not a known one (before any model is loaded)."""
    if not path:
        raise ValueError(f"reward {name!r} needs option 'path': {what}")
    for opt, p in (("path", path), ("processor_path", processor_path)):
        if p is not None and not Path(p).is_dir():
            raise FileNotFoundError(
                f"reward {name!r}: {opt}={str(p)!r} is not an existing local directory"
            )
    if dtype not in _DTYPES:
        raise ValueError(f"reward {name!r}: dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


class _ClipReward:
    """Shared loader/scorer; subclasses set ``reward_name`` and ``divisor``."""

    reward_name = "clip"
    divisor = 1.0

    def __init__(
        self,
        path: str | None = None,
        processor_path: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 32,
        divisor: float | None = None,
    ) -> None:
        check_model_options(
            self.reward_name, path, processor_path, dtype, "a local CLIPModel directory"
        )
        from transformers import AutoTokenizer, CLIPModel

        proc_dir = Path(processor_path or path)
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        if divisor is not None:
            self.divisor = float(divisor)
        self.model = CLIPModel.from_pretrained(path, local_files_only=True, dtype=_DTYPES[dtype])
        self.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(proc_dir, local_files_only=True)
        image_size = int(self.model.config.vision_config.image_size)
        self.resize, self.crop, self.mean, self.std = image_transform(proc_dir, image_size)
        text_cfg = self.model.config.text_config
        self.max_length = min(
            int(self.tokenizer.model_max_length), text_cfg.max_position_embeddings
        )

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] in [0, 1] -> CLIP pixel_values [B, 3, crop, crop] (normalised)."""
        return preprocess_images(images, self.resize, self.crop, self.mean, self.std)

    @torch.no_grad()
    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        scores = []
        dtype = next(self.model.parameters()).dtype
        for i in range(0, images.shape[0], self.batch_size):
            pix = self.preprocess(images[i : i + self.batch_size]).to(self.device, dtype)
            tok = self.tokenizer(
                list(prompts[i : i + self.batch_size]),
                padding="max_length",
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            out = self.model(
                input_ids=tok["input_ids"], attention_mask=tok["attention_mask"], pixel_values=pix
            )
            cos = (out.text_embeds.float() * out.image_embeds.float()).sum(-1)
            scores.append(self.model.logit_scale.exp().float() * cos / self.divisor)
        return torch.cat(scores).cpu()


class ClipScore(_ClipReward):
    """CLIP score: logit_scale.exp() * cos(text, image) / 30 per image [B]."""

    reward_name = "clip_score"
    divisor = 30.0


class PickScore(_ClipReward):
    """PickScore: a CLIP-H fine-tuned on human preferences; logit_scale.exp() * cos / 26.

    Real use: ``path`` = PickScore_v1 weights, ``processor_path`` = the CLIP-ViT-H-14 processor.
    """

    reward_name = "pickscore"
    divisor = 26.0
