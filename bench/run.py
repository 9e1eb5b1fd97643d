"""Run every benchmark in one process and write bench/results.json (+ a printed table).

    python -m bench            # full: 1024 image tokens, batch 4, 5 repeats (~10 min on 2 cores)
    python -m bench --quick    # smoke: tiny size, one repeat (what the test runs)

Every figure is a ratio of two times measured in the same run on the same machine, so the
targets hold on any hardware; docs/performance.md explains each one.
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
    "cfg_train_over_floor": ("<=", 1.1),
    "cfg_train_over_batched": ("<=", 0.75),
    "cfg_kl_train_over_floor": ("<=", 1.1),
    "cfg_kl_train_over_batched": ("<=", 0.8),
    "two_rank_per_sample_over_one_rank": ("<=", 1.2),
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
    from flowgrpo.models import build_adapter, tiny_pipeline

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

    F = one no-grad forward of the conditional micro-batch, FB = forward with grad + backward,
    B = FB - F. Guidance off: floor = K FB. Guidance on: floor = K (2F + B) (the unconditional
    branch needs a forward, never a backward); with KL: K (4F + B) (the reference policy's
    two branches). "batched" is the usual formulation: the doubled batch with grad, the
    unconditional half detached.
    """
    from flowgrpo.algo import flow_grpo_loss, kl_penalty_image, sde_step_with_logprob
    from flowgrpo.models.base import PromptEmbeds
    from flowgrpo.rollout import SDEWindow, trajectory_log_prob

    pipe, adapter, prompts, negatives, latents = _setup(kind, s)
    transformer = pipe.transformer
    transformer.requires_grad_(True)
    params = [p for p in transformer.parameters() if p.requires_grad]
    advantages = torch.linspace(-1, 1, s.batch, device=s.device)
    k_steps = s.trained_steps
    out: dict[str, float] = {}

    def trajectory(g: float):
        window = SDEWindow(size=k_steps, lo=0, hi=min(s.num_steps - 1, k_steps + 2))
        return _sample(adapter, prompts, negatives, latents, s, g, sde_window=window)

    def zero():
        for p in params:
            p.grad = None

    def ours(traj, kl: bool):
        zero()
        for k in range(k_steps):
            step = trajectory_log_prob(adapter, transformer, traj, k)
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

    def batched(traj, kl: bool):
        zero()
        both = PromptEmbeds.cat([traj.negative_embeds, traj.prompt_embeds])
        kw = dict(height=s.height, width=s.width, guidance_scale=traj.guidance_scale)
        for k in range(k_steps):
            x, sig = traj.latents[:, k], traj.sigmas[:, k]
            v = adapter.forward(transformer, torch.cat([x, x]), torch.cat([sig, sig]), both, **kw)
            v_u, v_c = v.chunk(2)
            guided = adapter.guide(v_c, v_u.detach(), traj.guidance_scale)
            step = sde_step_with_logprob(
                guided,
                x,
                sig,
                traj.sigmas_next[:, k],
                noise_level=traj.noise_level,
                sigma_max=traj.sigma_max,
                prev_sample=traj.latents[:, k + 1],
            )
            loss, _ = flow_grpo_loss(
                step.log_prob, traj.log_probs[:, k], advantages, clip_range=1e-4, adv_clip_max=5
            )
            if kl:
                with torch.no_grad():
                    v_ref = adapter.forward(
                        transformer, torch.cat([x, x]), torch.cat([sig, sig]), both, **kw
                    )
                    r_u, r_c = v_ref.chunk(2)
                    ref = sde_step_with_logprob(
                        adapter.guide(r_c, r_u, traj.guidance_scale),
                        x,
                        sig,
                        traj.sigmas_next[:, k],
                        noise_level=traj.noise_level,
                        sigma_max=traj.sigma_max,
                        prev_sample=traj.latents[:, k + 1],
                    )
                loss = (
                    loss
                    + 0.04
                    * kl_penalty_image(
                        step.prev_sample_mean, ref.prev_sample_mean, step.std_dev_t
                    ).mean()
                )
            loss.backward()

    # Bare forward (F) and forward+backward (FB) of the conditional micro-batch.
    traj_cfg = trajectory(_guidance(kind) if kind != "flux" else 4.5) if kind != "flux" else None
    traj_plain = trajectory(1.0)
    with record_calls(transformer) as calls, torch.no_grad():
        trajectory_log_prob(adapter, transformer, traj_plain, 0)
    args, kwargs = calls[0]
    weights = None

    @torch.no_grad()
    def bare_forward():
        transformer(*args, **kwargs)

    def bare_forward_backward():
        nonlocal weights
        zero()
        outp = transformer(*args, **kwargs)[0]
        if weights is None:
            weights = torch.randn(outp.shape, generator=torch.Generator().manual_seed(2)).to(
                outp.device
            )
        (outp * weights).sum().backward()

    fns = {
        "f": bare_forward,
        "fb": bare_forward_backward,
        "plain": lambda: ours(traj_plain, False),
    }
    if traj_cfg is not None:  # FLUX.1-dev is guidance-distilled: no unconditional branch
        fns.update(
            cfg=lambda: ours(traj_cfg, False),
            cfg_batched=lambda: batched(traj_cfg, False),
            kl=lambda: ours(traj_cfg, True),
            kl_batched=lambda: batched(traj_cfg, True),
        )
    t = median_times(fns, repeats=s.repeats, warmup=s.warmup)
    f, fb, t_plain = t["f"], t["fb"], t["plain"]
    b = max(fb - f, 0.0)
    out.update(F_s=f, FB_s=fb, B_s=b, train_s=t_plain, train_over_floor=t_plain / (k_steps * fb))
    if traj_cfg is not None:
        t_cfg, t_cfg_batched = t["cfg"], t["cfg_batched"]
        t_kl, t_kl_batched = t["kl"], t["kl_batched"]
        out.update(
            cfg_train_s=t_cfg,
            cfg_batched_s=t_cfg_batched,
            cfg_train_over_floor=t_cfg / (k_steps * (2 * f + b)),
            cfg_train_over_batched=t_cfg / t_cfg_batched,
            cfg_kl_train_s=t_kl,
            cfg_kl_batched_s=t_kl_batched,
            cfg_kl_train_over_floor=t_kl / (k_steps * (4 * f + b)),
            cfg_kl_train_over_batched=t_kl / t_kl_batched,
        )
    transformer.requires_grad_(False)
    return out


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
    for section in ("rollout", "batched_cfg", "training", "sharding"):
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
        default="rollout,batched_cfg,training,sharding,toy",
        help="comma-separated subset of rollout,batched_cfg,training,sharding,toy",
    )
    args = parser.parse_args(argv)
    s = replace(QUICK if args.quick else BenchSettings(), device=args.device)
    torch.set_num_threads(s.threads)
    kinds = [k for k in args.kinds.split(",") if k]
    sections = set(args.sections.split(","))
    results: dict[str, object] = {
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
    if "sharding" in sections:
        from bench.sharding import bench_sharding

        results["sharding"] = {"sd3": bench_sharding(s, quick=args.quick)}
    if "toy" in sections:
        from bench.toy import bench_toy

        results["toy"] = bench_toy(quick=args.quick)
    results["targets"] = check_targets(results)
    out = Path(args.out)
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
