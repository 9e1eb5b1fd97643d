"""Process-group setup shared by the engine and the trainer.

One code path for every launch: under ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR set)
the group comes from the environment; a plain ``python`` process gets a 1-rank group on an
in-memory ``HashStore`` (no port, no env vars), so FSDP2, DTensor and DCP behave identically
with 1 or N processes. Backend: NCCL for CUDA tensors (with gloo for CPU tensors) when CUDA is
available, gloo otherwise.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Callable
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


_REPORTER, _REPORTED, _THROUGH = (
    "flowgrpo/error_reporter",
    "flowgrpo/error_reported",
    "flowgrpo/error_through",
)
LAUNCH_STORE_WAIT_S = 30.0  # how long a rank waits for rank 0's store before a launch's group


def report_failure_once(emit: Callable[[], None]) -> bool:
    """Run ``emit()`` (print the failure's line) on the one rank that reports a failure: the
    first to claim it in a store every rank reaches; True there. The others wait (bounded) until
    it has emitted before they return and exit, so a launcher that terminates the other ranks
    when one exits (torchrun) cannot kill the reporter before its line is out.

    Inside a process group its store is used (a rank that cannot reach it, gone with the rank
    that failed and reported, stays quiet). Before the group exists (a config error, which
    every rank finds) torchrun's variables name the launch's store: torchrun's agent's, or one
    rank 0 hosts on MASTER_PORT (then it stays up until every rank is through, at most 10 s);
    a rank that cannot reach any emits anyway (a line twice beats none). One process: emits."""
    if dist.is_initialized():
        if dist.get_world_size() == 1:
            emit()
            return True
        try:
            store = dist.distributed_c10d._get_default_store()
            store.set_timeout(timedelta(seconds=5))
        except Exception:  # noqa: BLE001 - the store went down with the failing rank
            return False
        return _claim(store, str(get_rank()), emit, reach_fails_quietly=True)
    world = int(os.environ.get("WORLD_SIZE") or 1)
    store, hosting = _launch_store(world) if world > 1 else (None, False)
    if store is None:
        emit()
        return True
    won = _claim(store, os.environ.get("RANK", "0"), emit, reach_fails_quietly=False)
    with contextlib.suppress(Exception):
        store.add(_THROUGH, 1)
        end = time.monotonic() + 10.0
        while hosting and store.add(_THROUGH, 0) < world and time.monotonic() < end:
            time.sleep(0.05)  # the others still claim or wait in this rank's store
    return won


def _claim(store: Any, me: str, emit: Callable[[], None], *, reach_fails_quietly: bool) -> bool:
    try:
        won = store.compare_set(_REPORTER, "", me).decode() == me
    except Exception:  # noqa: BLE001 - the store is gone or unreachable
        if reach_fails_quietly:
            return False
        emit()
        return True
    if won:
        emit()
        with contextlib.suppress(Exception):
            store.set(_REPORTED, me)
    else:
        with contextlib.suppress(Exception):  # the reporter's line first, then this rank exits
            store.wait([_REPORTED], timedelta(seconds=10))
    return won


def _launch_store(world: int) -> tuple[Any, bool]:
    """(the store of the launch torchrun's variables describe, whether this rank hosts it), or
    (None, False) when there is none to reach. Under torchrun's agent (as init_process_group
    does): a client of the agent's store, keys scoped to this restart attempt; otherwise rank
    0 hosts one on MASTER_PORT and the others connect to it."""
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        rank = int(os.environ.get("RANK", "0"))
        wait = timedelta(seconds=LAUNCH_STORE_WAIT_S)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            client = dist.TCPStore(host, port, world, False, wait)
            return dist.PrefixStore(f"/worker/attempt_{attempt}/flowgrpo", client), False
        hosting = rank == 0
        store = dist.TCPStore(host, port, world, hosting, wait, wait_for_workers=False)
        store.set_timeout(timedelta(seconds=5))
        return store, hosting
    except Exception:  # noqa: BLE001 - no variables, a port taken, no rank 0 to reach
        return None, False


def claim_error_report() -> bool:
    """True for the one rank that reports a failure (``report_failure_once`` without a line)."""
    return report_failure_once(lambda: None)


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
    "report_failure_once",
    "barrier",
    "build_mesh",
    "cleanup",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_main_process",
    "seed_everything",
]
