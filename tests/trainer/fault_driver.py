"""Run ``flowgrpo train`` and SIGKILL this process at a chosen point (the fault-injection
tests' driver; nothing of it lives in the package).

    python fault_driver.py POINT HIT -- <flowgrpo train args>

POINT: ``rollout`` (a rollout chunk), ``train`` (a loss of the training pass), ``save``
(after the DCP shards are written, before the checkpoint is marked complete) or ``eval``
(inside an evaluation's rollout). The process kills itself on the HIT-th time it gets there.
``enospc``: the HIT-th checkpoint's state file write fails with "No space left on device".
``none``: an uninterrupted run.
"""

from __future__ import annotations

import os
import signal
import sys


def kill_on(module, name: str, hit: int) -> None:
    """Wrap ``module.name`` so that its ``hit``-th call SIGKILLs the process."""
    real, calls = getattr(module, name), [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == hit:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    setattr(module, name, wrapper)


def main() -> int:
    point, hit, sep, *argv = sys.argv[1:]
    assert sep == "--"
    hit = int(hit)
    from flowgrpo import cli
    from flowgrpo.algorithms import flow_grpo as flow_grpo_algo
    from flowgrpo.engine import checkpoint
    from flowgrpo.trainer import run as trainer_run

    if point == "none":
        pass
    elif point == "rollout":
        kill_on(trainer_run, "sample_trajectories", hit)
    elif point == "train":
        kill_on(flow_grpo_algo.FlowGRPO, "step_loss", hit)
    elif point == "save":
        kill_on(checkpoint, "_write_marker", hit)
    elif point == "eval":
        real = trainer_run.rollout
        calls = [0]

        def rollout(run, *args, eval=False, **kwargs):
            if eval:
                calls[0] += 1
                if calls[0] == hit:
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(run, *args, eval=eval, **kwargs)

        trainer_run.rollout = rollout
    elif point == "enospc":
        import errno

        real_save, calls = checkpoint.torch.save, [0]

        def save(obj, f, *args, **kwargs):
            if "rng" in str(f):
                calls[0] += 1
                if calls[0] == hit:
                    raise OSError(errno.ENOSPC, "No space left on device", str(f))
            return real_save(obj, f, *args, **kwargs)

        checkpoint.torch.save = save
    else:
        raise SystemExit(f"unknown point {point!r}")
    return cli.main(["train", *argv])


if __name__ == "__main__":
    sys.exit(main())
