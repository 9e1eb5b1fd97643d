"""OCR reward: scoring rules (pure python) and PP-OCRv4 on PIL-rendered text (4 OCR calls)."""

import json
import sys

import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from flowgrpo.rewards import ocr as rocr
from flowgrpo.rewards._image import from_pil

pytest.importorskip("rapidocr_onnxruntime")


def test_levenshtein_and_score_rules():
    assert rocr.levenshtein("kitten", "sitting") == 3
    assert rocr.levenshtein("", "abc") == 3
    assert rocr.ocr_score("Hello World", "hello world") == 1.0
    assert rocr.ocr_score("the sign says HELLO WORLD!", "Hello World") == 1.0  # substring
    assert rocr.ocr_score("helo", "hello") == pytest.approx(1 - 1 / 5)
    assert rocr.ocr_score("", "hello") == 0.0
    assert rocr.ocr_score("a completely different long text", "hi") == 0.0  # capped at len


def test_target_extraction():
    assert rocr.ocr_target('a neon sign saying "Open Late" at night') == "Open Late"
    assert rocr.ocr_target("a cat's poster that says 'meow' and \"woof\"") == "meow"
    assert rocr.ocr_target("a mug with “coffee” on it") == "coffee"
    assert rocr.ocr_target('sign "a"', {"ocr_text": "from meta"}) == "from meta"
    with pytest.raises(ValueError, match="no target text for prompt 'a plain cat'"):
        rocr.ocr_target("a plain cat")
    with pytest.raises(ValueError, match="empty target text"):
        rocr.ocr_target('quotes " " only')


def test_missing_extra_tells_how_to_install(monkeypatch):
    monkeypatch.setattr(rocr, "_ENGINE", None)
    monkeypatch.setitem(sys.modules, "rapidocr_onnxruntime", None)
    with pytest.raises(ImportError, match=r"pip install 'flowgrpo\[ocr\]'"):
        rocr.get_ocr_engine()


def _render(text: str) -> Image.Image:
    img = Image.new("RGB", (256, 96), "white")
    ImageDraw.Draw(img).text((12, 24), text, fill="black", font=ImageFont.load_default(size=36))
    return img


def test_ocr_reward_on_rendered_text():
    reward = rocr.OcrReward()
    shown = _render("Flow GRPO")
    images = from_pil([shown, shown, shown, Image.new("RGB", (256, 96), "white")])
    prompts = [
        'a sign that says "flow grpo"',  # the text shown
        'a sign that says "zebra"',  # a different word
        'a sign that says "zebra"',  # ...but metadata names the text shown
        'a sign that says "flow grpo"',  # blank image
    ]
    meta = [{}, {}, {"ocr_text": "Flow GRPO"}, {}]
    scores = reward(images, prompts, meta)
    assert scores.dtype == torch.float32 and scores.shape == (4,)
    assert scores[0] >= 0.9
    assert scores[1] <= 0.5
    assert scores[2] >= 0.9
    assert scores[3] == 0.0
    assert rocr.get_ocr_engine() is rocr.get_ocr_engine()  # one engine per process


def test_an_edit_records_metadata_reaches_the_ocr_target_as_a_text_records(tmp_path):
    """Text edits ("change the sign to say X"): an edit record's prompt and fields give the
    OCR reward the target a text-to-image record gives, its source images riding along."""
    from flowgrpo.data.prompts import load_prompts
    from flowgrpo.rewards import MultiReward

    _render("CLOSED").save(tmp_path / "sign.png")  # the source: the sign before the edit
    records = [
        {"prompt": 'change the sign to say "OPEN"'},  # target quoted in the prompt
        {"prompt": "change the sign's text", "ocr_text": "Late"},  # target as a field
    ]
    edit, t2i = tmp_path / "edit.jsonl", tmp_path / "t2i.jsonl"
    edit.write_text("".join(json.dumps(r | {"image": "sign.png"}) + "\n" for r in records))
    t2i.write_text("".join(json.dumps(r) + "\n" for r in records))
    (ep, em), (tp, tm) = load_prompts(edit).select([0, 1]), load_prompts(t2i).select([0, 1])
    assert [m["source_images"][0].shape for m in em] == [(3, 96, 256)] * 2
    assert "source_images" not in tm[0]
    targets = [rocr.ocr_target(p, m) for p, m in zip(ep, em)]
    assert targets == [rocr.ocr_target(p, m) for p, m in zip(tp, tm)] == ["OPEN", "Late"]
    results = from_pil([_render("OPEN"), _render("Late")])  # the edited signs
    multi = MultiReward("ocr")  # as the trainer scores: metadata copied, sources included
    assert multi(results, ep, em)["ocr"].min() >= 0.9  # (the CLOSED source is not read)
