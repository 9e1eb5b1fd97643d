import sys
from pathlib import Path

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture(scope="module")
def dist1():
    """The 1-rank process group of this pytest process (created once, reused, never torn
    down: other modules' engines may still hold DTensors on it)."""
    from flowgrpo.engine import init_distributed

    return init_distributed()


@pytest.fixture(scope="session")
def tiny_traj():
    import tinymodel

    return tinymodel.make_trajectory(tinymodel.TinyAdapter())


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and the spawned ranks need the other core."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
