"""Process-group setup shared by the engine and the trainer.

One code path for every launch: under ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR set)
the group comes from the environment; a plain ``python`` process gets a 1-rank group on an
in-memory ``HashStore`` (no port, no env vars), so FSDP2, DTensor and DCP behave identically
with 1 or N processes. Backend: NCCL for CUDA tensors (with gloo for CPU tensors) when CUDA is
available, gloo otherwise.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, rank on its node, its device."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _backend() -> str:
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 1800.0) -> DistInfo:
    """Join (or create) the default process group and return this process's DistInfo.

    Reuses an existing group. With torchrun's env vars it uses ``env://``; otherwise it makes a
    1-rank group on a HashStore (works without any network). Idempotent.
    """
    if dist.is_initialized():
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return DistInfo(
            dist.get_rank(),
            dist.get_world_size(),
            local_rank,
            _device(local_rank),
            str(dist.get_backend()),
        )
    backend = _backend()
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = _device(local_rank)
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        local_rank = 0
        device = _device(0)
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def build_mesh(world_size: int, replicate_degree: int = 1, device_type: str | None = None):
    """1-D mesh ("shard",) for FSDP, or 2-D ("replicate", "shard") for HSDP when
    ``replicate_degree`` > 1 (e.g. the number of nodes): shard inside a replica group."""
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if replicate_degree < 1 or world_size % replicate_degree:
        raise ValueError(
            f"replicate_degree={replicate_degree} must be >= 1 and divide world_size={world_size}"
        )
    if replicate_degree == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(
        device_type,
        (replicate_degree, world_size // replicate_degree),
        mesh_dim_names=("replicate", "shard"),
    )


def seed_everything(seed: int, rank: int = 0) -> None:
    """Seed python, numpy and torch (all devices) with ``seed + rank``."""
    s = int(seed) + int(rank)
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_gather_tensor(t: torch.Tensor) -> torch.Tensor:
    """Concatenate ``t`` [n_r, ...] from every rank along dim 0 (n_r may differ by rank)."""
    if get_world_size() == 1:
        return t
    n = torch.tensor([t.shape[0]], device=t.device)
    sizes = [torch.zeros_like(n) for _ in range(get_world_size())]
    dist.all_gather(sizes, n)
    sizes = [int(s) for s in sizes]
    pad = max(sizes) - t.shape[0]
    padded = torch.cat([t, t.new_zeros((pad, *t.shape[1:]))]) if pad else t.contiguous()
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return torch.cat([o[:s] for o, s in zip(out, sizes, strict=True)])


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order."""
    if get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over ranks (returns a new tensor; ``t`` untouched)."""
    t = t.clone()
    if get_world_size() > 1:
        dist.all_reduce(t)
        t /= get_world_size()
    return t


def all_reduce_min(t: torch.Tensor) -> torch.Tensor:
    """Elementwise minimum over ranks (returns a new tensor; ``t`` untouched)."""
    t = t.clone()
    if get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t


def claim_error_report() -> bool:
    """True for the one rank that reports a failure: the first to claim it in the process
    group's store (the rank that failed first; the others fail later, when their collectives
    lose it). A single process always reports; a rank that cannot reach the store does not."""
    if get_world_size() == 1:
        return True
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(timedelta(seconds=5))
        me = str(get_rank())
        return store.compare_set("flowgrpo/error_reporter", "", me).decode() == me
    except Exception:  # noqa: BLE001 - the store went down with the failing rank
        return False


def cleanup() -> None:
    """Destroy the default process group if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = [
    "DeviceMesh",
    "DistInfo",
    "all_gather_object",
    "all_gather_tensor",
    "all_reduce_mean",
    "all_reduce_min",
    "claim_error_report",
    "barrier",
    "build_mesh",
    "cleanup",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "seed_everything",
]
