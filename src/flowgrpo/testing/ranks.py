"""Several ranks on one machine: a free loopback port, torchrun's variables for a rank, spawned
worker processes (``torch.multiprocessing.spawn``, gloo on 127.0.0.1) and the CLI as ranks.

Spawned workers are pickled by module path: a worker function must live in an importable
module (not in a test file's ``__main__`` or a closure), and it receives ``(rank, world, port,
*args)``; its first line is ``rank_env(rank, world, port)``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

SRC = str(Path(__file__).resolve().parents[2])  # the folder holding the flowgrpo package


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_variables(rank: int, world: int, port: int) -> dict[str, str]:
    """torchrun's variables for ``rank`` of ``world`` on loopback ``port``, and the offline hub."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "HF_HUB_OFFLINE": "1",
    }


def rank_env(rank: int, world: int, port: int, *, threads: int = 1) -> None:
    """Make this process ``rank`` of ``world`` (torchrun's variables on loopback ``port``, the
    offline hub) with ``threads`` torch threads: the ranks share the machine's cores."""
    os.environ.update(rank_variables(rank, world, port))
    torch.set_num_threads(threads)


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, join: bool = True) -> Any:
    """``torch.multiprocessing.spawn`` of ``fn(rank, nprocs, port, *args)`` with a fresh
    loopback port; ``join=False`` returns the context to ``join()`` later."""
    import torch.multiprocessing as mp

    return mp.spawn(fn, args=(nprocs, free_port(), *args), nprocs=nprocs, join=join)


def start_cli_ranks(
    args: Sequence[str],
    *,
    world: int = 2,
    pythonpath: Sequence[str] = (),
    stdout: bool = False,
    merged: bool = False,
) -> list[subprocess.Popen]:
    """Start ``python -m flowgrpo ARGS`` as ``world`` ranks with the variables torchrun would
    set (one thread each, offline hub); stderr is piped, stdout too with ``stdout``, both into
    one pipe (``communicate()[0]``) with ``merged``. ``pythonpath`` folders are importable
    beside the package's sources."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", **rank_variables(rank, world, port))
        env["PYTHONPATH"] = os.pathsep.join([SRC, *pythonpath])
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "flowgrpo", *args],
                env=env,
                stdout=subprocess.PIPE if stdout or merged else None,
                stderr=subprocess.STDOUT if merged else subprocess.PIPE,
                text=True,
            )
        )
    return procs


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One torch intra-op thread inside the block: tiny models run as fast on one, far faster
    on a shared CPU (OpenMP's spinning threads), and spawned ranks get the other cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
