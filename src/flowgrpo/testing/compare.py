"""Comparisons that say where two results differ: tensors and state dicts, bit for bit or
within a tolerance, the message naming the key, the shapes and the largest difference."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64 (0.0 for empty tensors; inf where one is NaN and the other not)."""
    if a.numel() == 0:
        return 0.0
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    same_nan = a64.isnan() & b64.isnan()
    diff = (a64 - b64).abs().masked_fill(same_nan, 0.0)
    return float(diff.nan_to_num(nan=float("inf")).max())


def _describe(name: str, a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why ``a`` and ``b`` cannot be compared element-wise, or None."""
    if a.shape != b.shape:
        return f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return f"{name}: dtype {a.dtype} != {b.dtype}"
    return None


def assert_tensors_equal(a: torch.Tensor, b: torch.Tensor, name: str = "tensor") -> None:
    """``a`` and ``b`` are bit-identical (same shape and dtype; NaNs in the same places)."""
    if (why := _describe(name, a, b)) is not None:
        raise AssertionError(why)
    if not torch.equal(a.cpu(), b.cpu()) and max_abs_diff(a, b) != 0.0:
        raise AssertionError(f"{name}: not bit-identical, max |diff| = {max_abs_diff(a, b):.3e}")


def assert_tensors_close(
    a: torch.Tensor, b: torch.Tensor, atol: float, name: str = "tensor"
) -> float:
    """max |a - b| <= ``atol`` (same shape; dtypes may differ); returns the max difference."""
    if a.shape != b.shape:
        raise AssertionError(f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    worst = max_abs_diff(a, b)
    if not worst <= atol:
        raise AssertionError(f"{name}: max |diff| = {worst:.3e} > atol {atol:.1e}")
    return worst


def _state_dict_diffs(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], atol: float | None
) -> list[str]:
    problems = []
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        problems.append(f"keys differ: only in first {only_a[:5]}, only in second {only_b[:5]}")
    for key in sorted(set(a) & set(b)):
        try:
            if atol is None:
                assert_tensors_equal(a[key], b[key], key)
            else:
                assert_tensors_close(a[key], b[key], atol, key)
        except AssertionError as err:
            problems.append(str(err))
    return problems


def assert_state_dicts_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    """Same keys and every tensor bit-identical; the message lists each key that differs."""
    problems = _state_dict_diffs(a, b, None)
    if problems:
        raise AssertionError(f"{len(problems)} difference(s):\n" + "\n".join(problems[:20]))


def assert_state_dicts_close(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], atol: float
) -> None:
    """Same keys and every tensor within ``atol``; the message lists each key that differs."""
    problems = _state_dict_diffs(a, b, atol)
    if problems:
        raise AssertionError(f"{len(problems)} difference(s):\n" + "\n".join(problems[:20]))


def full_trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached full copies of ``model``'s trainable parameters, by name: DTensor shards are
    gathered (a collective: every rank calls it), so 1-rank and N-rank results compare."""
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
        if p.requires_grad
    }
