"""OCR reward: how well the image renders the target text, read with PP-OCRv4 (rapidocr).

Target text: ``metadata["ocr_text"]`` if present, else the first quoted span of the prompt
("...", '...', “...” or ‘...’). Both strings are lower-cased with spaces removed; the score is
1 - min(Levenshtein(recognised, target), len(target)) / len(target), and 1 if the target is a
substring of the recognised text (the Flow-GRPO reference).
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np
import torch

from flowgrpo.rewards._image import to_uint8

_ENGINE: Any = None
_ENGINE_LOCK = threading.Lock()
# PaddleOCR's defaults as the Flow-GRPO reference used them (no angle classifier, detection
# at most 960 px on the long side). rapidocr's own default upscales the short side to 736 px,
# which is 5-10x slower on small images and reads no better.
ENGINE_OPTIONS = {"det_limit_type": "max", "det_limit_side_len": 960, "use_cls": False}

# A single quote opens only after a non-word char and closes before one (apostrophes are not quotes).
_QUOTE_RE = re.compile(r"\"([^\"]+)\"|“([^”]+)”|‘([^’]+)’|(?<!\w)'([^']+)'(?!\w)")


def get_ocr_engine() -> Any:
    """The process-wide RapidOCR engine, created on first use (loading takes ~1 s)."""
    global _ENGINE
    with _ENGINE_LOCK:
        if _ENGINE is None:
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as e:
                raise ImportError(
                    "the 'ocr' reward needs rapidocr-onnxruntime: pip install 'flowgrpo[ocr]'"
                ) from e
            _ENGINE = RapidOCR(**ENGINE_OPTIONS)
        return _ENGINE


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions all cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _norm(text: str) -> str:
    return "".join(text.split()).lower()


def ocr_target(prompt: str, metadata: dict | None = None) -> str:
    """The text the image should show: metadata["ocr_text"], else the prompt's first quote."""
    if metadata and metadata.get("ocr_text") is not None:
        target = str(metadata["ocr_text"])
    else:
        m = _QUOTE_RE.search(prompt)
        if m is None:
            raise ValueError(
                f"OCR reward: no target text for prompt {prompt!r}: quote it in the prompt "
                "or give metadata['ocr_text']"
            )
        target = next(g for g in m.groups() if g is not None)
    if not _norm(target):
        raise ValueError(f"OCR reward: empty target text for prompt {prompt!r}")
    return target


def ocr_score(recognised: str, target: str) -> float:
    """1 - min(edit distance, len) / len on lower-cased, space-free strings; 1 if contained."""
    rec, tgt = _norm(recognised), _norm(target)
    if not tgt:
        raise ValueError("OCR target text is empty")
    dist = 0 if tgt in rec else min(levenshtein(rec, tgt), len(tgt))
    return 1.0 - dist / len(tgt)


def recognise(image_hwc_uint8: np.ndarray, min_confidence: float = 0.0) -> str:
    """All text lines the engine reads in one uint8 image [H, W, C] (C in 1, 3), joined."""
    img = image_hwc_uint8
    img = img[..., 0] if img.shape[-1] == 1 else np.ascontiguousarray(img[..., ::-1])  # BGR
    result, _ = get_ocr_engine()(img)
    if not result:
        return ""
    return "".join(str(r[1]) for r in result if float(r[2]) > min_confidence)


class OcrReward:
    """Reward = OCR accuracy of the target text per image [B] in [0, 1].

    The engine is shared by all instances of a process; rapidocr batches the text lines of
    one image internally (0.2-0.5 s per 512 px image on 2 CPU cores).
    """

    def __init__(self, min_confidence: float = 0.0) -> None:
        self.min_confidence = float(min_confidence)
        get_ocr_engine()  # fail early (missing extra) rather than at the first step

    def recognise(self, images: torch.Tensor) -> list[str]:
        """Recognised text per image of [B, C, H, W] in [0, 1]."""
        return [recognise(a, self.min_confidence) for a in to_uint8(images)]

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        targets = [ocr_target(p, m) for p, m in zip(prompts, metadata)]  # validate before OCR
        texts = self.recognise(images)
        return torch.tensor([ocr_score(t, g) for t, g in zip(texts, targets)], dtype=torch.float32)
