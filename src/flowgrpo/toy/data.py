"""scikit-learn's handwritten digits at their native 8x8, as images in [-1, 1], and the toy's
prompt set (``data.train_prompts=builtin:digits``).

The data (1797 images, 16 grey levels) ships inside scikit-learn: nothing is downloaded.
One fixed split (seed 0, 20 % test) is shared by the generator's pretraining, the reward
classifier and the judge, so their test figures are comparable.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from flowgrpo.data.prompts import PromptDataset

TEST_FRACTION = 0.2
SPLIT_SEED = 0


@lru_cache(maxsize=1)
def _load() -> tuple[torch.Tensor, torch.Tensor]:
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the toy digits model needs scikit-learn: pip install 'flowgrpo[toy]'"
        ) from err
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 8.0 - 1.0
    y = torch.tensor(data.target, dtype=torch.long)
    return x, y


def load_digits_data(split: str = "all") -> tuple[torch.Tensor, torch.Tensor]:
    """Images [N, 1, 8, 8] in [-1, 1] and labels [N] for split "train", "test" or "all"."""
    x, y = _load()
    if split == "all":
        return x.clone(), y.clone()
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_test = int(round(len(y) * TEST_FRACTION))
    if split == "test":
        idx = perm[:n_test]
    elif split == "train":
        idx = perm[n_test:]
    else:
        raise ValueError(f"digits split must be 'train', 'test' or 'all', got {split!r}")
    return x[idx].clone(), y[idx].clone()


def to_unit(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] -> [0, 1] (what rewards receive)."""
    return (images + 1) / 2


def digit_prompt_set() -> PromptDataset:
    """The toy's prompts: "a handwritten 0" ... "a handwritten 9", metadata {"digit": d}."""
    return PromptDataset(
        [f"a handwritten {d}" for d in range(10)], [{"digit": d} for d in range(10)], "digits"
    )


__all__ = ["digit_prompt_set", "load_digits_data", "to_unit"]
