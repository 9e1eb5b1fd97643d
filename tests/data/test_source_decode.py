"""Source images decoded as diffusers' ``load_image`` does (issue 40, items 3 and 6): EXIF
orientation applied, 16-bit PNGs read at their full range, pixels without a fixed range
(float or 32-bit integer TIFFs) refused in one line naming the file; prompt files check each
source's header only (nothing decoded when the file loads or the config is checked), and a
batch decodes each source once, its group's samples sharing the tensor."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.data import prompts as prompts_mod
from flowgrpo.data.prompts import load_image, load_prompts


def test_a_16_bit_png_keeps_its_range(tmp_path) -> None:
    a = np.random.default_rng(0).integers(0, 65536, (12, 10), dtype=np.uint16)
    Image.fromarray(a).save(tmp_path / "g16.png")
    assert Image.open(tmp_path / "g16.png").mode == "I;16"
    got = load_image(tmp_path / "g16.png")
    want = torch.from_numpy(a.astype(np.float32) / 65535).expand(3, -1, -1)
    assert got.shape == (3, 12, 10) and torch.allclose(got, want, atol=1e-7)
    assert abs(float(got.mean()) - a.mean() / 65535) < 1e-6  # was 0.99+: saturated


@pytest.mark.parametrize("mode, what", [("F", "32-bit float"), ("I", "32-bit integer")])
def test_pixels_without_a_fixed_range_are_refused(tmp_path, mode, what) -> None:
    a = np.linspace(0, 1, 64, dtype=np.float32).reshape(8, 8)
    im = Image.fromarray(a) if mode == "F" else Image.fromarray((a * 1000).astype(np.int32))
    assert im.mode == mode
    im.save(tmp_path / "x.tiff")
    with pytest.raises(ValueError) as info:
        load_image(tmp_path / "x.tiff")
    msg = str(info.value)
    assert str(tmp_path / "x.tiff") in msg and what in msg and "\n" not in msg
    f = tmp_path / "e.jsonl"  # and the prompt file's load says so before any run
    f.write_text(json.dumps({"prompt": "p", "image": "x.tiff"}) + "\n")
    with pytest.raises(ValueError, match=rf"^{f}:1: image {tmp_path / 'x.tiff'} .*{what}"):
        load_prompts(f)


@pytest.mark.parametrize("suffix", [".jpg", ".png", ".webp"])
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_applied_as_diffusers_load_image(tmp_path, suffix, orientation) -> None:
    from diffusers.utils import load_image as diffusers_load_image

    a = np.random.default_rng(orientation).integers(0, 256, (16, 24, 3), dtype=np.uint8)
    im = Image.fromarray(a)
    exif = im.getexif()
    exif[0x0112] = orientation
    path = tmp_path / f"o{suffix}"
    im.save(path, exif=exif.tobytes(), **({"lossless": True} if suffix == ".webp" else {}))
    ref = np.asarray(diffusers_load_image(str(path)), dtype=np.float32) / 255
    got = load_image(path)
    assert ref.shape[:2] == ((16, 24) if orientation == 3 else (24, 16))
    assert got.shape == (3, *ref.shape[:2])
    assert torch.equal(got, torch.from_numpy(ref).permute(2, 0, 1))


def _edit_file(tmp_path, n_rows: int = 2):
    for i in range(n_rows):
        a = np.full((6, 8, 3), 40 * i, dtype=np.uint8)
        Image.fromarray(a).save(tmp_path / f"{i}.png")
    f = tmp_path / "e.jsonl"
    f.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "image": f"{i}.png"}) + "\n" for i in range(n_rows))
    )
    return f


def test_loading_a_prompt_file_decodes_no_source(tmp_path, monkeypatch) -> None:
    f = _edit_file(tmp_path)

    def no_decode(self, *a, **k):
        raise AssertionError("a source image was decoded while the prompt file loaded")

    monkeypatch.setattr(Image.Image, "load", no_decode)
    monkeypatch.setattr(prompts_mod, "load_image", no_decode)
    ds = load_prompts(f)
    assert ds.has_images and len(ds) == 2


def test_a_batch_decodes_each_source_once_and_its_group_shares_it(tmp_path, monkeypatch) -> None:
    f = _edit_file(tmp_path)
    ds = load_prompts(f)
    calls = []
    real = prompts_mod.load_image
    monkeypatch.setattr(prompts_mod, "load_image", lambda p: calls.append(p) or real(p))
    prompts, meta = ds.select([1, 0, 1, 1, 0])
    assert prompts == ["p1", "p0", "p1", "p1", "p0"] and len(calls) == 2
    srcs = [m["source_images"][0] for m in meta]
    assert srcs[0] is srcs[2] is srcs[3] and srcs[1] is srcs[4] and srcs[0] is not srcs[1]
    assert float(srcs[0].mean()) == pytest.approx(40 / 255) and float(srcs[1].max()) == 0


def test_a_source_that_fails_to_decode_in_a_batch_names_file_and_line(tmp_path) -> None:
    f = _edit_file(tmp_path)
    good = (tmp_path / "1.png").read_bytes()
    ds = load_prompts(f)  # headers only: the truncation shows when a batch decodes it
    (tmp_path / "1.png").write_bytes(good[: len(good) // 2])
    with pytest.raises(ValueError) as info:
        ds.select([0, 1])
    msg = str(info.value)
    assert (
        msg.startswith(f"{f}:2: image {tmp_path / '1.png'} cannot be decoded") and "\n" not in msg
    )


def test_sample_prompt_file_decodes_nothing_before_the_config_check(tmp_path, monkeypatch, capsys):
    """``sample --prompt-file`` with source images: a config error comes before any source
    is decoded (it decoded every record first: 2.62 GB for 120 records of 1024²)."""
    from flowgrpo.cli import main

    f = _edit_file(tmp_path)

    def no_decode(*a, **k):
        raise AssertionError("a source image was decoded before the config check")

    monkeypatch.setattr(prompts_mod, "load_image", no_decode)
    args = ["sample", "toy-digits", "model.height=-3", "--prompt-file", str(f)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 2
    assert "model.height" in capsys.readouterr().err
    rows = load_prompts(f).sources([1, 0])
    assert len(rows) == 2 and prompts_mod.SourceRows is type(rows)
    monkeypatch.setattr(prompts_mod, "load_image", lambda p: str(p))
    assert rows[0] == [str(tmp_path / "1.png")] and rows[0:2][1] == [str(tmp_path / "0.png")]


def test_a_decoder_value_error_names_the_file(tmp_path, monkeypatch) -> None:
    """PIL's own ValueError (e.g. "conversion not supported" for an exotic mode) is the
    file's: one line naming it."""
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "x.png")

    def refuse(self, *a, **k):
        raise ValueError("conversion from LAB to RGB not supported")

    monkeypatch.setattr(Image.Image, "convert", refuse)
    with pytest.raises(ValueError) as info:
        load_image(tmp_path / "x.png")
    assert str(info.value) == (
        f"image {tmp_path / 'x.png'} cannot be decoded "
        "(ValueError: conversion from LAB to RGB not supported)"
    )
