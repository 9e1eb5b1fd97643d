"""End-to-end Flow-GRPO runs of the toy: 1 process, 2 ranks, resume (kill -9 and resume:
test_fault_injection.py).

All runs use the toy preset shrunk to 2 digits x K=4 (8 images per step), 4 sampling steps and
2 eval prompts x 2 seeds, so one step takes well under a second after start-up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.testing.models import random_toy_path
from flowgrpo.testing.ranks import start_cli_ranks
from flowgrpo.trainer.logging import deterministic_view, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SMALL = [
    f"model.path={random_toy_path()}",  # random init: independent of the shipped asset
    "sample.prompts_per_step=2",
    "sample.group_size=4",
    "sample.num_steps=4",
    "sample.eval_num_steps=4",
    "sample.rollout_batch_size=4",  # 2 chunks per rank-step: exercises chunking
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=2",
    "update.micro_batch_size=4",
    "trainer.eval_every=2",
    "trainer.save_every=2",
    "trainer.keep_last=2",
    "run.progress_bar=false",
]
CONTRACT_KEYS = {"step", "reward_mean", "samples", "time/step_s", "time/rollout_s"}
CONTRACT_KEYS |= {"time/reward_s", "time/train_s", "images_per_s", "zero_std_ratio"}
CONTRACT_KEYS |= {"reward/digits_mean", "train/loss", "train/approx_kl", "train/grad_norm"}
EVAL_KEYS = {"eval/reward_mean", "eval/digits_mean", "eval/accuracy", "eval/judge_accuracy"}
EVAL_KEYS |= {"eval/diversity"}


def small_cfg(out: Path, *extra: str, command: str = "train"):
    return load_config("toy-digits", [*SMALL, f"run.output_dir={out}", *extra], command=command)


def train(out: Path, *extra: str) -> dict:
    from flowgrpo.trainer.loop import run_training

    return run_training(small_cfg(out, *extra))


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint directory (via a torch.save conversion)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(dst))
    return torch.load(dst, weights_only=False)["model"]


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("two_steps") / "run"
    return out, train(out, "trainer.max_steps=2")


def test_two_step_run_writes_metrics_grids_curve_and_checkpoint(two_steps):
    out, summary = two_steps
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["samples"] for r in rows] == [8, 16]
    for r in rows:
        assert CONTRACT_KEYS <= set(r), CONTRACT_KEYS - set(r)
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["time/step_s"] > 0
        assert r["train/optimizer_steps"] == 1.0
    assert "eval/reward_mean" not in rows[0] and EVAL_KEYS <= set(rows[1])
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2]
    assert summary["base"] == {k: v for k, v in evals[0].items() if k.startswith("eval/")}
    assert summary["final"]["eval/reward_mean"] == pytest.approx(rows[1]["eval/reward_mean"])
    assert summary["steps"] == 2 and summary["samples"] == 16 and summary["resumed_from"] is None

    from PIL import Image

    for name in ("grid_before.png", "grid_after.png"):
        img = Image.open(out / name)  # 4 eval images of 8x8 -> 2x2 cells of 64 px + borders,
        band = (img.size[1] - (2 * 64 + 6)) // 4  # + a prompt band and a reward band a row
        assert img.size[0] == 2 * 64 + 6 and img.size[1] == 2 * 64 + 6 + 4 * band > 134, img.size
    assert Image.open(out / "reward_curve.png").size[0] >= 400
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step_2"]
    assert (out / "checkpoints" / "step_2" / "COMPLETE").is_file()
    state = json.loads((out / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["samples"] == 16 and state["sampler"]["seed"] == 0
    assert any((out / "tensorboard").iterdir())


def test_resume_matches_straight_run(two_steps, tmp_path):
    """4 steps straight == 2 steps (the fixture), resume=auto, 2 more: metrics and weights.
    The second half and the straight run score rewards asynchronously, the fixture does not."""
    first, _ = two_steps
    resumed = tmp_path / "resumed"
    shutil.copytree(first, resumed)
    more = ("trainer.max_steps=4", "advantage.async_reward=true")  # async == sync scoring
    summary = train(resumed, *more, "trainer.resume=auto")
    assert summary["resumed_from"].endswith("step_2")
    straight = tmp_path / "straight"
    train(straight, *more)

    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    assert [deterministic_view(r) for r in a] == [deterministic_view(r) for r in b]
    assert read_jsonl(straight / "eval.jsonl") == read_jsonl(resumed / "eval.jsonl")
    wa, wb = weights(straight / "checkpoints/step_4"), weights(resumed / "checkpoints/step_4")
    assert wa.keys() == wb.keys() and len(wa) > 10
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    w2 = weights(resumed / "checkpoints/step_2")  # training moved the weights: test can fail
    assert any(not torch.equal(w2[k], wb[k]) for k in wb)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **extra)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if k not in extra:
            env.pop(k, None)
    return env


def _args(out: Path, *extra: str) -> list[str]:
    return ["train", "toy-digits", *SMALL, f"run.output_dir={out}", *extra]


def _cli(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "flowgrpo", *_args(out, *extra)]


def _two_ranks(out: Path, *extra: str, timeout: float = 300) -> list[str]:
    """`flowgrpo train` as 2 gloo ranks (plain env vars, one CLI process each); both must
    succeed. Returns their logs."""
    procs = start_cli_ranks(_args(out, *extra), merged=True)
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    return logs


def test_two_ranks_match_one_process(two_steps, tmp_path):
    """2 gloo ranks (plain env vars, one CLI process each) reproduce the 1-process run: the
    rollout noise is per global sample and the engine's update is rank-count invariant."""
    single, _ = two_steps
    out = tmp_path / "ddp"
    logs = _two_ranks(out, "trainer.max_steps=2", timeout=240)
    rows, ref = read_jsonl(out / "metrics.jsonl"), read_jsonl(single / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and [r["samples"] for r in rows] == [8, 16]
    for r, s in zip(rows, ref):
        for k in ("reward_mean", "reward/digits_std", "zero_std_ratio", "train/grad_norm"):
            assert r[k] == pytest.approx(s[k], rel=1e-4, abs=1e-6), k
    for k in EVAL_KEYS:
        assert rows[1][k] == pytest.approx(ref[1][k], rel=1e-4, abs=1e-6), k
    assert "eval/accuracy" in logs[0] and "eval/accuracy" not in logs[1]  # rank 0 prints
    assert (out / "checkpoints/step_2/COMPLETE").is_file()
    assert sorted(p.name for p in (out / "checkpoints/step_2/rng").iterdir()) == [
        "rank_0.pt",
        "rank_1.pt",
    ]


# kill -9 and resume: tests/trainer/test_fault_injection.py (at four points of a run, bit
# exact against a straight run, no step duplicated or missing)


def test_eval_and_sample_from_checkpoint_reproduce_the_run(two_steps, tmp_path):
    from PIL import Image

    from flowgrpo.trainer.commands import run_eval, run_sample

    out, summary = two_steps
    cfg = small_cfg(tmp_path / "unused")
    assert run_eval(cfg, out) == summary["final"]  # run dir -> its newest checkpoint
    assert run_eval(cfg, None) == summary["base"]
    paths = run_sample(cfg, out / "checkpoints/step_2", ["a handwritten 3", "7"], tmp_path / "s")
    assert [p.name for p in paths] == ["sample_0000.png", "sample_0001.png"]
    assert Image.open(paths[0]).size == (64, 64)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        run_eval(cfg, tmp_path / "nope")


def test_full_fine_tune_exports_the_whole_transformer(two_steps, tmp_path):
    """A full fine-tune has no LoRA: a clear error, and --full writes save_pretrained weights
    that reproduce the checkpoint's transformer."""
    from diffusers import SD3Transformer2DModel

    from flowgrpo.trainer.commands import run_export_lora

    out, _ = two_steps
    cfg = small_cfg(tmp_path / "unused")
    with pytest.raises(ValueError, match="full fine-tune .* add --full"):
        run_export_lora(cfg, out, tmp_path / "lora.safetensors")
    path = run_export_lora(cfg, out, tmp_path / "full", full=True)
    exported = SD3Transformer2DModel.from_pretrained(path).state_dict()
    saved = weights(out / "checkpoints" / "step_2")
    assert set(exported) == set(saved)
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)


def test_lora_run_exports_a_diffusers_loadable_lora(tmp_path):
    from flowgrpo.rollout import sample_trajectories
    from flowgrpo.toy import ToyAdapter, toy_pipeline
    from flowgrpo.trainer.commands import run_export_lora, run_sample
    from flowgrpo.trainer.seeds import SAMPLE_SALT, generators

    lora = [
        "lora.enabled=true",
        "lora.rank=4",
        "lora.alpha=8",
        "optim.lr=3e-2",
        "flow_grpo.kl_beta=0",
    ]
    out = tmp_path / "lora"
    train(out, "trainer.max_steps=1", *lora)
    cfg = small_cfg(out, *lora, command="export")
    file = run_export_lora(cfg, out, tmp_path / "export")
    assert file.name == "pytorch_lora_weights.safetensors" and file.is_file()
    # load it as diffusers' SD3 pipelines do (the file's adapter metadata carries lora_alpha)
    from diffusers.loaders.lora_pipeline import SD3LoraLoaderMixin

    state, meta = SD3LoraLoaderMixin.lora_state_dict(str(file), return_lora_metadata=True)
    assert meta["transformer.lora_alpha"] == 8
    pipe = toy_pipeline(pretrained=False, seed=cfg.seed)
    pipe.transformer.load_lora_adapter(state, prefix="transformer", metadata=meta)
    gens = generators(cfg.seed, SAMPLE_SALT, [0], "cpu")
    mine = sample_trajectories(
        ToyAdapter(pipe),
        ["a handwritten 3"],
        num_steps=4,
        guidance_scale=1.0,
        noise_level=0.0,
        height=8,
        width=8,
        generator=gens,
    ).images
    ours = run_sample(cfg, out, ["a handwritten 3"], tmp_path / "s")
    from PIL import Image

    ref = np.asarray(Image.open(ours[0]))[::8, ::8, 0].astype(np.float32) / 255
    assert np.abs(ref - mine[0, 0].numpy()).max() <= 1 / 255 + 1e-6
    base = sample_trajectories(
        ToyAdapter(toy_pipeline(pretrained=False, seed=cfg.seed)),
        ["a handwritten 3"],
        num_steps=4,
        guidance_scale=1.0,
        noise_level=0.0,
        height=8,
        width=8,
        generator=generators(cfg.seed, SAMPLE_SALT, [0], "cpu"),
    ).images
    assert (base - mine).abs().max() > 1e-3  # the LoRA changed the model


def test_gpu_preset_features_on_the_toy(tmp_path):
    """LoRA + EMA + CFG + SDE window + 2 minibatches + advantage aggregation, as the real
    presets use them; eval and checkpoints use the EMA weights."""
    from flowgrpo.trainer.commands import run_eval

    feats = [
        *("lora.enabled=true", "lora.rank=4", "lora.alpha=8", "optim.lr=1e-2"),
        *("ema.enabled=true", "ema.update_every=1", "sample.guidance_scale=2.0"),
        *("sample.window_size=2", "sample.window_hi=3", "update.num_minibatches=2"),
        "advantage.mode=advantage",
    ]
    out = tmp_path / "feats"
    summary = train(out, "trainer.max_steps=2", *feats)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["train/optimizer_steps"] for r in rows] == [2.0, 2.0]
    assert all(r["train/skipped"] == 0 for r in rows)
    assert run_eval(small_cfg(out, *feats, command="eval"), out) == summary["final"]
    with pytest.warns(UserWarning, match="EMA is off"):
        live = run_eval(small_cfg(out, *feats, "ema.enabled=false", command="eval"), out)
    assert live["eval/reward_mean"] != summary["final"]["eval/reward_mean"]


def test_sequence_parallel_run_matches_one_process_and_resumes_across_sp(two_steps, tmp_path):
    """`flowgrpo train fsdp.sp_degree=2` on 2 processes (one SP group: both ranks hold every
    sample, only the first scores) reproduces the 1-process run; a checkpoint written under
    sp = 2 resumes on 1 process without SP to the same result."""
    single, _ = two_steps
    out = tmp_path / "sp"
    _two_ranks(out, "trainer.max_steps=2", "fsdp.sp_degree=2")
    rows, ref = read_jsonl(out / "metrics.jsonl"), read_jsonl(single / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r, s in zip(rows, ref):
        for k in ("reward_mean", "zero_std_ratio", "train/grad_norm", "train/loss", "train/kl"):
            assert r[k] == pytest.approx(s[k], rel=1e-4, abs=1e-6), k
        assert r["train/samples_trained"] == s["train/samples_trained"]
    for k in EVAL_KEYS:
        assert rows[1][k] == pytest.approx(ref[1][k], rel=1e-4, abs=1e-6), k
    # resume: 1 step under sp = 2, then the second step on 1 process
    half = tmp_path / "sp_then_one"
    _two_ranks(half, "trainer.max_steps=1", "fsdp.sp_degree=2")
    res = subprocess.run(
        _cli(half, "trainer.max_steps=2", "trainer.resume=auto"),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = read_jsonl(half / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [1, 2]
    for k in ("reward_mean", "train/grad_norm", "train/loss"):
        assert resumed[1][k] == pytest.approx(ref[1][k], rel=1e-4, abs=1e-6), k
