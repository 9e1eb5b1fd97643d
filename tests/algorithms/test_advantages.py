"""Advantages are the algorithm's: ``Algorithm.advantages`` turns the rewards' scores into the
advantages the update trains on, as the ``advantage`` section says (hand-computed values)."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.algorithms import ALGORITHMS, algorithm_class
from flowgrpo.algorithms.base import Algorithm
from flowgrpo.config import Config

SCORES = {"a": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([0.0, 1.0, 1.0, 1.0])}
WEIGHTS = {"a": 1.0, "b": 2.0}
GROUPS = torch.tensor([0, 0, 1, 1])
EPS = 1e-4


def _advantages(mode: str, global_std: bool):
    cfg = Config()
    cfg.advantage.mode, cfg.advantage.global_std = mode, global_std
    algo = algorithm_class(cfg.algorithm)(cfg, engine=None, adapter=None)
    return algo.advantages(SCORES, WEIGHTS, GROUPS)


def test_weighted_sum_with_the_global_std():
    # r = a + 2b = [1, 4, 5, 6]; group means 2.5, 5.5; std over all four sqrt(3.5)
    out = _advantages("weighted_sum", True)
    torch.testing.assert_close(out.reward, torch.tensor([1.0, 4.0, 5.0, 6.0]))
    expected = torch.tensor([-1.5, 1.5, -0.5, 0.5]) / (3.5**0.5 + EPS)
    torch.testing.assert_close(out.advantages, expected)


def test_weighted_sum_with_the_group_std():
    # group stds: [1, 4] -> 1.5, [5, 6] -> 0.5
    out = _advantages("weighted_sum", False)
    std = torch.tensor([1.5, 1.5, 0.5, 0.5]) + EPS
    expected = torch.tensor([-1.5, 1.5, -0.5, 0.5]) / std
    torch.testing.assert_close(out.advantages, expected)


def test_advantage_aggregation():
    # A_a = [-.5, .5, -.5, .5] / (sqrt(1.25) + eps), A_b = [-.5, .5, 0, 0] / (sqrt(0.1875) + eps)
    out = _advantages("advantage", True)
    exp_a = torch.tensor([-0.5, 0.5, -0.5, 0.5]) / (1.25**0.5 + EPS)
    exp_b = torch.tensor([-0.5, 0.5, 0.0, 0.0]) / (0.1875**0.5 + EPS)
    torch.testing.assert_close(out.advantages, exp_a + 2 * exp_b)
    torch.testing.assert_close(out.reward, torch.tensor([1.0, 4.0, 5.0, 6.0]))


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_declares_its_settings_and_gets_its_config_section(name):
    cls = algorithm_class(name)
    assert cls.name == name and issubclass(cls, Algorithm)
    assert type(getattr(Config(), name)) is cls.settings_class  # the section of its name
