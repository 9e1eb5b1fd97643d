"""The in-process GenEval reward trains the tiny SD3 pipeline with the sd3-geneval preset
(shrunk) on flow_grpo's geneval records: 2 steps, the reward logged under its name."""

from __future__ import annotations

import pytest

from flowgrpo.testing.geneval import FLOW_GRPO_RECORDS, save_tiny_clip, save_tiny_owlv2

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # ~30 s in process


def test_geneval_reward_trains_the_tiny_pipeline_two_steps(tmp_path):
    from flowgrpo.config import load_config
    from flowgrpo.testing.tiny import tiny_pipeline
    from flowgrpo.trainer.logging import read_jsonl
    from flowgrpo.trainer.loop import run_training

    tiny_pipeline("sd3").save_pretrained(tmp_path / "model")
    prompts = tmp_path / "train_metadata.jsonl"
    prompts.write_text(FLOW_GRPO_RECORDS)
    owl, clip = save_tiny_owlv2(tmp_path / "owl"), save_tiny_clip(tmp_path / "clip")
    cfg = load_config(
        "sd3-geneval",
        [
            f"model.path={tmp_path / 'model'}", f"data.train_prompts={prompts}",
            "reward=geneval", f"reward.geneval.options.path={owl}",
            f"reward.geneval.options.clip_path={clip}",
            "reward.geneval.options.threshold=0.0", "reward.geneval.options.counting_threshold=0.0",
            "model.height=64", "model.width=64", "model.dtype=fp32", "model.max_sequence_length=16",
            "sample.num_steps=3", "sample.eval_num_steps=2", "sample.prompts_per_step=2",
            "sample.group_size=2", "sample.rollout_batch_size=4", "update.micro_batch_size=2",
            "lora.rank=4", "lora.alpha=8", "fsdp.activation_checkpointing=false",
            "data.eval_num_prompts=1", "trainer.max_steps=2", "trainer.eval_every=2",
            "trainer.save_every=0", "ema.enabled=false", "run.progress_bar=false",
            f"run.output_dir={tmp_path / 'run'}",
        ],
    )  # fmt: skip
    assert [(r.name, r.options["path"]) for r in cfg.reward] == [("geneval", owl)]
    run_training(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # partial credit: 1 - |count - found| / count terms, <= 1, may be < 0
        assert r["reward/geneval_mean"] == r["reward_mean"] <= 1.0 and r["time/reward_s"] > 0
        assert r["train/grad_norm"] >= 0
    assert "eval/reward_mean" in rows[1]
