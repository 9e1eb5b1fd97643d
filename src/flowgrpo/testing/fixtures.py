"""pytest fixtures of the kit; a conftest.py makes them available with
``from flowgrpo.testing.fixtures import one_thread, dist1  # noqa: F401``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from flowgrpo.testing import ranks


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for the module's tests (see ``ranks.one_thread``): a file asks for it
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``, a folder with an autouse
    fixture in its conftest.py that requests it."""
    with ranks.one_thread():
        yield


@pytest.fixture(scope="module")
def dist1() -> Any:
    """The 1-rank process group of this pytest process (created once, reused, never torn
    down: other modules' engines may still hold DTensors on it)."""
    from flowgrpo.engine import init_distributed

    return init_distributed()
