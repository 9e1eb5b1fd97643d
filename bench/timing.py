"""Timing helpers: warm-up, repeats, medians; the bare-forward floor of a transformer."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch


def median_time(fn: Callable[[], Any], *, repeats: int, warmup: int = 1) -> float:
    """Median wall-clock seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_times(
    fns: dict[str, Callable[[], Any]], *, repeats: int, warmup: int = 1
) -> dict[str, float]:
    """Median seconds of each function, timed in alternation (a, b, c, a, b, c, ...) so that
    drift in the machine's speed (other processes, clocks) hits every contender alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(median_time(fn, repeats=1, warmup=0))
    return {name: statistics.median(t) for name, t in times.items()}


@contextmanager
def record_calls(module: torch.nn.Module):
    """Record (args, kwargs) of every call of ``module`` inside the block: the exact inputs
    flowgrpo hands the transformer, to replay as the floor."""
    calls: list[tuple[tuple, dict]] = []

    def hook(_mod, args, kwargs):
        calls.append((args, dict(kwargs)))

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def replay(module: torch.nn.Module, calls: list[tuple[tuple, dict]]) -> None:
    """Call ``module`` with each recorded input: the bare transformer work, nothing else."""
    for args, kwargs in calls:
        module(*args, **kwargs)
