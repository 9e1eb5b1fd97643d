"""Sequence parallelism: peak memory per rank and time per sample of one training pass at a
long sequence, sp=2 (2 ranks, one SP group) against sp=1 (1 rank), the same code path.

The pass is what training does per micro-batch: the guided velocity with grad through BOTH
CFG branches (one doubled batch), a scalar loss on it, backward; LoRA (r 8, the adapter's
targets), FSDP2 per block + root on the run's mesh, SP enabled on the sp=2 run. Default size
256 x 256 px = 4,096 image tokens on the tiny-width pipelines, batch 1 (2 rows with CFG).

Memory = peak of live bytes allocated by torch during the pass (activations, gathered
params, grads, collective buffers), from the profiler's allocator events
(``profile_memory=True``: torch's CPU allocator reports every allocation and free to it),
plus the model state held before the pass (local parameter shards). Why this: torch has no
allocator statistics for the CPU (``torch.cuda.max_memory_allocated`` has no CPU twin);
tracemalloc sees only Python's allocator, not torch's; RSS adds the libraries, the allocator's
caching and everything else in the process, and ``ru_maxrss`` cannot be reset between runs.
Time per sample (gloo on loopback, 1 thread per rank, tiny widths) is reported, not a target:
measure speed on GPUs.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import tempfile
import time
from itertools import accumulate
from pathlib import Path

import torch
import torch.multiprocessing as mp

from flowgrpo.testing.ranks import free_port, rank_env

GUIDANCE = 4.0


def allocator_timeline(events) -> tuple[list[int], list[int]]:
    """(times [ns], bytes live after each record) of the profiler's allocation (+) and free
    (-) records among ``events`` (a profile's kineto events), in time order: the running sum
    above the profiled region's start."""
    records = [e for e in events if e.name() == "[memory]"]
    records.sort(key=lambda e: e.start_ns())
    return [e.start_ns() for e in records], list(accumulate(e.nbytes() for e in records))


def peak_allocated_mb(prof) -> float:
    """Peak of the running sum of the profiler's allocation (+) and free (-) records, in MiB:
    the most torch memory live at once during the profiled region, above its start."""
    _, live = allocator_timeline(prof.profiler.kineto_results.events())
    return max([0, *live]) / 2**20


def _model_state_mb(model: torch.nn.Module) -> float:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total / 2**20


def _prepare(kind: str, pm, size: int, batch: int, lora_rank: int = 8):
    from peft import LoraConfig
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flowgrpo.engine.parallelize import transformer_blocks
    from flowgrpo.engine.sp import enable_sequence_parallel, set_sp_gradient_scale
    from flowgrpo.models import build_adapter
    from flowgrpo.testing.tiny import tiny_pipeline

    adapter = build_adapter(tiny_pipeline(kind))
    if kind == "flux":  # FLUX.1-dev's guidance is distilled: true CFG gives the second branch
        adapter.true_cfg_scale = GUIDANCE
    model = adapter.transformer
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        targets = list(adapter.lora_target_modules)
        model.add_adapter(LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, target_modules=targets))
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    enable_sequence_parallel(model, pm, pm.sp_size)  # None for sp = 1
    for block in transformer_blocks(model):
        fully_shard(block, mesh=pm.fsdp)
    fully_shard(model, mesh=pm.fsdp, mp_policy=MixedPrecisionPolicy(output_dtype=torch.float32))
    set_sp_gradient_scale(model, pm)
    prompts = [f"a photo of a red cube number {i}" for i in range(batch)]
    with torch.no_grad():
        pos, neg = adapter.encode(prompts, ["blurry"] * batch, guidance_scale=GUIDANCE)
    latents = adapter.prepare_latents(batch, size, size, torch.Generator().manual_seed(0))
    sigma = torch.full((batch,), 0.7)

    def train_pass() -> None:
        model.zero_grad(set_to_none=True)
        v = adapter.velocity(
            model, latents, sigma, pos, neg, guidance_scale=GUIDANCE, height=size, width=size
        )
        v.square().mean().backward()

    # tiny pipelines: VAE factor 2 x patch 2, so (size / 4)^2 image tokens for every family
    tokens = {"image_tokens": (size // 4) ** 2, "text_tokens": int(pos.embeds.shape[1])}
    return model, train_pass, tokens


def _worker(rank: int, world: int, port: int, settings: dict, out_file: str) -> None:
    rank_env(rank, world, port)
    import warnings

    import diffusers
    from torch.profiler import ProfilerActivity, profile

    from flowgrpo.engine import dist as fdist
    from flowgrpo.engine.sp import build_parallel_mesh

    warnings.filterwarnings("ignore")
    diffusers.utils.logging.set_verbosity_error()
    fdist.init_distributed()
    pm = build_parallel_mesh(world, 1, world, "cpu")
    results = {}
    for kind in settings["kinds"]:
        model, train_pass, row = _prepare(kind, pm, settings["size"], settings["batch"])
        for _ in range(settings["warmup"]):
            train_pass()
        times = []
        for _ in range(settings["repeats"]):
            fdist.barrier()
            t0 = time.perf_counter()
            train_pass()
            fdist.barrier()
            times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            train_pass()
        row["pass_peak_mb"] = peak_allocated_mb(prof)
        row["model_state_mb"] = _model_state_mb(model)
        row["peak_mb"] = row["pass_peak_mb"] + row["model_state_mb"]
        row["per_sample_s"] = statistics.median(times) / settings["batch"]
        results[kind] = row
        del model, train_pass
        gc.collect()
    every = fdist.all_gather_object(results)
    if rank == 0:  # the worst rank's memory and time
        for kind, row in results.items():
            for key in ("pass_peak_mb", "model_state_mb", "peak_mb", "per_sample_s"):
                row[key] = max(r[kind][key] for r in every)
        Path(out_file).write_text(json.dumps(results))
    fdist.cleanup()
    # Leave without interpreter teardown: torch's CPU profiler (kineto) sometimes aborts a
    # process at exit after profiling ("terminate called without an active exception",
    # SIGABRT: 3 of 11 runs of the quick sp bench here, 0 of 8 with this exit). The results
    # are written and the process group destroyed by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(world: int, settings: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, free_port(), settings, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def bench_sp(kinds, *, quick: bool = False, repeats: int = 3, warmup: int = 1) -> dict:
    """Per kind: image/text tokens, sp1_/sp2_ peak_mb (pass peak + model state, worst rank),
    pass_peak_mb, model_state_mb, per_sample_s, and the ratios ``sp2_peak_over_sp1``
    (target <= 0.6) and ``sp2_time_over_sp1``. quick: 64 x 64 px (256 tokens), one repeat."""
    settings = {
        "kinds": list(kinds),
        "size": 64 if quick else 256,
        "batch": 1,
        "repeats": 1 if quick else repeats,
        "warmup": 0 if quick else warmup,
    }
    one, two = _run(1, settings), _run(2, settings)
    out = {}
    for kind in settings["kinds"]:
        row = {k: one[kind][k] for k in ("image_tokens", "text_tokens")}
        for name, res in (("sp1", one[kind]), ("sp2", two[kind])):
            for key in ("peak_mb", "pass_peak_mb", "model_state_mb", "per_sample_s"):
                row[f"{name}_{key}"] = res[key]
        row["sp2_peak_over_sp1"] = row["sp2_peak_mb"] / row["sp1_peak_mb"]
        row["sp2_time_over_sp1"] = row["sp2_per_sample_s"] / row["sp1_per_sample_s"]
        out[kind] = row
    return out
