"""Per-rank peak memory of loading and one training step, against the sharded floor.

A tiny-width but deep SD3 pipeline (weights dominate; saved in fp32 to a temporary folder,
loaded with ``model.dtype=bf16``) is loaded as ``flowgrpo train`` loads it, the engine is
built (full fine-tune with a KL reference, or LoRA), and one training step runs (policy and
reference forwards, backward, AdamW step). Each run is a fresh process per rank (1 and 2
ranks, gloo), measured twice: the whole-model path (``load_pipeline`` then the engine
shards it: how every run loaded before sharded loading) and the sharded path (the trained
transformer built on the meta device, each rank reading its shards).

Figures per rank (the worst rank): ``rss_peak_mb``, the process's peak resident memory
(VmHWM, reset at the start of the run: libraries included; glibc's mmap threshold fixed, see
``MALLOC_ENV``), and ``alloc_peak_mb``, the most
bytes torch's CPU allocator held at once (the profiler's allocation records summed in time,
from the start of the run). The same run with a ONE-block transformer gives the fixed part
(libraries, frozen text encoders and VAE, activations of a block); ``over_floor`` = (peak -
one-block peak) / the sharded floor of the blocks' difference in parameters: 18 bytes/param/
ranks for a full fine-tune with KL (fp32 master 4 + fp32 grad 4 + Adam moments 8 + bf16
reference 2), 2 bytes/param/ranks for LoRA (the bf16 base weights; the LoRA itself is small).
Target: <= 1.2 on the sharded path.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.multiprocessing as mp

from flowgrpo.testing.ranks import free_port, rank_env

FLOOR_BYTES = {"full": 18, "lora": 2}
#: tiny width (6 heads x 64 = 384), deep: about 5.3 M parameters per block
WIDE = dict(attention_head_dim=64, num_attention_heads=6, caption_projection_dim=384)


def _hwm_mb() -> float:
    """Peak resident memory of this process since the last reset (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_hwm() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux: ru_maxrss, from process start


def _run_one(spec: dict, profile_alloc: bool) -> dict:
    """Load, build the engine, train one step; returns the peaks of this rank."""
    from torch.profiler import ProfilerActivity, profile

    from bench.sp import peak_allocated_mb
    from flowgrpo.engine import DiffusersFSDPEngine, EngineConfig
    from flowgrpo.models.registry import build_adapter, load_pipeline

    gc.collect()
    _reset_hwm()
    watch = (
        profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        if profile_alloc
        else nullcontext()
    )
    with watch as prof:
        pipe = load_pipeline(
            spec["path"], torch_dtype=torch.bfloat16, empty_trained=spec["sharded"]
        )
        adapter = build_adapter(pipe)
        cfg = EngineConfig(seed=0)
        cfg.lora.enabled, cfg.lora.rank = spec["case"] == "lora", 8
        engine = DiffusersFSDPEngine(adapter, cfg, reference=spec["case"] == "full")
        pos, _ = adapter.encode(["a red cube on a table"], guidance_scale=1.0)
        latents = adapter.prepare_latents(1, 32, 32, torch.Generator().manual_seed(0))
        sigma = torch.tensor([0.7])
        kw = dict(guidance_scale=1.0, height=32, width=32)
        with torch.no_grad(), engine.reference_transformer() as ref:
            v_ref = adapter.velocity(ref, latents, sigma, pos, **kw)
        v = adapter.velocity(engine.transformer, latents, sigma, pos, **kw)
        engine.backward((v - v_ref).square().mean() + v.mean(), last=True)
        engine.optimizer_step()
    row = {"rss_peak_mb": _hwm_mb()}
    if profile_alloc:
        row["alloc_peak_mb"] = peak_allocated_mb(prof)
    del engine, adapter, pipe
    gc.collect()
    return row


def _worker(rank: int, world: int, port: int, specs: list, profile_alloc: bool, out: str):
    rank_env(rank, world, port)
    import warnings

    import diffusers

    from flowgrpo.engine import dist as fdist

    warnings.filterwarnings("ignore")
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    fdist.init_distributed()
    rows = [_run_one(spec, profile_alloc) for spec in specs]
    every = fdist.all_gather_object(rows)
    if rank == 0:  # the worst rank
        worst = [{k: max(r[i][k] for r in every) for k in rows[i]} for i in range(len(rows))]
        Path(out).write_text(json.dumps(worst))
    fdist.cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown after profiling (see bench/sp.py)


#: glibc's mmap threshold fixed at 128 KiB in the ranks: by default glibc raises it to the
#: size of each large block freed (up to 32 MiB), so FSDP's per-block all-gather buffers on the
#: CPU come from the heap afterwards and stay resident once freed: measured here, peak RSS of a
#: 2-rank full fine-tune step 1646 MB with the default, 1077 MB with the threshold fixed, the
#: loading stages unchanged. Fixed, RSS follows the memory actually live.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _spawn(world: int, specs: list, profile_alloc: bool) -> list[dict]:
    saved = {k: os.environ.get(k) for k in MALLOC_ENV}
    os.environ.update(MALLOC_ENV)  # the spawned ranks inherit it at start
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            args = (world, free_port(), specs, profile_alloc, out)
            mp.spawn(_worker, args=args, nprocs=world, join=True)
            return json.loads(Path(out).read_text())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _save(folder: Path, num_layers: int) -> int:
    """The SD3 pipeline with ``num_layers`` blocks saved in ``folder``; its transformer's
    parameter count."""
    from flowgrpo.models.tiny import tiny_pipeline

    pipe = tiny_pipeline("sd3", num_layers=num_layers, **WIDE)
    count = sum(p.numel() for p in pipe.transformer.parameters())
    pipe.save_pretrained(folder)
    return count


def bench_memory(*, quick: bool = False, num_layers: int = 12) -> dict:
    """{"<case>_<ranks>rank": {per path: deep / one-block peaks, over_floor}, "params": ...}.

    Full run: both paths (whole, sharded), full and LoRA, 1 and 2 ranks, each run in fresh
    processes. quick (a smoke test of the code, not a measurement): the sharded path, full
    fine-tune, 3 blocks, 2 ranks, the one-block then the deep run in the same processes, no
    allocator profile."""
    layers = 3 if quick else num_layers
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        deep, one = Path(tmp) / "deep", Path(tmp) / "one"
        n_deep, n_one = _save(deep, layers), _save(one, 1)
        out["params"] = {"deep": n_deep, "one_block": n_one, "blocks": layers}
        paths = ("sharded",) if quick else ("whole", "sharded")
        cases = ("full",) if quick else ("full", "lora")
        for case in cases:
            for world in (2,) if quick else (1, 2):
                row: dict = {}
                floor_mb = FLOOR_BYTES[case] * (n_deep - n_one) / world / 2**20
                row["floor_mb"] = floor_mb
                for path in paths:
                    specs = [
                        {"path": str(p), "case": case, "sharded": path == "sharded"}
                        for p in (one, deep)
                    ]
                    if quick:
                        small, big = _spawn(world, specs, False)
                    else:
                        small = _spawn(world, specs[:1], True)[0]
                        big = _spawn(world, specs[1:], True)[0]
                    for key in big:
                        row[f"{path}_{key}"] = big[key]
                        row[f"{path}_one_block_{key}"] = small[key]
                    row[f"{path}_over_floor"] = (
                        big["rss_peak_mb"] - small["rss_peak_mb"]
                    ) / floor_mb
                    if "alloc_peak_mb" in big:
                        row[f"{path}_alloc_over_floor"] = (
                            big["alloc_peak_mb"] - small["alloc_peak_mb"]
                        ) / floor_mb
                out[f"{case}_{world}rank"] = row
    return out
