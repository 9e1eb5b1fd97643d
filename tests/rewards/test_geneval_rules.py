"""GenEval's rules (flowgrpo.rewards.geneval) against GenEval's own and flow_grpo's code.

The reference below is a transcription, kept as close to the source as the stubs allow, of
- djghosh13/geneval @ af4902f24d3ca90ebbb446dd9891a59e0f82725f, evaluation/evaluate_images.py:
  ``compute_iou``, ``relative_position``, ``evaluate`` and the detection filter of
  ``evaluate_image`` (THRESHOLD 0.3, COUNTING_THRESHOLD 0.9, MAX_OBJECTS 16, NMS_THRESHOLD
  1.0, POSITION_THRESHOLD 0.1 from its ``__main__``);
- yifan123/reward-server @ 92ac29fb322c028f8840db8f93c950422931710d,
  reward_server/gen_eval.py: ``evaluate_reward`` (the partial credit flow_grpo trains on:
  yifan123/flow_grpo @ ac4c86e flow_grpo/rewards.py ``geneval_score``).
``color_classification`` (CLIP) is replaced by a table of synthetic colours, one per box,
and ``reason`` strings are not compared (only the verdicts and scores, exactly).
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from flowgrpo.rewards.geneval import (
    COLORS,
    Thresholds,
    flow_grpo_score,
    geneval_correct,
    keep_detections,
)

# ---- reference (transcribed; module globals as in the source) --------------------------------
THRESHOLD = 0.3
COUNTING_THRESHOLD = 0.9
MAX_OBJECTS = 16
NMS_THRESHOLD = 1.0
POSITION_THRESHOLD = 0.1
COLOUR_TABLE: dict[tuple, str] = {}


def color_classification(image, bboxes, classname):
    return [COLOUR_TABLE[tuple(np.asarray(box).tolist())] for box, _ in bboxes]


def compute_iou(box_a, box_b):
    area_fn = lambda box: max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)  # noqa: E731
    i_area = area_fn(
        [
            max(box_a[0], box_b[0]),
            max(box_a[1], box_b[1]),
            min(box_a[2], box_b[2]),
            min(box_a[3], box_b[3]),
        ]
    )
    u_area = area_fn(box_a) + area_fn(box_b) - i_area
    return i_area / u_area if u_area else 0


def relative_position(obj_a, obj_b):
    boxes = np.array([obj_a[0], obj_b[0]])[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised_offset = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (dim_a + dim_b), 0) * np.sign(
        offset
    )
    if np.all(np.abs(revised_offset) < 1e-3):
        return set()
    dx, dy = revised_offset / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def ref_filter(bbox, classnames, metadata):
    """evaluate_image's loop from 'detected = {}' to before '# Evaluate' (segm None)."""
    detected = {}
    confidence_threshold = THRESHOLD if metadata["tag"] != "counting" else COUNTING_THRESHOLD
    for index, classname in enumerate(classnames):
        ordering = np.argsort(bbox[index][:, 4])[::-1]
        ordering = ordering[bbox[index][ordering, 4] > confidence_threshold]
        ordering = ordering[:MAX_OBJECTS].tolist()
        detected[classname] = []
        while ordering:
            max_obj = ordering.pop(0)
            detected[classname].append((bbox[index][max_obj], None))
            ordering = [
                obj
                for obj in ordering
                if NMS_THRESHOLD == 1
                or compute_iou(bbox[index][max_obj], bbox[index][obj]) < NMS_THRESHOLD
            ]
        if not detected[classname]:
            del detected[classname]
    return detected


def evaluate(image, objects, metadata):
    correct = True
    matched_groups = []
    for req in metadata.get("include", []):
        classname = req["class"]
        matched = True
        found_objects = objects.get(classname, [])[: req["count"]]
        if len(found_objects) < req["count"]:
            correct = matched = False
        else:
            if "color" in req:
                colors = color_classification(image, found_objects, classname)
                if colors.count(req["color"]) < req["count"]:
                    correct = matched = False
            if "position" in req and matched:
                expected_rel, target_group = req["position"]
                if matched_groups[target_group] is None:
                    correct = matched = False
                else:
                    for obj in found_objects:
                        for target_obj in matched_groups[target_group]:
                            true_rels = relative_position(obj, target_obj)
                            if expected_rel not in true_rels:
                                correct = matched = False
                                break
                        if not matched:
                            break
        if matched:
            matched_groups.append(found_objects)
        else:
            matched_groups.append(None)
    for req in metadata.get("exclude", []):
        classname = req["class"]
        if len(objects.get(classname, [])) >= req["count"]:
            correct = False
    return correct


def evaluate_reward(image, objects, metadata):
    correct = True
    rewards = []
    matched_groups = []
    for req in metadata.get("include", []):
        classname = req["class"]
        matched = True
        found_objects = objects.get(classname, [])
        rewards.append(1 - abs(req["count"] - len(found_objects)) / req["count"])
        if len(found_objects) != req["count"]:
            correct = matched = False
            if "color" in req or "position" in req:
                rewards.append(0.0)
        else:
            if "color" in req:
                colors = color_classification(image, found_objects, classname)
                rewards.append(1 - abs(req["count"] - colors.count(req["color"])) / req["count"])
                if colors.count(req["color"]) != req["count"]:
                    correct = matched = False
            if "position" in req and matched:
                expected_rel, target_group = req["position"]
                if matched_groups[target_group] is None:
                    correct = matched = False
                    rewards.append(0.0)
                else:
                    for obj in found_objects:
                        for target_obj in matched_groups[target_group]:
                            true_rels = relative_position(obj, target_obj)
                            if expected_rel not in true_rels:
                                correct = matched = False
                                rewards.append(0.0)
                                break
                        if not matched:
                            break
                    rewards.append(1.0)
        if matched:
            matched_groups.append(found_objects)
        else:
            matched_groups.append(None)
    reward = sum(rewards) / len(rewards) if rewards else 0
    return correct, reward


# ---- synthetic detections --------------------------------------------------------------------
CLASSES = ["dog", "cat", "bench", "wine glass", "car"]
RELS = ["left of", "right of", "above", "below"]


def _metadata(rng: random.Random, tag: str) -> dict:
    a, b = rng.sample(CLASSES[:4], 2)
    c1, c2 = rng.choice(COLORS), rng.choice(COLORS)
    if tag == "single_object":
        return {"tag": tag, "include": [{"class": a, "count": 1}]}
    if tag == "two_object":
        return {"tag": tag, "include": [{"class": a, "count": 1}, {"class": b, "count": 1}]}
    if tag == "counting":
        n = rng.randint(2, 4)
        return {
            "tag": tag,
            "include": [{"class": a, "count": n}],
            "exclude": [{"class": a, "count": n + 1}],
        }
    if tag == "colors":
        return {"tag": tag, "include": [{"class": a, "count": 1, "color": c1}]}
    if tag == "position":
        rel = rng.choice(RELS)
        return {
            "tag": tag,
            "include": [{"class": a, "count": 1}, {"class": b, "count": 1, "position": [rel, 0]}],
        }
    return {  # color_attr
        "tag": tag,
        "include": [
            {"class": a, "count": 1, "color": c1},
            {"class": b, "count": 1, "color": c2},
        ],
    }


def _detections(rng: random.Random, meta: dict) -> list[np.ndarray]:
    """Per class of CLASSES an [n, 5] array: boxes anywhere in 512x512 (some overlapping,
    some tiny), scores around both thresholds (ties and exact threshold values included);
    each box gets a colour in COLOUR_TABLE (the requested one half the time)."""
    wanted = {r["class"]: r for r in meta["include"]}
    placed = {}
    if meta["tag"] == "position" and rng.random() < 0.5:
        a, b = (r["class"] for r in meta["include"])
        rel = meta["include"][1]["position"][0] if rng.random() < 0.7 else rng.choice(RELS)
        dx, dy = {"left of": (-1, 0), "right of": (1, 0), "above": (0, -1), "below": (0, 1)}[rel]
        jitter = rng.uniform(-40, 40)
        placed = {a: (220, 220), b: (220 + dx * 120 + jitter, 220 + dy * 120 + jitter)}
    out = []
    for name in CLASSES:
        n = rng.choice([0, 0, 1, 1, 1, 2, 2, 3, 4, 5]) if name in wanted else rng.choice([0, 1])
        rows = []
        for _ in range(n):
            x0, y0 = rng.uniform(0, 400), rng.uniform(0, 400)
            w, h = rng.choice([rng.uniform(1, 30), rng.uniform(20, 200)]), rng.uniform(1, 200)
            score = rng.choice([0.3, 0.9, 0.95, 0.5, rng.random(), rng.random(), 0.29999])
            if meta["tag"] == "counting" and rng.random() < 0.7:
                score = rng.choice([0.95, 0.97, 0.9, 0.91])
            if rows and rng.random() < 0.2:
                score = rows[-1][4]  # a tie
            if rows and rng.random() < 0.2:  # a near-duplicate box
                x0, y0, w, h = rows[-1][0] + 2, rows[-1][1] + 1, rows[-1][2] - rows[-1][0], 50.0
            rows.append([x0, y0, x0 + w, y0 + h, score])
        if meta["tag"] == "position" and name in wanted and placed:  # one object each,
            x0, y0 = placed[name]  # the second where its relation says (mostly)
            rows = [[x0, y0, x0 + 60, y0 + 60, 0.8]]
        arr = np.array(rows, dtype=np.float32).reshape(-1, 5)
        for row in arr:
            want = wanted.get(name, {}).get("color")
            colour = want if want and rng.random() < 0.6 else rng.choice(COLORS)
            COLOUR_TABLE[tuple(row.tolist())] = colour
        out.append(arr)
    return out


TAGS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]


def _cases(n_per_tag: int = 60, seed: int = 0):
    rng = random.Random(seed)
    for tag in TAGS:
        for _ in range(n_per_tag):
            meta = _metadata(rng, tag)
            yield meta, _detections(rng, meta)


def _arrays(boxes: dict, colour: str = "red", transpose: bool = False) -> list[np.ndarray]:
    out = [np.array(boxes.get(c, []), dtype=np.float64).reshape(-1, 5) for c in CLASSES]
    if transpose:
        out = [arr[:, [1, 0, 3, 2, 4]] for arr in out]
    for arr in out:
        for row in arr:
            COLOUR_TABLE[tuple(row.tolist())] = colour
    return out


def _hand_cases():
    """Boundaries random draws rarely hit: an axis share of exactly 0.5 (A = x 0..2, B = x
    2.5..5.5: offset -3, shrunk by 0.1 * 5 to -2.5, over the norm 5), a missing position
    target, a count one over (the exclude clause), scores exactly at the thresholds."""
    a = [0.0, 0.0, 2.0, 10.0, 0.8]
    b = [2.5, 4.0, 5.5, 14.0, 0.8]  # A's centre (1, 5), B's (4, 9): dx = -0.5, dy = -0.4
    for rel in RELS:
        for first, second in (("dog", "cat"), ("cat", "dog")):
            meta = {
                "tag": "position",
                "include": [
                    {"class": first, "count": 1},
                    {"class": second, "count": 1, "position": [rel, 0]},
                ],
            }
            yield meta, _arrays({"cat": [a], "dog": [b]})
            yield meta, _arrays({"cat": [a], "dog": [b]}, transpose=True)  # dy = -0.5
            yield meta, _arrays({second: [a]})  # no target: 'no target' branch
    for n in (2, 3):
        boxes = [[10.0 * i, 0.0, 10.0 * i + 5, 5.0, 0.95] for i in range(n + 1)]
        meta = {
            "tag": "counting",
            "include": [{"class": "bench", "count": n}],
            "exclude": [{"class": "bench", "count": n + 1}],
        }
        yield meta, _arrays({"bench": boxes})
        yield meta, _arrays({"bench": boxes[:n]})
        yield meta, _arrays({"bench": [*boxes[:n], [0, 0, 9, 9, 0.9]]})  # 0.9: not > 0.9
    for score in (0.3, 0.30001):
        for colour in ("red", "blue"):
            meta = {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}]}
            yield meta, _arrays({"car": [[0, 0, 50, 50, score]]}, colour)


def _mine_colours(objs, name):
    return [COLOUR_TABLE[tuple(np.asarray(o[0]).tolist())] for o in objs]


@pytest.mark.parametrize("nms,pos_th", [(1.0, 0.1), (0.5, 0.1), (1.0, 0.0), (0.3, 0.25)], ids=str)
def test_rules_equal_geneval_and_flow_grpo_on_synthetic_detections(nms, pos_th):
    """394 synthetic images (60 random per tag, 34 made by hand) per setting: the kept detections, GenEval's verdict,
    the strict verdict and the partial credit equal the references' exactly."""
    global NMS_THRESHOLD, POSITION_THRESHOLD
    NMS_THRESHOLD, POSITION_THRESHOLD = nms, pos_th
    try:
        th = Thresholds(nms_threshold=nms, position_threshold=pos_th)
        seen = {t: set() for t in TAGS}
        partials = set()
        n = 0
        for meta, arrays in [*_cases(), *_hand_cases()]:
            ref = ref_filter(arrays, CLASSES, meta)
            mine = keep_detections(
                {c: list(zip(a, [None] * len(a))) for c, a in zip(CLASSES, arrays)}, meta["tag"], th
            )
            assert {k: [o[0].tolist() for o in v] for k, v in mine.items()} == {
                k: [o[0].tolist() for o in v] for k, v in ref.items()
            }
            want_correct = evaluate(None, ref, meta)
            want_strict, want_score = evaluate_reward(None, ref, meta)
            got_correct, _ = geneval_correct(mine, meta, _mine_colours, pos_th)
            got_strict, got_score, _ = flow_grpo_score(mine, meta, _mine_colours, pos_th)
            assert (got_correct, got_strict) == (want_correct, want_strict), meta
            assert got_score == want_score, meta  # exact, not approx
            seen[meta["tag"]].add((want_correct, want_strict))
            partials.add(round(want_score, 6))
            n += 1
        assert n == 360 + 24 + 6 + 4
        for tag, outcomes in seen.items():  # every tag passes and fails both verdicts
            assert {(True, True), (False, False)} <= outcomes, (tag, outcomes)
        assert any((True, False) in o for o in seen.values())  # correct, not exact: both rules
        assert len(partials) >= 8 and min(partials) < 0  # partial credit can go negative
    finally:
        NMS_THRESHOLD, POSITION_THRESHOLD = 1.0, 0.1
