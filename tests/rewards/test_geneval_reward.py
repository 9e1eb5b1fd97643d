"""The ``geneval`` reward's parts: OWLv2 (tiny random, built offline) and CLIP colours against
their models' own forwards, the mmdet result conversion, the scorer over a stub detector, bad
input, and GenEval's jsonl records through the prompt loader."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.data.prompts import load_prompts
from flowgrpo.rewards import build_reward
from flowgrpo.rewards.geneval import (
    COLORS,
    GenEvalScorer,
    Thresholds,
    check_metadata,
    flow_grpo_score,
    geneval_correct,
    keep_detections,
)
from flowgrpo.rewards.geneval_detectors import (
    MMDET_MISSING,
    TEMPLATES,
    ClipColours,
    MmdetDetector,
    Owlv2Detector,
    mmdet_objects,
    nms,
)
from flowgrpo.testing.geneval import FLOW_GRPO_RECORDS, save_tiny_clip, save_tiny_owlv2


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("geneval_models")
    return save_tiny_owlv2(root / "owlv2"), save_tiny_clip(root / "clip")


def test_owlv2_cached_queries_equal_the_models_forward(tiny_paths):
    """Text embedded once per class, then the image heads: the logits and boxes of
    ``Owlv2ForObjectDetection.forward`` with the queries repeated per image."""
    det = Owlv2Detector(tiny_paths[0])
    names = ["dog", "wine glass", "cat"]
    pix = det.preprocess(torch.rand(2, 3, 40, 24, generator=torch.Generator().manual_seed(0)))
    assert pix.shape == (2, 3, 32, 32)
    logits, boxes = det.raw(pix, names)
    tok = det.tokenizer(
        [det.template.format(n) for n in names] * 2, padding="max_length", max_length=16, truncation=True,
        return_tensors="pt",
    )  # fmt: skip
    with torch.no_grad():
        ref = det.model(
            input_ids=tok["input_ids"], attention_mask=tok["attention_mask"], pixel_values=pix
        )
    torch.testing.assert_close(logits, ref.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(boxes, ref.pred_boxes, atol=1e-6, rtol=1e-6)


def test_owlv2_detections_are_in_the_image_above_the_floor_and_suppressed(tiny_paths):
    det = Owlv2Detector(tiny_paths[0], min_score=0.0, nms_iou=0.3)
    images = [
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (40, 24, 3), np.uint8))
        for i in range(2)
    ]
    found = det.detect(images, ["dog", "zebra crossing"])  # a class outside COCO's 80 too
    assert len(found) == 2 and sum(len(v) for v in found[0].values()) > 0
    for per_image in found:
        for objs in per_image.values():
            boxes = np.stack([o[0] for o in objs])
            assert (boxes[:, [0, 2]] >= 0).all() and (boxes[:, [0, 2]] <= 24).all()
            assert (boxes[:, [1, 3]] >= 0).all() and (boxes[:, [1, 3]] <= 40).all()
            t = torch.from_numpy(boxes[:, :4])
            assert len(nms(t, torch.from_numpy(boxes[:, 4]), 0.3)) == len(objs)  # all kept


def test_nms_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    xy = torch.rand(60, 2, generator=g) * 50
    boxes = torch.cat([xy, xy + 5 + torch.rand(60, 2, generator=g) * 30], 1)
    scores = torch.rand(60, generator=g)
    keep = []
    for i in sorted(range(60), key=lambda i: -float(scores[i])):

        def iou(a, b):
            w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
            h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
            area = lambda r: (r[2] - r[0]) * (r[3] - r[1])  # noqa: E731
            return w * h / (area(a) + area(b) - w * h)

        if all(iou(boxes[i].tolist(), boxes[k].tolist()) <= 0.4 for k in keep):
            keep.append(i)
    assert nms(boxes, scores, 0.4) == keep and 5 < len(keep) < 60


def test_clip_colours_equal_the_zero_shot_reference(tiny_paths):
    """clip_benchmark's zero_shot_classifier / run_classification, recomputed with the
    model's get_*_features: the colour of each crop; the crop's pixels: masked to #999."""
    colours = ClipColours(tiny_paths[1])
    model, tok = colours.model, colours.tokenizer
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (64, 48, 3), np.uint8))
    mask = np.zeros((64, 48), bool)
    mask[10:40, 5:30] = True
    objs = [
        (np.array([4.4, 9.6, 36.4, 41.5, 0.9], np.float32), None),  # 32 x 32 after rounding
        (np.array([5, 10, 30, 40, 0.8], np.float32), mask),
        (np.array([0, 0, 48, 20, 0.7], np.float32), None),
    ]
    crop = colours.crop(image, objs[0])  # 32 px: no resize, PIL rounds the box
    want = np.asarray(image, np.float32)[10:42, 4:36] / 255.0
    mean, std = colours.mean.numpy().reshape(3, 1, 1), colours.std.numpy().reshape(3, 1, 1)
    np.testing.assert_allclose(crop.numpy(), (want.transpose(2, 0, 1) - mean) / std, atol=1e-6)
    masked = colours.crop(image, (np.array([0, 0, 48, 64, 1.0]), mask))  # 48x64 -> 32x42 -> 32x32
    assert masked.shape == (3, 32, 32)
    corner = masked[:, 0, 0].numpy() * std[:, 0, 0] + mean[:, 0, 0]
    np.testing.assert_allclose(corner, [0x99 / 255] * 3, atol=1e-6)  # outside the mask: #999
    got = colours.classify(image, objs, "wine glass")
    with torch.no_grad():
        clf = []
        for c in COLORS:
            ids = tok(
                [t.format(c=c, name="wine glass") for t in TEMPLATES],
                padding=True,
                return_tensors="pt",
            )
            e = model.get_text_features(**ids)
            e = getattr(e, "pooler_output", e)
            e = torch.nn.functional.normalize(e, dim=-1).mean(0)
            clf.append(e / e.norm())
        pix = torch.stack([colours.crop(image, o) for o in objs])
        f = model.get_image_features(pixel_values=pix)
        f = torch.nn.functional.normalize(getattr(f, "pooler_output", f), dim=-1)
        want_cols = [COLORS[k] for k in (100.0 * f @ torch.stack(clf, 1)).argmax(1).tolist()]
    assert got == want_cols and all(c in COLORS for c in got)


def test_mmdet_results_convert_from_both_versions_and_missing_mmdet_is_one_line():
    bbox = [np.zeros((0, 5), np.float32) for _ in range(80)]
    bbox[16] = np.array([[1, 2, 3, 4, 0.9], [5, 6, 7, 8, 0.4]], np.float32)  # dog
    segm = [[] for _ in range(80)]
    segm[16] = [np.ones((9, 9), bool), np.zeros((9, 9), bool)]
    v2 = mmdet_objects((bbox, segm))
    assert list(v2) == ["dog"] and [o[0][4] for o in v2["dog"]] == pytest.approx([0.9, 0.4])
    assert v2["dog"][0][1].all() and mmdet_objects(bbox)["dog"][1][1] is None
    inst = types.SimpleNamespace(
        bboxes=torch.tensor([[1.0, 2, 3, 4], [0, 0, 9, 9], [5, 6, 7, 8]]),
        scores=torch.tensor([0.9, 0.5, 0.4]),
        labels=torch.tensor([16, 0, 16]),
        masks=torch.ones(3, 9, 9, dtype=torch.bool),
    )
    v3 = mmdet_objects(types.SimpleNamespace(pred_instances=inst))
    assert sorted(v3) == ["dog", "person"]
    for a, b in zip(v3["dog"], v2["dog"], strict=True):
        np.testing.assert_allclose(a[0], b[0])
    try:
        import mmdet  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError) as e:
            MmdetDetector("cfg.py", "ckpt.pth")
        assert str(e.value) == MMDET_MISSING and "\n" not in MMDET_MISSING


class StubDetector:
    """Fixed detections per image (float32 arrays, as detectors give them)."""

    def __init__(self, per_image):
        self.per_image, self.calls = per_image, []

    def detect(self, images, classnames):
        self.calls.append((len(images), list(classnames), images[0].size))
        self.seen = [np.asarray(im) for im in images]
        return self.per_image


class StubColours:
    def classify(self, image, objects, classname):
        return ["red" if o[0][0] < 100 else "blue" for o in objects]


def _obj(x0, score):
    return (np.array([x0, 10, x0 + 50, 60, score], np.float32), None)


def test_scorer_applies_the_rules_to_the_detectors_output_and_names_bad_samples():
    meta = [json.loads(line) for line in FLOW_GRPO_RECORDS.splitlines()]
    per_image = [
        {"wine glass": [_obj(10, 0.95), _obj(200, 0.97), _obj(300, 0.5)]},  # 2 over 0.9
        {"handbag": [_obj(10, 0.5)], "scissors": [_obj(200, 0.6)]},  # pink? red: wrong
        {"dining table": [_obj(10, 0.2)], "dog": [_obj(10, 0.9)]},  # table below 0.3
        {"teddy bear": [_obj(10, 0.9)], "dog": [_obj(300, 0.9)]},  # dog right of the bear
    ]
    prompts = [m.pop("prompt") for m in meta]
    det = StubDetector(per_image)
    scorer = GenEvalScorer(det, StubColours())
    images = torch.rand(4, 3, 64, 80)
    verdicts = scorer.evaluate(images, prompts, meta)
    assert det.calls == [
        (
            4,
            sorted({"wine glass", "handbag", "scissors", "dining table", "dog", "teddy bear"}),
            (80, 64),
        )
    ]
    th = Thresholds()
    colours = lambda objs, name: StubColours().classify(None, objs, name)  # noqa: E731
    for v, raw, m in zip(verdicts, per_image, meta, strict=True):
        kept = keep_detections(raw, m["tag"], th)
        assert v.correct == geneval_correct(kept, m, colours)[0]
        assert (v.strict, v.partial) == flow_grpo_score(kept, m, colours)[:2]
    assert [v.correct for v in verdicts] == [True, False, False, True]
    assert [v.partial for v in verdicts] == [1.0, 0.5, 0.25, 1.0]
    for score in ("partial", "strict", "correct"):
        got = GenEvalScorer(det, StubColours(), score=score)(images, prompts, meta)
        assert got.tolist() == [float(getattr(v, score)) for v in verdicts]

    import io

    GenEvalScorer(det, StubColours(), jpeg_quality=75)(images, prompts, meta)  # flow_grpo's
    buf = io.BytesIO()  # client sends its server PIL's JPEG (quality 75): the detector sees it
    Image.fromarray((images[2] * 255).round().byte().permute(1, 2, 0).numpy()).save(buf, "JPEG")
    np.testing.assert_array_equal(det.seen[2], np.asarray(Image.open(buf).convert("RGB")))
    with pytest.raises(ValueError, match="jpeg_quality"):
        GenEvalScorer(det, StubColours(), jpeg_quality=0)

    with pytest.raises(ValueError) as e:  # a prompt without GenEval metadata: named
        scorer(images[:2], ["a photo of a dog", "a red cat"], [meta[0], {"ocr_text": "x"}])
    assert str(e.value).startswith("reward 'geneval': sample 1 (prompt 'a red cat') has no GenEval")
    assert "\n" not in str(e.value)
    for bad, what in [
        ({"tag": "colors", "include": [{"class": "car", "count": 1, "color": "teal"}]}, "teal"),
        ({"tag": "x", "include": [{"class": "car", "count": 0}]}, "'count' >= 1"),
        ({"tag": "x", "include": [{"class": "a", "count": 1, "position": ["near", 0]}]}, "near"),
        ({"tag": "x", "include": []}, "non-empty"),
    ]:
        with pytest.raises(ValueError, match=what):
            check_metadata(bad, "sample 0")


def test_geneval_records_load_as_they_are(tmp_path):
    """flow_grpo's geneval metadata files load through the prompt loader unchanged; every
    field but ``prompt`` reaches the reward as the sample's metadata."""
    path = tmp_path / "test_metadata.jsonl"
    path.write_text(FLOW_GRPO_RECORDS)
    ds = load_prompts(path)
    assert ds.prompts[0] == "a photo of two wine glasses" and len(ds) == 4
    assert ds.metadata[0] == {
        "tag": "counting",
        "include": [{"class": "wine glass", "count": 2}],
        "exclude": [{"class": "wine glass", "count": 3}],
    }
    prompts, meta = ds.select([3, 1])
    assert meta[0]["include"][1]["position"] == ["right of", 0]
    for i, m in enumerate(meta):
        check_metadata(m, f"sample {i}")


def test_reward_builds_from_the_registry_and_bad_options_are_one_line(tiny_paths):
    owl, clip = tiny_paths
    reward = build_reward("geneval", path=owl, clip_path=clip, score="strict")
    assert isinstance(reward, GenEvalScorer) and reward.thresholds.threshold == 0.1
    meta = [json.loads(line) for line in FLOW_GRPO_RECORDS.splitlines()]
    prompts = [m.pop("prompt") for m in meta]
    out = reward(torch.rand(4, 3, 48, 48), prompts, meta)
    assert out.shape == (4,) and set(out.tolist()) <= {0.0, 1.0}
    for opts, msg in [
        ({"path": owl}, "needs option 'clip_path'"),
        ({"path": owl, "clip_path": clip, "detector": "yolo"}, "detector must be"),
        ({"path": owl, "clip_path": clip, "score": "f1"}, "score must be one of"),
        ({"path": str(owl) + "x", "clip_path": clip}, "is not an existing local directory"),
    ]:
        with pytest.raises((ValueError, FileNotFoundError), match=msg) as e:
            build_reward("geneval", **opts)
        assert "\n" not in str(e.value)


def test_served_geneval_equals_in_process_and_a_detector_of_ones_own_plugs_in(tiny_paths):
    """``flowgrpo reward-server --reward geneval`` (the recipe's server, here over OWLv2)
    answers the remote client with the in-process scores; metadata travels as JSON."""
    from flowgrpo.rewards.server import serve_reward

    owl, clip = tiny_paths
    opts = {"path": owl, "clip_path": clip, "threshold": 0.0, "counting_threshold": 0.0}
    meta = [json.loads(line) for line in FLOW_GRPO_RECORDS.splitlines()]
    prompts = [m.pop("prompt") for m in meta]
    images = torch.rand(4, 3, 48, 40, generator=torch.Generator().manual_seed(0))
    local = build_reward("geneval", **opts)(images, prompts, meta)
    server = serve_reward("geneval", options=opts).start_in_thread()
    try:
        remote = build_reward("remote", url=server.url, timeout=60)
        served = torch.tensor(remote(images, prompts, meta))
    finally:
        server.close()
    quantised = (images * 255).round() / 255  # the wire carries 8-bit PNGs
    torch.testing.assert_close(served, build_reward("geneval", **opts)(quantised, prompts, meta))
    assert local.shape == served.shape == (4,)

    own = build_reward(
        "geneval", detector="flowgrpo.testing.geneval:FixedDetector",
        detector_options={"name": "dog"}, clip_path=clip, score="correct",
    )  # fmt: skip
    assert own.thresholds.threshold == 0.3  # GenEval's own defaults for a detector of yours
    single = [
        {"tag": "single_object", "include": [{"class": c, "count": 1}]} for c in ("dog", "cat")
    ]
    assert own(images[:2], ["a dog", "a cat"], single).tolist() == [1.0, 0.0]


def test_missing_model_folders_are_a_config_error_before_anything_loads(tmp_path, tiny_paths):
    from flowgrpo.config import ConfigError, load_config

    prompts = tmp_path / "train_metadata.jsonl"
    prompts.write_text(FLOW_GRPO_RECORDS)
    base = [f"model.path={tmp_path}", f"data.train_prompts={prompts}", "reward=geneval"]
    for extra, want in [
        (
            [],
            "reward 'geneval' needs a CLIP ViT-L/14 directory: set reward.geneval.options.clip_path",
        ),
        ([f"reward.geneval.options.clip_path={tiny_paths[1]}"], "options.path"),
        (
            [
                f"reward.geneval.options.clip_path={tiny_paths[1]}",
                "reward.geneval.options.detector=mmdet",
            ],
            "Mask2Former config (detector=mmdet): set reward.geneval.options.config",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config("sd3-geneval", [*base, *extra])
        assert str(e.value).startswith(want) or want in str(e.value), str(e.value)
    ok = [
        f"reward.geneval.options.clip_path={tiny_paths[1]}",
        f"reward.geneval.options.path={tiny_paths[0]}",
    ]
    assert load_config("sd3-geneval", [*base, *ok]).reward[0].name == "geneval"
