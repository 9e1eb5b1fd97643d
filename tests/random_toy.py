"""A saved toy pipeline with random weights for runs that must not depend on the shipped asset."""

from __future__ import annotations


def random_toy_path() -> str:
    """A saved toy pipeline with random weights (seed 0), made once per test session: runs
    that must not depend on the shipped pretrained asset point model.path at it."""
    import tempfile
    from pathlib import Path

    global _RANDOM_TOY
    if _RANDOM_TOY is None:
        from flowgrpo.toy.pipeline import ToyDigitsPipeline

        path = Path(tempfile.mkdtemp(prefix="flowgrpo-random-toy-")) / "toy"
        ToyDigitsPipeline.from_config(seed=0).save_pretrained(path)
        _RANDOM_TOY = str(path)
    return _RANDOM_TOY


_RANDOM_TOY = None
