"""GenEval as a reward: GenEval's rules applied to a pluggable detector's detections.

The rules are GenEval's ``evaluation/evaluate_images.py`` (djghosh13/geneval @ af4902f):
keep a class's detections above a confidence threshold (a stricter one for the ``counting``
tag), at most 16, most confident first; then each ``include`` clause of the prompt's metadata
needs its class ``count`` times, in its ``color`` (CLIP zero-shot on the object), at its
``position`` relative to an earlier clause's objects; an ``exclude`` clause forbids ``count``
or more. Three scores per image:

- ``correct``: GenEval's benchmark verdict (``evaluate``: at least ``count``, excludes checked);
- ``strict``: flow_grpo's reward server's (yifan123/reward-server @ 92ac29f,
  ``reward_server/gen_eval.py`` ``evaluate_reward``): exactly ``count``, no exclude check;
- ``partial``: that function's partial credit, the reward flow_grpo trains on
  (flow_grpo @ ac4c86e ``flow_grpo/rewards.py`` ``geneval_score`` returns it first): the mean
  of per-clause terms 1 - |count - found| / count, colour terms likewise, position terms
  (kept as the server computes them: a failed position check adds 0 and then 1).

A detector is any object with ``detect(images, classnames) -> [{class: [(box, mask), ...]}]``
(``box`` = [x0, y0, x1, y1, score] in pixels, ``mask`` an [H, W] bool array or None); a colour
classifier any object with ``classify(image, objects, classname) -> [colour, ...]``. The
built-in ones (OWLv2 + CLIP in process, GenEval's Mask2Former through mmdet) and the
registered reward ``GenEval`` that builds them from its options live in
``geneval_detectors.py`` (which imports this module, never the other way round).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
SCORES = ("partial", "strict", "correct")
#: GenEval's detector classes in its label order (evaluation/object_names.txt: COCO's 80)
OBJECT_NAMES = (
    "person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat",
    "traffic light", "fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog",
    "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "backpack", "umbrella",
    "handbag", "tie", "suitcase", "frisbee", "skis", "snowboard", "sports ball", "kite",
    "baseball bat", "baseball glove", "skateboard", "surfboard", "tennis racket", "bottle",
    "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple", "sandwich",
    "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch",
    "potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse",
    "tv remote", "computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink",
    "refrigerator", "book", "clock", "vase", "scissors", "teddy bear", "hair drier", "toothbrush",
)  # fmt: skip

Obj = tuple[np.ndarray, Any]  # (box [x0, y0, x1, y1, score], mask [H, W] bool or None)
Colours = Callable[[list[Obj], str], list[str]]


class Detector(Protocol):
    """Finds objects: per image, class name -> [(box, mask)] (any order; all scores)."""

    def detect(self, images: list[Any], classnames: Sequence[str]) -> list[dict[str, list[Obj]]]:
        """``images``: PIL RGB images; ``classnames``: the classes the batch's prompts name."""
        ...


class ColourClassifier(Protocol):
    """Names each object's colour, one of ``COLORS`` (GenEval: CLIP zero-shot)."""

    def classify(self, image: Any, objects: list[Obj], classname: str) -> list[str]: ...


@dataclass(frozen=True)
class Thresholds:
    """GenEval's detection filter (its defaults: evaluate_images.py ``__main__``)."""

    threshold: float = 0.3  # THRESHOLD
    counting_threshold: float = 0.9  # COUNTING_THRESHOLD (tag "counting")
    max_objects: int = 16  # MAX_OBJECTS per class
    nms_threshold: float = 1.0  # max_overlap: 1 keeps overlapping boxes
    position_threshold: float = 0.1  # POSITION_THRESHOLD


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two [x0, y0, x1, y1] pixel boxes, inclusive ends (+1), as GenEval's."""

    def area(x0: float, y0: float, x1: float, y1: float) -> float:
        return max(x1 - x0 + 1, 0) * max(y1 - y0 + 1, 0)

    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a[:4]) + area(*b[:4]) - inter
    return inter / union if union else 0


def relations(box_a: np.ndarray, box_b: np.ndarray, position_threshold: float) -> set[str]:
    """Where A is relative to B: centre offset shrunk by ``position_threshold`` x both sizes,
    then each axis whose share of the offset's length exceeds 1/2 names a relation."""
    pts = np.array([box_a[:4], box_b[:4]]).reshape(2, 2, 2)  # [obj, corner, xy]
    centre_a, centre_b = pts.mean(axis=-2)
    size_a, size_b = np.abs(np.diff(pts, axis=-2))[..., 0, :]
    offset = centre_a - centre_b
    shrunk = np.maximum(np.abs(offset) - position_threshold * (size_a + size_b), 0)
    shrunk = shrunk * np.sign(offset)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    dx, dy = shrunk / np.linalg.norm(offset)
    out = set()
    if dx < -0.5:
        out.add("left of")
    if dx > 0.5:
        out.add("right of")
    if dy < -0.5:
        out.add("above")
    if dy > 0.5:
        out.add("below")
    return out


def keep_detections(
    found: Mapping[str, Sequence[Obj]], tag: str, th: Thresholds = Thresholds()
) -> dict[str, list[Obj]]:
    """GenEval's filter of one image's detections: per class, scores above the threshold
    (``counting_threshold`` for the counting tag), most confident first (``np.argsort`` of the
    scores reversed, as GenEval: ties keep its order), at most ``max_objects``, then greedy
    suppression of boxes overlapping a kept one by ``nms_threshold`` or more (none at 1)."""
    cut = th.counting_threshold if tag == "counting" else th.threshold
    out: dict[str, list[Obj]] = {}
    for name, objs in found.items():
        objs = list(objs)
        if not objs:
            continue
        # the detector's dtype, as GenEval compares it (float32 0.3 is not > 0.3 there)
        scores = np.stack([np.asarray(o[0]) for o in objs])[:, 4]
        order = np.argsort(scores)[::-1]
        order = order[scores[order] > cut][: th.max_objects].tolist()
        kept: list[Obj] = []
        while order:
            best = order.pop(0)
            kept.append(objs[best])
            if th.nms_threshold != 1:
                box = objs[best][0]
                order = [i for i in order if box_iou(box, objs[i][0]) < th.nms_threshold]
        if kept:
            out[name] = kept
    return out


def geneval_correct(
    objects: Mapping[str, list[Obj]],
    metadata: Mapping[str, Any],
    colours: Colours,
    position_threshold: float = 0.1,
) -> tuple[bool, str]:
    """GenEval's verdict (``evaluate``): each include clause met by its ``count`` most
    confident objects (colour, then position against the target clause's objects), and no
    exclude clause's class seen ``count`` or more times. Returns (correct, reasons)."""
    ok, why, groups = True, [], []
    for req in metadata.get("include", []):
        name, n = req["class"], req["count"]
        good = True
        objs = list(objects.get(name, []))[:n]
        if len(objs) < n:
            ok = good = False
            why.append(f"expected {name}>={n}, found {len(objs)}")
        else:
            if "color" in req:
                got = colours(objs, name)
                if got.count(req["color"]) < n:
                    ok = good = False
                    why.append(f"expected {req['color']} {name}>={n}, found {got}")
            if "position" in req and good:
                rel, target = req["position"]
                if groups[target] is None:
                    ok = good = False
                    why.append(f"no target for {name} to be {rel}")
                else:
                    good = all(
                        rel in relations(o[0], t[0], position_threshold)
                        for o in objs
                        for t in groups[target]
                    )
                    if not good:
                        ok = False
                        why.append(f"expected {name} {rel} target")
        groups.append(objs if good else None)
    for req in metadata.get("exclude", []):
        seen = len(objects.get(req["class"], []))
        if seen >= req["count"]:
            ok = False
            why.append(f"expected {req['class']}<{req['count']}, found {seen}")
    return ok, "\n".join(why)


def flow_grpo_score(
    objects: Mapping[str, list[Obj]],
    metadata: Mapping[str, Any],
    colours: Colours,
    position_threshold: float = 0.1,
) -> tuple[bool, float, str]:
    """flow_grpo's reward server (``evaluate_reward``): (strict verdict, partial credit,
    reasons). Counts must be exact; excludes are not checked; partial credit is the mean of
    the terms described in the module docstring (0 for metadata without clauses)."""
    ok, why, terms, groups = True, [], [], []
    for req in metadata.get("include", []):
        name, n = req["class"], req["count"]
        good = True
        objs = list(objects.get(name, []))
        terms.append(1 - abs(n - len(objs)) / n)
        if len(objs) != n:
            ok = good = False
            why.append(f"expected {name}=={n}, found {len(objs)}")
            if "color" in req or "position" in req:
                terms.append(0.0)
        else:
            if "color" in req:
                hits = colours(objs, name).count(req["color"])
                terms.append(1 - abs(n - hits) / n)
                if hits != n:
                    ok = good = False
                    why.append(f"expected {req['color']} {name}=={n}, found {hits}")
            if "position" in req and good:
                rel, target = req["position"]
                if groups[target] is None:
                    ok = good = False
                    why.append(f"no target for {name} to be {rel}")
                    terms.append(0.0)
                else:
                    failed = any(
                        rel not in relations(o[0], t[0], position_threshold)
                        for o in objs
                        for t in groups[target]
                    )
                    if failed:
                        ok = good = False
                        why.append(f"expected {name} {rel} target")
                        terms.append(0.0)  # the server then appends 1.0 regardless
                    terms.append(1.0)
        groups.append(objs if good else None)
    score = sum(terms) / len(terms) if terms else 0
    return ok, float(score), "\n".join(why)


def check_metadata(meta: Any, where: str) -> None:
    """ValueError naming ``where`` unless ``meta`` is a GenEval record: a ``tag`` and a
    non-empty ``include`` list of {class, count >= 1[, color][, position]} clauses."""
    hint = (
        "GenEval metadata ('tag' and 'include', as the records of GenEval's "
        "evaluation_metadata.jsonl or Flow-GRPO's dataset/geneval/*_metadata.jsonl; give the "
        "prompts as such a .jsonl)"
    )
    if not isinstance(meta, Mapping) or "include" not in meta or "tag" not in meta:
        keys = sorted(meta)[:8] if isinstance(meta, Mapping) else type(meta).__name__
        raise ValueError(f"{where} has no {hint}; its metadata has {keys}")
    include = meta["include"]
    if not isinstance(include, list) or not include:
        raise ValueError(f"{where}: 'include' must be a non-empty list of clauses, got {include!r}")
    for i, req in enumerate([*include, *meta.get("exclude", [])]):
        ok = isinstance(req, Mapping) and isinstance(req.get("class"), str)
        count = req.get("count") if ok else None
        if not ok or isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{where}: clause {req!r} needs a 'class' and a 'count' >= 1")
        if "color" in req and req["color"] not in COLORS:
            raise ValueError(f"{where}: colour {req['color']!r} is not one of {list(COLORS)}")
        if "position" in req:
            pos = req["position"]
            good = isinstance(pos, (list, tuple)) and len(pos) == 2 and pos[0] in RELATIONS
            if not good or not isinstance(pos[1], int) or not 0 <= pos[1] < i:
                raise ValueError(
                    f"{where}: position {pos!r} must be [relation, index of an earlier "
                    f"clause] with relation in {list(RELATIONS)}"
                )


def _jpeg(image: Any, quality: int) -> Any:
    """``image`` after a JPEG round trip at ``quality``."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    buf.seek(0)
    with Image.open(buf) as im:
        return im.convert("RGB")


@dataclass
class Verdict:
    """One image's GenEval result: the three scores and the reasons it missed."""

    partial: float
    strict: bool
    correct: bool | None  # None when not asked for (``evaluate(..., correct=False)``)
    reason: str
    detected: dict[str, list[Obj]]


class GenEvalScorer:
    """GenEval's rules over any detector and colour classifier (no model of its own).

    ``score`` picks the reward: ``partial`` (flow_grpo's training reward), ``strict`` or
    ``correct`` (see the module docstring). Serve it with ``flowgrpo reward-server`` through
    the ``geneval`` reward (``GenEval``), or call ``evaluate`` for all three at once.
    """

    reward_name = "geneval"

    def __init__(
        self,
        detector: Detector,
        colours: ColourClassifier,
        *,
        score: str = "partial",
        thresholds: Thresholds = Thresholds(),
        jpeg_quality: int | None = None,
    ) -> None:
        if jpeg_quality is not None and not 1 <= int(jpeg_quality) <= 100:
            raise ValueError(f"reward 'geneval': jpeg_quality must be 1..100, got {jpeg_quality!r}")
        self.jpeg_quality = None if jpeg_quality is None else int(jpeg_quality)
        if score not in SCORES:
            raise ValueError(
                f"reward 'geneval': score must be one of {list(SCORES)}, got {score!r}"
            )
        self.detector, self.colours, self.score, self.thresholds = (
            detector,
            colours,
            score,
            thresholds,
        )

    def evaluate(
        self,
        images: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping],
        *,
        correct: bool = True,
    ) -> list[Verdict]:
        """Detect, filter and judge every image [B, C, H, W] in [0, 1] by its metadata
        (``correct=False`` skips GenEval's own verdict, which may classify more colours)."""
        from flowgrpo.rewards._image import to_pil

        for i, meta in enumerate(metadata):
            check_metadata(meta, f"reward 'geneval': sample {i} (prompt {prompts[i]!r})")
        names = sorted(
            {r["class"] for m in metadata for r in [*m["include"], *m.get("exclude", [])]}
        )
        pils = [p.convert("RGB") for p in to_pil(images)]
        if self.jpeg_quality is not None:  # as flow_grpo's client sends them (PIL's JPEG q75)
            pils = [_jpeg(p, self.jpeg_quality) for p in pils]
        found = self.detector.detect(pils, names)
        out, th = [], self.thresholds
        for pil, raw, meta in zip(pils, found, metadata, strict=True):
            objs = keep_detections(raw, meta["tag"], th)
            cache: dict[tuple, list[str]] = {}

            def colours(
                objs_: list[Obj], name: str, _pil: Any = pil, _c: dict = cache
            ) -> list[str]:
                key = (name, tuple(tuple(np.asarray(o[0]).tolist()) for o in objs_))
                if key not in _c:
                    _c[key] = list(self.colours.classify(_pil, objs_, name))
                return _c[key]

            ok = geneval_correct(objs, meta, colours, th.position_threshold)[0] if correct else None
            strict, partial, reason = flow_grpo_score(objs, meta, colours, th.position_threshold)
            out.append(Verdict(partial, strict, ok, reason, objs))
        return out

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict]
    ) -> torch.Tensor:
        verdicts = self.evaluate(images, prompts, metadata, correct=self.score == "correct")
        return torch.tensor([float(getattr(v, self.score)) for v in verdicts], dtype=torch.float32)


#: per detector, the filter defaults: mmdet = GenEval's own; OWLv2's scores run lower than
#: Mask2Former's (its examples threshold at 0.1) and are NOT calibrated here against GenEval's
#: Mask2Former (no real weights offline): check them on your prompts (docs/rewards.md)
DETECTOR_THRESHOLDS = {"mmdet": (0.3, 0.9), "owlv2": (0.1, 0.2)}


def missing_options(options: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(option, what it names) for each model option ``options`` of the ``geneval`` reward
    lack (checked at config time, before the generator loads)."""
    out = [] if options.get("clip_path") else [("clip_path", "a CLIP ViT-L/14 directory")]
    detector = options.get("detector", "owlv2")
    if detector == "owlv2" and not options.get("path"):
        out.append(("path", "an OWLv2 directory (detector=owlv2)"))
    if detector == "mmdet":
        out += [
            (k, f"GenEval's Mask2Former {k} (detector=mmdet)")
            for k in ("config", "checkpoint")
            if not options.get(k)
        ]
    return out


__all__ = [
    "missing_options",
    "COLORS",
    "OBJECT_NAMES",
    "ColourClassifier",
    "Detector",
    "GenEvalScorer",
    "Thresholds",
    "Verdict",
    "box_iou",
    "check_metadata",
    "flow_grpo_score",
    "geneval_correct",
    "keep_detections",
    "relations",
]
