"""Registry, MultiReward validation, combination and async scoring (no heavy models)."""

import threading
import time

import pytest
import torch

from flowgrpo.functional.advantages import combine_rewards
from flowgrpo.rewards import (
    AsyncRewardScorer,
    MultiReward,
    RewardSpec,
    build_reward,
    parse_reward_specs,
    register_reward,
    registered_rewards,
)
from flowgrpo.rewards import base as rbase


def _batch(b=4, c=3, hw=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.rand(b, c, hw, hw, generator=g),
        [f"p{i}" for i in range(b)],
        [{} for _ in range(b)],
    )


def mean_brightness(images, prompts, metadata, scale=1.0):
    return images.mean(dim=(1, 2, 3)) * scale


@pytest.fixture
def registry(monkeypatch):
    """Isolate registry mutations of a test."""
    monkeypatch.setattr(rbase, "_REGISTRY", dict(rbase._REGISTRY))
    return rbase._REGISTRY


def test_builtin_names_registered():
    names = registered_rewards()
    for n in ["ocr", "jpeg_compressibility", "jpeg_incompressibility", "digits", "clip_score"]:
        assert n in names
    assert {"pickscore", "remote", "hpsv2", "image_reward", "aesthetic"} <= set(names)
    # lazy: registering digits must not import it
    assert isinstance(rbase._REGISTRY["digits"], str)


def test_build_by_name_import_path_and_options(registry):
    images, prompts, meta = _batch()
    fn = build_reward("jpeg_compressibility")
    assert fn(images, prompts, meta).shape == (4,)
    path_fn = build_reward(f"{__name__}:mean_brightness", scale=2.0)
    torch.testing.assert_close(
        torch.as_tensor(path_fn(images, prompts, meta)), images.mean(dim=(1, 2, 3)) * 2.0
    )
    with pytest.raises(
        ValueError, match=r"unknown option\(s\) \['bogus'\]; it accepts \['scale'\]"
    ):
        build_reward(f"{__name__}:mean_brightness", bogus=1)
    with pytest.raises(ValueError, match="no attribute 'nope'"):
        build_reward(f"{__name__}:nope")

    @register_reward("brightness_test")
    class Bright:
        def __init__(self, offset: float = 0.0):
            self.offset = offset

        def __call__(self, images, prompts, metadata):
            return [float(x) + self.offset for x in images.mean(dim=(1, 2, 3))]

    r = build_reward("brightness_test", offset=1.0)
    assert isinstance(r, Bright) and r.offset == 1.0


def test_unknown_name_lists_and_suggests():
    with pytest.raises(ValueError) as e:
        build_reward("jpeg_compresibility")
    msg = str(e.value)
    assert "'jpeg_compresibility'" in msg and "did you mean 'jpeg_compressibility'" in msg
    assert "ocr" in msg and "digits" in msg and "package.module:function" in msg


def test_parse_specs():
    specs = parse_reward_specs({"ocr": 1.0, "jpeg_compressibility": 0.5})
    assert [(s.name, s.weight) for s in specs] == [("ocr", 1.0), ("jpeg_compressibility", 0.5)]
    specs = parse_reward_specs([{"name": "remote", "weight": 2, "options": {"url": "http://x"}}])
    assert specs[0] == RewardSpec("remote", 2.0, {"url": "http://x"})
    with pytest.raises(ValueError, match="needs a 'name'"):
        parse_reward_specs([{"weight": 1}])


def test_input_validation_names_culprit():
    m = MultiReward([RewardSpec("jpeg_compressibility")])
    images, prompts, meta = _batch(b=2)
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        m(images[0], prompts, meta)
    with pytest.raises(ValueError, match="C in"):
        m(torch.rand(2, 4, 8, 8), prompts, meta)
    with pytest.raises(ValueError, match="float tensor"):
        m((images * 255).to(torch.uint8), prompts, meta)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        m(images * 2 - 0.5, prompts, meta)
    bad = images.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        m(bad, prompts, meta)
    with pytest.raises(ValueError, match="prompts must be a list of 2"):
        m(images, prompts[:1], meta)
    with pytest.raises(ValueError, match="metadata must be a list of 2"):
        m(images, prompts, meta + [{}])


def test_output_validation_names_reward():
    images, prompts, meta = _batch(b=3)
    short = MultiReward.from_functions({"short": lambda i, p, m: [1.0, 2.0]})
    with pytest.raises(ValueError, match=r"reward 'short' returned scores of shape \(2,\)"):
        short(images, prompts, meta)
    nan = MultiReward.from_functions({"nanny": lambda i, p, m: [1.0, float("nan"), 0.0]})
    with pytest.raises(
        ValueError, match=r"reward 'nanny' returned non-finite scores at indices \[1\]"
    ):
        nan(images, prompts, meta)
    huge = MultiReward.from_functions({"huge": lambda i, p, m: [1.0, 1e39, 0.0]})
    with pytest.raises(ValueError, match=r"'huge' returned scores beyond float32's range") as e:
        huge(images, prompts, meta)  # finite, but not in fp32: not "non-finite"
    assert "[1]" in str(e.value)
    from flowgrpo.cli import exit_code

    assert exit_code(e.value) == 1  # a run failure, as docs/training.md says (2: config errors)
    text = MultiReward.from_functions({"texty": lambda i, p, m: ["a", "b", "c"]})
    with pytest.raises(ValueError, match="reward 'texty' returned non-numeric"):
        text(images, prompts, meta)
    boom = MultiReward.from_functions({"boom": lambda i, p, m: 1 / 0})
    with pytest.raises(RuntimeError, match="reward 'boom' failed: ZeroDivisionError"):
        boom(images, prompts, meta)


def test_multi_reward_outputs_dicts_and_weights(registry):
    register_reward("two_keys")(lambda i, p, m: {"acc": [1.0, 0.0], "extra": torch.tensor([5, 6])})
    m = MultiReward(
        [
            RewardSpec("jpeg_compressibility", weight=0.5),
            RewardSpec("two_keys", weight=2.0, key_weights={"acc": 1.0}),
        ]
    )
    images, prompts, meta = _batch(b=2)
    out = m(images, prompts, meta)
    assert list(out) == ["jpeg_compressibility", "two_keys/acc", "two_keys/extra"]
    assert all(v.dtype == torch.float32 and v.shape == (2,) for v in out.values())
    torch.testing.assert_close(out["two_keys/extra"], torch.tensor([5.0, 6.0]))
    assert m.weights_of(out) == {
        "jpeg_compressibility": 0.5,
        "two_keys/acc": 2.0,
        "two_keys/extra": 0.0,
    }


def test_combination_hand_computed():
    a = torch.tensor([1.0, 2.0, 3.0, 4.0])
    b = torch.tensor([0.0, 1.0, 1.0, 1.0])
    m = MultiReward.from_functions(
        {"a": lambda i, p, md: a, "b": lambda i, p, md: b}, weights={"a": 1.0, "b": 2.0}
    )
    images, prompts, meta = _batch(b=4)
    rewards = m(images, prompts, meta)
    groups = ["x", "x", "y", "y"]
    weights = m.weights_of(rewards)  # the algorithm forms advantages from scores and weights
    assert weights == {"a": 1.0, "b": 2.0}
    assert m.weights_of(["b", "not_a_reward"]) == {"b": 2.0}  # only what a reward gives
    # weighted sum: r = a + 2b = [1, 4, 5, 6]; group means 2.5, 5.5; global std sqrt(3.5)
    ws = combine_rewards(rewards, weights, groups, mode="weighted_sum")
    torch.testing.assert_close(ws.reward, torch.tensor([1.0, 4.0, 5.0, 6.0]))
    expected = torch.tensor([-1.5, 1.5, -0.5, 0.5]) / (3.5**0.5 + 1e-4)
    torch.testing.assert_close(ws.advantages, expected)
    # advantage aggregation: A_a = [-.5, .5, -.5, .5] / (sqrt(1.25) + eps),
    # A_b = [-.5, .5, 0, 0] / (sqrt(0.1875) + eps); A = A_a + 2 A_b
    adv = combine_rewards(rewards, weights, groups, mode="advantage")
    exp_a = torch.tensor([-0.5, 0.5, -0.5, 0.5]) / (1.25**0.5 + 1e-4)
    exp_b = torch.tensor([-0.5, 0.5, 0.0, 0.0]) / (0.1875**0.5 + 1e-4)
    torch.testing.assert_close(adv.advantages, exp_a + 2 * exp_b)
    torch.testing.assert_close(adv.reward, ws.reward)


def test_async_scorer_keeps_order_copies_inputs_and_names_failures():
    calls = []

    def slow_first(images, prompts, metadata):
        calls.append(threading.current_thread().name)
        if prompts[0] == "first":
            time.sleep(0.2)
        return [float(m["i"]) for m in metadata]

    with AsyncRewardScorer(MultiReward.from_functions({"idx": slow_first}), max_workers=2) as s:
        images = torch.full((3, 1, 4, 4), 0.5)
        f1 = s.submit(images, ["first"] * 3, [{"i": i} for i in range(3)])
        f2 = s.submit(images, ["second"] * 3, [{"i": 10 + i} for i in range(3)])
        images.fill_(7.0)  # caller reuses its buffer: the scorer must have copied it
        torch.testing.assert_close(f2.result(timeout=5)["idx"], torch.tensor([10.0, 11.0, 12.0]))
        torch.testing.assert_close(f1.result(timeout=5)["idx"], torch.tensor([0.0, 1.0, 2.0]))
    assert all(n.startswith("reward") for n in calls)

    def broken(images, prompts, metadata):
        raise OSError("disk on fire")

    with AsyncRewardScorer(MultiReward.from_functions({"broken": broken})) as s:
        fut = s.submit(*_batch(b=2))
        with pytest.raises(RuntimeError, match="reward 'broken' failed: OSError: disk on fire"):
            fut.result(timeout=5)
    with AsyncRewardScorer(lambda i, p, m: [0.0]) as s:  # wrong count, plain callable
        with pytest.raises(RuntimeError, match=r"reward '<lambda>' failed: .*shape \(1,\)"):
            s.submit(*_batch(b=2)).result(timeout=5)


def test_import_path_label_and_alias():
    images, prompts, meta = _batch(b=2)
    m = MultiReward(
        [
            RewardSpec(f"{__name__}:mean_brightness"),
            RewardSpec(f"{__name__}:mean_brightness", 3.0, {"scale": 2.0}, alias="bright2"),
        ]
    )
    out = m(images, prompts, meta)
    assert list(out) == ["mean_brightness", "bright2"]
    torch.testing.assert_close(out["bright2"], 2 * out["mean_brightness"])
    assert m.weights_of(out) == {"mean_brightness": 1.0, "bright2": 3.0}
    with pytest.raises(ValueError, match=r"\['mean_brightness'\] more than once"):
        MultiReward([f"{__name__}:mean_brightness", f"{__name__}:mean_brightness"])


def test_digits_name_resolves_to_the_toy_reward():
    mod = pytest.importorskip("flowgrpo.toy.reward")
    assert build_reward("digits") is mod.digits_reward


def test_reward_calling_sys_exit_is_a_reward_failure():
    """SystemExit is no Exception: it used to end training with status 0 and no message."""
    import sys

    images, prompts, meta = _batch(b=2)
    for exit_arg, shown in [(3, "SystemExit: 3"), (None, "SystemExit"), ("bye", "SystemExit: bye")]:
        quitter = MultiReward.from_functions({"quitter": lambda i, p, m, a=exit_arg: sys.exit(a)})
        with pytest.raises(RuntimeError) as info:
            quitter(images, prompts, meta)
        assert str(info.value) == f"reward 'quitter' failed: {shown}"
        assert info.value.reward_name == "quitter"
    with AsyncRewardScorer(
        MultiReward.from_functions({"quitter": lambda i, p, m: sys.exit(0)})
    ) as s:
        with pytest.raises(RuntimeError, match="^reward 'quitter' failed: SystemExit: 0$"):
            s.submit(images, prompts, meta).result(timeout=5)

    def interrupted(images, prompts, metadata):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # Ctrl-C still stops the run
        MultiReward.from_functions({"ctrl_c": interrupted})(images, prompts, meta)


def test_rewards_get_copies_they_cannot_corrupt():
    def vandal(images, prompts, metadata):
        images.mul_(0)
        prompts[0] = "edited"
        metadata[0]["digit"] = -1
        metadata[1]["tags"].append("edited")
        return [0.0] * images.shape[0]

    def witness(images, prompts, metadata):
        seen.append((images.clone(), list(prompts), metadata))
        return images.mean(dim=(1, 2, 3))

    seen = []
    images, prompts, _ = _batch(b=2)
    meta = [{"digit": 3}, {"tags": ["a"]}]
    keep = (images.clone(), list(prompts), [{"digit": 3}, {"tags": ["a"]}])
    out = MultiReward.from_functions({"vandal": vandal, "witness": witness})(images, prompts, meta)
    assert torch.equal(images, keep[0]) and prompts == keep[1] and meta == keep[2]
    torch.testing.assert_close(out["witness"], keep[0].mean(dim=(1, 2, 3)), rtol=0, atol=0)
    assert torch.equal(seen[0][0], keep[0]) and seen[0][1:] == keep[1:]
    bf16 = images.bfloat16()  # a non-fp32 batch reaches the reward as fp32, once
    MultiReward.from_functions({"witness": witness})(bf16, prompts, meta)
    assert seen[-1][0].dtype == torch.float32 and torch.equal(seen[-1][0], bf16.float())
