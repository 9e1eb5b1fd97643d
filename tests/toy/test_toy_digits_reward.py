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


def test_ink_is_mean_brightness_and_hackable(real):
    images, labels = real
    prompts = [f"a handwritten {d}" for d in labels]
    ink = torch.tensor(build_reward("digits_ink")(images, prompts, [{}] * 60))
    grey = images.mean(dim=1)  # 8x8 already: ink is the mean pixel
    torch.testing.assert_close(ink, grey.reshape(60, -1).mean(1))
    white = torch.ones_like(images)  # maximal ink, not a digit: the judge reads no digit
    assert build_reward("digits_ink")(white[:2], prompts[:2], [{}] * 2) == [1.0, 1.0]
    judge = build_reward("digits_judge")(images, prompts, [{}] * 60)
    assert float(torch.as_tensor(judge).mean()) == pytest.approx(digits_judge(images, labels))


def test_pairwise_digits_compares_the_classifier_probability(real):
    from flowgrpo.functional.advantages import group_pairs, win_rates
    from flowgrpo.rewards import MultiReward, is_pairwise

    images, labels = real
    prompts = [f"a handwritten {d}" for d in labels[:3]]
    blank = torch.zeros_like(images[:3])
    fn = build_reward("digits_pairwise")
    assert is_pairwise(fn)
    p_real = torch.tensor(digits_reward(images[:3], prompts))
    p_blank = torch.tensor(digits_reward(blank, prompts))
    expected = [1.0 if a > b else 0.0 if a < b else 0.5 for a, b in zip(p_real, p_blank)]
    assert fn(images[:3], blank, prompts, [{}] * 3) == expected
    assert fn(images[:3], images[:3], prompts, [{}] * 3) == [0.5] * 3  # a tie with itself
    # with ink: a white image out-scores the real digit once ink weighs enough
    white = torch.ones_like(images[:3])
    assert (
        build_reward("digits_pairwise", ink_weight=10.0)(white, images[:3], prompts, None)
        == [1.0] * 3
    )
    # MultiReward: a call skips it, score_pairs scores it; win rates by hand
    multi = MultiReward([{"name": "digits_pairwise"}, {"name": "digits_ink", "weight": 0.0}])
    # one group (one prompt): a real digit, another real image, a blank
    both = torch.cat([images[:2], blank[:1]])
    group_prompts = [f"a handwritten {labels[0]}"] * 3
    assert multi.pairwise_labels == ["digits_pairwise"]
    assert set(multi(both, group_prompts, [{}] * 3)) == {"digits_ink"}
    firsts, seconds = group_pairs([0, 0, 0])
    out = multi.score_pairs(both, group_prompts, None, firsts, seconds)["digits_pairwise"]
    p = torch.tensor(digits_reward(both, group_prompts))
    assert len(set(p.tolist())) == 3  # distinct scores: no ties
    by_hand = [1.0 if p[a] > p[b] else 0.0 for a, b in zip(firsts, seconds)]
    assert out.tolist() == by_hand
    rates = win_rates(out, firsts, seconds, 3)
    ranks = p.argsort().argsort().float()  # win rate = rank / (K - 1)
    torch.testing.assert_close(rates, ranks / 2)


def test_pairwise_reward_outcomes_outside_0_1_are_named(real):
    from flowgrpo.rewards import MultiReward

    def bad(a, b, prompts, metadata):
        return [2.0] * len(prompts)

    bad.pairwise = True
    multi = MultiReward.from_functions({"bad": bad})
    with pytest.raises(ValueError, match="pairwise reward 'bad' returned outcomes outside"):
        multi.score_pairs(real[0][:2], ["a 1", "a 1"], None, [0], [1])
