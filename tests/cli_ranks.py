"""`python -m flowgrpo ...` as several gloo ranks, one CLI process each, with the variables
torchrun would set (loopback rendezvous, one thread each, offline hub)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def start_ranks(
    args: Sequence[str], *, world: int = 2, pythonpath: Sequence[str] = (), stdout: bool = False
) -> list[subprocess.Popen]:
    """Start ``flowgrpo ARGS`` on ``world`` ranks (stderr piped; stdout too with ``stdout``);
    ``pythonpath`` folders are importable beside the package's sources."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = []
    for rank in range(world):
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", RANK=str(rank))
        env.update(WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=port, PYTHONPATH=os.pathsep.join([SRC, *pythonpath]))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "flowgrpo", *args],
                env=env,
                stdout=subprocess.PIPE if stdout else None,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs
