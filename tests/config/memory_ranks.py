"""Measure the per-rank peak of torch's CPU allocator during two training steps (rollout +
update; from the second on, AdamW's moments live through the backward) of a small saved pipeline, excluding loading: the profiler records every allocation and
free from before the run is built; the peak is taken over the events after a marker allocation
made once the run is built (the live bytes then, the state, count; what loading freed does not).
Used by test_memory_planner.py; ``python tests/config/memory_ranks.py`` prints the table."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from flowgrpo.testing.ranks import free_port, rank_env

MARK = 7_654_321  # bytes of the marker allocation (no other tensor has this size)
# a small SD3: 4 blocks of width 256, so that the weights and their state dominate
SMALL_SD3 = dict(
    num_layers=4,
    attention_head_dim=64,
    num_attention_heads=4,
    caption_projection_dim=256,
    dual_attention_layers=(),
)
BASE = [
    "model.height=64",
    "model.width=64",
    "model.max_sequence_length=16",
    "sample.num_steps=3",
    "sample.eval_num_steps=2",
    "sample.prompts_per_step=2",
    "sample.group_size=2",
    "sample.rollout_batch_size=2",
    "sample.guidance_scale=4.0",
    "update.micro_batch_size=2",
    "update.num_minibatches=1",
    "reward=jpeg_compressibility:1.0",
    "trainer.max_steps=2",
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "ema.enabled=false",
    "run.progress_bar=false",
]
CONFIGS = {  # name -> extra overrides
    "lora": ["lora.enabled=true", "lora.rank=8", "flow_grpo.kl_beta=0.0"],
    "full-kl": ["lora.enabled=false", "flow_grpo.kl_beta=0.04"],
    # a CLIP reward model on the device (a small CLIPModel saved beside the pipeline)
    "lora-clip": ["lora.enabled=true", "lora.rank=8", "flow_grpo.kl_beta=0.0"],
    # the frozen base's Linear weights (and the text encoders') stored in NF4 (engine.quant)
    "lora-nf4": [
        "lora.enabled=true",
        "lora.rank=8",
        "flow_grpo.kl_beta=0.0",
        "model.base_quant=nf4",
    ],
}
#: a small CLIP (2 x 2 layers of width 512): its 13M fp32 parameters are a visible share
CLIP = dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8)


def save_small_pipeline(root: Path) -> Path:
    from flowgrpo.testing.tiny import tiny_pipeline

    path = root / "small-sd3"
    if not (path / "model_index.json").is_file():
        tiny_pipeline("sd3", **SMALL_SD3).save_pretrained(path)
    save_small_clip(root / "small-clip")
    (root / "prompts.txt").write_text("a red cat\na blue dog\na green bird\na tall tree\n")
    # the toy's settings on an SD3 folder: a preset of our own (toy-digits refuses SD3 folders)
    (root / "preset.yaml").write_text("base: toy-digits\n")
    return path


def save_small_clip(path: Path) -> None:
    """A CLIPModel (and a character tokenizer) the clip_score reward loads from ``path``."""
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    if (path / "config.json").is_file():
        return
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789":
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77).save_pretrained(path)
    text = dict(CLIP, vocab_size=len(vocab), max_position_embeddings=77, bos_token_id=0,
                eos_token_id=1, pad_token_id=1)  # fmt: skip
    vision = dict(CLIP, image_size=64, patch_size=8)
    torch.manual_seed(0)
    CLIPModel(
        CLIPConfig(text_config=text, vision_config=vision, projection_dim=64)
    ).save_pretrained(path)


def overrides(root: Path, name: str) -> list[str]:
    reward = []
    if name == "lora-clip":
        reward = ["reward=clip_score:1.0", f"reward.clip_score.options.path={root / 'small-clip'}"]
    return [
        *BASE,
        *reward,
        *CONFIGS[name],
        f"model.path={root / 'small-sd3'}",
        f"data.train_prompts={root / 'prompts.txt'}",
        f"run.output_dir={root / ('out-' + name)}",
        "run.overwrite=true",
    ]


def live_bytes() -> int:
    """Bytes of every CPU tensor storage reachable now (each storage once; DTensors: the
    local shard): the state the run holds once built."""
    import gc

    from torch.distributed.tensor import DTensor

    seen, total = set(), 0
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor):
                continue
            t = obj.to_local() if isinstance(obj, DTensor) else obj
            storage = t.untyped_storage()
        except Exception:  # noqa: BLE001 - meta/fake tensors and the like
            continue
        if storage.device.type == "cpu" and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _rise_after_mark(prof) -> float:
    """The most the allocator's live bytes rose above their level at the marker, after it."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live, base, rise = 0, None, 0
    for e in events:
        live += e.nbytes()
        if base is None and e.nbytes() == MARK:
            base = live - MARK
        elif base is not None:
            rise = max(rise, live - base)
    if base is None:
        raise RuntimeError("marker allocation not found in the profile")
    return float(rise)


def _worker(rank: int, world: int, port: int, root: str, name: str, result: str) -> None:
    rank_env(rank, world, port)
    from torch.profiler import ProfilerActivity, profile

    from flowgrpo.config import load_config
    from flowgrpo.engine.dist import cleanup, init_distributed, seed_everything
    from flowgrpo.trainer.loop import Run, train_one_step

    cfg = load_config(str(Path(root) / "preset.yaml"), overrides(Path(root), name), command="train")
    dist = init_distributed()
    seed_everything(cfg.seed, dist.rank)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run = Run(cfg, dist)
        state = live_bytes()  # what the built run holds (loading's transients excluded)
        marker = torch.empty(MARK, dtype=torch.uint8)
        del marker
        for step in (1, 2):  # step 2: the optimizer's moments exist during the backward
            train_one_step(run, step)
    peak = state + _rise_after_mark(prof)
    if rank == 0:
        Path(result).write_text(json.dumps({"peak": peak}))
    cleanup()
    os._exit(0)  # the CPU profiler can abort at interpreter exit (see bench/sp.py)


def measure(root: Path, name: str, world: int) -> float:
    """Rank 0's peak bytes of one training step of config ``name`` on ``world`` ranks."""
    port = free_port()
    result = root / f"peak-{name}-{world}.json"
    mp.start_processes(
        _worker,
        args=(world, port, str(root), name, str(result)),
        nprocs=world,
        start_method="spawn",
        join=True,
    )
    return json.loads(result.read_text())["peak"]


def planned(root: Path, name: str, world: int) -> float:
    from flowgrpo.config import load_config
    from flowgrpo.planner import plan_memory

    cfg = load_config(str(root / "preset.yaml"), overrides(root, name), check_paths=False)
    return plan_memory(cfg, world, 1.0, device="cpu").total


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    save_small_pipeline(root)
    for name in CONFIGS:
        for world in (1, 2):
            got, plan = measure(root, name, world), planned(root, name, world)
            print(
                f"{name:8} ranks {world}: measured {got / 2**20:8.1f} MiB, planned "
                f"{plan / 2**20:8.1f} MiB, ratio {plan / got:.3f}",
                flush=True,
            )
