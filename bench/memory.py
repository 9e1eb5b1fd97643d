"""Per-rank peak memory of loading and one training step, against the sharded floor.

A tiny-width but deep SD3 pipeline (saved in fp32 to a temporary folder, loaded with
``model.dtype=bf16``) is loaded as ``flowgrpo train`` loads it, the engine is built as that run
builds it (full fine-tune with a KL reference, or LoRA; ``fsdp.param_dtype`` auto resolves to
``model.dtype``, bf16, as ``config.loader.resolve_defaults`` does; activation checkpointing
on, as the presets of the large models set it) and one training step runs (reference and
policy forwards, backward, AdamW step). Each run is a fresh process per rank (1 and 2 ranks,
gloo), on the sharded path (the trained transformer built on the meta device, each rank
reading its shards); ``paths`` may add the whole-model path (``load_pipeline`` then the
engine shards it: how every run loaded before sharded loading).

Figures per rank (the worst rank): ``rss_peak_mb``, the process's peak resident memory
(VmHWM, reset at the start of the run: libraries included; glibc's mmap threshold fixed, see
``MALLOC_ENV``) with its peak per phase (``rss_phases_mb``), and ``alloc_peak_mb``, the most
bytes torch's CPU allocator held at once (the profiler's allocation records summed in time,
from the start of the run), measured in a SEPARATE run of the same job: the profiler's own
records are resident and grow with the number of ops, i.e. with depth (see ``bench_memory``).
The same run with a ONE-block transformer gives the fixed part (libraries, frozen text
encoders and VAE, one block gathered, its activations); ``over_floor`` = (peak - one-block
peak) / the sharded floor of the blocks' difference in parameters: 18 bytes/param/ranks for a
full fine-tune with KL (fp32 master 4 + fp32 grad 4 + Adam moments 8 + bf16 reference 2),
2 bytes/param/ranks for LoRA (the bf16 base weights). Target: <= 1.2. The allocator's peak
per phase (``alloc_<phase>_mb``) gives ``alloc_over_floor_same_phase``: the deep run's peak
minus the one-block run's peak in the SAME phase (the two runs' peaks can fall in different
phases). The profiler sees allocations on the threads it follows only: a collective's own
buffers on gloo's worker threads are in RSS, not in the allocator's figures (on a GPU, NCCL
writes into FSDP's buffers). ``lora_state_mb`` is
what the floor leaves out for LoRA: its fp32 master, grad and two Adam moments (16 bytes per
LoRA parameter / ranks) of the extra blocks.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
from bisect import bisect_left, bisect_right
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
import torch.multiprocessing as mp

from bench.sp import allocator_timeline, peak_allocated_mb
from flowgrpo.testing.ranks import free_port, rank_env

FLOOR_BYTES = {"full": 18, "lora": 2}
#: fp32 master 4 + fp32 grad 4 + Adam moments 8 per LoRA parameter (left out of the floor)
LORA_STATE_BYTES = 16
#: tiny width (6 heads x 64 = 384), deep: about 5.3 M parameters per block
WIDE = dict(attention_head_dim=64, num_attention_heads=6, caption_projection_dim=384)
#: blocks of the deep model per case. LoRA's floor is 2 bytes/param/ranks, so the costs that
#: come once per run rather than per block (a second block gathered while FSDP prefetches in
#: backward, which the one-block run does not have) weigh 9x more against it than against the
#: full fine-tune's 18: LoRA runs twice as deep to amortise them as much.
LAYERS = {"full": 12, "lora": 24}
LORA_RANK = 8
#: the run's settings: `flowgrpo train ... model.dtype=bf16` resolves fsdp.param_dtype auto to
#: bf16 (config.loader.resolve_defaults); checkpointing as qwen-image-ocr and wan-t2v-ocr set it
RUN_FSDP = {"param_dtype": "bf16", "activation_checkpointing": True}
PHASES = ("load", "engine", "reference_forward", "forward", "backward", "optimizer_step")


def _status_mb(key: str) -> float:
    """A field of /proc/self/status (VmHWM, VmRSS, RssAnon, RssFile), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    if key != "VmHWM":
        return 0.0
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _hwm_mb() -> float:
    """Peak resident memory of this process since the last reset (VmHWM), MiB."""
    return _status_mb("VmHWM")


def _reset_hwm() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # not Linux: ru_maxrss, from process start


def _alloc_phase_peaks_mb(prof, names: tuple[str, ...]) -> dict[str, float]:
    """The allocator's peak within each ``bench.memory.<name>`` range of the profile, MiB: the
    running sum of every allocation (+) and free (-) record from the start of the run, its
    maximum over the range (what is live on entering it included). Allocations on threads the
    profiler does not follow (gloo's workers: its collectives' own buffers on a CPU) are not in
    the records."""
    events = list(prof.profiler.kineto_results.events())
    ranges = {
        e.name()[len("bench.memory.") :]: (e.start_ns(), e.end_ns())
        for e in events
        if e.name().startswith("bench.memory.")
    }
    times, live = allocator_timeline(events)
    peaks = {}
    for name in names:  # what is live on entering the range, then after each record inside it
        start, end = ranges[name]
        first, last = bisect_left(times, start), bisect_right(times, end)
        peaks[name] = max([live[first - 1] if first else 0, *live[first:last]]) / 2**20
    return peaks


def _run_one(spec: dict, profile_alloc: bool) -> dict:
    """Load, build the engine, train one step; returns the peaks of this rank: the RSS peak
    and its peak per phase, or (``profile_alloc``) the allocator's peak and its peak per
    phase."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from flowgrpo.engine import DiffusersFSDPEngine, EngineConfig
    from flowgrpo.models.registry import build_adapter, load_pipeline

    phases: dict[str, float] = {}

    @contextmanager
    def stage(name: str):  # a phase: its RSS peak, and its range in the profiled run
        with record_function(f"bench.memory.{name}") if profile_alloc else nullcontext():
            yield
        phases[name] = _hwm_mb()
        _reset_hwm()

    gc.collect()
    _reset_hwm()
    watch = (
        profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        if profile_alloc
        else nullcontext()
    )
    with watch as prof:
        with stage("load"):
            pipe = load_pipeline(
                spec["path"], torch_dtype=torch.bfloat16, empty_trained=spec["sharded"]
            )
        with stage("engine"):
            adapter = build_adapter(pipe)
            cfg = EngineConfig(seed=0)
            cfg.lora.enabled, cfg.lora.rank = spec["case"] == "lora", LORA_RANK
            for key, value in RUN_FSDP.items():
                setattr(cfg.fsdp, key, value)
            engine = DiffusersFSDPEngine(adapter, cfg, reference=spec["case"] == "full")
        with stage("reference_forward"):
            pos, _ = adapter.encode(["a red cube on a table"], guidance_scale=1.0)
            latents = adapter.prepare_latents(1, 32, 32, torch.Generator().manual_seed(0))
            sigma = torch.tensor([0.7])
            kw = dict(guidance_scale=1.0, height=32, width=32)
            with torch.no_grad(), engine.reference_transformer() as ref:
                v_ref = adapter.velocity(ref, latents, sigma, pos, **kw)
        with stage("forward"):
            v = adapter.velocity(engine.transformer, latents, sigma, pos, **kw)
        with stage("backward"):
            engine.backward((v - v_ref).square().mean() + v.mean(), last=True)
        with stage("optimizer_step"):
            engine.optimizer_step()
    if profile_alloc:
        row = {"alloc_peak_mb": peak_allocated_mb(prof)}
        by_phase = _alloc_phase_peaks_mb(prof, PHASES)
        row.update({f"alloc_{name}_mb": by_phase[name] for name in PHASES})
    else:
        row = {"rss_peak_mb": max(phases.values()), "rss_file_mb": _status_mb("RssFile")}
        row.update({f"rss_{name}_mb": phases[name] for name in PHASES})
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


def _save(folder: Path, num_layers: int) -> tuple[int, int]:
    """The SD3 pipeline with ``num_layers`` blocks saved in ``folder``; its transformer's
    parameter count and the count of the LoRA (rank ``LORA_RANK``) the engine adds to it."""
    from peft import LoraConfig

    from flowgrpo.models.sd3 import SD3Adapter
    from flowgrpo.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline("sd3", num_layers=num_layers, **WIDE)
    model = pipe.transformer
    count = sum(p.numel() for p in model.parameters())
    pipe.save_pretrained(folder)
    targets = list(SD3Adapter.lora_target_modules)
    model.add_adapter(LoraConfig(r=LORA_RANK, target_modules=targets))
    lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    return count, lora


def _same_phase_over(big: dict, small: dict, floor_mb: float) -> tuple[str, float]:
    """(the phase of the deep run's allocator peak, (its peak there - the one-block run's peak
    in the same phase) / floor): the peaks of the two runs need not fall in the same phase (a
    one-block run peaks while the text is encoded, a deep one in backward), and then
    ``alloc_over_floor``, peak minus peak, subtracts a fixed cost the deep run's peak does not
    hold."""
    at = max(PHASES, key=lambda name: big[f"alloc_{name}_mb"])
    return at, (big[f"alloc_{at}_mb"] - small[f"alloc_{at}_mb"]) / floor_mb


def bench_memory(
    *, quick: bool = False, layers: dict[str, int] | None = None, paths: tuple = ("sharded",)
) -> dict:
    """{"<case>_<ranks>rank": {per path: deep / one-block peaks, over_floor}, "params": ...}.

    Full run: full and LoRA (``layers`` blocks each, default ``LAYERS``), 1 and 2 ranks,
    ``paths`` (sharded; "whole" for the old path too), each figure in fresh processes: RSS in
    a run without the profiler, the allocator's peak in a profiled run of the same job (the
    profiler's event records are resident: measured with it on, a 2-rank full fine-tune's
    peak RSS over the floor read 1.36, without it 1.01). quick (a smoke test of the code, not a
    measurement): the sharded path, full fine-tune, 3 blocks, 2 ranks, the one-block then the
    deep run in the same processes, no allocator profile."""
    layers = {"full": 3} if quick else (layers or LAYERS)
    out: dict = {"settings": {"lora_rank": LORA_RANK, **RUN_FSDP}}
    with tempfile.TemporaryDirectory() as tmp:
        saved: dict[int, tuple[Path, int, int]] = {}
        for n in sorted({1, *layers.values()}):
            saved[n] = (Path(tmp) / f"sd3_{n}", *_save(Path(tmp) / f"sd3_{n}", n))
        out["params"] = {
            f"{n}_blocks": {"transformer": c, "lora": r} for n, (_, c, r) in saved.items()
        }
        paths = ("sharded",) if quick else paths
        for case, n_layers in layers.items():
            (deep, n_deep, l_deep), (one, n_one, l_one) = saved[n_layers], saved[1]
            for world in (2,) if quick else (1, 2):
                row: dict = {"blocks": n_layers}
                floor_mb = FLOOR_BYTES[case] * (n_deep - n_one) / world / 2**20
                row["floor_mb"] = floor_mb
                if case == "lora":
                    row["lora_state_mb"] = LORA_STATE_BYTES * (l_deep - l_one) / world / 2**20
                for path in paths:
                    specs = [
                        {"path": str(p), "case": case, "sharded": path == "sharded"}
                        for p in (one, deep)
                    ]
                    if quick:
                        small, big = _spawn(world, specs, False)
                    else:
                        small, big = (_spawn(world, [s], False)[0] for s in specs)
                        small_alloc, big_alloc = (_spawn(world, [s], True)[0] for s in specs)
                        small.update(small_alloc)
                        big.update(big_alloc)
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
                        at, over = _same_phase_over(big, small, floor_mb)
                        row[f"{path}_alloc_peak_phase"] = at
                        row[f"{path}_alloc_over_floor_same_phase"] = over
                out[f"{case}_{world}rank"] = row
    return out
