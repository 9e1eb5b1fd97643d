"""What every multi-rank bench worker does first: a free loopback port, and the rank's
environment (torchrun's variables on 127.0.0.1, offline hub, its thread count)."""

from __future__ import annotations

import os
import socket

import torch


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, *, threads: int = 1) -> None:
    """Set torchrun's variables for ``rank`` of ``world`` on loopback ``port``, the offline
    hub, and ``threads`` torch threads (the ranks share the machine's cores)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",
    )
    torch.set_num_threads(threads)
