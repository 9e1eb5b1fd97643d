"""Editing data (issue 26, DESIGN contract 10): a .jsonl record's ``image`` / ``images`` name
source images relative to the file; they decode when the file loads, reach the sample's
metadata as [3, H, W] tensors in [0, 1], and records that do not fit the model (images for a
text-to-image model, none for an editing model), a missing or undecodable image are one-line
config errors before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.config import ConfigError, load_config
from flowgrpo.data.prompts import load_prompts, source_images
from flowgrpo.models.registry import SUPPORTED_PIPELINES, import_adapter


def write_images(root: Path) -> list[np.ndarray]:
    (root / "imgs").mkdir(parents=True, exist_ok=True)
    arrays = []
    for i, (h, w) in enumerate(((6, 8), (5, 5), (4, 7))):
        a = np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(a).save(root / "imgs" / f"{i}.png")
        arrays.append(a)
    return arrays


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_records_carry_their_source_images_to_the_metadata(tmp_path) -> None:
    arrays = write_images(tmp_path)
    f = write_jsonl(
        tmp_path / "edit.jsonl",
        [
            {"prompt": "make it red", "image": "imgs/0.png", "include": [1]},
            {"prompt": "two of them", "images": ["imgs/1.png", "imgs/2.png"]},
        ],
    )
    ds = load_prompts(f)
    assert ds.has_images
    prompts, meta = ds.select([1, 0, 1])
    assert prompts == ["two of them", "make it red", "two of them"]
    assert meta[1]["include"] == [1] and meta[1]["image"] == "imgs/0.png"
    got = [m["source_images"] for m in meta]
    assert [len(g) for g in got] == [2, 1, 2]
    for tensor, array in zip(got[0] + got[1], [arrays[1], arrays[2], arrays[0]], strict=True):
        assert tensor.dtype == torch.float32 and tensor.shape == (3, *array.shape[:2])
        want = torch.from_numpy(array.astype(np.float32) / 255).permute(2, 0, 1)
        assert torch.equal(tensor, want)
    assert source_images(meta) == got
    assert source_images(ds.subset([0]).select([0])[1])[0][0].shape == (3, 6, 8)
    assert source_images([{}, {"x": 1}]) is None
    assert not load_prompts(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a"}])).has_images


@pytest.mark.parametrize(
    "record, expected",
    [
        ({"prompt": "p", "image": "imgs/none.png"}, "imgs/none.png not found"),
        ({"prompt": "p", "image": "notes.txt"}, "notes.txt cannot be decoded"),
        ({"prompt": "p", "images": []}, "'images' a non-empty list of paths"),
        ({"prompt": "p", "image": "imgs/0.png", "images": ["imgs/0.png"]}, "not both"),
    ],
)
def test_bad_image_records_name_file_and_line(tmp_path, record, expected) -> None:
    write_images(tmp_path)
    (tmp_path / "notes.txt").write_text("not an image")
    f = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "ok", "image": "imgs/0.png"}, record])
    with pytest.raises(ValueError) as info:
        load_prompts(f)
    message = str(info.value)
    assert message.startswith(f"{f}:2: ") and expected in message and "\n" not in message


def model_dir(root: Path, cls: str) -> Path:
    d = root / cls
    d.mkdir()
    (d / "model_index.json").write_text(json.dumps({"_class_name": cls}))
    return d


def config_error(tmp_path: Path, cls: str, rows: list[dict]) -> str:
    prompts = write_jsonl(tmp_path / "eval.jsonl", rows)
    overrides = [
        f"model.path={model_dir(tmp_path, cls)}",
        f"data.eval_prompts={prompts}",
        "model.height=64",
        "model.width=64",
    ]
    preset = tmp_path / "custom.yaml"  # a user's own YAML: no shipped preset's pipeline
    preset.write_text("seed: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(preset), overrides, command="eval")
    message = str(info.value)
    assert "\n" not in message
    return message


def test_records_must_fit_the_model(tmp_path) -> None:
    write_images(tmp_path)
    rows = [{"prompt": "a", "image": "imgs/0.png"}, {"prompt": "b"}]
    edit = config_error(tmp_path, "QwenImageEditPipeline", rows)
    assert f"{tmp_path / 'eval.jsonl'}:2: no 'image' or 'images' field" in edit
    assert "QwenImageEditPipeline, which edits images" in edit
    text = config_error(tmp_path, "QwenImagePipeline", rows)
    assert f"{tmp_path / 'eval.jsonl'}:1: the record has source images" in text
    assert "QwenImagePipeline, which generates from text" in text
    bad = config_error(tmp_path, "FluxPipeline", [{"prompt": "a", "image": "imgs/9.png"}])
    assert "config key 'data.eval_prompts'" in bad and "eval.jsonl:1: image" in bad


@pytest.mark.parametrize(
    "image, expected",
    [("imgs/9.png", "imgs/9.png not found"), ("notes.txt", "notes.txt cannot be decoded")],
)
def test_an_edit_models_bad_image_is_a_config_error(tmp_path, image, expected) -> None:
    """A missing or undecodable source image of an editing model's prompt file: one line
    naming the key, the file and line and the image, from the config check (nothing loads)."""
    write_images(tmp_path)
    (tmp_path / "notes.txt").write_text("not an image")
    rows = [{"prompt": "a", "image": "imgs/0.png"}, {"prompt": "b", "image": image}]
    message = config_error(tmp_path, "QwenImageEditPipeline", rows)
    assert message.startswith("config key 'data.eval_prompts': ")
    assert f"{tmp_path / 'eval.jsonl'}:2: " in message and expected in message


#: the editing pipelines whose adapter takes one source image per prompt
ONE_SOURCE = [
    name
    for name, path in SUPPORTED_PIPELINES.items()
    if getattr(import_adapter(path), "max_images", None) == 1
]


@pytest.mark.parametrize("cls", ONE_SOURCE)
def test_more_sources_than_the_model_takes_is_a_config_error(tmp_path, cls) -> None:
    """Two source images for a one-source model: one line naming the file and line (it
    stopped the run at its first rollout naming neither)."""
    write_images(tmp_path)
    rows = [
        {"prompt": "a", "image": "imgs/0.png"},
        {"prompt": "b", "images": ["imgs/0.png", "imgs/1.png"]},
    ]
    message = config_error(tmp_path, cls, rows)
    assert f"{tmp_path / 'eval.jsonl'}:2: 2 source images" in message
    assert f"{cls}, which takes 1 per prompt" in message
