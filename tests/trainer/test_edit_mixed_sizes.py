"""The README's editing journey with sources of different aspect ratios (issue 39 item 8):
`flowgrpo train` on a tiny Qwen-Image-Edit with a square and a 4:3 source (they resize to
1024 x 1024 and 1184 x 896: two source layouts) trains a step with rollout chunks,
micro-batches and the base eval mixing both sizes, and `sample --prompt-file` edits both."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.slow


def _flowgrpo(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "flowgrpo", *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_sources_of_two_aspect_ratios_train_and_sample(tmp_path) -> None:
    from flowgrpo.models.qwen_image_edit import QwenImageEditAdapter
    from flowgrpo.testing.tiny import tiny_pipeline
    from flowgrpo.trainer.logging import read_jsonl

    tiny_pipeline("qwen_image_edit").save_pretrained(tmp_path / "model")
    (tmp_path / "data" / "images").mkdir(parents=True)
    for i, (h, w) in enumerate(((64, 64), (48, 64))):
        a = np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)
        Image.fromarray(a).save(tmp_path / "data" / "images" / f"{i}.png")
        dims = QwenImageEditAdapter._dims_at(QwenImageEditAdapter.vae_area, w / h)
        assert dims == ((1024, 1024), (1184, 896))[i]
    prompts = tmp_path / "data" / "edit.jsonl"
    rows = [
        {"prompt": "make the cat red", "image": "images/0.png"},
        {"prompt": "two dogs", "image": "images/1.png"},
    ]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    preset = tmp_path / "edit.yaml"
    preset.write_text("seed: 0\n")
    run = tmp_path / "run"
    _flowgrpo(
        "train", str(preset), f"model.path={tmp_path / 'model'}", f"data.train_prompts={prompts}",
        "model.height=64", "model.width=64", "model.dtype=fp32", "sample.num_steps=2",
        "sample.eval_num_steps=2", "sample.prompts_per_step=2", "sample.group_size=2",
        "sample.rollout_batch_size=4", "update.micro_batch_size=4", "sample.guidance_scale=4.0",
        "sample.negative_prompt=' '", "lora.rank=4", "lora.alpha=8",
        "fsdp.activation_checkpointing=false", "data.eval_samples_per_prompt=1",
        "reward=jpeg_compressibility:1.0", "trainer.max_steps=1", "trainer.eval_every=1",
        "trainer.save_every=1", f"run.output_dir={run}",
    )  # fmt: skip
    lines = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in lines if "reward_mean" in m] == [1]
    assert any("eval/reward_mean" in m for m in lines)
    assert np.isfinite([m["reward_mean"] for m in lines if "reward_mean" in m]).all()
    out = tmp_path / "samples"
    _flowgrpo("sample", "--checkpoint", str(run), "--prompt-file", str(prompts), "--out", str(out))
    assert sorted(p.name for p in out.glob("*.png")) == [
        "grid.png",
        "sample_0000.png",
        "sample_0001.png",
    ]
