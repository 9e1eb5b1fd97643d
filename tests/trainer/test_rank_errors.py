"""A failure under torchrun is reported in exactly one line, from the rank that found it: a
config error every rank finds (before the process group exists) is printed once, and the
reporter prints before any rank exits, so torchrun terminating the others when the first
exits cannot swallow the line (it did in 1 of 3 runs; the others printed it twice)."""

from __future__ import annotations

import time

import pytest

from flowgrpo.testing.ranks import start_cli_ranks

pytestmark = pytest.mark.slow

BAD = ["train", "toy-digits", "trainer.max_steps=0"]


def _as_torchrun(procs, timeout: float = 120) -> list[str]:
    """Wait for ``procs`` as torchrun does: once one exits with an error, terminate the rest
    (SIGTERM; torchrun polls every 0.1 s, this every 0.02 s). Their stderr."""
    end = time.monotonic() + timeout
    while any(p.poll() is None for p in procs) and time.monotonic() < end:
        if any(p.returncode not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.terminate()
        time.sleep(0.02)
    return [p.communicate(timeout=30)[1] for p in procs]


def _lines(errs: list[str]) -> list[str]:
    return [x for e in errs for x in e.splitlines() if x.startswith("flowgrpo: error")]


def test_a_config_error_on_every_rank_is_printed_once_when_torchrun_ends_the_others(tmp_path):
    for attempt in range(3):
        procs = start_cli_ranks([*BAD, f"run.output_dir={tmp_path / str(attempt)}"])
        errs = _as_torchrun(procs)
        lines = _lines(errs)
        assert lines == ["flowgrpo: error: config key 'trainer.max_steps' must be >= 1, got 0"], (
            attempt,
            errs,
        )
        assert 2 in [p.returncode for p in procs]


def test_a_config_error_on_every_rank_is_printed_once_when_every_rank_exits(tmp_path):
    procs = start_cli_ranks([*BAD, f"run.output_dir={tmp_path}"])
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], errs
    assert len(_lines(errs)) == 1, errs
