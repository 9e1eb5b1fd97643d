"""VAE decode in slices (one sample at a time, ``model.vae_slicing``, on by default) equals the
batched decode of every family's tiny pipeline to 2e-6 (measured <= 8.4e-7 in [0, 1] pixels);
the trainer's setup turns slicing and tiling on from the config."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.models import build_adapter, tiny_pipeline


@pytest.mark.parametrize("kind", ["qwen_image", "sd3", "flux", "wan"])
def test_sliced_decode_equals_batched(kind):
    adapter = build_adapter(tiny_pipeline(kind))
    h, w = 32, 48
    video = {"num_frames": 5} if kind == "wan" else {}
    latents = adapter.prepare_latents(3, h, w, torch.Generator().manual_seed(0), **video)
    batched = adapter.decode(latents, h, w)
    adapter.pipe.vae.enable_slicing()
    sliced = adapter.decode(latents, h, w)
    assert sliced.shape == batched.shape
    assert (sliced - batched).abs().max() <= 2e-6
    assert batched.std() > 0.01  # real images, not a constant


def test_setup_applies_the_vae_settings(monkeypatch):
    from flowgrpo.config import load_config
    from flowgrpo.engine.dist import DistInfo
    from flowgrpo.models import registry
    from flowgrpo.trainer import setup

    pipe = tiny_pipeline("sd3")
    monkeypatch.setattr(registry, "load_pipeline", lambda path, torch_dtype=None, **kw: pipe)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    for slicing, tiling in ((True, False), (False, True)):
        pipe.vae.use_slicing = pipe.vae.use_tiling = False
        cfg = load_config(
            "toy-digits", [f"model.vae_slicing={slicing}", f"model.vae_tiling={tiling}"]
        )
        setup.build_adapter_for(cfg, dist)
        assert (pipe.vae.use_slicing, pipe.vae.use_tiling) == (slicing, tiling)
