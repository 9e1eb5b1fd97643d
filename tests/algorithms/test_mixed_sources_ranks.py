"""Editing sources of different sizes on 2 ranks (issue 39 item 8): rank 0's samples hold two
source layouts and rank 1's one, so rank 0 makes two transformer calls per velocity and rank
1 makes the same two (the second a dropped extra row): FSDP's collectives pair up and one
Flow-GRPO LoRA update on 2 gloo ranks equals 1 process (which sees both layouts)."""

from __future__ import annotations

import algo_ranks as ar
import pytest
import torch

from flowgrpo.testing.ranks import rank_env, spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KIND = "qwen_image_edit"
#: (H, W) of each sample's source: rank 0 gets a square and a 2:1, rank 1 two 2:1
SIZES = ((64, 64), (48, 96), (48, 96), (40, 80))


def small_sources() -> None:
    """Sources resized to ~128² instead of the pipeline's ~1024² (the vision encoder's cost
    on a CPU); the layouts still differ: 128 x 128 and 192 x 96."""
    from flowgrpo.models.qwen_image_edit import QwenImageEditAdapter as A

    A.vae_area = A.condition_area = 128 * 128


def mixed_images(kind: str, rows: list[int]) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    table = [[torch.rand(3, h, w, generator=g)] for h, w in SIZES]
    return [table[i] for i in rows]


def job(rank: int, world: int, port: int, out: str) -> None:
    rank_env(rank, world, port)
    from flowgrpo.engine import cleanup

    ar.edit_images = mixed_images
    small_sources()
    try:
        result = ar.run("flow_grpo", KIND, "lora", rank=rank, world=world)
    except Exception as e:  # noqa: BLE001 - reported by the test, not a hang
        result = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        torch.save(result, out)
    cleanup()


def test_mixed_source_sizes_two_ranks_equal_one_process(tmp_path, monkeypatch) -> None:
    from flowgrpo.engine import init_distributed

    out = tmp_path / "two.pt"
    ctx = spawn(job, 2, str(out), join=False)
    try:
        init_distributed()
        monkeypatch.setattr(ar, "edit_images", mixed_images)
        from flowgrpo.models.qwen_image_edit import QwenImageEditAdapter as A

        monkeypatch.setattr(A, "vae_area", 128 * 128)
        monkeypatch.setattr(A, "condition_area", 128 * 128)
        layouts = {A(ar.pipeline(KIND)).source_layout(r) for r in mixed_images(KIND, [0, 1, 2, 3])}
        assert layouts == {((128, 128),), ((192, 96),)}
        one = ar.run("flow_grpo", KIND, "lora")
    finally:
        while not ctx.join():
            pass
    two = torch.load(out, weights_only=False)
    assert "error" not in two, two.get("error")
    before = ar.run_initial("flow_grpo", KIND, "lora")
    moved = max((one["params"][n] - before[n]).abs().max().item() for n in before)
    worst = max((one["params"][n] - two["params"][n]).abs().max().item() for n in before)
    assert moved > 1e-4 and worst < 2e-5, (moved, worst)
    for key in ("loss", "grad_norm"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-7)
