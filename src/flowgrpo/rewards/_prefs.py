"""What the preference-model rewards (``hpsv2``, ``image_reward``, ``aesthetic``) share:
option checks, safe checkpoint loading, building a transformers model from a converted state
dict without initialising it, and the torchvision preprocessing their references use,
transcribed (torchvision cannot be imported beside torch 2.13 here).

The references feed PIL images: flow_grpo turns a reward's float images into uint8
(``(x * 255).round()``, flow_grpo/rewards.py:38 and :54 at yifan123/flow_grpo@ac4c86e), so
every path here quantises the same way first (``_image.to_uint8``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from flowgrpo.rewards._image import to_uint8

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_options(name: str, dtype: str, **paths: tuple[str | None, str, str]) -> None:
    """One line naming reward ``name`` and the option at fault: each ``paths`` entry is
    ``option=(value, "file" | "dir", what it should be)``; ``dtype`` must be a known one."""
    for opt, (value, kind, what) in paths.items():
        if not value:
            raise ValueError(f"reward {name!r} needs option {opt!r}: {what}")
        p = Path(value)
        ok = p.is_file() if kind == "file" else p.is_dir()
        if not ok:
            where = "file" if kind == "file" else "directory"
            raise FileNotFoundError(
                f"reward {name!r}: {opt}={str(value)!r} is not an existing local {where} ({what})"
            )
    if dtype not in DTYPES:
        raise ValueError(f"reward {name!r}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")


def load_state_dict(path: str, name: str) -> dict[str, torch.Tensor]:
    """Tensors of a ``.pt``/``.pth``/``.safetensors`` checkpoint, unwrapped from a
    ``{"state_dict": ...}`` (HPS) or ``{"model": ...}`` wrapper and a ``module.`` prefix.
    Loaded with ``weights_only=True``: a checkpoint that needs pickled code is refused."""
    if str(path).endswith(".safetensors"):
        from safetensors.torch import load_file

        sd: Any = load_file(path)
    else:
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - one line naming the file
            raise ValueError(f"reward {name!r}: cannot read checkpoint {path!r}: {e}") from None
    for key in ("state_dict", "model"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not sd:
        raise ValueError(f"reward {name!r}: checkpoint {path!r} holds no state dict")
    if all(k.startswith("module.") for k in sd):
        sd = {k[len("module.") :]: v for k, v in sd.items()}
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def build_from_state_dict(
    cls: type, config: Any, sd: dict[str, torch.Tensor], dtype: torch.dtype, **kw: Any
) -> torch.nn.Module:
    """``cls(config, **kw)`` built on the meta device and given ``sd`` (strict), cast to
    ``dtype``: no random initialisation, no second copy of a 1B-parameter model."""
    with torch.device("meta"):
        model = cls(config, **kw)
    sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
    model.load_state_dict(sd, strict=True, assign=True)
    for mod in model.modules():  # non-persistent buffers: transformers' position ids
        for bname, buf in list(mod.named_buffers(recurse=False)):
            if buf.is_meta:
                if bname != "position_ids":
                    raise RuntimeError(f"buffer {bname!r} of {type(mod).__name__} not set")
                ids = torch.arange(buf.shape[-1]).expand(buf.shape).clone()
                mod.register_buffer(bname, ids, persistent=False)
    return model.eval().requires_grad_(False)


def resized_size(h: int, w: int, size: int) -> tuple[int, int]:
    """torchvision's ``Resize(size)`` output (h, w): the shorter side to ``size``, the longer
    ``int(size * long / short)`` (torchvision/transforms/functional.py
    ``_compute_resized_output_size``)."""
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = size, int(size * long / short)
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    return new_h, new_w


def _crop_box(h: int, w: int, crop: int) -> tuple[int, int]:
    """torchvision ``center_crop``'s (top, left): ``int(round((side - crop) / 2.0))``."""
    return int(round((h - crop) / 2.0)), int(round((w - crop) / 2.0))


def pil_resize_crop(images: torch.Tensor, size: int) -> torch.Tensor:
    """[B, C, H, W] float in [0, 1] -> [B, 3, size, size] float in [0, 1], as
    ``Compose([Resize(size, BICUBIC), CenterCrop(size), convert("RGB"), ToTensor()])`` does
    on PIL images (CLIP's, LAION's and ImageReward's ``_transform``): uint8 pixels, PIL's
    bicubic resample, torchvision's crop rounding; an image already at the size is left as is
    (torchvision's shortcut)."""
    out = []
    for arr in to_uint8(images):
        pil = Image.fromarray(arr[..., 0] if arr.shape[-1] == 1 else arr)
        h, w = arr.shape[:2]
        nh, nw = resized_size(h, w, size)
        if (nh, nw) != (h, w):
            pil = pil.resize((nw, nh), Image.BICUBIC)
        top, left = _crop_box(nh, nw, size)
        pil = pil.crop((left, top, left + size, top + size)).convert("RGB")
        out.append(torch.from_numpy(np.asarray(pil, dtype=np.uint8).copy()))
    return torch.stack(out).permute(0, 3, 1, 2).float().div_(255.0)


def tensor_resize_crop(images: torch.Tensor, size: int, device: torch.device) -> torch.Tensor:
    """[B, C, H, W] float in [0, 1] -> [B, 3, size, size] on ``device``, as open_clip's eval
    transform ``Compose([ToTensor(), Resize(size, BICUBIC), CenterCrop(size)])`` does
    (HPSv2's, hpsv2/src/open_clip/transform.py:159-170 at tgxs002/HPSv2@866735e): uint8
    pixels / 255, then a *tensor* resize, bicubic with antialias (torchvision >= 0.17's
    default) and no clamp, then torchvision's centre crop."""
    x = torch.from_numpy(to_uint8(images)).to(device).permute(0, 3, 1, 2).float() / 255.0
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    h, w = x.shape[-2:]
    nh, nw = resized_size(h, w, size)
    if (nh, nw) != (h, w):
        x = F.interpolate(x, size=(nh, nw), mode="bicubic", align_corners=False, antialias=True)
    top, left = _crop_box(nh, nw, size)
    return x[..., top : top + size, left : left + size]


def normalize(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """torchvision ``Normalize``: (x - mean) / std per channel."""
    m = torch.tensor(mean, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s
