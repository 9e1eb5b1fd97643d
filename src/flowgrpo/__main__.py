"""``python -m flowgrpo ...`` and ``torchrun --nproc_per_node=N -m flowgrpo train ...``."""

from flowgrpo.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
