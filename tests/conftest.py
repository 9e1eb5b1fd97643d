import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# one thread per pytest-xdist worker (`make test` runs two on two cores), else two
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def outside_the_working_folder(tmp_path_factory):
    """Every test runs in a fresh empty folder: what a user has in theirs (``runs/`` of a
    ``make demo``, a ``myrewards.py``) never changes a result, and no test writes there."""
    before = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(before)


# The kit's fixtures (one_thread, dist1), available to every test folder.
from flowgrpo.testing.fixtures import dist1, one_thread  # noqa: E402, F401
