import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for the toy's tiny ops: as fast alone, and far faster on a shared
    CPU (OpenMP's spinning threads). Files ask for it with ``usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
