"""Detectors and the colour classifier for the ``geneval`` reward (rules: ``geneval.py``).

- ``Owlv2Detector``: OWLv2 (transformers' ``Owlv2ForObjectDetection``, pure torch: no
  torchvision, no custom kernels) queried with "a photo of a {class}" for GenEval's 80 classes
  (plus any other class a prompt names); per patch box the best query is its class (as
  transformers' post-processing), then class-wise NMS. OWLv2 has no masks: boxes only.
- ``MmdetDetector``: GenEval's own Mask2Former through mmdet (2.x or 3.x), importable only
  where mmdet is installed: run it behind ``flowgrpo reward-server`` (docs/rewards.md, GenEval).
- ``ClipColours``: GenEval's colour rule, CLIP zero-shot over its 10 colours with its three
  templates (clip_benchmark's ``zero_shot_classifier``: each template's embedding normalised,
  averaged, renormalised), on the object composited over grey #999 by its mask (when the
  detector gives one) and cropped to its box, preprocessed as open_clip's ViT-L-14 transform
  (PIL bicubic resize of the short side, centre crop, CLIP mean/std), with transformers'
  ``CLIPModel`` (openai/clip-vit-large-patch14 holds the weights open_clip's "openai" loads).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from flowgrpo.rewards.clip import _DTYPES, CLIP_MEAN, CLIP_STD, image_transform
from flowgrpo.rewards.geneval import (
    COLORS,
    DETECTOR_THRESHOLDS,
    OBJECT_NAMES,
    SCORES,
    GenEvalScorer,
    Obj,
    Thresholds,
)

TEMPLATES = (
    "a photo of a {c} {name}",
    "a photo of a {c}-colored {name}",
    "a photo of a {c} object",
)
MMDET_MISSING = (
    "reward 'geneval' with detector=mmdet needs mmdet and mmcv (GenEval's Mask2Former), which "
    "do not install beside this torch: serve it with `flowgrpo reward-server` from an "
    "environment that has them (docs/rewards.md, GenEval), or use detector=owlv2"
)


def _local_dir(opt: str, path: Any, what: str) -> Path:
    if not path:
        raise ValueError(f"reward 'geneval' needs option {opt!r}: {what}")
    if not Path(path).is_dir():
        raise FileNotFoundError(
            f"reward 'geneval': {opt}={str(path)!r} is not an existing local directory"
        )
    return Path(path)


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou: float) -> list[int]:
    """Greedy non-maximum suppression ([N, 4] xyxy boxes): kept indices, best first; a box
    overlapping a kept one by IoU > ``iou`` is dropped. (torchvision.ops.nms without it.)"""
    order = torch.argsort(scores, descending=True, stable=True).tolist()
    area = (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)
    keep: list[int] = []
    while order:
        i = order.pop(0)
        keep.append(i)
        if not order:
            break
        rest = torch.tensor(order)
        lt = torch.maximum(boxes[rest, :2], boxes[i, :2])
        rb = torch.minimum(boxes[rest, 2:], boxes[i, 2:])
        inter = (rb - lt).clamp(min=0).prod(dim=1)
        ious = inter / (area[rest] + area[i] - inter).clamp(min=1e-9)
        order = [j for j, v in zip(order, ious.tolist(), strict=True) if v <= iou]
    return keep


class Owlv2Detector:
    """OWLv2 from a local directory; ``detect`` returns per image {class: [(box5, None)]}
    with every box scoring above ``min_score`` after class-wise NMS at ``nms_iou``."""

    def __init__(
        self,
        path: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 4,
        nms_iou: float = 0.5,
        min_score: float = 0.05,
        template: str = "a photo of a {}",
    ) -> None:
        from transformers import AutoTokenizer, Owlv2ForObjectDetection

        path_ = _local_dir("path", path, "a local Owlv2ForObjectDetection directory")
        self.device, self.batch_size = torch.device(device), int(batch_size)
        self.nms_iou, self.min_score, self.template = float(nms_iou), float(min_score), template
        self.model = Owlv2ForObjectDetection.from_pretrained(
            path_, local_files_only=True, dtype=_DTYPES[dtype]
        )
        self.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(path_, local_files_only=True)
        cfg_file = path_ / "preprocessor_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.mean = torch.tensor(cfg.get("image_mean", CLIP_MEAN)).view(1, 3, 1, 1)
        self.std = torch.tensor(cfg.get("image_std", CLIP_STD)).view(1, 3, 1, 1)
        self.size = int(self.model.config.vision_config.image_size)
        self._queries: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def query_embeds(self, names: Sequence[str]) -> torch.Tensor:
        """[Q, D] normalised text embeddings of ``names`` (cached), as OWLv2's forward makes them."""
        new = [n for n in names if n not in self._queries]
        if new:
            tok = self.tokenizer(
                [self.template.format(n) for n in new], padding="max_length",
                max_length=int(self.model.config.text_config.max_position_embeddings),
                truncation=True, return_tensors="pt",
            ).to(self.device)  # fmt: skip
            owl = self.model.owlv2
            pooled = owl.text_model(
                input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]
            ).pooler_output
            emb = owl.text_projection(pooled)
            emb = emb / torch.linalg.norm(emb, ord=2, dim=-1, keepdim=True)
            self._queries.update(zip(new, emb, strict=True))
        return torch.stack([self._queries[n] for n in names])

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [0, 1] -> OWLv2 pixel_values: padded bottom/right to a square with
        0.5 (as its processor), resized to the model's size (bilinear, antialiased; the
        processor blurs then resizes with scipy), normalised."""
        h, w = images.shape[-2:]
        side = max(h, w)
        x = F.pad(images.float(), (0, side - w, 0, side - h), value=0.5)
        if side != self.size:
            mode = "bilinear"
            x = F.interpolate(x, size=(self.size, self.size), mode=mode, antialias=True)
        return (x - self.mean) / self.std

    @torch.no_grad()
    def raw(
        self, pixel_values: torch.Tensor, names: Sequence[str]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, P, Q], boxes [B, P, 4] cxcywh in [0, 1] of the padded square)."""
        m = self.model
        dtype = next(m.parameters()).dtype
        feature_map = m.image_embedder(pixel_values=pixel_values.to(self.device, dtype))[0]
        b, ph, pw, d = feature_map.shape
        feats = feature_map.reshape(b, ph * pw, d)
        q = self.query_embeds(names).to(dtype).unsqueeze(0).expand(b, -1, -1)
        logits, _ = m.class_predictor(feats, q, None)
        boxes = m.box_predictor(feats, feature_map)
        return logits.float().cpu(), boxes.float().cpu()

    def detect(self, images: list[Any], classnames: Sequence[str]) -> list[dict[str, list[Obj]]]:
        names = list(OBJECT_NAMES) + [n for n in classnames if n not in OBJECT_NAMES]
        out: list[dict[str, list[Obj]]] = []
        for i in range(0, len(images), self.batch_size):
            chunk = images[i : i + self.batch_size]
            arr = np.stack([np.asarray(im.convert("RGB")) for im in chunk])
            x = torch.from_numpy(arr).permute(0, 3, 1, 2).float().div_(255.0)
            logits, boxes = self.raw(self.preprocess(x), names)
            h, w = x.shape[-2:]
            for lg, bx in zip(logits, boxes, strict=True):
                out.append(self._objects(lg, bx, names, h, w))
        return out

    def _objects(
        self, logits: torch.Tensor, boxes: torch.Tensor, names: list[str], h: int, w: int
    ) -> dict[str, list[Obj]]:
        score, label = torch.sigmoid(logits).max(dim=-1)
        cx, cy, bw, bh = boxes.unbind(-1)
        side = max(h, w)
        xyxy = torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], -1) * side
        xyxy = torch.minimum(xyxy.clamp(min=0), torch.tensor([w, h, w, h], dtype=xyxy.dtype))
        found: dict[str, list[Obj]] = {}
        for q in torch.unique(label[score > self.min_score]).tolist():
            idx = torch.nonzero((label == q) & (score > self.min_score)).flatten()
            for k in nms(xyxy[idx], score[idx], self.nms_iou):
                j = int(idx[k])
                row = np.array([*xyxy[j].tolist(), float(score[j])], dtype=np.float32)
                found.setdefault(names[q], []).append((row, None))
        return found


class ClipColours:
    """GenEval's colour classifier with transformers' CLIPModel (see the module docstring)."""

    def __init__(
        self,
        path: str,
        *,
        processor_path: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        background: str = "#999",
        batch_size: int = 16,
    ) -> None:
        from transformers import AutoTokenizer, CLIPModel

        path_ = _local_dir(
            "clip_path", path, "a local CLIPModel directory (openai/clip-vit-large-patch14)"
        )
        proc = Path(processor_path) if processor_path else path_
        self.device, self.background, self.batch_size = torch.device(device), background, batch_size
        self.model = CLIPModel.from_pretrained(path_, local_files_only=True, dtype=_DTYPES[dtype])
        self.model.to(self.device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(proc, local_files_only=True)
        size = int(self.model.config.vision_config.image_size)
        self.resize, self.crop_size, mean, std = image_transform(proc, size)
        self.mean, self.std = mean.view(3, 1, 1), std.view(3, 1, 1)
        self._classifiers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def text_features(self, texts: list[str]) -> torch.Tensor:
        tok = self.tokenizer(texts, padding=True, truncation=True, return_tensors="pt").to(
            self.device
        )
        pooled = self.model.text_model(
            input_ids=tok["input_ids"], attention_mask=tok["attention_mask"]
        ).pooler_output
        return self.model.text_projection(pooled).float()

    def classifier(self, classname: str) -> torch.Tensor:
        """[D, 10]: per colour, its three templates' normalised embeddings averaged, renormalised."""
        if classname not in self._classifiers:
            cols = []
            for c in COLORS:
                emb = self.text_features([t.format(c=c, name=classname) for t in TEMPLATES])
                mean = F.normalize(emb, dim=-1).mean(dim=0)
                cols.append(mean / mean.norm())
            self._classifiers[classname] = torch.stack(cols, dim=1)
        return self._classifiers[classname]

    def crop(self, image: Any, obj: Obj) -> torch.Tensor:
        """The object as CLIP input [3, S, S]: masked onto the background colour (if a mask),
        cropped to its box (PIL rounds the coordinates; at least 1 px), short side resized
        bicubic (PIL), centre-cropped, normalised (open_clip's eval transform in PIL)."""
        from PIL import Image

        box, mask = obj
        img = image.convert("RGB")
        if mask is not None:
            blank = Image.new("RGB", img.size, color=self.background)
            img = Image.composite(img, blank, Image.fromarray(np.asarray(mask)))
        x0, y0, x1, y1 = (int(round(float(v))) for v in box[:4])
        x1, y1 = max(x1, x0 + 1), max(y1, y0 + 1)
        img = img.crop((x0, y0, x1, y1))
        w, h = img.size
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = self.resize, int(self.resize * long / short)
        size = (new_short, new_long) if w <= h else (new_long, new_short)
        img = img.resize(size, Image.BICUBIC)
        w, h = img.size
        top, left = int(round((h - self.crop_size) / 2.0)), int(round((w - self.crop_size) / 2.0))
        img = img.crop((left, top, left + self.crop_size, top + self.crop_size))
        x = torch.from_numpy(np.asarray(img, dtype=np.float32) / 255.0).permute(2, 0, 1)
        return (x - self.mean) / self.std

    @torch.no_grad()
    def classify(self, image: Any, objects: list[Obj], classname: str) -> list[str]:
        clf = self.classifier(classname)
        dtype = next(self.model.parameters()).dtype
        out: list[str] = []
        for i in range(0, len(objects), self.batch_size):
            pix = torch.stack([self.crop(image, o) for o in objects[i : i + self.batch_size]])
            pooled = self.model.vision_model(pixel_values=pix.to(self.device, dtype)).pooler_output
            feats = F.normalize(self.model.visual_projection(pooled).float(), dim=-1)
            out += [COLORS[k] for k in (100.0 * feats @ clf).argmax(dim=1).tolist()]
        return out


def mmdet_objects(result: Any, classnames: Sequence[str] = OBJECT_NAMES) -> dict[str, list[Obj]]:
    """One mmdet result -> {class: [(box5, mask)]} in the detector's order: mmdet 2.x's
    (per-class [n, 5] boxes, per-class masks) tuple, as GenEval reads it, or mmdet 3.x's
    ``DetDataSample`` (``pred_instances``: bboxes, scores, labels, masks)."""
    found: dict[str, list[Obj]] = {}
    inst = getattr(result, "pred_instances", None)
    if inst is not None:
        boxes = np.asarray(inst.bboxes.detach().cpu(), dtype=np.float32)
        scores = np.asarray(inst.scores.detach().cpu(), dtype=np.float32)
        labels = np.asarray(inst.labels.detach().cpu())
        masks = getattr(inst, "masks", None)
        masks = None if masks is None else np.asarray(masks.detach().cpu()).astype(bool)
        for j, lab in enumerate(labels.tolist()):
            row = np.concatenate([boxes[j], scores[j : j + 1]])
            found.setdefault(classnames[lab], []).append((row, None if masks is None else masks[j]))
        return found
    bbox = result[0] if isinstance(result, tuple) else result
    segm = result[1] if isinstance(result, tuple) and len(result) > 1 else None
    for k, name in enumerate(classnames):
        rows = np.asarray(bbox[k])
        if len(rows):
            found[name] = [
                (rows[j], None if segm is None else segm[k][j]) for j in range(len(rows))
            ]
    return found


class MmdetDetector:
    """GenEval's Mask2Former (or any mmdet detector of COCO's 80 classes) via mmdet's
    ``init_detector`` / ``inference_detector``. Images go in as BGR arrays, as mmdet reads
    GenEval's image files (``channels="rgb"``: as flow_grpo's reward server passes them)."""

    def __init__(
        self, config: str, checkpoint: str, *, device: str = "cuda", channels: str = "bgr"
    ) -> None:
        try:
            from mmdet.apis import inference_detector, init_detector
        except ImportError:
            raise ImportError(MMDET_MISSING) from None
        if channels not in ("bgr", "rgb"):
            raise ValueError(f"reward 'geneval': channels must be 'bgr' or 'rgb', got {channels!r}")
        for opt, p in (("config", config), ("checkpoint", checkpoint)):
            if not p or not Path(p).is_file():
                raise FileNotFoundError(f"reward 'geneval': {opt}={p!r} is not an existing file")
        self._infer, self.channels = inference_detector, channels
        self.model = init_detector(str(config), str(checkpoint), device=device)

    def detect(self, images: list[Any], classnames: Sequence[str]) -> list[dict[str, list[Obj]]]:
        arrays = [np.asarray(im.convert("RGB")) for im in images]
        if self.channels == "bgr":
            arrays = [np.ascontiguousarray(a[..., ::-1]) for a in arrays]
        return [mmdet_objects(r) for r in self._infer(self.model, arrays)]


class GenEval(GenEvalScorer):
    """The ``geneval`` reward: GenEval's rules over ``detector`` = ``owlv2`` (in process,
    ``path`` = an OWLv2 directory), ``mmdet`` (``config`` + ``checkpoint`` of GenEval's
    Mask2Former; where mmdet is installed, e.g. behind ``flowgrpo reward-server``) or an
    import path ``pkg.mod:factory`` called with ``detector_options``. ``clip_path``: the CLIP
    ViT-L/14 directory of the colour rule. ``threshold`` / ``counting_threshold`` default by
    detector (``DETECTOR_THRESHOLDS``; GenEval's for a custom one). ``jpeg_quality=75``
    scores JPEG copies, as flow_grpo's client sends its server (PIL's default quality)."""

    def __init__(
        self,
        detector: str = "owlv2",
        path: str | None = None,
        clip_path: str | None = None,
        clip_processor_path: str | None = None,
        config: str | None = None,
        checkpoint: str | None = None,
        detector_options: dict[str, Any] | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        score: str = "partial",
        threshold: float | None = None,
        counting_threshold: float | None = None,
        max_objects: int = 16,
        nms_threshold: float = 1.0,
        position_threshold: float = 0.1,
        batch_size: int = 4,
        jpeg_quality: int | None = None,
    ) -> None:
        if score not in SCORES:
            raise ValueError(
                f"reward 'geneval': score must be one of {list(SCORES)}, got {score!r}"
            )
        if dtype not in _DTYPES:
            raise ValueError(
                f"reward 'geneval': dtype must be one of {sorted(_DTYPES)}, got {dtype!r}"
            )
        if detector not in DETECTOR_THRESHOLDS and ":" not in detector:
            raise ValueError(
                "reward 'geneval': detector must be 'owlv2', 'mmdet' or 'package.module:factory', "
                f"got {detector!r}"
            )
        lo, hi = DETECTOR_THRESHOLDS.get(detector, (0.3, 0.9))
        th = Thresholds(
            lo if threshold is None else float(threshold),
            hi if counting_threshold is None else float(counting_threshold),
            int(max_objects),
            float(nms_threshold),
            float(position_threshold),
        )
        colours = ClipColours(
            clip_path, processor_path=clip_processor_path, device=device, dtype=dtype
        )
        opts = dict(detector_options or {})
        if detector == "owlv2":
            opts.setdefault("min_score", min(th.threshold, th.counting_threshold))
            det: Any = Owlv2Detector(
                path, device=device, dtype=dtype, batch_size=batch_size, **opts
            )
        elif detector == "mmdet":
            det = MmdetDetector(config, checkpoint, device=device, **opts)
        else:
            from flowgrpo.rewards.base import _import_path

            det = _import_path(detector)(**opts)
        super().__init__(det, colours, score=score, thresholds=th, jpeg_quality=jpeg_quality)


__all__ = [
    "GenEval",
    "ClipColours",
    "MmdetDetector",
    "Owlv2Detector",
    "TEMPLATES",
    "mmdet_objects",
    "nms",
]
