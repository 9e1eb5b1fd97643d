"""flowgrpo benchmarks: cost of rollout and training against their floors, as ratios."""


def reaches(value: float, target: float) -> bool:
    """Whether an accuracy read from a run's logs reaches ``target``. The trainer logs means
    of float32 tensors: 475 of 500 images right is logged as 0.949999988, below 0.95 in a
    plain ``>=``. Accuracies are counts over a few hundred images, so a 1e-6 allowance is exact."""
    return value >= target - 1e-6
