"""Editing batches whose source images differ in size (issue 39 item 8): one transformer call
takes one source layout, so the adapter encodes and runs each layout as its own batch, and
rollout chunks and micro-batches of mixed sizes concatenate and split (``SourceLayouts``).
Each sample of a mixed batch equals that sample sampled alone, and the training pass
recomputes the rollout's log-probs, for every editing family."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models.base import PromptEmbeds, SourceLayouts
from flowgrpo.rollout.sampler import Trajectory, sample_trajectories, trajectory_log_prob
from flowgrpo.testing import conformance as C
from flowgrpo.testing.families import kinds, params

pytestmark = pytest.mark.usefixtures("one_thread")

#: (H, W) of each prompt's source(s): 1:1, 16:9 and 1:1 again (two layouts in one batch)
SIZES = ((96, 96), (72, 128), (96, 96))


def _sources(kind: str) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for h, w in SIZES:
        row = [torch.rand(3, h, w, generator=g)]
        if kind == "qwen_image_edit_plus":  # a second source, of the other shape
            row.append(torch.rand(3, w, h, generator=g))
        rows.append(row)
    return rows


def _rollout(adapter, prompts, images, seeds, scale):
    return sample_trajectories(
        adapter,
        prompts,
        num_steps=3,
        guidance_scale=scale,
        noise_level=0.8,
        height=64,
        width=64,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        images=images,
        negative_prompts=[" "] * len(prompts),
    )


@pytest.mark.parametrize("kind", params(kinds(lambda f: f.sources)))  # editing families
def test_a_batch_of_mixed_source_sizes_samples_and_trains(kind) -> None:
    fam = C.family(kind)
    adapter = fam.adapter(fam.pipeline(), cfg=True)
    if kind != "flux_kontext":  # sources resized to ~128² (the pipelines' ~1024²: slow here)
        adapter.vae_area = adapter.condition_area = 128 * 128
    scale = 2.5 if kind == "flux_kontext" else 4.0
    prompts = list(fam.prompts[:3])
    images = _sources(kind)
    assert len({adapter.source_layout(r) for r in images}) == 2
    traj = _rollout(adapter, prompts, images, [10, 11, 12], scale)
    shapes = traj.prompt_embeds.image_shapes
    assert isinstance(shapes, SourceLayouts) and shapes.layouts[0] == shapes.layouts[2]
    alone = [_rollout(adapter, [p], [im], [10 + i], scale) for i, (p, im) in enumerate(
        zip(prompts, images, strict=True))]  # fmt: skip
    for i, one in enumerate(alone):
        assert not isinstance(one.prompt_embeds.image_shapes, SourceLayouts)
        C.assert_tensors_close(traj.latents[i], one.latents[0], 1e-4, f"sample {i} latents")
        C.assert_tensors_close(traj.log_probs[i], one.log_probs[0], 1e-4, f"sample {i} logp")
    # the training pass on the mixed batch recomputes the rollout's log-probs
    with torch.no_grad():
        for k in range(traj.num_train_steps):
            got = trajectory_log_prob(adapter, adapter.transformer, traj, k).log_prob
            C.assert_tensors_close(got, traj.log_probs[:, k], 1e-4, f"step {k} recomputed")
    # chunks of different sizes concatenate (the base eval's Trajectory.cat), micro-batches
    # of one size come back as a plain batch of that size
    both = Trajectory.cat([alone[1], alone[0], alone[2]])
    assert isinstance(both.prompt_embeds.image_shapes, SourceLayouts)
    sub = both.select([1, 2])
    assert sub.prompt_embeds.image_shapes == alone[0].prompt_embeds.image_shapes
    n = alone[0].prompt_embeds.image_latents.shape[1]
    assert sub.prompt_embeds.image_latents.shape[1] == n
    assert torch.equal(sub.prompt_embeds.image_latents[0], alone[0].prompt_embeds.image_latents[0])
    with torch.no_grad():
        got = trajectory_log_prob(adapter, adapter.transformer, both, 0).log_prob
    want = torch.cat([alone[i].log_probs[:, 0] for i in (1, 0, 2)])
    C.assert_tensors_close(got, want, 1e-4, "concatenated chunks recomputed")


def test_source_layouts_pad_and_trim() -> None:
    """cat of batches of different source layouts pads each row to the longest and keeps its
    layout; select of one layout's rows trims back to a shared layout."""
    a = PromptEmbeds(torch.zeros(2, 3, 4), None, None, torch.ones(2, 5, 2), ((1, 1, 5),))
    b = PromptEmbeds(torch.zeros(1, 3, 4), None, None, 2 * torch.ones(1, 2, 2), ((1, 2, 1),))
    both = PromptEmbeds.cat([a, b])
    assert both.image_latents.shape == (3, 5, 2)
    assert both.image_shapes == SourceLayouts((((1, 1, 5),),) * 2 + (((1, 2, 1),),), (5, 5, 2))
    assert both.image_latents[2, 2:].abs().sum() == 0 and both.layout_groups() == [[0, 1], [2]]
    one = both.select(torch.tensor([2]))
    assert one.image_shapes == ((1, 2, 1),) and torch.equal(one.image_latents, b.image_latents)
    again = PromptEmbeds.cat([both.select([2, 0]), a])
    assert again.layout_groups() == [[0], [1, 2, 3]] and again.image_latents.shape == (4, 5, 2)
    assert PromptEmbeds.cat([a, a]).layout_groups() is None


def test_a_shared_source_converts_to_pil_once() -> None:
    """A group's samples share their decoded source tensor: the adapter converts it once."""
    from flowgrpo.models.qwen_image_edit import pil_rows

    a, b = torch.rand(3, 8, 6), torch.rand(3, 4, 4)
    rows = pil_rows([[a], [b], [a], [a, b]])
    assert rows[0][0] is rows[2][0] is rows[3][0] and rows[1][0] is rows[3][1]
    assert rows[0][0].size == (6, 8) and rows[1][0] is not rows[0][0]
