"""MixGRPO: the sliding window against hand values and the authors' state machine, and Flash's
compressed grid against their code (its DPM-Solver++(2M) tail: tests/functional/test_dpm_solver.py)."""

import pytest
import torch

from flowgrpo.algorithms.mix_grpo import flash_schedule, sde_window_at


class _AuthorsWindow:
    """Tencent-Hunyuan/MixGRPO fastvideo/utils/grpo_states.py, the "progressive" branch of
    GRPOTrainingStates with prog_overlap=True, transcribed as an independent reference."""

    def __init__(self, iters_per_group, group_size, max_timesteps, step, roll_back):
        self.iters_per_group, self.group_size = iters_per_group, group_size
        self.max_timesteps, self.step, self.roll_back = max_timesteps, step, roll_back
        self.cur_timestep, self.cur_iter_in_group = 0, 0

    def get_current_timesteps(self):
        end = min(self.cur_timestep + self.group_size, self.max_timesteps)
        return list(range(self.cur_timestep, end))

    def update_iteration(self):
        self.cur_iter_in_group += 1
        if self.cur_iter_in_group >= self.iters_per_group:
            self.cur_iter_in_group = 0
            self.cur_timestep += self.step
        if self.cur_timestep > self.max_timesteps:
            if self.roll_back:
                self.cur_timestep, self.cur_iter_in_group = 0, 0
            else:
                self.cur_timestep = self.max_timesteps


def _window(k, **kw):
    return sde_window_at(k, **{"num_steps": 25, "window_size": 4, **kw})


def test_window_by_hand_for_the_published_settings():
    mix = dict(shift_interval=25, stride=1)  # MixGRPO
    assert _window(0, **mix) == (0, 4)
    assert _window(24, **mix) == (0, 4)
    assert _window(25, **mix) == (1, 5)
    assert _window(299, **mix) == (11, 15)  # the last of the authors' 300 steps
    flash = dict(shift_interval=20, stride=1)  # MixGRPO-Flash
    assert _window(24, **flash) == (1, 5)
    assert _window(299, **flash) == (14, 18)
    for k in (0, 57, 299, 10_000):  # MixGRPO-Flash*: stride 0, the window never moves
        assert _window(k, shift_interval=20, stride=0) == (0, 4)


def test_window_shrinks_empties_and_rolls_back_at_the_end():
    # N = 25: indices 0..22 are trainable (M = 23); one move per step
    kw = dict(shift_interval=1, stride=1)
    assert [_window(k, **kw) for k in (19, 20, 21, 22, 23, 24)] == [
        (19, 23), (20, 23), (21, 23), (22, 23), (23, 23), (0, 4),
    ]  # fmt: skip
    assert _window(30, roll_back=False, **kw) == (23, 23)  # clipped: empty for good
    # N = 6 (M = 4), window 2, two steps per position
    small = [sde_window_at(k, num_steps=6, window_size=2, shift_interval=2) for k in range(11)]
    assert small == [(0, 2), (0, 2), (1, 3), (1, 3), (2, 4), (2, 4), (3, 4), (3, 4),
                     (4, 4), (4, 4), (0, 2)]  # fmt: skip
    # stride 2 (N = 7, M = 5, window 3): 0, 2, 4, then 6 > 5 rolls back
    assert [sde_window_at(k, num_steps=7, window_size=3, shift_interval=1, stride=2)
            for k in range(4)] == [(0, 3), (2, 5), (4, 5), (0, 3)]  # fmt: skip


@pytest.mark.parametrize(
    "num_steps, window_size, shift_interval, stride, roll_back",
    [(25, 4, 25, 1, True), (25, 4, 20, 1, True), (25, 4, 20, 0, True), (10, 3, 3, 2, True),
     (10, 3, 2, 1, False), (8, 4, 1, 4, True), (5, 1, 7, 3, True)],
)  # fmt: skip
def test_window_equals_the_authors_state_machine(
    num_steps, window_size, shift_interval, stride, roll_back
):
    states = _AuthorsWindow(shift_interval, window_size, num_steps - 2, stride, roll_back)
    for k in range(600):
        start, end = sde_window_at(
            k,
            num_steps=num_steps,
            window_size=window_size,
            shift_interval=shift_interval,
            stride=stride,
            roll_back=roll_back,
        )
        assert list(range(start, end)) == states.get_current_timesteps(), k
        states.update_iteration()


def _shift(t, s=3.0):
    return s * t / (1 + (s - 1) * t)


def _authors_flash_grid(n_steps, last_false_index, ratio, shift=3.0):
    """sampling_utils.py:9-10, 44-54 and train_grpo_flux.py:187-189, transcribed (fp32)."""
    sigma_schedule = _shift(torch.linspace(1, 0, n_steps + 1), shift)
    num_post_steps = int(max((sigma_schedule.size(0) - 1 - last_false_index) * ratio, 1))
    post_time_step = torch.linspace(1, 0, sigma_schedule.size(0))[last_false_index + 1].item()
    post = _shift(torch.linspace(post_time_step, 0, num_post_steps), shift)
    return torch.cat([sigma_schedule[: last_false_index + 1], post], dim=0)


@pytest.mark.parametrize("window_end, ratio, post_steps", [(4, 0.4, 7), (4, 0.2, 3), (18, 0.4, 2)])
def test_flash_schedule_matches_the_authors_grid(window_end, ratio, post_steps):
    sigmas = _shift(torch.linspace(1, 0, 26, dtype=torch.float64))
    ours = flash_schedule(sigmas, window_end, compress_ratio=ratio, shift=3.0)
    theirs = _authors_flash_grid(25, window_end - 1, ratio)
    assert ours.shape == theirs.shape
    assert ours.numel() - 1 - window_end == post_steps  # DPM steps after the window
    torch.testing.assert_close(ours, theirs.double(), rtol=0, atol=1e-6)
    assert torch.equal(ours[: window_end + 1], sigmas[: window_end + 1])  # continuous
    assert ours[-1] == 0 and bool((ours[1:] < ours[:-1]).all())


@pytest.mark.parametrize("n, window_end", [(25, 23), (10, 7), (10, 8)])
def test_flash_schedule_with_a_one_point_tail_takes_one_step_to_zero(n, window_end):
    """(N - L) * 0.4 < 2 leaves the authors' tail one point (sigma_L+1, no step to 0: the image
    would keep its noise); the tail is then one step sigma_L+1 -> 0. (10, 7) is the toy's
    MixGRPO-Flash window at step 31, which crashed the run."""
    sigmas = _shift(torch.linspace(1, 0, n + 1, dtype=torch.float64))
    assert int(max((n - (window_end - 1)) * 0.4, 1)) == 1
    grid = flash_schedule(sigmas, window_end, compress_ratio=0.4, shift=3.0)
    torch.testing.assert_close(grid, torch.cat([sigmas[: window_end + 1], sigmas.new_zeros(1)]))


def test_flash_schedule_refuses_an_empty_window():
    sigmas = _shift(torch.linspace(1, 0, 26, dtype=torch.float64))
    with pytest.raises(ValueError, match="window_end"):
        flash_schedule(sigmas, 0, compress_ratio=0.4, shift=3.0)  # an empty window at 0


def test_window_rejects_bad_input():
    with pytest.raises(ValueError, match="num_steps"):
        sde_window_at(0, num_steps=2, window_size=1, shift_interval=1)
