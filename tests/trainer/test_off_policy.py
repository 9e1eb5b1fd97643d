"""``trainer.off_policy_steps=1``: step t + 1's rollout sampled by the weights before update t.
The schedule by hand on a one-parameter engine; the config's refusals; toy runs: staleness
logged, the ratio off 1 at staleness 1 (and exactly 1 on-policy), step 2's rollout made by the
initial weights, a bit-exact resume, and 2 ranks = 1 process."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.engine.ema import ParamShadow
from flowgrpo.settings import ConfigError
from flowgrpo.testing.models import random_toy_path
from flowgrpo.trainer.logging import deterministic_view, read_jsonl
from flowgrpo.trainer.off_policy import SHADOW, OffPolicy

# -- the schedule, by hand -------------------------------------------------------------------


class OneParamEngine:
    """The engine's shadow API over one trainable scalar."""

    def __init__(self) -> None:
        self.params = [torch.nn.Parameter(torch.zeros(()))]
        self.shadows: dict[str, ParamShadow] = {}

    def shadow(self, name: str) -> ParamShadow:
        return self.shadows.setdefault(name, ParamShadow(self.params))

    def update(self) -> None:  # one optimizer step: w <- w + 1
        with torch.no_grad():
            self.params[0] += 1


def run_steps(engine: OneParamEngine, off: OffPolicy, first: int, last: int) -> list[tuple]:
    """Steps first..last of the loop's order: take, prefetch, update. Each 'rollout' records
    the weight that sampled it."""

    def sample(run, step):
        return {"step": step, "w": float(run.weight().detach())}, None, 0.0

    run = SimpleNamespace(
        algorithm=SimpleNamespace(rollout_weights=contextlib.nullcontext),
        weight=lambda: engine.params[0],
    )
    out = []
    for step in range(first, last + 1):
        got = off.take(step, run, sample)
        out.append((step, got.trajectory["w"], got.staleness))
        off.prefetch(step, last, run, sample)
        engine.update()
        off.join()
    return out


def test_the_schedule_samples_with_the_weights_before_the_previous_update():
    """W_t = t after update t. On-policy step t samples W_{t-1}; off-policy step 1 samples W_0
    (staleness 0), step t > 1 samples W_{t-2} (staleness 1)."""
    on = OneParamEngine()
    assert run_steps(on, OffPolicy(on, 0), 1, 4) == [(1, 0, 0), (2, 1, 0), (3, 2, 0), (4, 3, 0)]
    assert not on.shadows  # on-policy keeps no copy
    off = OneParamEngine()
    assert run_steps(off, OffPolicy(off, 1), 1, 4) == [(1, 0, 0), (2, 0, 1), (3, 1, 1), (4, 2, 1)]


class OneParamCopy:
    """``PolicyCopy``'s API over a second scalar: the overlapped rollout samples with it."""

    def __init__(self) -> None:
        self.param = torch.zeros(())

    def load(self, values: list[torch.Tensor]) -> None:
        self.param.copy_(values[0])

    def view(self, run):
        return SimpleNamespace(algorithm=run.algorithm, weight=lambda: self.param)


def test_the_overlapped_schedule_samples_what_the_sequential_one_does():
    """The thread samples with the copy, loaded with the pre-update weights: the same
    (step, weight, staleness) rows while the live weight moves on."""
    eng = OneParamEngine()
    rows = run_steps(eng, OffPolicy(eng, 1, OneParamCopy()), 1, 4)
    assert rows == [(1, 0, 0), (2, 0, 1), (3, 1, 1), (4, 2, 1)]


def test_a_resume_samples_with_the_saved_behaviour_policy():
    """A run stopped after step 2 (its checkpoint: W_2 and the shadow W_1) and resumed samples
    step 3 with W_1 as the straight run did; the shadow is also kept at the last step."""
    eng = OneParamEngine()
    off = OffPolicy(eng, 1)
    run_steps(eng, off, 1, 2)  # max_steps 2: the last step keeps the copy, samples nothing
    assert off.pending is None and float(eng.shadows[SHADOW].shadow[0]) == 1.0
    resumed = OneParamEngine()
    r_off = OffPolicy(resumed, 1)
    resumed.shadows[SHADOW].load_state_dict({"w": eng.shadows[SHADOW].shadow[0]}, ["w"])
    with torch.no_grad():
        resumed.params[0].copy_(eng.params[0])
    assert run_steps(resumed, r_off, 3, 4) == [(3, 1, 1), (4, 2, 1)]
    assert float(resumed.params[0].detach()) == 4.0  # the live weights came back after the swap


def test_off_policy_steps_other_than_0_or_1_are_refused_by_the_class():
    with pytest.raises(ValueError, match="0 or 1"):
        OffPolicy(OneParamEngine(), 2)


# -- the config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["trainer.off_policy_steps=2"], ["trainer.off_policy_steps", "one of 0, 1", "2"]),
        (["trainer.off_policy_steps=-1"], ["trainer.off_policy_steps", "one of 0, 1"]),
        (
            ["trainer.off_policy_steps=1", "algorithm=awm"],
            ["trainer.off_policy_steps", "algorithm=awm", "on-policy"],
        ),
        (
            ["trainer.off_policy_steps=1", "sample.refill_rounds=1"],
            ["trainer.off_policy_steps", "sample.refill_rounds"],
        ),
        (["trainer.off_policy_overlap=true"], ["trainer.off_policy_overlap", "off_policy_steps=0"]),
        (
            [
                "trainer.off_policy_steps=1",
                "trainer.off_policy_overlap=true",
                "algorithm=dpo",
                "lora.enabled=true",
            ],
            ["trainer.off_policy_overlap", "algorithm=dpo"],
        ),
    ],
)
def test_config_refuses_what_off_policy_cannot_serve(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config("toy-digits", overrides, check_paths=False)
    line = str(e.value)
    assert "\n" not in line and all(w in line for w in words), line


def test_the_overlap_is_refused_with_more_than_one_process():
    from flowgrpo.config.checks import check_world

    over = ["trainer.off_policy_steps=1", "trainer.off_policy_overlap=true"]
    cfg = load_config("toy-digits", over, check_paths=False)
    check_world(cfg, 1)
    with pytest.raises(ConfigError, match=r"'trainer.off_policy_overlap' must be false with w"):
        check_world(cfg, 2)


@pytest.mark.parametrize("algorithm", ["flow_grpo", "mix_grpo", "grpo_guard", "flow_dppo", "nft"])
def test_config_takes_off_policy_for_ratio_and_ratio_free_algorithms(algorithm):
    cfg = load_config(
        "toy-digits",
        ["trainer.off_policy_steps=1", f"algorithm={algorithm}"],
        check_paths=False,
    )
    assert cfg.trainer.off_policy_steps == 1


# -- toy runs --------------------------------------------------------------------------------

SMALL = [
    f"model.path={random_toy_path()}",
    "sample.prompts_per_step=2",
    "sample.group_size=4",
    "sample.num_steps=4",
    "sample.eval_num_steps=4",
    "sample.rollout_batch_size=8",
    "data.eval_num_prompts=2",
    "data.eval_samples_per_prompt=1",
    "update.micro_batch_size=8",
    "trainer.eval_every=0",
    "trainer.save_every=2",
    "run.progress_bar=false",
    "run.tensorboard=false",
]


def _args(out: Path, *extra: str) -> list[str]:
    return [*SMALL, f"run.output_dir={out}", *extra]


def train(out: Path, *extra: str) -> dict:
    from flowgrpo.trainer.loop import run_training

    return run_training(load_config("toy-digits", _args(out, *extra), command="train"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: run folder}: on-policy, off-policy (3 steps each) and on-policy at lr 1e-30."""
    root = tmp_path_factory.mktemp("off_policy")
    out = {}
    for name, extra in {
        "on": [],
        "off": ["trainer.off_policy_steps=1"],
        "lr0": ["optim.lr=1e-30"],  # the weights stay (all but exactly) put
    }.items():
        out[name] = root / name
        train(out[name], "trainer.max_steps=3", *extra)
    return out


@pytest.mark.slow  # trains end to end
def test_staleness_and_the_ratio_at_staleness_1(runs):
    """Off-policy: staleness 0, 1, 1; step 1 equals the on-policy run's; from step 2 the
    ratio is off 1 (the samples are one update old). On-policy (one optimizer step per
    rollout): the ratio is exactly 1 at every step."""
    on, off = read_jsonl(runs["on"] / "metrics.jsonl"), read_jsonl(runs["off"] / "metrics.jsonl")
    assert [r["train/staleness"] for r in off] == [0.0, 1.0, 1.0]
    assert [r["train/staleness"] for r in on] == [0.0, 0.0, 0.0]
    assert deterministic_view(on[0]) == deterministic_view(off[0])
    for r in on:
        assert r["train/ratio_mean"] == 1.0 and r["train/approx_kl_k2"] == 0.0
    for r in off[1:]:
        assert r["train/approx_kl_k2"] > 0 and r["train/ratio_mean"] != 1.0
        assert r["train/clipfrac"] > 0  # the toy's clip (1e-4) bites one update later


@pytest.mark.slow  # trains end to end
def test_the_overlapped_schedule_is_the_sequential_one(runs, tmp_path):
    """``trainer.off_policy_overlap``: the next rollout sampled in a thread on a copy of the
    model gives the sequential schedule's metrics bit for bit (and its rollout times)."""
    out = tmp_path / "overlap"
    train(
        out, "trainer.max_steps=3", "trainer.off_policy_steps=1", "trainer.off_policy_overlap=true"
    )
    a, b = read_jsonl(runs["off"] / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    assert [deterministic_view(r) for r in a] == [deterministic_view(r) for r in b]
    assert ["time/overlapped_rollout_s" in r for r in b] == [True, True, False]
    wa = _weights(runs["off"] / "checkpoints" / "step_3")["model"]
    wb = _weights(out / "checkpoints" / "step_3")["model"]
    assert all(torch.equal(v, wb[k]) for k, v in wa.items())


@pytest.mark.slow  # trains end to end
def test_step_2_is_sampled_by_the_initial_weights(runs):
    """Off-policy step 2's rollout (its rewards) is the one a run that does not move its
    weights (lr 1e-30: the optimizer is positive-only) makes at step 2, and not the on-policy
    run's (sampled after update 1)."""
    on, off = read_jsonl(runs["on"] / "metrics.jsonl"), read_jsonl(runs["off"] / "metrics.jsonl")
    lr0 = read_jsonl(runs["lr0"] / "metrics.jsonl")
    for k in ("reward_mean", "reward/digits_std"):
        assert off[1][k] == pytest.approx(lr0[1][k], rel=1e-6, abs=1e-9), k
    assert abs(off[1]["reward_mean"] - on[1]["reward_mean"]) > 1e-4


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dst = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(str(ckpt), str(dst))
    return torch.load(dst, weights_only=False)


@pytest.mark.slow  # trains end to end
def test_resume_is_bit_exact(runs, tmp_path):
    """The off-policy run's checkpoint at step 2 (weights W_2, the behaviour copy W_1),
    resume=auto, step 3: the metrics and the weights equal the straight run's bit for bit."""
    straight = runs["off"]
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_3")
    lines = (straight / "metrics.jsonl").read_text().splitlines(True)[:2]
    (resumed / "metrics.jsonl").write_text("".join(lines))
    summary = train(resumed, "trainer.max_steps=3", "trainer.off_policy_steps=1", "resume=auto")
    assert summary["resumed_from"].endswith("step_2")
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3]
    assert [deterministic_view(r) for r in a] == [deterministic_view(r) for r in b]
    wa = _weights(straight / "checkpoints" / "step_3")
    wb = _weights(resumed / "checkpoints" / "step_3")
    assert f"shadow.{SHADOW}" in wa
    for section in ("model", f"shadow.{SHADOW}"):
        for k, v in wa[section].items():
            assert torch.equal(v, wb[section][k]), (section, k)


@pytest.mark.slow  # 2 gloo ranks, end to end
def test_two_ranks_match_one_process(runs, tmp_path):
    """2 gloo ranks (one CLI process each) reproduce the 1-process off-policy run: the
    behaviour copy is sharded like the params, each rank samples its share."""
    from flowgrpo.testing.ranks import start_cli_ranks

    out = tmp_path / "ranks"
    args = ["train", "toy-digits", *_args(out, "trainer.max_steps=3", "trainer.off_policy_steps=1")]
    procs = start_cli_ranks(args, merged=True)
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    rows, ref = read_jsonl(out / "metrics.jsonl"), read_jsonl(runs["off"] / "metrics.jsonl")
    assert [r["train/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    for r, s in zip(rows, ref, strict=True):
        for k in ("reward_mean", "reward/digits_std", "train/grad_norm", "train/approx_kl_k2"):
            assert r[k] == pytest.approx(s[k], rel=1e-4, abs=1e-6), k


@pytest.mark.slow  # trains end to end
@pytest.mark.parametrize(
    "extra",
    [
        ["algorithm=nft"],  # its old policy samples: the behaviour copy is the old one's
        ["algorithm=dpo"],  # the reference samples (full fine-tune: swapped in)
        ["ema.enabled=true", "sample.use_ema_for_rollout=true"],  # the EMA samples
    ],
    ids=["nft", "dpo", "ema_rollouts"],
)
def test_resume_is_bit_exact_whichever_weights_sample(extra, tmp_path):
    """The behaviour copy is what ``rollout_weights`` put in the model: a resume after step 2
    samples step 3 as the straight run did, for the old policy, the reference and the EMA."""
    common = ["trainer.max_steps=3", "trainer.off_policy_steps=1", *extra]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, *common)
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_3")
    lines = (straight / "metrics.jsonl").read_text().splitlines(True)[:2]
    (resumed / "metrics.jsonl").write_text("".join(lines))
    assert train(resumed, *common, "resume=auto")["resumed_from"].endswith("step_2")
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [r["train/staleness"] for r in b] == [0.0, 1.0, 1.0]
    assert [deterministic_view(r) for r in a] == [deterministic_view(r) for r in b]
