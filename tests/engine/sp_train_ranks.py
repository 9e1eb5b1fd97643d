"""Rollout and one Flow-GRPO update through the engine with sequence parallelism (sp = 2 over
2 ranks) or without it (1 process): the worker of tests/engine/test_sp_training.py."""

from __future__ import annotations

from pathlib import Path

import tinymodel
import torch

from flowgrpo.testing.ranks import rank_env

HERE = Path(__file__).resolve().parent
PROMPTS = ["a red cat", "a photo of a big old house with a tree"]
ADVANTAGES = torch.tensor([1.0, -0.5])
KINDS = (
    "qwen_image",
    "flux",
    "sd3",
    "wan",
    "wan22",
    "flux2",
    "flux2_klein",
    "qwen_image_edit",
    "qwen_image_edit_plus",
    "z_image",
    "qwen_image21",
    "hunyuan_video15",
    "flux_kontext",
)
MODES = ("lora", "full")
#: the module whose input is split (its output is gathered): proj_out unless named here
OUTPUT_MODULE = {"z_image": "all_final_layer.2-1"}
#: families whose text is padded under SP, and the text keyword whose length grows
PADDED = {"qwen_image21": "encoder_hidden_states", "hunyuan_video15": "encoder_hidden_states"}


def padded_forward(adapter, model, kind: str) -> dict:
    """One forward whose text does not divide by 2 (Qwen-Image 2.1: every prompt cut to an odd
    length; HunyuanVideo-1.5: its joint text is odd, 4 + 16 + 25 tokens, like the real model's
    729 + 256 + 1000): the velocity and the text length each transformer call got."""
    from flowgrpo.models.base import PromptEmbeds

    embeds = adapter.encode_prompts(PROMPTS)
    if kind == "qwen_image21":
        n = embeds.mask.sum(1)
        n = n - (1 - n % 2)  # odd lengths
        mask = (torch.arange(embeds.mask.shape[1])[None] < n[:, None]).long()
        embeds = PromptEmbeds(embeds.embeds, mask, embeds.pooled)
    texts: list[int] = []
    key = PADDED[kind]
    hook = adapter.transformer.register_forward_pre_hook(  # after the engine's padding hook
        lambda module, args, kwargs: texts.append(kwargs[key].shape[1]), with_kwargs=True
    )
    lat = adapter.prepare_latents(len(PROMPTS), 32, 32, torch.Generator().manual_seed(5))
    sigma = torch.tensor([0.7, 0.4])
    with torch.no_grad():
        v = adapter.forward(model, lat, sigma, embeds, height=32, width=32, guidance_scale=4.0)
    hook.remove()
    return {"pad_v": v.cpu(), "pad_text": texts}


#: editing kinds: (height, width, each prompt's source images as (height, width) pixels, the
#: VAE view's pixel area, the source tokens). The pipelines resize a source to ~1024² pixels
#: (multiples of 32, aspect kept); scaled down here to 64 x 192 to keep the test fast: a 1:3
#: source becomes 64 x 192 pixels, 2 x 6 latents of the tiny VAE (factor 32), 1 x 3 tokens
#: (2x2 packing). Qwen-Image-Edit: 1 x 3 noised + 3 source tokens; the 3 noised alone do not
#: split over sp = 2, so SP runs only if the source tokens are counted and split with them.
#: Edit-Plus: 2 x 3 noised + 3 + 3 source tokens (two sources, 3:1 and 1:3).
EDITS = {
    "qwen_image_edit": (64, 192, [(20, 60)], 64 * 192, 3),
    "qwen_image_edit_plus": (128, 192, [(20, 60), (60, 20)], 64 * 192, 6),
    # FLUX.1 Kontext with flux_kontext.source_size=64: one source token (1 x 1 after the 2x2 packing)
    # beside the 1 x 3 noised ones (its vae_area is unused)
    "flux_kontext": (64, 192, [(20, 60)], 64 * 192, 1),
}


def source_images(kind: str) -> list[list[torch.Tensor]] | None:
    """One list of random [3, H, W] source images in [0, 1] per prompt (8-bit values)."""
    if kind not in EDITS:
        return None
    g = torch.Generator().manual_seed(7)
    return [
        [torch.randint(0, 256, (3, h, w), generator=g).float() / 255 for h, w in EDITS[kind][2]]
        for _ in PROMPTS
    ]


def run(kind: str, mode: str, sp: int) -> dict:
    from flowgrpo.config import config_from_dict
    from flowgrpo.engine import init_distributed
    from flowgrpo.models import build_adapter
    from flowgrpo.rollout import sample_trajectories, trajectory_log_prob
    from flowgrpo.testing.tiny import tiny_pipeline
    from flowgrpo.trainer.setup import build_engine

    cfg = config_from_dict(
        {
            "seed": 1,
            "fsdp": {"param_dtype": "fp32", "sp_degree": sp},
            "lora": {"enabled": mode == "lora", "rank": 4, "alpha": 8},
            "optim": {"lr": 1.0, "eps": 1.0, "weight_decay": 0.0, "max_grad_norm": 1e6},
            "update": {"micro_batch_size": 2, "num_minibatches": 1},
            "flow_grpo": {"clip_range": 0.5, "kl_beta": 0.05},
        }
    )
    pipe = tiny_pipeline(kind)
    if kind == "hunyuan_video15":  # an odd joint text (4 + 16 + 25), as the real model's 1985
        pipe.tokenizer_max_length = 25
    options = {
        "flux": {"true_cfg_scale": 4.0},
        "wan": {"num_frames": 5},
        "wan22": {"num_frames": 5},
        "flux2": {"max_sequence_length": 64},  # text and image tokens both split over sp=2
        "flux2_klein": {"max_sequence_length": 64},
        "hunyuan_video15": {"num_frames": 5},
        "flux_kontext": {"max_sequence_length": 16, "source_size": 64},
    }
    options = options.get(kind, {})
    adapter = build_adapter(pipe, **options)
    images = source_images(kind)
    if images is not None:
        adapter.vae_area = EDITS[kind][3]
    engine, algo = build_engine(cfg, adapter, init_distributed())
    seen: list[int] = []  # tokens reaching proj_out on this rank (halved under SP: the
    # output is gathered after it)
    parts = getattr(adapter.transformer, "sequence_parallel_parts", None)  # Wan2.2's experts
    for transformer in parts() if parts else [adapter.transformer]:
        transformer.get_submodule(OUTPUT_MODULE.get(kind, "proj_out")).register_forward_pre_hook(
            lambda module, args: seen.append(args[0].shape[1])
        )
    g = 3.5 if kind == "flux" else 4.0
    height, width = EDITS[kind][:2] if kind in EDITS else (32, 32)
    kw = dict(num_steps=3, guidance_scale=g, height=height, width=width, decode=False)
    kw["images"] = images

    def gens():
        return [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]

    with torch.no_grad():
        ode = sample_trajectories(adapter, PROMPTS, noise_level=0.0, generator=gens(), **kw)
        traj = sample_trajectories(adapter, PROMPTS, noise_level=0.8, generator=gens(), **kw)
        recomputed = torch.stack(
            [
                trajectory_log_prob(adapter, engine.model, traj, k).log_prob
                for k in range(traj.num_train_steps)
            ],
            dim=1,
        )
    padded = padded_forward(adapter, engine.model, kind) if kind in PADDED else {}
    metrics = algo.update(traj, ADVANTAGES, step=1, sample_seeds=[0, 1])
    params = tinymodel.trainable(engine)
    return {
        "final": ode.final_latents.cpu(),
        "log_probs": traj.log_probs.cpu(),
        "log_ratio": (recomputed - traj.log_probs).abs().max().item(),
        "params": params,
        "metrics": metrics,
        "tokens": max(seen),
        "dp_size": engine.dp_size,
        **padded,
    }


def job(rank: int, world: int, port: int, out: str) -> None:
    rank_env(rank, world, port)
    from flowgrpo.engine import cleanup

    results = {(k, m): run(k, m, sp=world) for k in KINDS for m in MODES}
    if rank == 0:
        torch.save(results, out)
    cleanup()
