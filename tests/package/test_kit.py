"""The test kit's comparisons fail where they should, with a message that says where."""

from __future__ import annotations

import socket

import pytest
import torch

from flowgrpo.testing import (
    assert_state_dicts_close,
    assert_state_dicts_equal,
    assert_tensors_close,
    assert_tensors_equal,
    free_port,
    max_abs_diff,
    one_thread,
)


def test_tensor_comparisons():
    a = torch.tensor([1.0, 2.0, float("nan")])
    assert_tensors_equal(a, a.clone())  # NaNs in the same places are equal
    b = a.clone()
    b[1] += 1e-6  # 2 + 1e-6 in fp32: 2 + 2^-20 = 9.54e-7 above
    assert max_abs_diff(a, b) == 2.0**-20
    with pytest.raises(AssertionError, match=r"x: not bit-identical, max \|diff\| = 9\.5"):
        assert_tensors_equal(a, b, "x")
    assert assert_tensors_close(a, b, 1e-5) <= 1e-5
    with pytest.raises(AssertionError, match=r"tensor: max \|diff\| = 9\.537e-07 > atol 1\.0e-07"):
        assert_tensors_close(a, b, 1e-7)
    with pytest.raises(AssertionError, match=r"y: shape \(3,\) != \(2,\)"):
        assert_tensors_close(a, a[:2], 1.0, "y")
    with pytest.raises(AssertionError, match="dtype"):
        assert_tensors_equal(a, a.double())
    c = a.clone()
    c[0] = float("nan")  # a NaN where the other has a number is never close
    with pytest.raises(AssertionError, match="inf"):
        assert_tensors_close(a, c, 1e3)


def test_state_dict_comparisons_name_every_key_that_differs():
    a = {"w": torch.ones(2), "b": torch.zeros(1), "k": torch.ones(1)}
    assert_state_dicts_equal(a, {k: v.clone() for k, v in a.items()})
    b = {"w": torch.ones(2) * 1.5, "b": torch.zeros(1), "extra": torch.ones(1)}
    with pytest.raises(AssertionError) as err:
        assert_state_dicts_equal(a, b)
    msg = str(err.value)
    assert "2 difference(s)" in msg and "only in first ['k']" in msg and "['extra']" in msg
    assert "w: not bit-identical, max |diff| = 5.000e-01" in msg and "b:" not in msg
    close = {k: v + 1e-7 for k, v in a.items()}
    assert_state_dicts_close(a, close, 1e-6)
    with pytest.raises(AssertionError, match="3 difference"):
        assert_state_dicts_close(a, close, 1e-8)


def test_free_port_and_one_thread():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: it can be bound
    before = torch.get_num_threads()
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
