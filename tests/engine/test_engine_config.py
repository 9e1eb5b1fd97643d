"""The engine's shared rules: how ranks split (``parallel_layout``) and what a dtype setting
names (``flowgrpo.settings.resolve_dtype``)."""

import pytest
import torch

from flowgrpo.engine.config import parallel_layout
from flowgrpo.settings import resolve_dtype


def test_parallel_layout_splits_the_world():
    lay = parallel_layout(8, replicate_degree=2, sp_degree=2)
    assert (lay.replicate, lay.dp_shard, lay.sp) == (2, 2, 2)
    assert (lay.world_size, lay.dp, lay.shard_group) == (8, 4, 4)
    one = parallel_layout(6)
    assert (one.dp, one.dp_shard, one.shard_group, one.sp) == (6, 6, 6, 1)
    sp = parallel_layout(6, sp_degree=3)
    assert (sp.dp, sp.dp_shard, sp.shard_group) == (2, 2, 6)
    for world, rep, spd in [(6, 4, 1), (4, 1, 3), (4, 0, 1)]:
        with pytest.raises(ValueError, match="must be divisible by replicate_degree"):
            parallel_layout(world, rep, spd)


def test_resolve_dtype():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16  # no GPU needed to name it
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    got = [resolve_dtype(n, "cpu") for n in ("fp32", "bf16", "fp16")]
    assert got == [torch.float32, torch.bfloat16, torch.float16]
