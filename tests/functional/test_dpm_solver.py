"""DPM-Solver++(2M), the sampler's ``dpm2`` steps (MixGRPO-Flash's tail, DiffusionNFT's
rollouts): Euler at first order, second-order convergence, and step-for-step equality with
diffusers' DPMSolverMultistepScheduler and the authors' sampler."""

import math

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

from flowgrpo.functional.dpm_solver import dpm_solver_2m_step

# diffusers' DPMSolverMultistepScheduler.set_timesteps trips a numpy 2 copy-keyword warning
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def _shift(t, s=3.0):
    return s * t / (1 + (s - 1) * t)


@pytest.mark.parametrize("sigma, sigma_next", [(1.0, 0.9), (0.7, 0.4), (0.3, 0.0)])
def test_first_order_step_is_the_euler_step(sigma, sigma_next):
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    out = dpm_solver_2m_step(v, x, sigma, sigma_next)
    torch.testing.assert_close(out.prev_sample, x + (sigma_next - sigma) * v, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.x0_pred, x - sigma * v)
    # history present: into sigma = 0 it is still first order (the authors' lower_order_final),
    # and with the history taken at sigma_prev = 1 the correction D1 vanishes (lambda = -inf)
    history = torch.randn(2, 3, 4, generator=g)
    if sigma_next == 0.0:
        last = dpm_solver_2m_step(v, x, sigma, 0.0, prev_x0=history, sigma_prev=0.5)
        assert torch.equal(last.prev_sample, out.prev_sample)
    if sigma < 1.0:
        first = dpm_solver_2m_step(v, x, sigma, sigma_next, prev_x0=history, sigma_prev=1.0)
        assert torch.equal(first.prev_sample, out.prev_sample)


# A Gaussian data distribution N(m, c^2) per coordinate has a closed-form probability-flow ODE:
# x0_hat(x, s) = m + (1-s) c^2 / ((1-s)^2 c^2 + s^2) (x - (1-s) m), v = (x - x0_hat) / s, and
# x(s) = (1-s) m + std(s)/std(s0) (x(s0) - (1-s0) m) with std(s) = sqrt((1-s)^2 c^2 + s^2).
M, C = 0.8, 0.5


def _std(s):
    return math.sqrt((1 - s) ** 2 * C * C + s * s)


def _velocity(x, s):
    a = 1 - s
    x0_hat = M + a * C * C / (a * a * C * C + s * s) * (x - a * M)
    return (x - x0_hat) / s


def _solve(n, solver, s0=0.95, s1=0.05):
    sigmas = [s0 + (s1 - s0) * i / n for i in range(n + 1)]
    x_start = torch.linspace(-2, 2, 9, dtype=torch.float64) * _std(s0) + (1 - s0) * M
    x, history = x_start, None
    for s, s_next in zip(sigmas[:-1], sigmas[1:]):
        v = _velocity(x, s)
        if solver == "euler":
            x = x + (s_next - s) * v
        else:
            prev = {} if history is None else {"prev_x0": history[1], "sigma_prev": history[0]}
            out = dpm_solver_2m_step(v, x, s, s_next, **prev)
            x, history = out.prev_sample, (s, out.x0_pred)
    exact = (1 - s1) * M + _std(s1) / _std(s0) * (x_start - (1 - s0) * M)
    return (x - exact).abs().max().item()


def test_dpm_solver_2m_converges_with_second_order_and_euler_with_first():
    """Error ratio when the step count doubles (16 -> 32 -> 64): ~4 for 2M, ~2 for Euler.
    Measured: 2M 4.07, 4.22; Euler 1.96, 1.98 (sigma 0.95 -> 0.05; on the full 1 -> 0 grid the
    first steps from sigma = 1 and into 0 are first order by design and the ratio nears 4 more
    slowly: 3.3-3.5 at 160-640 steps)."""
    for solver, lo, hi in (("dpm", 3.6, 4.6), ("euler", 1.85, 2.15)):
        errors = [_solve(n, solver) for n in (16, 32, 64)]
        ratios = [errors[0] / errors[1], errors[1] / errors[2]]
        assert all(lo < r < hi for r in ratios), (solver, errors, ratios)
    assert _solve(32, "dpm") < _solve(32, "euler") / 5  # 5.0e-3 vs 3.6e-2


def _field(x, s):
    """A nonlinear velocity field for the step-by-step comparison."""
    return torch.tanh(1.5 * x) * (0.5 + s) - 0.3 * x + s * s


@pytest.mark.parametrize("start_at_one", [False, True])
def test_equals_diffusers_dpm_solver_multistep_flow_prediction(start_at_one):
    """diffusers' DPMSolverMultistepScheduler(dpmsolver++, order 2, midpoint, flow sigmas, flow
    prediction, final sigma 0) is the same solver; fed the same grid it gives the same steps.
    start_at_one uses the authors' grid shift(linspace(1, 0, N+1)) instead of diffusers' own
    (which starts at shift(0.999))."""
    n = 10
    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000,
        algorithm_type="dpmsolver++",
        solver_order=2,
        solver_type="midpoint",
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=3.0,
        lower_order_final=True,
        final_sigmas_type="zero",
    )
    scheduler.set_timesteps(n)
    if start_at_one:
        scheduler.sigmas = _shift(torch.linspace(1, 0, n + 1)).float()
    sigmas = scheduler.sigmas.tolist()
    g = torch.Generator().manual_seed(0)
    x_ref = torch.randn(2, 4, 8, 8, generator=g)
    x, history = x_ref.clone(), None
    for i, t in enumerate(scheduler.timesteps):
        x_ref = scheduler.step(_field(x_ref, sigmas[i]), t, x_ref, return_dict=False)[0]
        prev = {} if history is None else {"prev_x0": history[1], "sigma_prev": history[0]}
        out = dpm_solver_2m_step(_field(x, sigmas[i]), x, sigmas[i], sigmas[i + 1], **prev)
        x, history = out.prev_sample, (sigmas[i], out.x0_pred)
        torch.testing.assert_close(x, x_ref, rtol=0, atol=5e-6)  # measured 7e-7
    assert bool(torch.isfinite(x).all())


def _authors_dpm2_sample(x, sigmas):
    """NVlabs/DiffusionNFT flow_grpo/diffusers_patch/solver.py:207-356 (``dpm_step`` with
    order 2; "Modified from MixGRPO"), transcribed: DDIM at step 0 and at the final step,
    DPM-Solver++(2M) midpoint otherwise, sigmas in float64."""
    sigmas = sigmas.to(torch.float64)
    outputs, lower_order_nums = [None, None], 0

    def lam(s):
        return torch.log(1 - s) - torch.log(s)

    for i in range(len(sigmas) - 1):
        x0 = x - sigmas[i] * _field(x, float(sigmas[i]))
        outputs = [outputs[1], x0]
        t, s = sigmas[i + 1], sigmas[i]
        if lower_order_nums < 1 or i == len(sigmas) - 2:  # ddim_update with eta = 0
            x = (1 - t) * x0 + t * (x - (1 - s) * x0) / s
        else:
            h, h_0 = lam(t) - lam(s), lam(s) - lam(sigmas[i - 1])
            d1 = (1.0 / (h_0 / h)) * (outputs[1] - outputs[0])
            x = (t / s) * x - ((1 - t) * (torch.exp(-h) - 1.0)) * x0
            x = x - 0.5 * ((1 - t) * (torch.exp(-h) - 1.0)) * d1
        x = x.float()
        lower_order_nums = min(lower_order_nums + 1, 2)
    return x


def test_equals_the_authors_dpm2_sampler_on_their_grid():
    # DiffusionNFT's rollout grid: SD3.5's FlowMatchEulerDiscreteScheduler (shift 3), 10 steps
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.float()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 8, 8, generator=g)
    expected = _authors_dpm2_sample(x.clone(), sigmas)
    grid, history = sigmas.tolist(), None
    for i in range(10):
        prev = {} if history is None else {"prev_x0": history[1], "sigma_prev": history[0]}
        out = dpm_solver_2m_step(_field(x, grid[i]), x, grid[i], grid[i + 1], **prev)
        x, history = out.prev_sample, (grid[i], out.x0_pred)
    torch.testing.assert_close(x, expected, rtol=0, atol=5e-6)


def test_dpm_step_rejects_bad_input():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="sigma_next < sigma"):
        dpm_solver_2m_step(x, x, 0.3, 0.5)
    with pytest.raises(ValueError, match="both or neither"):
        dpm_solver_2m_step(x, x, 0.5, 0.3, prev_x0=x)
    with pytest.raises(ValueError, match="sigma_prev"):
        dpm_solver_2m_step(x, x, 0.5, 0.3, prev_x0=x, sigma_prev=0.4)
