"""The memory bench's allocator figures per phase: the peak inside each phase's profile range,
and the deep-minus-one-block ratio taken in the phase of the deep run's peak."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.memory import PHASES, _alloc_phase_peaks_mb, _same_phase_over

MB = 2**20


def test_phase_peaks_are_the_running_sums_maximum_inside_each_range():
    """Known allocations: 'load' keeps 1 MiB, 'engine' adds 2 MiB and a 4 MiB transient, the
    forward frees the 2 MiB: the peaks are 1, 1 + 2 + 4, then what is live on entry (3, 3, 1)."""
    keep = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("bench.memory.load"):
            keep.append(torch.empty(MB, dtype=torch.uint8))
        with record_function("bench.memory.engine"):
            keep.append(torch.empty(2 * MB, dtype=torch.uint8))
            transient = torch.empty(4 * MB, dtype=torch.uint8)
            del transient
        with record_function("bench.memory.reference_forward"):
            pass
        with record_function("bench.memory.forward"):
            keep.pop()
        for name in PHASES[4:]:
            with record_function(f"bench.memory.{name}"):
                pass
    peaks = _alloc_phase_peaks_mb(prof, PHASES)
    assert peaks["load"] == pytest.approx(1.0)
    assert peaks["engine"] == pytest.approx(7.0)
    assert peaks["reference_forward"] == pytest.approx(3.0)  # no record: the live 1 + 2
    assert peaks["forward"] == pytest.approx(3.0)  # live on entry, then freed inside it
    assert peaks["backward"] == pytest.approx(1.0)  # no record inside: what is live on entry


def test_same_phase_ratio_subtracts_the_one_block_peak_of_the_deep_peaks_phase():
    big = {f"alloc_{p}_mb": v for p, v in zip(PHASES, (1, 10, 20, 25, 30, 12))}
    small = {f"alloc_{p}_mb": v for p, v in zip(PHASES, (1, 2, 9, 4, 5, 3))}
    at, over = _same_phase_over(big, small, floor_mb=20.0)
    assert at == "backward" and over == pytest.approx((30 - 5) / 20)
