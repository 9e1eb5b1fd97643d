"""The digits reward, judge and diversity on real scikit-learn digits."""

import pytest
import torch

from flowgrpo.rewards import build_reward
from flowgrpo.toy.data import load_digits_data, to_unit
from flowgrpo.toy.reward import digits_judge, digits_reward, diversity


@pytest.fixture(scope="module")
def real():
    x, y = load_digits_data("test")
    return to_unit(x[:60]), y[:60]


def test_reward_is_high_for_the_right_digit_and_low_for_a_wrong_one(real):
    images, labels = real
    right = torch.tensor(digits_reward(images, [f"a handwritten {d}" for d in labels], None))
    wrong = torch.tensor(digits_reward(images, [f"a {(d + 3) % 10}" for d in labels], None))
    assert right.shape == (60,) and float(right.min()) >= 0 and float(right.max()) <= 1
    assert float(right.mean()) > 0.9 and float(right.median()) > 0.95
    assert float(wrong.mean()) < 0.1


def test_metadata_digit_overrides_the_prompt_and_registry_name(real):
    images, labels = real
    meta = [{"digit": int(d)} for d in labels[:4]]
    by_meta = digits_reward(images[:4], ["anything"] * 4, meta)
    by_prompt = build_reward("digits")(images[:4], [f"{d}" for d in labels[:4]], [{}] * 4)
    assert by_meta == pytest.approx(by_prompt)


def test_reward_accepts_rgb_and_larger_images(real):
    images, labels = real
    big = torch.nn.functional.interpolate(images[:4], scale_factor=4).repeat(1, 3, 1, 1)
    prompts = [f"a {d}" for d in labels[:4]]
    assert digits_reward(big, prompts, None) == pytest.approx(
        digits_reward(images[:4], prompts, None), abs=1e-5
    )


def test_prompt_without_digit_raises(real):
    with pytest.raises(ValueError, match="a cat"):
        digits_reward(real[0][:1], ["a cat"], None)
    with pytest.raises(ValueError, match="no digit"):
        digits_reward(real[0][:1], [""], [{}])


def test_judge_and_diversity_on_real_and_collapsed_images(real):
    images, labels = real
    assert digits_judge(images, labels) > 0.95
    assert digits_judge(images, (labels + 1) % 10) < 0.1
    x, y = load_digits_data("all")
    assert diversity(to_unit(x), y) == pytest.approx(0.33, abs=0.01)
    collapsed = images[:1].repeat(8, 1, 1, 1)
    assert diversity(collapsed, [2] * 8) == 0.0
