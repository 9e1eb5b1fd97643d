"""A minimal Flow-GRPO loop on the toy model (no engine, no trainer): a sanity check that the
shipped base model + digits reward + sampler + algo can raise the reward in a few steps.

Settings follow the toy-digits preset (README.md, docs/training.md): 10 digits x K=16 images per step, SDE a = 0.7,
10 steps with the last one deterministic (9 trained), full fine-tune with AdamW 3e-4, one
optimizer step per rollout, clip 1e-4, KL beta = 0.04 against a frozen copy of the base.
``python -m flowgrpo.toy.quickcheck --steps 20`` prints one line per step.
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Any

import torch

from flowgrpo.algo import flow_grpo_loss, group_advantages, kl_penalty_image
from flowgrpo.rollout.sampler import sample_trajectories, trajectory_log_prob
from flowgrpo.toy.eval import digit_prompts, evaluate_toy
from flowgrpo.toy.pipeline import IMAGE_SIZE, ToyAdapter, toy_pipeline
from flowgrpo.toy.reward import digits_accuracy, digits_reward


def quickcheck(
    steps: int = 20,
    *,
    seed: int = 0,
    group_size: int = 16,
    lr: float = 3e-4,
    kl_beta: float = 0.04,
    noise_level: float = 0.7,
    num_steps: int = 10,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
    eval_every: int = 10,
    verbose: bool = True,
) -> list[dict[str, Any]]:
    """Run ``steps`` Flow-GRPO steps from the shipped base model; returns one dict per step
    (reward_mean, rollout accuracy, kl, ratio, timings; eval_* on eval steps and step 0)."""
    pipe = toy_pipeline()
    adapter = ToyAdapter(pipe)
    policy = pipe.transformer.eval()
    reference = copy.deepcopy(policy).requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=1e-4, eps=1e-8)
    prompts = digit_prompts(group_size)
    digits = torch.arange(10).repeat_interleave(group_size)
    rows: list[dict[str, Any]] = []

    def evaluate(row: dict[str, Any]) -> None:
        res = evaluate_toy(pipe, seed=seed)
        row.update({f"eval_{k}": v for k, v in res.items() if k != "images"})

    start = time.perf_counter()
    for step in range(steps + 1):
        row: dict[str, Any] = {"step": step}
        if step % eval_every == 0 or step == steps:
            evaluate(row)
        if step == steps:
            rows.append(row)
            if verbose:
                print(_fmt(row), flush=True)
            break
        t0 = time.perf_counter()
        traj = sample_trajectories(
            adapter,
            prompts,
            num_steps=num_steps,
            guidance_scale=1.0,
            noise_level=noise_level,
            height=IMAGE_SIZE,
            width=IMAGE_SIZE,
            generator=torch.Generator().manual_seed(seed * 1_000_003 + step),
        )
        t1 = time.perf_counter()
        rewards = torch.tensor(digits_reward(traj.images, prompts, None))
        accuracy = digits_accuracy(traj.images, digits)
        adv = group_advantages(rewards, prompts)
        opt.zero_grad(set_to_none=True)
        k = traj.num_train_steps
        stats = {"kl": 0.0, "ratio_mean": 0.0, "clipfrac": 0.0}
        for j in range(k):
            out = trajectory_log_prob(adapter, policy, traj, j)
            loss, m = flow_grpo_loss(
                out.log_prob,
                traj.log_probs[:, j],
                adv,
                clip_range=clip_range,
                adv_clip_max=adv_clip_max,
            )
            with torch.no_grad():
                ref = trajectory_log_prob(adapter, reference, traj, j)
            kl = kl_penalty_image(out.prev_sample_mean, ref.prev_sample_mean, out.std_dev_t).mean()
            ((loss + kl_beta * kl) / k).backward()
            stats["kl"] += float(kl.detach()) / k
            stats["ratio_mean"] += float(m["ratio_mean"]) / k
            stats["clipfrac"] += float(m["clipfrac"]) / k
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        t2 = time.perf_counter()
        row.update(
            reward_mean=float(rewards.mean()),
            accuracy=accuracy,
            grad_norm=float(grad_norm),
            rollout_s=t1 - t0,
            train_s=t2 - t1,
            elapsed_s=time.perf_counter() - start,
            **stats,
        )
        rows.append(row)
        if verbose:
            print(_fmt(row), flush=True)
    return rows


def _fmt(row: dict[str, Any]) -> str:
    parts = [f"step {row['step']:3d}"]
    if "reward_mean" in row:
        parts.append(
            f"reward {row['reward_mean']:.3f}  acc {row['accuracy']:.3f}  kl {row['kl']:.2e}  ratio {row['ratio_mean']:.5f}"
            f"  rollout {row['rollout_s']:.1f}s train {row['train_s']:.1f}s"
        )
    if "eval_accuracy" in row:
        parts.append(
            f"| eval acc {row['eval_accuracy']:.3f} reward {row['eval_reward_mean']:.3f} "
            f"judge {row['eval_judge_accuracy']:.3f} diversity {row['eval_diversity']:.3f}"
        )
    return "  ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flowgrpo.toy.quickcheck", description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kl-beta", type=float, default=0.04)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    quickcheck(
        args.steps, seed=args.seed, kl_beta=args.kl_beta, lr=args.lr, eval_every=args.eval_every
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
