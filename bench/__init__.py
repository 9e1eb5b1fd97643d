"""flowgrpo benchmarks: cost of rollout and training against their floors, as ratios."""
