"""vlm_judge against a real ``vllm serve`` on this CPU: a tiny random Qwen2-VL saved offline,
served from the Makefile's vLLM venv (``make vllm-venv``; ``make test`` builds it in the
background). Its yes-probabilities equal the same weights' run directly with transformers,
and the toy trains against it. Without the venv the tests fail with one line saying why."""

from __future__ import annotations

import json
import time

import pytest
import torch

from flowgrpo.rewards import build_reward
from flowgrpo.testing.vlm import (
    IMAGE_SIDE,
    VllmServer,
    reference_yes_probability,
    save_tiny_vl_judge,
    wait_for_vllm_venv,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    """(server, model folder): one server for the module."""
    try:
        python = wait_for_vllm_venv()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    folder = save_tiny_vl_judge(tmp_path_factory.mktemp("judge") / "model")
    server = VllmServer(python, folder, tmp_path_factory.mktemp("vllm") / "serve.log")
    print(f"vllm serve started in {server.start_s:.1f}s")
    try:
        yield server, folder
    finally:
        server.stop()


def test_yes_probabilities_equal_the_models_own_computed_by_transformers(vllm):
    server, folder = vllm
    g = torch.Generator().manual_seed(0)
    images = torch.rand(6, 3, IMAGE_SIDE, IMAGE_SIDE, generator=g)
    images[1], images[2] = 0.0, 1.0  # black, white
    prompts = ["a cat", "a red dog on grass", "two cups", "text", "a house", "the sky"]
    # every token's log-prob: "Yes" is always listed (more than the vocabulary crashes
    # vLLM 0.32's engine: torch.topk "selected index k out of range")
    vocab = _vocab_size(folder)
    judge = build_reward("vlm_judge", url=server.url, top_logprobs=vocab, concurrency=3)
    t0 = time.monotonic()
    scores = judge(images, prompts, [{} for _ in prompts])
    took = time.monotonic() - t0
    questions = [f'Does this figure show "{p}"? Please answer yes or no.' for p in prompts]
    ref = reference_yes_probability(folder, images, questions)
    diff = max(abs(a - b) for a, b in zip(scores, ref, strict=True))
    print(f"6 images in {took:.2f}s; yes-probabilities {[round(s, 4) for s in scores]}")
    assert diff <= 1e-3, (scores, ref)
    assert max(ref) > 0.3 and max(ref) - min(ref) > 0.3  # large and varied: the check can fail


def test_a_generated_answer_goes_through_the_number_rule_and_its_policy(vllm):
    """The random judge writes text, never a "Score: N" line: each sample is named, or scores
    the fallback. A prompt past the server's context is its one-line 400."""
    server, _ = vllm
    images = torch.rand(2, 3, IMAGE_SIDE, IMAGE_SIDE, generator=torch.Generator().manual_seed(1))
    prompts, meta = ["a cat", "a dog"], [{}, {}]
    opts = dict(url=server.url, template="Rate {prompt} from 1 to 5.", score="number")
    opts.update(pattern=r"Score:\s*(\d)", scale=[1, 5], max_tokens=8)
    with pytest.raises(
        RuntimeError, match=r"could not score 2 of 2 sample\(s\) \(sample 0: no score"
    ):
        build_reward("vlm_judge", **opts)(images, prompts, meta)
    assert build_reward("vlm_judge", fallback=0.0, **opts)(images, prompts, meta) == [0.0, 0.0]
    long = build_reward("vlm_judge", url=server.url, template="unifiedreward")  # > 256 tokens
    with pytest.raises(RuntimeError, match=r"rejected the request of sample \d: HTTP 400") as e:
        long(images, prompts, meta)
    assert "\n" not in str(e.value)


def test_the_toy_trains_two_steps_against_the_judge(vllm, tmp_path, one_thread):
    from flowgrpo.config import load_config
    from flowgrpo.testing.models import random_toy_path
    from flowgrpo.trainer.logging import read_jsonl
    from flowgrpo.trainer.loop import run_training

    server, folder = vllm
    overrides = [
        f"model.path={random_toy_path()}",
        "sample.prompts_per_step=2",
        "sample.group_size=2",
        "sample.num_steps=2",
        "sample.eval_num_steps=2",
        "data.eval_num_prompts=1",
        "data.eval_samples_per_prompt=2",
        "update.micro_batch_size=4",
        "trainer.max_steps=2",
        "trainer.eval_every=0",
        "trainer.save_every=2",
        "run.progress_bar=false",
        "reward=vlm_judge",
        f"reward.vlm_judge.options.url={server.url}",
        f"reward.vlm_judge.options.top_logprobs={_vocab_size(folder)}",
        "reward.vlm_judge.options.timeout=60",
        f"run.output_dir={tmp_path / 'run'}",
    ]
    run_training(load_config("toy-digits", overrides))
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2]
    means = [r["reward/vlm_judge_mean"] for r in rows]
    assert all(0.0 <= m <= 1.0 for m in means) and any(m > 0 for m in means), rows
    assert (tmp_path / "run" / "checkpoints" / "step_2").is_dir()


def _vocab_size(folder) -> int:
    return json.loads((folder / "config.json").read_text())["text_config"]["vocab_size"]
