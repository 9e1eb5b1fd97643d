"""Sharded loading against today's whole-model loading: helpers for tests/engine/
test_engine_load.py and its spawned 2-rank job. Each case saves a tiny pipeline, builds one
engine from the whole pipeline (``load_pipeline`` as before) and one from the meta-built
transformer(s) (``empty_trained=True``: shards read from the files), and records every
tensor that differs (weights, buffers, the reference copy, the EMA), before and after one
training step."""

from __future__ import annotations

import gc
import math
import traceback
from pathlib import Path

import torch

from flowgrpo.testing.families import double
from flowgrpo.testing.tiny import tiny_pipeline

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def save(kind: str, folder: Path) -> Path:
    """The tiny pipeline of ``kind`` saved (fp32 files) in ``folder / kind``."""
    path = folder / kind
    if not (path / "model_index.json").is_file():
        tiny_pipeline(kind).save_pretrained(path)
    return path


def build(path: Path, case: str, *, empty: bool, dtype: str = "bf16", **fsdp):
    """(engine, adapter) of a LoRA or full (with reference and EMA) fine-tune of the pipeline
    saved in ``path`` (named as its test double's kind, ``save``)."""
    from flowgrpo.engine import DiffusersFSDPEngine, EngineConfig
    from flowgrpo.models.registry import load_pipeline

    pipe = load_pipeline(path, torch_dtype=DTYPES[dtype], empty_trained=empty)
    adapter = double(path.name).adapter(pipe)
    cfg = EngineConfig(seed=5)
    cfg.lora.enabled, cfg.lora.rank = case == "lora", 4
    cfg.ema.enabled, cfg.ema.update_every = True, 1
    cfg.optim.lr = 1e-3
    for k, v in fsdp.items():
        setattr(cfg.fsdp, k, v)
    return DiffusersFSDPEngine(adapter, cfg, reference=case == "full"), adapter


def snapshot(engine) -> dict[str, torch.Tensor]:
    """Every tensor of the engine, whole (collective; rank 0 holds them): weights and buffers,
    the reference copy's weights, the EMA."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.tensor import DTensor

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {f"model.{k}": v for k, v in engine.full_state_dict().items()}
    out.update({f"buffer.{n}": b.detach().cpu().clone() for n, b in engine.model.named_buffers()})
    if engine._ref_model is not None:
        ref = get_model_state_dict(engine._ref_model, options=opts)
        out.update({f"ref.{k}": v for k, v in ref.items()})
    if engine.ema is not None:
        for name, e in zip(engine.param_names, engine.ema.shadow, strict=True):
            out[f"ema.{name}"] = e.full_tensor() if isinstance(e, DTensor) else e.clone()
    return out


def train_once(engine, adapter, kind: str) -> None:
    """One optimizer step on the squared guided velocity of two prompts (identical inputs on
    every rank: what an SP group needs) at the test double's size (with its source images,
    its frames)."""
    fam = double(kind)
    h, w = fam.size
    prompts = list(fam.prompts[:2])
    pos, neg = adapter.encode(
        prompts, [fam.negative] * 2, guidance_scale=3.0, images=fam.source_images(prompts)
    )
    video = {} if fam.num_frames is None else {"num_frames": fam.num_frames}
    latents = adapter.prepare_latents(2, h, w, torch.Generator().manual_seed(1), **video)
    sigma = torch.tensor([0.9, 0.4])
    v = adapter.velocity(
        engine.transformer, latents, sigma, pos, neg, guidance_scale=3.0, height=h, width=w
    )
    engine.backward(v.float().square().mean(), last=True)
    engine.optimizer_step()


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in dtype or any bit (and names only one side has)."""
    out = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k]):
            out.append(k)
    return out


def compare(path: Path, case: str, dtype: str = "bf16", **fsdp) -> dict[str, list[str]]:
    """{"loaded": differing names after loading, "trained": after one step, "count": how many
    tensors were compared}: the new path against today's."""
    old, old_adapter = build(path, case, empty=False, dtype=dtype, **fsdp)
    new, new_adapter = build(path, case, empty=True, dtype=dtype, **fsdp)
    loaded = (snapshot(old), snapshot(new))
    train_once(old, old_adapter, path.name)
    train_once(new, new_adapter, path.name)
    trained = (snapshot(old), snapshot(new))
    return {
        "loaded": differences(*loaded),
        "trained": differences(*trained),
        "count": [len(loaded[0])],
    }


CASES = {  # name: (kind, lora or full, fsdp settings); every family, both cases
    "sd3-full-offload": ("sd3", "full", {"cpu_offload": True}),
    "wan22-lora": ("wan22", "lora", {}),
    "qwen-full-hsdp": ("qwen_image", "full", {"replicate_degree": 2}),
    "qwen-lora-sp": ("qwen_image", "lora", {"sp_degree": 2}),
    "flux-full-sp": ("flux", "full", {"sp_degree": 2}),
    "wan-lora-sp": ("wan", "lora", {"sp_degree": 2}),
}


def job(rank: int, world: int, port: int, workdir: str) -> None:
    """Every case of ``CASES`` on this rank; rank 0 saves the results (or the error)."""
    from flowgrpo.testing.ranks import rank_env

    rank_env(rank, world, port)
    import diffusers

    from flowgrpo.engine import cleanup, init_distributed
    from flowgrpo.engine import dist as fdist

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    init_distributed()
    work = Path(workdir)
    results: dict = {}
    try:
        for name, (kind, case, fsdp) in CASES.items():
            results[name] = compare(work / kind, case, **fsdp)
        results["bytes"] = bytes_read(work / "sd3")
    except Exception:  # noqa: BLE001 - reported by the test process
        results["error"] = traceback.format_exc()
    every = fdist.all_gather_object(results.pop("bytes", None))
    if rank == 0:
        torch.save({"cases": results, "bytes": every}, work / "results.pt")
    cleanup()


def _peak_bytes(prof) -> int:
    """The most bytes torch's allocator held at once in the profiled region, above its start
    (the profiler's allocation and free records summed in time order)."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _bytes(tensors) -> int:
    from flowgrpo.engine.ema import local

    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def measure_construction(path: Path, *, empty: bool) -> dict[str, int]:
    """Peak allocated bytes while loading the pipeline and while building a full fine-tune
    engine (bf16 weights, fp32 masters, bf16 reference, EMA), with the sizes to judge them:
    the frozen components, the whole transformer (bf16), its largest block (fp32), this rank's
    engine state."""
    import diffusers
    from torch.profiler import ProfilerActivity, profile

    from flowgrpo.engine import DiffusersFSDPEngine, EngineConfig
    from flowgrpo.engine.parallelize import transformer_blocks
    from flowgrpo.models.registry import build_adapter, load_pipeline

    # each region starts after a collection: an earlier run's engine (FSDP modules hold
    # reference cycles) freed by the GC inside a region would count as negative bytes there
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        diffusers.StableDiffusion3Pipeline.from_pretrained(
            path, transformer=None, dtype=torch.bfloat16
        )
    without_transformer = _peak_bytes(prof)
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pipe = load_pipeline(path, torch_dtype=torch.bfloat16, empty_trained=empty)
    load_peak = _peak_bytes(prof)
    adapter = build_adapter(pipe)
    model = adapter.transformer
    numel = sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in b.parameters()) for b in transformer_blocks(model))
    cfg = EngineConfig()
    cfg.lora.enabled, cfg.ema.enabled = False, True
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine = DiffusersFSDPEngine(adapter, cfg, reference=True)
    state = list(engine.model.parameters()) + list(engine._ref_model.parameters())
    return {
        "load_peak": load_peak,
        "load_peak_without_transformer": without_transformer,
        "engine_peak": _peak_bytes(prof),
        "buffers": _bytes(model.buffers()),
        "whole_bf16": 2 * numel,
        "block_fp32": 4 * block,
        "engine_state": _bytes(state + list(engine.ema.shadow)),
    }


def bytes_read(path: Path) -> dict[str, int]:
    """Bytes this rank reads from the transformer's files while building a full fine-tune
    engine with a reference (both read from the files), and the files' tensor bytes."""
    from flowgrpo.engine import load

    counted = [0]
    original = load.Stored.read

    def read(self, f, rows=None):
        out = original(self, f, rows)
        counted[0] += out.numel() * out.element_size()
        return out

    load.Stored.read = read
    try:
        build(path, "full", empty=True)
    finally:
        load.Stored.read = original
    stored = load.weight_files(path / "transformer").values()
    total = sum(math.prod(s.shape) * s.dtype.itemsize for s in stored)
    return {"read": counted[0], "file": total}
