"""What every model family must satisfy (as diffusers' ``PipelineTesterMixin``): a family is
its ``Family`` lines in ``flowgrpo.testing.families.<family>`` (``FAMILIES``: every registered
family's) and gets every check of tests/models/test_conformance.py, and the "2 ranks equal 1
process" update of every algorithm (tests/algorithms).

The checks, each a function taking a ``Family`` (and what it builds):
- ``check_noise0_matches_pipeline``: a noise-0 rollout's final latents equal the stock
  pipeline's ``output_type="latent"`` from the same initial latents (<= 1e-5);
- ``check_batch_invariance``: each prompt rolled out alone equals its row of the batch;
- ``check_log_prob_splits``: the training pass recomputes the rollout's log-probs under any
  micro-batch split and row order, with and without grad (<= 1e-6, fp32);
- ``check_bf16_on_policy``: with bf16 weights, the recomputation is exact (|log r| = 0) with
  the rollout's split and any row order (other splits: ``bf16_split_atol``). Before the fix
  (bf16-stored latents, the unconditional branch run apart) the same rollouts gave
  |log r| = 3.7e-4 - 7.2e-4, beyond the 1e-4 clip range before any update. On this CPU bf16
  kernels are batch-size invariant, so other splits stay exact too, except Qwen-Image, which
  re-pads a micro-batch's text to its own longest prompt (measured max 2.3e-4 sde, 8.1e-5
  cps); GPUs' GEMMs also depend on the batch shape (docs/math.md);
- ``check_checkpointing_gradients``: with activation checkpointing the training pass gives
  the same velocity and gradients (the checkpointed call takes every input);
- ``check_lora_targets``: every LoRA target names modules of the transformer, all linear;
- ``check_lora_export``: the engine's LoRA export loads in the stock pipeline and gives the
  trained velocity (< 1e-5).
A user testing their own family builds a ``Family`` and calls these functions.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from flowgrpo.testing.compare import assert_tensors_close
from flowgrpo.testing.families import double, doubles
from flowgrpo.testing.family import Family

NOISE0_ATOL = 1e-5  # stock pipeline vs our rollout (batched CFG rounds differently: <= 3.8e-6)
SPLIT_ATOL = 1e-6  # fp32 log-prob recomputation under another split (measured <= 1.2e-7)
EXPORT_ATOL = 1e-5  # velocity of the exported LoRA in the stock pipeline vs the engine's


#: every family's conformance entry, from the registry (``flowgrpo.testing.families``)
FAMILIES: tuple[Family, ...] = doubles()


def family(kind: str) -> Family:
    """The ``FAMILIES`` entry of ``kind``."""
    return double(kind)


def _rollout(fam: Family, adapter: Any, prompts: Sequence[str], **kw: Any) -> Any:
    from flowgrpo.rollout import sample_trajectories

    h, w = kw.pop("size", fam.size)
    g = kw.pop("guidance_scale", fam.guidance)
    negatives = [fam.negative] * len(prompts) if adapter.uses_cfg(g) else None
    kw.setdefault("images", fam.source_images(prompts))
    return sample_trajectories(
        adapter,
        list(prompts),
        num_steps=kw.pop("num_steps", 3),
        guidance_scale=g,
        noise_level=kw.pop("noise_level", 0.0),
        height=h,
        width=w,
        negative_prompts=negatives,
        decode=False,
        num_frames=fam.num_frames,
        **kw,
    )


def _initial_latents(fam: Family, adapter: Any, n: int, size: tuple[int, int], seed: int):
    extra = {} if fam.num_frames is None else {"num_frames": fam.num_frames}
    return adapter.prepare_latents(n, *size, torch.Generator().manual_seed(seed), **extra)


def check_noise0_matches_pipeline(
    fam: Family, pipe: Any, size: tuple[int, int], guidance_scale: float, steps: int = 3
) -> float:
    """Noise-0 rollout == ``pipe(..., latents=, output_type="latent")``; returns the max diff."""
    adapter = fam.adapter(pipe)
    prompts = fam.prompts[:2]
    latents = _initial_latents(fam, adapter, len(prompts), size, seed=1)
    ours = _rollout(
        fam,
        adapter,
        prompts,
        size=size,
        guidance_scale=guidance_scale,
        num_steps=steps,
        latents=latents.clone(),
        ode_solver=fam.ode_solver,
    ).final_latents
    moved = float((ours - latents).abs().max())  # in the rollout's layout
    if fam.stock_layout is not None:
        ours = fam.stock_layout(pipe, ours, size)
    cfg = adapter.uses_cfg(guidance_scale)
    guidance = (
        {fam.guidance_arg: guidance_scale}
        if fam.stock_guidance is None
        else fam.stock_guidance(pipe, guidance_scale)
    )
    sources = fam.sources()[: len(prompts)] if fam.sources is not None else None
    rows = [slice(None)] if fam.stock_batch else [slice(i, i + 1) for i in range(len(prompts))]
    refs = []
    for r in rows:
        extra = dict(fam.call_options)
        if fam.num_frames is not None:
            extra["num_frames"] = fam.num_frames
        if cfg and fam.stock_negative:
            extra["negative_prompt"] = [fam.negative] * len(prompts[r])
        if sources is not None:  # one PIL image alone, as the pipelines document
            srcs = [s[0] if len(s) == 1 else s for s in sources[r]]
            extra["image"] = srcs[0] if len(srcs) == 1 else srcs
        out = pipe(
            prompt=list(prompts[r]),
            height=size[0],
            width=size[1],
            num_inference_steps=steps,
            latents=latents[r].clone(),
            output_type="latent",
            **guidance,
            **extra,
        )
        refs.append(out.frames if fam.num_frames is not None else out.images)
    ref = torch.cat(refs)
    worst = assert_tensors_close(ours, ref, NOISE0_ATOL, f"{fam.kind} final latents")
    assert moved > 1e-2, f"{fam.kind}: the sampler did not move the latents ({moved:.2e})"
    return worst


def check_batch_invariance(fam: Family, pipe: Any, guidance_scale: float) -> None:
    """Each prompt rolled out alone (noise 0) equals its row of the batched rollout."""
    adapter = fam.adapter(pipe)
    latents = _initial_latents(fam, adapter, len(fam.prompts), fam.size, seed=2)
    kw = dict(guidance_scale=guidance_scale)
    batch = _rollout(fam, adapter, fam.prompts, latents=latents.clone(), **kw).final_latents
    for i, prompt in enumerate(fam.prompts):
        alone = _rollout(fam, adapter, [prompt], latents=latents[i : i + 1].clone(), **kw)
        assert_tensors_close(
            alone.final_latents, batch[i : i + 1], NOISE0_ATOL, f"{fam.kind} row {i}"
        )


def _sde_rollout(fam: Family, adapter: Any, sde_type: str) -> Any:
    """4 steps with guidance on, per-sample generators; the family's SDE window if any."""
    from flowgrpo.rollout import SDEWindow

    window = None if fam.sde_window is None else SDEWindow(*fam.sde_window)
    seeds = (0, 1, 2, 5)[: len(fam.prompts)]
    n = len(fam.prompts)
    x0 = None if fam.x0_seed is None else _initial_latents(fam, adapter, n, fam.size, fam.x0_seed)
    with torch.no_grad():
        traj = _rollout(
            fam,
            adapter,
            fam.prompts,
            latents=x0,
            num_steps=4,
            noise_level=0.7 if sde_type == "sde" else 0.8,
            sde_type=sde_type,
            generator=[torch.Generator().manual_seed(s) for s in seeds],
            sde_window=window,
        )
    if fam.rollout_check is not None:
        fam.rollout_check(traj)
    return traj


SPLITS = ([[0, 1, 2, 3]], [[0], [1, 2, 3]], [[0, 2], [1, 3]], [[3, 1, 0, 2]])


def log_ratios(adapter: Any, traj: Any, splits: Sequence[Sequence[int]], grad: bool = True):
    """|log p_recomputed - log p_rollout| [B, K] over micro-batches ``splits`` of the batch."""
    from flowgrpo.rollout import trajectory_log_prob

    out = torch.zeros_like(traj.log_probs)
    for rows in splits:
        rows = torch.tensor(rows)
        for k in range(traj.num_train_steps):
            with torch.set_grad_enabled(grad):
                logp = trajectory_log_prob(adapter, adapter.transformer, traj, k, rows).log_prob
            assert logp.requires_grad == grad
            out[rows, k] = (logp.detach() - traj.log_probs[rows, k]).abs()
    return out


def check_log_prob_splits(fam: Family, pipe: Any, sde_type: str) -> float:
    """fp32: the recomputed log-probs equal the rollout's under every split of ``SPLITS``, with
    grad (the training pass) and without; returns the worst |log r|."""
    adapter = fam.adapter(pipe, cfg=True)
    traj = _sde_rollout(fam, adapter, sde_type)
    assert bool((traj.log_probs != 0).all()) and bool(torch.isfinite(traj.log_probs).all())
    worst = 0.0
    for split in SPLITS:  # the training path (grad), then the no-grad path on two splits
        worst = max(worst, float(log_ratios(adapter, traj, split, grad=True).max()))
    for split in SPLITS[:2]:
        worst = max(worst, float(log_ratios(adapter, traj, split, grad=False).max()))
    assert worst <= SPLIT_ATOL, f"{fam.kind} {sde_type}: |log r| = {worst:.2e}"
    return worst


def bf16_adapter(fam: Family, tmp_path: Path | None = None) -> Any:
    """The family's adapter with bf16 weights (``bf16_via_load``: saved, then loaded with
    ``load_pipeline(torch_dtype=bfloat16)`` as users load it, into ``tmp_path``)."""
    pipe = fam.pipeline()
    if fam.bf16_via_load:
        from flowgrpo.models.registry import load_pipeline

        assert tmp_path is not None, "bf16_via_load needs a folder"
        pipe.save_pretrained(tmp_path)
        pipe = load_pipeline(tmp_path, torch_dtype=torch.bfloat16)
        pipe.set_progress_bar_config(disable=True)
    else:
        pipe.to(dtype=torch.bfloat16)
    adapter = fam.adapter(pipe, cfg=True)
    assert adapter.dtype == torch.bfloat16
    return adapter


def check_bf16_on_policy(fam: Family, adapter: Any, sde_type: str) -> float:
    """bf16 weights, fp32 trajectories: |log r| = 0 exactly with the rollout's split and in any
    row order; other splits within ``bf16_split_atol``. Returns the worst other split."""
    traj = _sde_rollout(fam, adapter, sde_type)
    for name in ("latents", "log_probs", "final_latents", "sigmas"):
        assert getattr(traj, name).dtype == torch.float32, name
    assert bool((traj.log_probs != 0).all())
    n = len(fam.prompts)
    assert float(log_ratios(adapter, traj, [list(range(n))]).max()) == 0.0
    assert float(log_ratios(adapter, traj, [list(reversed(range(n)))]).max()) == 0.0
    worst = max(float(log_ratios(adapter, traj, s).max()) for s in SPLITS[1:3])
    assert worst <= fam.bf16_split_atol, f"{fam.kind} {sde_type}: |log r| = {worst:.2e}"
    return worst


def check_lora_targets(fam: Family, pipe: Any) -> set[str]:
    """Every name in the adapter's ``lora_target_modules`` names at least one linear layer of
    the trained transformer(s) (a misspelt target would silently train nothing); returns the
    names of the modules peft wraps."""
    from peft import LoraConfig, inject_adapter_in_model

    adapter = fam.adapter(pipe)
    model = copy.deepcopy(adapter.transformer)
    targets = list(adapter.lora_target_modules)
    names = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for target in targets:
        hits = [n for n in names if n == target or n.endswith("." + target)]
        assert hits, f"{fam.kind}: LoRA target {target!r} names no linear layer"
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=targets), model)
    wrapped = {n for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped, f"{fam.kind}: no module wrapped"
    return wrapped


def check_checkpointing_gradients(fam: Family, pipe: Any) -> float:
    """The training pass with activation checkpointing on (``fsdp.activation_checkpointing``:
    diffusers' ``enable_gradient_checkpointing``) gives the velocity and the gradients of the
    pass without it: the checkpointed call must take every input the plain call does (Chroma's
    single blocks lose the text mask otherwise). Guidance on, fp32; returns the worst gradient
    difference relative to the largest gradient (0 when the transformer cannot checkpoint)."""
    adapter = fam.adapter(pipe, cfg=True)
    model = copy.deepcopy(adapter.transformer)
    if not getattr(model, "_supports_gradient_checkpointing", False):
        return 0.0
    prompts = list(fam.prompts[:2])
    g = fam.guidance
    embeds, negative = adapter.encode(
        prompts, [fam.negative] * 2, guidance_scale=g, images=fam.source_images(prompts)
    )
    h, w = fam.size
    x = _initial_latents(fam, adapter, 2, (h, w), seed=5)
    sigma = torch.tensor([0.8, 0.4])
    weight = torch.randn(x.shape, generator=torch.Generator().manual_seed(6))

    def grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        v = adapter.velocity(model, x, sigma, embeds, negative, guidance_scale=g, height=h, width=w)
        (v * weight).sum().backward()
        return v.detach(), {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }

    v_plain, plain = grads()
    model.enable_gradient_checkpointing()
    v_ckpt, ckpt = grads()
    assert set(ckpt) == set(plain), f"{fam.kind}: checkpointing changes what gets a gradient"
    assert_tensors_close(v_ckpt, v_plain, 0.0, f"{fam.kind} velocity with checkpointing")
    scale = max(float(t.abs().max()) for t in plain.values())
    worst = max(float((ckpt[n] - plain[n]).abs().max()) for n in plain) / scale
    assert worst <= 1e-6, f"{fam.kind}: checkpointed gradients differ by {worst:.2e} (relative)"
    return worst


def check_lora_export(fam: Family, tmp_path: Path) -> tuple[float, float]:
    """The engine's LoRA export (a "trained" LoRA, B non-zero) loads in a fresh stock pipeline,
    whose velocity equals the engine's (< 1e-5) and differs from the base's (> 1e-2): the
    LoRA matters. Needs a process group (the ``dist1`` fixture). Returns both differences."""
    from torch.distributed.tensor import DTensor

    from flowgrpo.engine import DiffusersFSDPEngine, EngineConfig, LoraConfig

    adapter = fam.adapter(fam.pipeline())
    engine = DiffusersFSDPEngine(adapter, EngineConfig(lora=LoraConfig(rank=4, alpha=8)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in engine.model.named_parameters():
            if "lora_B" in n:
                t = p.to_local() if isinstance(p, DTensor) else p
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
    h, w = fam.size
    x = _initial_latents(fam, adapter, 2, (h, w), seed=3)
    sigma = torch.tensor([1.0, 0.3])  # Wan2.2: one sample per expert
    off = 1.0 if not adapter.uses_cfg(1.0) else 0.0  # guidance off (Z-Image: g = 0)
    kw = dict(guidance_scale=off, height=h, width=w)

    def velocity(a: Any, model: Any) -> torch.Tensor:
        with torch.no_grad():
            prompts = list(fam.prompts[:2])
            embeds = a.encode(prompts, images=fam.source_images(prompts))[0]
            return a.velocity(model, x, sigma, embeds, **kw)

    v_engine = velocity(adapter, engine.transformer)
    base = fam.adapter(fam.pipeline())
    v_base = velocity(base, base.transformer)
    engine.export_lora(tmp_path / "lora")
    fresh = fam.pipeline()
    (fam.load_lora or (lambda p, d: p.load_lora_weights(d)))(fresh, tmp_path / "lora")
    loaded = fam.adapter(fresh)
    d_lora = float((velocity(loaded, loaded.transformer) - v_engine).abs().max())
    effect = float((v_engine - v_base).abs().max())
    assert effect > 1e-2, f"{fam.kind}: the LoRA changes nothing ({effect:.2e})"
    assert d_lora < EXPORT_ATOL, f"{fam.kind}: exported LoRA differs by {d_lora:.2e}"
    return d_lora, effect
