"""FLUX.2 dev and klein: what is particular to the family (the checks every family passes are in
tests/models/test_conformance.py): the empirical-mu schedule against Black Forest Labs' own
formula, decoding against the pipeline's images, the step-distilled klein ignoring guidance,
and sequence parallelism refusing text it cannot split."""

from __future__ import annotations

import math

import pytest
import torch

from flowgrpo.models import build_adapter
from flowgrpo.rollout import sample_trajectories
from flowgrpo.testing.families import of
from flowgrpo.testing.tiny import tiny_pipeline

PROMPTS = ["a red cat holding a sign", "two blue birds"]
SEQ = 64  # the tiny tokenizer's system message is ~35 tokens
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dev():
    return tiny_pipeline("flux2")


@pytest.fixture(scope="module")
def klein():
    return tiny_pipeline("flux2_klein")


def _bfl_schedule(num_steps: int, image_seq_len: int) -> list[float]:
    """black-forest-labs/flux2 src/flux2/sampling.py ``get_schedule`` (transcribed): the
    empirical mu (fits at 10 and 200 steps, linear in the step count up to 4300 tokens), then
    ``time_shift(mu, 1, t) = e^mu / (e^mu + (1/t - 1))`` on linspace(1, 0, N + 1)."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if image_seq_len > 4300:
        mu = a2 * image_seq_len + b2
    else:
        m200, m10 = a2 * image_seq_len + b2, a1 * image_seq_len + b1
        a = (m200 - m10) / 190.0
        mu = a * num_steps + (m200 - 200.0 * a)
    ts = [1 - i / num_steps for i in range(num_steps + 1)]
    return [math.exp(mu) / (math.exp(mu) + (1 / t - 1)) if t > 0 else 0.0 for t in ts]


@pytest.mark.parametrize(("steps", "size"), [(4, (32, 48)), (8, (24, 16)), (28, (1024, 1024))])
def test_schedule_is_bfl_empirical_mu_shift(dev, steps, size):
    sched = build_adapter(dev).schedule(steps, *size)
    tokens = (size[0] // 4) * (size[1] // 4)  # tiny: VAE factor 2 x 2x2 patches
    expected = torch.tensor(_bfl_schedule(steps, tokens))
    assert torch.allclose(sched.sigmas.double(), expected.double(), atol=1e-6)
    assert torch.allclose(sched.timesteps, sched.sigmas[:-1] * 1000)


def test_mu_depends_on_the_step_count(dev):
    """Unlike FLUX.1, the same size gives another shift at another step count."""
    adapter = build_adapter(dev)
    a, b = adapter.schedule(4, 32, 48).sigmas[1], adapter.schedule(8, 32, 48).sigmas[2]
    assert abs(float(a - b)) > 1e-3  # both at t = 0.75 before the shift


@pytest.mark.parametrize("kind", of("flux2"))  # dev and klein
def test_decode_equals_the_pipeline_images(dev, klein, kind):
    pipe = dev if kind == "flux2" else klein
    adapter = build_adapter(pipe, max_sequence_length=SEQ)
    h, w = 32, 48
    x0 = adapter.prepare_latents(2, h, w, torch.Generator().manual_seed(0))
    traj = sample_trajectories(
        adapter, PROMPTS, num_steps=2, guidance_scale=1.0, noise_level=0.0, height=h,
        width=w, latents=x0.clone(), decode=True,
    )  # fmt: skip
    ref = pipe(
        prompt=PROMPTS, height=h, width=w, num_inference_steps=2, guidance_scale=1.0,
        latents=x0.clone(), output_type="pt", max_sequence_length=SEQ,
    ).images  # fmt: skip
    assert traj.images.shape == ref.shape == (2, 3, h, w)
    assert (traj.images - ref.float()).abs().max() < 1e-5
    assert ref.std() > 0


def test_distilled_klein_ignores_guidance_as_the_pipeline(klein):
    pipe = tiny_pipeline("flux2_klein")
    pipe.register_to_config(is_distilled=True)
    adapter = build_adapter(pipe, max_sequence_length=SEQ)
    assert not adapter.uses_cfg(4.0) and build_adapter(klein).uses_cfg(4.0)
    x0 = adapter.prepare_latents(2, 32, 48, torch.Generator().manual_seed(1))
    kw = dict(num_steps=3, noise_level=0.0, height=32, width=48, decode=False)
    ours = sample_trajectories(adapter, PROMPTS, guidance_scale=4.0, latents=x0.clone(), **kw)
    plain = sample_trajectories(adapter, PROMPTS, guidance_scale=1.0, latents=x0.clone(), **kw)
    assert torch.equal(ours.final_latents, plain.final_latents)
    ref = pipe(
        prompt=PROMPTS, height=32, width=48, num_inference_steps=3, guidance_scale=4.0,
        latents=x0.clone(), output_type="latent", max_sequence_length=SEQ,
    ).images  # fmt: skip
    bn, eps = pipe.vae.bn, pipe.vae.config.batch_norm_eps
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps)
    mine = pipe._unpatchify_latents(ours.final_latents * std + bn.running_mean.view(1, -1, 1, 1))
    assert (mine - ref).abs().max() < 1e-5


def test_sizes_are_refused_not_rounded(dev):
    adapter = build_adapter(dev)
    with pytest.raises(ValueError, match="multiple of 4"):
        adapter.schedule(4, 30, 48)


def test_sequence_parallel_refuses_text_it_cannot_split(dev):
    spec = build_adapter(dev).sequence_parallel
    kwargs = {"encoder_hidden_states": torch.zeros(1, 63, 48)}
    with pytest.raises(ValueError, match="max_sequence_length a multiple"):
        spec.pad_text(kwargs, 1)
