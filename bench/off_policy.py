"""Does overlapping the next rollout with the update pay on this machine?
(``trainer.off_policy_steps=1``, docs/algorithms.md.)

On the toy preset (one process): the rollout of step 2 (with its rewards) and the update of
step 1 are timed alone, one after the other (the trainer's schedule) and at the same time, the
rollout in a thread on a second copy of the model (a second ``Run``: what an overlapped
schedule would run on). Overlap pays when "overlapped" is clearly below "sequential".

    PYTHONPATH=src python -m bench.off_policy [--repeats 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import torch


def _time(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(overrides: list[str], repeats: int) -> dict[str, Any]:
    """Median seconds of: rollout, update, both in sequence, both overlapped (threads)."""
    from flowgrpo.config import load_config
    from flowgrpo.engine.dist import init_distributed, seed_everything
    from flowgrpo.trainer.loop import sample_step, step_draw
    from flowgrpo.trainer.run import Run, gather_rewards
    from flowgrpo.trainer.seeds import sample_seed

    cfg = load_config("toy-digits", ["trainer.max_steps=2", *overrides], command="train")
    dist = init_distributed()
    seed_everything(cfg.seed, dist.rank)
    run, other = Run(cfg, dist), Run(cfg, dist)  # other: the rollout's copy of the model
    traj, local, _ = sample_step(run, 1)
    indices, groups, start, count = step_draw(run, 1)
    rewards = gather_rewards(run, local)
    combined = run.algorithm.advantages(rewards, run.reward.weights_of(rewards), groups)
    adv = combined.advantages[start : start + count]
    seeds = [sample_seed(cfg.seed, 1, i) for i in range(start, start + count)]

    def rollout() -> None:
        sample_step(other, 2)

    def update() -> None:
        run.algorithm.update(traj, adv, step=1, sample_seeds=seeds)

    def overlapped() -> None:
        worker = threading.Thread(target=rollout)
        worker.start()
        update()
        worker.join()

    rollout(), update()  # warm-up
    rows: dict[str, list[float]] = {"rollout": [], "update": [], "sequential": [], "overlapped": []}
    for _ in range(repeats):
        rows["rollout"].append(_time(rollout))
        rows["update"].append(_time(update))
        rows["sequential"].append(_time(lambda: (rollout(), update())))
        rows["overlapped"].append(_time(overlapped))
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["overlapped / sequential"] = out["overlapped"] / out["sequential"]
    out["threads"] = torch.get_num_threads()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    print(json.dumps(measure(a.overrides, a.repeats), indent=1))


if __name__ == "__main__":
    main()
