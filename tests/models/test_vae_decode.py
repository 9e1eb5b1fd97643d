"""VAE decode in slices (one sample at a time, ``model.vae_slicing``, on by default) equals the
batched decode of every family's tiny pipeline with a VAE to 4e-6 (measured <= 8.4e-7 in [0, 1] pixels,
2.3e-6 for the VAE of factor 32);
the trainer's setup turns slicing and tiling on from the config."""

from __future__ import annotations

import pytest
import torch

from flowgrpo.testing.families import doubles, params
from flowgrpo.testing.tiny import tiny_pipeline, tiny_size


@pytest.mark.parametrize("fam", params(f for f in doubles() if f.vae))  # families with a VAE
def test_sliced_decode_equals_batched(fam):
    adapter = fam.adapter(tiny_pipeline(fam.kind))
    h, w = tiny_size(fam.kind)
    video = {} if fam.num_frames is None else {"num_frames": fam.num_frames}
    latents = adapter.prepare_latents(3, h, w, torch.Generator().manual_seed(0), **video)
    batched = adapter.decode(latents, h, w)
    adapter.pipe.vae.enable_slicing()
    sliced = adapter.decode(latents, h, w)
    assert sliced.shape == batched.shape
    # <= 8.4e-7 measured; FLUX.1 Kontext's 6-level tiny VAE (factor 32): 2.3e-6
    assert (sliced - batched).abs().max() <= 4e-6
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
