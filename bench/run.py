"""Run every benchmark in one process and write bench/results.json (+ a printed table).

    python -m bench            # full: 1024 image tokens, batch 4, 5 repeats (~10 min on 2 cores)
    python -m bench --quick    # smoke: tiny size, one repeat (what the test runs)

Every figure is a ratio of two times measured in the same run on the same machine, so the
targets hold on any hardware (``sp``: a ratio of peak memories, sp=2 against sp=1 on CPU/gloo);
docs/performance.md explains each one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench.timing import median_times, record_calls, replay

KINDS = ("qwen_image", "sd3", "flux")
TARGETS = {
    "sampler_over_floor": ("<=", 1.05),
    "sampler_over_pipeline": ("<=", 1.0),
    "train_over_floor": ("<=", 1.15),
    "batched_cfg_speedup": (">=", 1.3),
    "cfg_train_over_floor": ("<=", 1.05),
    "cfg_kl_train_over_floor": ("<=", 1.05),
    "time_ratio_over_kept_fraction": ("<=", 1.1),
    "two_rank_per_sample_over_one_rank": ("<=", 1.2),
    "sp2_peak_over_sp1": ("<=", 0.6),
    "sharded_over_floor": ("<=", 1.2),  # resident memory (host: Python objects count)
    "sharded_alloc_over_floor": ("<=", 1.2),  # torch allocator (what a GPU's device peak is)
    "sharded_alloc_over_floor_same_phase": ("<=", 1.2),  # both runs' allocator, one phase
    # the fastest algorithm on the toy (median of 3 seeds) against Flow-GRPO's
    "time_to_target_over_flow_grpo": ("<=", 0.2),
    "diversity_at_target_over_flow_grpo": (">=", 1.0),
}


@dataclass
class BenchSettings:
    height: int = 128  # 32 x 32 = 1024 image tokens for the tiny pipelines
    width: int = 128
    batch: int = 4
    num_steps: int = 10
    trained_steps: int = 2
    repeats: int = 5
    warmup: int = 1
    threads: int = 2
    device: str = "cpu"


QUICK = BenchSettings(height=32, width=32, batch=2, num_steps=3, trained_steps=1, repeats=1)


def _guidance(kind: str) -> float:
    return 3.5 if kind == "flux" else 4.5


def _setup(kind: str, s: BenchSettings):
    from flowgrpo.models import build_adapter
    from flowgrpo.testing.tiny import tiny_pipeline

    pipe = tiny_pipeline(kind).to(s.device)
    adapter = build_adapter(pipe)
    prompts = [f"a photo of a red cube number {i}" for i in range(s.batch)]
    negatives = ["blurry"] * s.batch
    gen = torch.Generator().manual_seed(0)
    latents = adapter.prepare_latents(s.batch, s.height, s.width, gen)
    return pipe, adapter, prompts, negatives, latents


class FreeTransformer(torch.nn.Module):
    """Stands in for a transformer at zero cost (returns zeros): timing the sampler with it
    measures exactly what the sampler adds around the forwards."""

    def __init__(self, real: torch.nn.Module):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # adapters read the param dtype
        self.config = real.config

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        return (torch.zeros_like(hidden_states),)


def _sample(adapter, prompts, negatives, latents, s: BenchSettings, guidance: float, **kw):
    """The benchmark's rollout: SDE (a = 0.7) from fixed latents and noise, no decoding."""
    from flowgrpo.rollout import sample_trajectories

    return sample_trajectories(
        adapter,
        prompts,
        negative_prompts=negatives,
        num_steps=s.num_steps,
        guidance_scale=guidance,
        noise_level=0.7,
        height=s.height,
        width=s.width,
        latents=latents,
        generator=torch.Generator().manual_seed(1),
        decode=False,
        **kw,
    )


def bench_rollout(kind: str, s: BenchSettings) -> dict[str, float]:
    """flowgrpo's SDE sampler vs the bare transformer forwards it makes vs the diffusers call."""
    pipe, adapter, prompts, negatives, latents = _setup(kind, s)
    g = _guidance(kind)

    def sampler(transformer=None):
        return _sample(adapter, prompts, negatives, latents, s, g, transformer=transformer)

    free = FreeTransformer(pipe.transformer)

    def overhead():
        sampler(free)

    with record_calls(pipe.transformer) as calls:
        sampler()

    @torch.no_grad()
    def floor():
        replay(pipe.transformer, calls)

    def encode():  # the text encoders' share of the sampler (the pipeline pays it too)
        adapter.encode(prompts, negatives, guidance_scale=g)

    cfg_kw = {"true_cfg_scale": g} if kind == "qwen_image" else {"guidance_scale": g}

    def pipeline():
        return pipe(
            prompt=prompts,
            negative_prompt=negatives if kind != "flux" else None,
            num_inference_steps=s.num_steps,
            height=s.height,
            width=s.width,
            latents=latents,
            output_type="latent",
            **cfg_kw,
        )

    t = median_times(
        {
            "sampler": sampler,
            "floor": floor,
            "pipeline": pipeline,
            "encode": encode,
            "overhead": overhead,
        },
        repeats=s.repeats,
        warmup=s.warmup,
    )
    t_sampler, t_floor, t_pipe = t["sampler"], t["floor"], t["pipeline"]
    return {
        "transformer_calls": len(calls),
        "sampler_s": t_sampler,
        "floor_s": t_floor,
        "pipeline_s": t_pipe,
        "text_encode_s": t["encode"],
        "sampler_over_floor": t_sampler / t_floor,
        "sampler_over_floor_with_text": t_sampler / (t_floor + t["encode"]),
        "overhead_s": t["overhead"],
        "floor_plus_overhead_over_floor": (t_floor + t["overhead"]) / t_floor,
        "sampler_over_pipeline": t_sampler / t_pipe,
    }


def bench_batched_cfg(kind: str, s: BenchSettings) -> dict[str, float]:
    """No-grad guided velocity: one forward of the doubled batch vs two forwards."""
    pipe, adapter, prompts, negatives, latents = _setup(kind, s)
    g = _guidance(kind) if kind != "flux" else 4.5
    if kind == "flux":
        adapter.true_cfg_scale = g  # true CFG so there are two branches to batch
    pos, neg = adapter.encode(prompts, negatives, guidance_scale=g)
    sigma = torch.full((s.batch,), 0.7)
    kw = dict(guidance_scale=g, height=s.height, width=s.width)

    @torch.no_grad()
    def batched():
        adapter.batch_cfg = True
        adapter.velocity(pipe.transformer, latents, sigma, pos, neg, **kw)

    @torch.no_grad()
    def separate():
        adapter.batch_cfg = False
        adapter.velocity(pipe.transformer, latents, sigma, pos, neg, **kw)

    t = median_times({"b": batched, "s": separate}, repeats=s.repeats, warmup=s.warmup)
    t_b, t_s = t["b"], t["s"]
    adapter.batch_cfg = type(adapter).batch_cfg
    return {"batched_s": t_b, "separate_s": t_s, "batched_cfg_speedup": t_s / t_b}


def bench_training(kind: str, s: BenchSettings) -> dict[str, float]:
    """One training pass over K trained steps against the bare forward/backward floor.

    Guidance off: floor = K FB, FB = forward with grad + backward of the micro-batch.
    Guidance on (FLUX: its true CFG), the gradient flows through both branches: floor = K FB2,
    FB2 = forward + backward of the doubled batch; with KL: K (FB2 + F2), F2 = the reference
    policy's no-grad doubled forward. ``cfg_cond_only_over_exact`` reports what the opt-in,
    biased ``cfg_grad="cond_only"`` would save.
    """
    from flowgrpo.functional import flow_grpo_loss, kl_penalty_image
    from flowgrpo.rollout import SDEWindow, trajectory_log_prob

    pipe, adapter, prompts, negatives, latents = _setup(kind, s)
    transformer = pipe.transformer
    transformer.requires_grad_(True)
    params = [p for p in transformer.parameters() if p.requires_grad]
    advantages = torch.linspace(-1, 1, s.batch, device=s.device)
    k_steps = s.trained_steps
    if kind == "flux":  # FLUX.1-dev is guidance-distilled: use its true CFG for two branches
        adapter.true_cfg_scale = 4.5

    def trajectory(g: float):
        window = SDEWindow(size=k_steps, lo=0, hi=min(s.num_steps - 1, k_steps + 2))
        return _sample(adapter, prompts, negatives, latents, s, g, sde_window=window)

    def zero():
        for p in params:
            p.grad = None

    def ours(traj, kl: bool, cfg_grad: str = "both"):
        zero()
        for k in range(k_steps):
            step = trajectory_log_prob(adapter, transformer, traj, k, cfg_grad=cfg_grad)
            loss, _ = flow_grpo_loss(
                step.log_prob, traj.log_probs[:, k], advantages, clip_range=1e-4, adv_clip_max=5
            )
            if kl:
                with torch.no_grad():  # reference: its own guidance, one batched forward
                    ref = trajectory_log_prob(adapter, transformer, traj, k)
                kl_term = kl_penalty_image(
                    step.prev_sample_mean, ref.prev_sample_mean, step.std_dev_t
                )
                loss = loss + 0.04 * kl_term.mean()
            loss.backward()

    def bare(traj):
        """(forward, forward+backward) of the transformer call the training pass makes."""
        with record_calls(transformer) as calls, torch.no_grad():
            trajectory_log_prob(adapter, transformer, traj, 0)
        ((args, kwargs),) = calls
        out = transformer(*args, **kwargs)[0]
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)

        @torch.no_grad()
        def forward():
            transformer(*args, **kwargs)

        def forward_backward():
            zero()
            (transformer(*args, **kwargs)[0] * weights).sum().backward()

        return forward, forward_backward

    traj_plain, traj_cfg = trajectory(1.0), trajectory(_guidance(kind))
    f1, fb1 = bare(traj_plain)
    f2, fb2 = bare(traj_cfg)
    t = median_times(
        {
            "fb": fb1,
            "plain": lambda: ours(traj_plain, False),
            "f2": f2,
            "fb2": fb2,
            "cfg": lambda: ours(traj_cfg, False),
            "kl": lambda: ours(traj_cfg, True),
            "cond_only": lambda: ours(traj_cfg, False, "cond_only"),
        },
        repeats=s.repeats,
        warmup=s.warmup,
    )
    transformer.requires_grad_(False)
    if kind == "flux":
        adapter.true_cfg_scale = 1.0
    return {
        "FB_s": t["fb"],
        "train_s": t["plain"],
        "train_over_floor": t["plain"] / (k_steps * t["fb"]),
        "F2_s": t["f2"],
        "FB2_s": t["fb2"],
        "cfg_train_s": t["cfg"],
        "cfg_train_over_floor": t["cfg"] / (k_steps * t["fb2"]),
        "cfg_kl_train_s": t["kl"],
        "cfg_kl_train_over_floor": t["kl"] / (k_steps * (t["fb2"] + t["f2"])),
        "cfg_cond_only_s": t["cond_only"],
        "cfg_cond_only_over_exact": t["cond_only"] / t["cfg"],
    }


def bench_zero_advantage(s: BenchSettings, drop: float = 0.5) -> dict[str, float]:
    """The Flow-GRPO update (tiny SD3, LoRA, CFG) when a share ``drop`` of the samples
    has advantage exactly 0 and is skipped, against every sample kept. The time should fall in
    proportion: ``time_ratio_over_kept_fraction`` ~ 1."""
    from flowgrpo.config import config_from_dict
    from flowgrpo.engine import init_distributed
    from flowgrpo.rollout import SDEWindow
    from flowgrpo.trainer.setup import build_engine

    dist = init_distributed()
    batch = max(4, 2 * s.batch)
    _, adapter, _, _, _ = _setup("sd3", s)
    cfg = config_from_dict(
        {
            "lora": {"rank": 8, "alpha": 16},
            "update": {"micro_batch_size": 2, "num_minibatches": 1},
            "fsdp": {"param_dtype": "fp32"},
        }
    )
    engine, algorithm = build_engine(cfg, adapter, dist)
    seeds = list(range(batch))

    def train(advantages):
        return algorithm.update(traj, advantages, step=1, sample_seeds=seeds)

    prompts = [f"a photo of a red cube number {i}" for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    latents = adapter.prepare_latents(batch, s.height, s.width, gen)
    window = SDEWindow(size=s.trained_steps, lo=0, hi=min(s.num_steps - 1, s.trained_steps + 2))
    traj = _sample(
        adapter, prompts, ["blurry"] * batch, latents, s, 4.5, sde_window=window,
        transformer=engine.transformer,
    )  # fmt: skip
    kept = batch - int(round(drop * batch))
    every = torch.linspace(-1.0, 1.0, batch) + 0.01
    some = every.clone()
    some[kept:] = 0.0
    t = median_times(
        {
            "all": lambda: train(every),
            "some": lambda: train(some),
        },
        repeats=s.repeats,
        warmup=s.warmup,
    )
    fraction = kept / batch
    return {
        "all_kept_s": t["all"],
        "zero_dropped_s": t["some"],
        "kept_fraction": fraction,
        "time_ratio": t["some"] / t["all"],
        "time_ratio_over_kept_fraction": t["some"] / t["all"] / fraction,
    }


def machine_info() -> dict[str, object]:
    import diffusers

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def check_targets(results: dict) -> list[dict[str, object]]:
    """Flatten every ratio that has a target into rows (kind, figure, value, target, met)."""
    rows = []
    sections = ("rollout", "batched_cfg", "training", "zero_advantage", "sharding", "sp", "memory")
    for section in sections:
        for kind, figures in results.get(section, {}).items():
            for name, value in figures.items():
                if name in TARGETS:
                    op, bound = TARGETS[name]
                    met = value <= bound if op == "<=" else value >= bound
                    rows.append(
                        dict(
                            kind=kind,
                            figure=name,
                            value=round(value, 3),
                            target=f"{op} {bound}",
                            met=met,
                        )
                    )
    best = results.get("algorithms", {}).get("best")
    for name, value in (best or {}).items():
        if name in TARGETS:
            op, bound = TARGETS[name]
            met = value is not None and (value <= bound if op == "<=" else value >= bound)
            value = None if value is None else round(value, 3)
            rows.append(dict(kind=f"toy: {best['row']}", figure=name, value=value,
                             target=f"{op} {bound}", met=met))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny size, one repeat (smoke test)")
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda"
    )
    parser.add_argument("--out", default="bench/results.json", help="where to write the JSON")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated model kinds")
    parser.add_argument(
        "--sections",
        default="rollout,batched_cfg,training,zero_advantage,sharding,sp,memory,toy,algorithms,"
        "rewards",
        help="comma-separated subset of rollout,batched_cfg,training,zero_advantage,sharding,"
        "sp,memory,toy,algorithms,rewards, or hacking (not by default: 18 toy runs, "
        "docs/reward_hacking.md)",
    )
    parser.add_argument(
        "--rows",
        default="",
        help="algorithms section: train only these rows (comma-separated keys), keep the "
        "others' curves from --out, and time every row by one new calibration",
    )
    args = parser.parse_args(argv)
    s = replace(QUICK if args.quick else BenchSettings(), device=args.device)
    torch.set_num_threads(s.threads)
    kinds = [k for k in args.kinds.split(",") if k]
    sections = set(args.sections.split(","))
    out = Path(args.out)
    # a full run merges into the file it writes: the sections not run now keep their results
    earlier = json.loads(out.read_text()) if out.exists() and not args.quick else {}
    results: dict[str, object] = {
        **earlier,
        "machine": machine_info(),
        "settings": asdict(s),
        "quick": args.quick,
    }
    if "rollout" in sections:
        results["rollout"] = {k: bench_rollout(k, s) for k in kinds}
    if "batched_cfg" in sections:
        # also at 64 image tokens, where a forward is overhead-bound and batching pays
        small = replace(s, height=32, width=32)
        results["batched_cfg"] = {
            k: {
                **bench_batched_cfg(k, s),
                **{f"{n}_64_tokens": v for n, v in bench_batched_cfg(k, small).items()},
            }
            for k in kinds
        }
    if "training" in sections:
        results["training"] = {k: bench_training(k, s) for k in kinds}
    if "zero_advantage" in sections:
        results["zero_advantage"] = {"sd3": bench_zero_advantage(s)}
    if "sharding" in sections:
        from bench.sharding import bench_sharding

        results["sharding"] = {"sd3": bench_sharding(s, quick=args.quick)}
    if "sp" in sections:  # sequence parallelism: 2 ranks (one SP group) vs 1, 4096 tokens
        from bench.sp import bench_sp

        results["sp"] = bench_sp(kinds, quick=args.quick, repeats=min(s.repeats, 3))
    if "memory" in sections:  # per-rank peak of loading + one step against the sharded floor
        from bench.memory import bench_memory

        results["memory"] = bench_memory(quick=args.quick)
    if "toy" in sections:
        from bench.toy import bench_toy

        results["toy"] = bench_toy(quick=args.quick)
    if "algorithms" in sections:  # time-to-reward of every algorithm on the toy
        from bench.algorithms import bench_algorithms, write_report

        results["algorithms"] = bench_algorithms(
            quick=args.quick,
            only=tuple(k for k in args.rows.split(",") if k),
            previous=earlier.get("algorithms"),
        )
        if not args.quick:
            write_report(results["algorithms"])
    if "rewards" in sections:  # images/s of every built-in reward at 512 px, real sizes
        from bench.rewards import bench_rewards

        results["rewards"] = bench_rewards(quick=args.quick, device=s.device)
    if "hacking" in sections:  # reward hacking on the toy, the guard, pairwise rewards
        from bench.hacking import main as bench_hacking

        bench_hacking(["all"])
    results["targets"] = check_targets(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(format_table(results))
    print(f"wrote {out}")
    return 0


def format_table(results: dict) -> str:
    lines = ["| model | figure | value | target | met |", "|---|---|---|---|---|"]
    for row in results["targets"]:
        mark = "yes" if row["met"] else "no"
        lines.append(
            f"| {row['kind']} | {row['figure']} | {row['value']} | {row['target']} | {mark} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
