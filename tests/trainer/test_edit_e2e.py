"""Editing end to end (issue 26): `flowgrpo train` on a saved tiny Qwen-Image-Edit directory
with a .jsonl of prompts + a folder of source images trains and checkpoints, resumes exactly,
draws source | result grids; `flowgrpo export-lora` loads into the stock pipeline; `flowgrpo
sample --image` writes one edit per prompt; a text-only prompt file or an undecodable image
is a one-line error before anything trains."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.slow

SMALL = [
    "model.height=64",
    "model.width=128",
    "model.dtype=fp32",
    "sample.num_steps=3",
    "sample.eval_num_steps=2",
    "sample.prompts_per_step=2",
    "sample.group_size=2",
    "sample.guidance_scale=4.0",
    "sample.negative_prompt=' '",
    "update.micro_batch_size=2",
    "lora.rank=4",
    "lora.alpha=8",
    "optim.lr=1e-2",
    "fsdp.activation_checkpointing=false",
    "data.eval_num_prompts=1",
    "data.eval_samples_per_prompt=1",
    "reward=jpeg_compressibility:1.0",
]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _flowgrpo(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(
        [sys.executable, "-m", "flowgrpo", *args],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    if ok:
        assert res.returncode == 0, res.stderr[-3000:]
    return res


def _tiny_clip(path: Path) -> Path:
    import torch
    from transformers import CLIPConfig, CLIPModel

    text = {"vocab_size": 40, "hidden_size": 32, "intermediate_size": 37}
    vision = {"hidden_size": 32, "intermediate_size": 37, "image_size": 32, "patch_size": 8}
    for cfg in (text, vision):
        cfg.update(num_hidden_layers=2, num_attention_heads=2)
    torch.manual_seed(0)
    CLIPModel(
        CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    ).save_pretrained(path)
    return path


def _pixels(path: Path) -> np.ndarray:
    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"))


def _weights(ckpt: Path) -> dict:
    """The model tensors of a DCP checkpoint directory (via a torch.save conversion)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(dst))
    return torch.load(dst, weights_only=False)["model"]


def _metrics(run: Path) -> list[dict]:
    from flowgrpo.trainer.logging import deterministic_view, read_jsonl

    return [deterministic_view(r) for r in read_jsonl(run / "metrics.jsonl")]


def test_edit_run_journey(tmp_path) -> None:
    """Train 3 steps; resume a copy from step 2 to the same step 3; the grids show source |
    result; export-lora loads into the stock pipeline; sample --image."""
    import torch
    from diffusers import QwenImageEditPipeline

    from flowgrpo.models.qwen_image_edit import QwenImageEditAdapter
    from flowgrpo.testing.tiny import tiny_pipeline

    tiny_pipeline("qwen_image_edit").save_pretrained(tmp_path / "model")
    (tmp_path / "data" / "images").mkdir(parents=True)
    sources = []  # the size of the results (64 x 128): the grids show them unscaled
    for i in range(2):
        a = np.random.default_rng(i).integers(0, 256, (64, 128, 3), dtype=np.uint8)
        Image.fromarray(a).save(tmp_path / "data" / "images" / f"{i}.png")
        sources.append(a)
    prompts = tmp_path / "data" / "edit.jsonl"
    rows = [
        {"prompt": "make the cat red", "image": "images/0.png", "include": [["cat", 1]]},
        {"prompt": "two dogs", "image": "images/1.png"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    preset = tmp_path / "edit.yaml"  # a user's own YAML (the settings: SMALL)
    preset.write_text("seed: 0\n")
    common = [f"model.path={tmp_path / 'model'}", *SMALL]

    # a text-only prompt file for the edit model: one line, before anything is trained (the
    # other bad inputs: tests/data/test_edit_data.py, at config time)
    text_only = tmp_path / "text.txt"
    text_only.write_text("a red cat\n")
    bad = _flowgrpo(
        "train", str(preset), *common, f"data.train_prompts={text_only}",
        f"run.output_dir={tmp_path / 'bad'}", ok=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "which edits images" in bad.stderr, bad.stderr[-2000:]
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr[-2000:]
    assert not (tmp_path / "bad").exists()

    run = tmp_path / "run"
    clip = _tiny_clip(tmp_path / "clip")  # the similarity-to-source reward beside the task's
    train = [
        "train", str(preset), *common, f"data.train_prompts={prompts}", "trainer.eval_every=0",
        "sample.prompts_per_step=1",  # 2 samples a step: each encodes its source at ~1024²
        "reward=jpeg_compressibility:1.0,image_similarity:0.2",
        f"reward.image_similarity.options.path={clip}",
    ]  # fmt: skip
    _flowgrpo(*train, "trainer.max_steps=3", "trainer.save_every=1", f"run.output_dir={run}")
    lines = _metrics(run)
    assert [m["step"] for m in lines] == [1, 2, 3]
    sims = [m["reward/image_similarity_mean"] for m in lines]
    assert all(-1.0 <= x <= 1.0 for x in sims)

    # resume: a copy of the run as it was after step 2 continues to the same step 3
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_3")
    _flowgrpo(*train, "trainer.max_steps=3", "trainer.resume=auto", f"run.output_dir={resumed}")
    assert _metrics(resumed) == _metrics(run)
    w2, wa = _weights(run / "checkpoints" / "step_2"), _weights(run / "checkpoints" / "step_3")
    wb = _weights(resumed / "checkpoints" / "step_3")
    assert wa.keys() == wb.keys() and len(wa) > 10
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(w2[k], wa[k]) for k in wa)  # step 3 moved them: it can fail

    # the eval grids: one eval image, source | result in a 2 x 128 px wide cell
    for name in ("grid_before.png", "grid_after.png"):
        grid = _pixels(run / name)
        band = (grid.shape[0] - 128 - 4) // 2  # the prompt band and the reward band
        assert grid.shape[1] == 2 * 128 + 4 and band > 0, grid.shape
        source = grid[2 + band + 32 : 2 + band + 96, 2:130]  # 64 x 128, centred vertically
        assert any(np.array_equal(source, a) for a in sources), name
        assert not np.array_equal(grid[2 + band + 32 : 2 + band + 96, 130:258], source)

    # export-lora: the file loads into the stock pipeline and changes its transformer's output
    lora = tmp_path / "lora" / "edit-lora.safetensors"
    _flowgrpo("export-lora", "--checkpoint", str(run), "--out", str(lora))
    model = tmp_path / "model"  # the processor built without its video part (no torchvision)
    parts = QwenImageEditAdapter.load_components(model)
    pipe = QwenImageEditPipeline.from_pretrained(model, local_files_only=True, **parts)
    g = torch.Generator().manual_seed(0)
    x, e = torch.randn(1, 2 + 4, 16, generator=g), torch.randn(1, 7, 32, generator=g)
    call = dict(img_shapes=[[(1, 1, 2), (1, 2, 2)]], return_dict=False)  # noised + source

    def velocity() -> torch.Tensor:
        with torch.no_grad():
            return pipe.transformer(x, e, timestep=torch.tensor([0.5]), **call)[0]

    base = velocity()
    pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    assert (velocity() - base).abs().max() > 1e-4

    # sample --image from the trained checkpoint: one PNG a prompt and grid.png, source | result
    out = tmp_path / "samples"
    _flowgrpo(
        "sample", "--checkpoint", str(run), "--prompts", "make it blue", "a dog",
        "--image", str(tmp_path / "data" / "images" / "0.png"), "--out", str(out),
    )  # fmt: skip
    assert sorted(p.name for p in out.glob("*.png")) == [
        "grid.png",
        "sample_0000.png",
        "sample_0001.png",
    ]
    results = [_pixels(out / f"sample_000{i}.png") for i in range(2)]
    assert results[0].shape == (128, 128, 3)  # save_images centres on a square (black bands)
    made = [json.loads(x)["prompt"] for x in (out / "prompts.jsonl").read_text().splitlines()]
    assert made == ["make it blue", "a dog"]
    grid = _pixels(out / "grid.png")
    band = (grid.shape[0] - 2 * (128 + 2) - 2) // 2  # 2 rows (prompts), a prompt band each
    assert grid.shape[1] == 2 * 128 + 4 and band > 0, grid.shape
    for row in range(2):  # each prompt's source | its result, unscaled (64 x 128 each)
        top = 2 + row * (band + 128 + 2) + band + 32
        assert np.array_equal(grid[top : top + 64, 2:130], sources[0])
        assert np.array_equal(grid[top : top + 64, 130:258], results[row][32:96])


def test_flux_kontext_run_exports_and_samples(tmp_path) -> None:
    """FLUX.1 Kontext (sources at 64 px: flux_kontext.source_size): train 2 steps with the
    similarity-to-source reward, export-lora loads into the stock FluxKontextPipeline and
    changes its transformer's output, sample --image from the checkpoint."""
    import torch
    from diffusers import FluxKontextPipeline

    from flowgrpo.testing.tiny import tiny_pipeline

    tiny_pipeline("flux_kontext").save_pretrained(tmp_path / "model")
    (tmp_path / "data" / "images").mkdir(parents=True)
    for i in range(2):  # at least 64 px: the tiny pipeline's multiple
        a = np.random.default_rng(i).integers(0, 256, (64, 96, 3), dtype=np.uint8)
        Image.fromarray(a).save(tmp_path / "data" / "images" / f"{i}.png")
    prompts = tmp_path / "data" / "edit.jsonl"
    rows = [{"prompt": "make the cat red", "image": "images/0.png"}]
    rows.append({"prompt": "two dogs", "image": "images/1.png"})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    preset = tmp_path / "edit.yaml"
    preset.write_text("seed: 0\n")
    common = [
        f"model.path={tmp_path / 'model'}", *SMALL, "model.max_sequence_length=16",
        "flux_kontext.source_size=64", "sample.guidance_scale=2.5",
    ]  # fmt: skip
    clip = _tiny_clip(tmp_path / "clip")
    run = tmp_path / "run"
    _flowgrpo(
        "train", str(preset), *common, f"data.train_prompts={prompts}", "trainer.eval_every=0",
        "reward=jpeg_compressibility:1.0,image_similarity:0.2",
        f"reward.image_similarity.options.path={clip}",
        "trainer.max_steps=2", "trainer.save_every=2", f"run.output_dir={run}",
    )  # fmt: skip
    lines = _metrics(run)
    assert [m["step"] for m in lines] == [1, 2]
    assert all(-1.0 <= m["reward/image_similarity_mean"] <= 1.0 for m in lines)

    lora = tmp_path / "lora" / "kontext-lora.safetensors"
    _flowgrpo("export-lora", "--checkpoint", str(run), "--out", str(lora))
    pipe = FluxKontextPipeline.from_pretrained(tmp_path / "model", local_files_only=True)
    g = torch.Generator().manual_seed(0)
    x, e = torch.randn(1, 2 + 1, 16, generator=g), torch.randn(1, 5, 32, generator=g)
    ids = torch.tensor([[0.0, 0, 0], [0, 0, 1], [1, 0, 0]])  # 2 noised + 1 source token

    def velocity() -> torch.Tensor:
        with torch.no_grad():
            return pipe.transformer(
                hidden_states=x, encoder_hidden_states=e, pooled_projections=e[:, 0],
                timestep=torch.tensor([0.5]), guidance=torch.tensor([2.5]),
                img_ids=ids, txt_ids=torch.zeros(5, 3), return_dict=False,
            )[0]  # fmt: skip

    base = velocity()
    pipe.load_lora_weights(lora.parent, weight_name=lora.name)
    assert (velocity() - base).abs().max() > 1e-4

    out = tmp_path / "samples"
    _flowgrpo(
        "sample", "--checkpoint", str(run), "--prompts", "make it blue", "a dog",
        "--image", str(tmp_path / "data" / "images" / "0.png"), "--out", str(out),
    )  # fmt: skip
    assert sorted(p.name for p in out.glob("sample_*.png")) == [
        "sample_0000.png",
        "sample_0001.png",
    ]
