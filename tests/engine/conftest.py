import pytest


@pytest.fixture(scope="session")
def tiny_traj():
    import tinymodel

    return tinymodel.make_trajectory(tinymodel.TinyAdapter())


@pytest.fixture(autouse=True, scope="module")
def _one_thread_here(one_thread):
    """Every engine test on one thread (the kit's fixture): tiny models run fastest so, and
    the spawned ranks need the other core."""
    yield
