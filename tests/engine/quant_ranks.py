"""The quantized base (``model.base_quant``) on 2 ranks against 1 process: helpers for
tests/engine/test_engine_quant.py and its spawned job. Each rank loads the saved tiny SD3
pipeline's transformer sharded (meta-built, each rank quantizing its own rows as they load)
and from the whole pipeline, and records the whole state (codes, scales, LoRA) before and
after one training step, with the bytes of codes this rank holds."""

from __future__ import annotations

import traceback
from pathlib import Path

import torch

MODES = ("int8", "nf4")


def build(path: Path, mode: str, *, empty: bool):
    """The engine of a LoRA fine-tune (r 4, EMA off) on the ``mode``-quantized base."""
    from flowgrpo.engine import DiffusersFSDPEngine, EngineConfig
    from flowgrpo.models.registry import build_adapter, load_pipeline

    pipe = load_pipeline(path, torch_dtype=torch.bfloat16, empty_trained=empty)
    cfg = EngineConfig(seed=5)
    cfg.lora.rank, cfg.optim.lr = 4, 1e-3
    cfg.base_quant = mode
    return DiffusersFSDPEngine(build_adapter(pipe), cfg)


def run(path: Path, mode: str, *, empty: bool) -> dict:
    """{"loaded": whole state, "trained": after one step, "local_bytes": (this rank's code
    bytes, weights coded)}."""
    from load_ranks import snapshot, train_once

    from flowgrpo.engine.quant import quantized_bytes

    engine = build(path, mode, empty=empty)
    out = {"loaded": snapshot(engine), "local_bytes": quantized_bytes(engine.model)}
    train_once(engine, engine.adapter, "sd3")
    out["trained"] = snapshot(engine)
    return out


def job(rank: int, world: int, port: int, workdir: str) -> None:
    """Both modes, sharded and whole-model path, on this rank; rank 0 saves the results."""
    from flowgrpo.testing.ranks import rank_env

    rank_env(rank, world, port)
    from flowgrpo.engine import cleanup, init_distributed
    from flowgrpo.engine import dist as fdist

    init_distributed()
    work = Path(workdir)
    results: dict = {}
    try:
        for mode in MODES:
            results[mode] = {e: run(work / "sd3", mode, empty=e) for e in (True, False)}
            results[mode]["bytes"] = fdist.all_gather_object(results[mode][True]["local_bytes"])
    except Exception:  # noqa: BLE001 - reported by the test process
        results = {"error": traceback.format_exc()}
    if rank == 0:
        torch.save(results, work / "quant.pt")
    cleanup()
