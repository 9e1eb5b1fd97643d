"""Exponential moving average of the trainable params, kept sharded like the params themselves."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank-local shard of a DTensor (an alias: in-place ops write through), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


class ParamShadow:
    """A copy of the trainable params, kept sharded like them (DCP saves and reshards it):
    the EMA, or an algorithm's old policy (DiffusionNFT). ``swapped()`` puts it in the params
    for a block; ``blend_(w)`` moves it toward the params: shadow <- shadow + w (param - shadow).
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = list(params)
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def reset_(self) -> None:
        """shadow <- the params' current values."""
        for e, p in zip(self.shadow, self.params, strict=True):
            local(e).copy_(local(p))

    @torch.no_grad()
    def blend_(self, weight: float) -> None:
        for e, p in zip(self.shadow, self.params, strict=True):
            local(e).lerp_(local(p).to(e.dtype), weight)

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """Params hold the shadow values inside the block; the trained values come back after."""
        with torch.no_grad():
            saved = [local(p).clone() for p in self.params]
            for e, p in zip(self.shadow, self.params, strict=True):
                local(p).copy_(local(e))
        try:
            yield
        finally:
            with torch.no_grad():
                for s, p in zip(saved, self.params, strict=True):
                    local(p).copy_(s)

    def state_dict(self, names: list[str]) -> dict[str, torch.Tensor]:
        return dict(zip(names, self.shadow, strict=True))

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor], names: list[str]) -> None:
        for name, e in zip(names, self.shadow, strict=True):
            if state[name] is not e:
                local(e).copy_(local(state[name]))


class EMA(ParamShadow):
    """shadow <- shadow + (1 - d_s) (param - shadow) after optimizer step s (0-based) when
    (s + 1) % update_every == 0, with d_s = min((1 + s) / (10 + s), decay) (Flow-GRPO's
    schedule)."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float, update_every: int):
        super().__init__(params)
        self.decay = float(decay)
        self.update_every = int(update_every)

    def decay_at(self, step: int) -> float:
        return min((1 + step) / (10 + step), self.decay)

    @torch.no_grad()
    def update(self, step: int) -> bool:
        """Apply the update for 0-based optimizer step ``step``; True if one was applied."""
        if (step + 1) % self.update_every:
            return False
        self.blend_(1.0 - self.decay_at(step))
        return True


__all__ = ["EMA", "ParamShadow", "local"]
