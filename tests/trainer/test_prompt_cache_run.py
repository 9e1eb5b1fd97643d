"""A toy run with the prompt-embedding cache and the text encoder freed gives the same metrics
as the run without (the toy's encoder embeds each prompt alone, so the cache is exact here),
fills the cache once, and a second run reads it without encoding."""

from __future__ import annotations

import pytest

from flowgrpo.config import load_config
from flowgrpo.testing.models import random_toy_path
from flowgrpo.trainer.logging import deterministic_view, read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SMALL = [
    f"model.path={random_toy_path()}",
    "sample.prompts_per_step=2",
    "sample.group_size=4",
    "sample.num_steps=4",
    "sample.eval_num_steps=4",
    "sample.rollout_batch_size=4",
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=2",
    "update.micro_batch_size=4",
    "trainer.eval_every=2",
    "trainer.save_every=0",
    "trainer.max_steps=2",
    "run.progress_bar=false",
]


def test_cached_run_equals_uncached_and_frees_the_encoder(tmp_path, monkeypatch):
    from flowgrpo.trainer import loop, setup

    plain, cached = tmp_path / "plain", tmp_path / "cached"
    loop.run_training(load_config("toy-digits", [*SMALL, f"run.output_dir={plain}"]))
    cache = tmp_path / "cache"
    extra = [f"model.embed_cache_dir={cache}", "model.text_encoder_offload=free"]
    seen = {}
    real_prepare = setup.prepare_prompt_cache

    def spy(cfg, adapter, dist, sets):
        real_prepare(cfg, adapter, dist, sets)
        seen["cache"], seen["pipe"] = adapter.prompt_cache, adapter.pipe

    monkeypatch.setattr(setup, "prepare_prompt_cache", spy)
    loop.run_training(load_config("toy-digits", [*SMALL, f"run.output_dir={cached}", *extra]))
    first = seen["cache"]
    assert seen["pipe"].text_encoder is None  # freed once every prompt was cached
    assert first.misses > 0 and first.hits > 0
    again = tmp_path / "again"
    loop.run_training(load_config("toy-digits", [*SMALL, f"run.output_dir={again}", *extra]))
    assert seen["cache"].misses == 0  # the second run encodes nothing
    # `flowgrpo sample` prompts are cached before the text encoder is freed
    out = tmp_path / "sample-run"
    cfg = load_config("toy-digits", [*SMALL, f"run.output_dir={out}", *extra], command="sample")
    files = loop.run_sample(cfg, None, ["the digit seven"], tmp_path / "samples")
    assert len(files) == 1 and seen["pipe"].text_encoder is None
    a, b = read_jsonl(plain / "metrics.jsonl"), read_jsonl(cached / "metrics.jsonl")
    assert [deterministic_view(r) for r in a] == [deterministic_view(r) for r in b]
    assert read_jsonl(plain / "eval.jsonl") == read_jsonl(cached / "eval.jsonl")
