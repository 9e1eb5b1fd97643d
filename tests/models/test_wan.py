"""The Wan adapter drives ``WanPipeline`` exactly (tiny random Wan2.1 / Wan2.2 pipelines).

Wan2.1 ("wan"): one transformer. Wan2.2 ("wan22"): ``transformer`` above the boundary
(t >= 875, only sigma = 1 on the 3- and 4-step grids used here), ``transformer_2`` below, each
with its guidance scale; the adapter exposes both as one ``WanExperts`` module. Checked: noise-0
rollouts equal ``pipe(..., output_type="latent")`` (9 frames, two guidance scales) and the
decoded videos ``output_type="pt"``; the guidance gradient through both branches equals an
independent reference built from the pipeline's own embeddings. What every family passes
(log-probs under any split with batches straddling the boundary, bf16 exactly on-policy, the
LoRA export loading in ``WanPipeline``): tests/models/test_conformance.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from flowgrpo.functional.sde import sde_step_with_logprob
from flowgrpo.models.base import PromptEmbeds
from flowgrpo.models.wan import WanAdapter, WanExperts, use_flow_match
from flowgrpo.rollout import SDEWindow, sample_trajectories, trajectory_log_prob
from flowgrpo.testing.families import of
from flowgrpo.testing.tiny import tiny_pipeline, tiny_size

PROMPTS = ["a red cat sitting on a table", "two dogs"]
PROMPTS4 = ["a red cat", "a photo of a big old house with a tree", "dog", "two blue birds"]
SIZES = [tiny_size("wan"), (48, 32)]  # 4 x 6 and 6 x 4 tokens per latent frame
BOUNDARY = 875.0  # tiny wan22: boundary_ratio 0.875 x 1000 train timesteps
SEQ = 32  # padded text length for speed (the pipeline's 512 is checked in two tests)
# Tiny ops gain nothing from a second thread, and on a loaded 2-core machine OpenMP's spinning
# made this file 7x slower with 2 threads (81 s vs 12 s wall, load ~4).
pytestmark = pytest.mark.usefixtures("one_thread")
WAN = of("wan")  # Wan2.1 and Wan2.2 (two experts)


@pytest.fixture(scope="module")
def pipes():
    return {kind: tiny_pipeline(kind) for kind in WAN}


def _wan(pipe, **kw) -> WanAdapter:
    return WanAdapter(pipe, **{"max_sequence_length": SEQ, **kw})


def _pipe_call(
    pipe, prompts, *, size, frames, steps, g, g2=None, seed=0, output_type="latent", seq=SEQ
):
    kw = {} if g2 is None else {"guidance_scale_2": g2}
    return pipe(
        prompts,
        height=size[0],
        width=size[1],
        num_frames=frames,
        num_inference_steps=steps,
        guidance_scale=g,
        generator=torch.Generator().manual_seed(seed),
        output_type=output_type,
        max_sequence_length=seq,
        **kw,
    ).frames


def _rollout(adapter, prompts, *, size, frames, steps, g, seed=0, decode=False, **kw):
    return sample_trajectories(
        adapter,
        prompts,
        num_steps=steps,
        guidance_scale=g,
        noise_level=kw.pop("noise_level", 0.0),
        height=size[0],
        width=size[1],
        num_frames=frames,
        generator=kw.pop("generator", torch.Generator().manual_seed(seed)),
        decode=decode,
        **kw,
    )


def guidance(kind: str) -> list[tuple[float, float | None]]:
    """(guidance_scale, guidance_scale_2) pairs: off, on, and Wan2.2's second expert's own."""
    return [(1.0, None), (5.0, None)] + ([(4.0, 3.0)] if kind == "wan22" else [])


@pytest.mark.parametrize("kind", WAN)
def test_noise0_rollout_equals_pipeline_latents(pipes, kind):
    """9 frames (3 latent frames) and Wan2.2's second guidance scale; 5 frames at two sizes,
    with and without guidance: tests/models/test_conformance.py."""
    size, frames = SIZES[1], 9
    pipe = pipes[kind]
    if kind == "wan22":  # the grid visits both experts: sigma 1 high, the rest low
        sigmas = _wan(pipe).schedule(3, *size).sigmas
        assert sigmas[0] * 1000 >= BOUNDARY > sigmas[1] * 1000
    for g, g2 in guidance(kind):
        adapter = _wan(pipe, guidance_scale_2=g2)
        traj = _rollout(adapter, PROMPTS, size=size, frames=frames, steps=3, g=g, seed=1)
        ref = _pipe_call(pipe, PROMPTS, size=size, frames=frames, steps=3, g=g, g2=g2, seed=1)
        f_lat = (frames - 1) // 4 + 1
        assert traj.final_latents.shape == ref.shape == (2, 4, f_lat, size[0] // 4, size[1] // 4)
        assert traj.final_latents.dtype == torch.float32 and traj.num_frames == frames
        # measured: 0 without guidance; <= 3.8e-6 with it (one doubled batch vs two calls)
        assert (traj.final_latents - ref).abs().max().item() <= 1e-5, (g, g2)
        assert (traj.negative_embeds is None) == (g <= 1.0)


def test_guidance_scale_2_is_used_below_the_boundary(pipes):
    pipe = pipes["wan22"]
    runs = [
        _rollout(
            _wan(pipe, guidance_scale_2=g2), PROMPTS, size=SIZES[0], frames=5, steps=3, g=4.0
        ).final_latents
        for g2 in (None, 4.0, 2.0)
    ]
    assert torch.equal(runs[0], runs[1]) and (runs[0] - runs[2]).abs().max() > 1e-3
    with pytest.raises(ValueError, match="boundary_ratio"):
        WanAdapter(pipes["wan"], guidance_scale_2=3.0)


def test_decoded_video_equals_pipeline_pt(pipes):
    pipe = pipes["wan22"]
    adapter = WanAdapter(pipe, num_frames=9)
    size = SIZES[1]
    traj = _rollout(adapter, PROMPTS, size=size, frames=None, steps=2, g=4.5, seed=2, decode=True)
    ref = _pipe_call(
        pipe, PROMPTS, size=size, frames=9, steps=2, g=4.5, seed=2, output_type="pt", seq=512
    )
    video = traj.images  # contract 9: [B, C, F, H, W]; output_type="pt" is [B, F, C, H, W]
    assert video.shape == (2, 3, 9, *size) and ref.shape == (2, 9, 3, *size)
    assert video.dtype == torch.float32 and video.device.type == "cpu"
    assert 0 <= video.min() and video.max() <= 1 and video.std() > 0
    # measured <= 8.3e-7 (the latents differ by the batched-CFG rounding)
    assert (video - ref.permute(0, 2, 1, 3, 4)).abs().max().item() <= 1e-5


def test_expand_timesteps_per_token(pipes):
    """Wan2.2-TI2V-5B style (``expand_timesteps``): one timestep per video token."""
    pipe = tiny_pipeline("wan")
    pipe.register_to_config(expand_timesteps=True)
    adapter = _wan(pipe)
    seen = []
    hook = pipe.transformer.register_forward_pre_hook(
        lambda m, args, kw: seen.append(tuple(kw["timestep"].shape)), with_kwargs=True
    )
    traj = _rollout(adapter, PROMPTS, size=SIZES[0], frames=5, steps=3, g=5.0, seed=4)
    hook.remove()
    assert seen == [(4, 2 * 4 * 6)] * 3  # [2B, F' (h/2) (w/2)]: one timestep per video token
    ref = _pipe_call(pipe, PROMPTS, size=SIZES[0], frames=5, steps=3, g=5.0, seed=4)
    assert (traj.final_latents - ref).abs().max().item() <= 1e-5


def test_embeddings_stored_trimmed_and_repadded_exactly(pipes):
    pipe = pipes["wan"]
    adapter = WanAdapter(pipe)
    emb = adapter.encode_prompts(PROMPTS)
    with torch.no_grad():  # as __call__ (with grad, UMT5's attention rounds differently)
        full = pipe._get_t5_prompt_embeds(PROMPTS, max_sequence_length=512, device="cpu")
    lengths = emb.mask.sum(1)
    assert emb.embeds.shape[1] == int(lengths.max()) < 32 and int(lengths.min()) < int(
        lengths.max()
    )
    assert torch.equal(adapter.padded_embeds(emb), full)  # bit-identical, L = 512
    assert torch.equal(adapter.padded_embeds(emb.select([1])), full[1:])
    junk = PromptEmbeds(emb.embeds.masked_fill(emb.mask[..., None] == 0, 7.0), emb.mask)
    assert torch.equal(adapter.padded_embeds(junk), full)  # padded positions are zeroed
    neg = adapter.encode_prompts([""])  # the default negative prompt: </s> only
    assert neg.embeds.shape[1] == 1 and adapter.default_negative_prompt == ""


def _sde_rollout(adapter, *, dtype=torch.float32, model=None):
    """4 samples, one trained SDE step each at step 0, 1 or 2 (a window of 1 drawn per sample):
    with these seeds the trained steps straddle the Wan2.2 boundary."""
    x0 = adapter.prepare_latents(4, *SIZES[0], torch.Generator().manual_seed(3), num_frames=5)
    with torch.no_grad():
        traj = _rollout(
            adapter,
            PROMPTS4,
            size=SIZES[0],
            frames=5,
            steps=4,
            g=4.5,
            noise_level=0.8,
            latents=x0.to(dtype),
            generator=[torch.Generator().manual_seed(i) for i in (0, 1, 2, 5)],
            sde_window=SDEWindow(size=1, lo=0, hi=3),
            transformer=model,
        )
    high = traj.sigmas[:, 0] * 1000 >= BOUNDARY
    assert bool(high.any()) and not bool(high.all()), traj.step_indices
    return traj


def _lora_policy(adapter, dtype):
    """The policy: LoRA (the adapter's targets) added as the engine does, weights moved off the
    rollout's so the gradient is generic; plus the frozen rollout weights."""
    from peft import LoraConfig

    model = copy.deepcopy(adapter.transformer).to(dtype)
    model.requires_grad_(False)
    cfg = LoraConfig(
        r=2,
        lora_alpha=4,
        init_lora_weights="gaussian",
        target_modules=list(adapter.lora_target_modules),
    )
    model.add_adapter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 2e-2)
    return model, copy.deepcopy(adapter.transformer).to(dtype)


def _reference_step(pipe, model, traj, g, g2, per_sample=False):
    """Independent of the adapter: the pipeline's own [B, 512, D] embeddings, the expert picked
    per sample as ``WanPipeline.__call__`` does (each expert's samples as one [negative;
    positive] batch with grad), ``v_u + g (v_c - v_u)`` with that expert's scale, then the SDE
    step's log-prob."""
    x, sig = traj.latents[:, 0], traj.sigmas[:, 0]
    with torch.no_grad():  # as __call__
        pos = pipe._get_t5_prompt_embeds(traj.prompts, max_sequence_length=SEQ, device="cpu")
        neg = pipe._get_t5_prompt_embeds([""] * len(traj), max_sequence_length=SEQ, device="cpu")
    t = sig.float() * 1000
    high = t >= BOUNDARY if isinstance(model, WanExperts) else torch.ones_like(t, dtype=bool)
    v = torch.zeros_like(x)
    groups = (
        [(bool(high[i]), torch.tensor([i])) for i in range(len(t))]
        if per_sample
        else [(h, (high == h).nonzero().squeeze(1)) for h in (True, False)]
    )
    for is_high, idx in groups:
        if not idx.numel():
            continue
        m, scale = model, (g if is_high else g2)
        if isinstance(model, WanExperts):
            m = model.transformer if is_high else model.transformer_2
        out = m(
            hidden_states=torch.cat([x[idx], x[idx]]),
            timestep=torch.cat([t[idx], t[idx]]),
            encoder_hidden_states=torch.cat([neg[idx], pos[idx]]).to(x.dtype),
            return_dict=False,
        )[0]
        v_u, v_c = out.to(x.dtype).chunk(2)
        v = v.index_put((idx,), v_u + scale * (v_c - v_u))
    return sde_step_with_logprob(
        v,
        x,
        sig,
        traj.sigmas_next[:, 0],
        noise_level=traj.noise_level,
        sde_type=traj.sde_type,
        prev_sample=traj.latents[:, 1],
        sigma_max=traj.sigma_max,
    )


def _grads(loss, params):
    grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]


def _rel(a, b) -> float:
    num = sum(((x - y).double() ** 2).sum() for x, y in zip(a, b)) ** 0.5
    den = sum((y.double() ** 2).sum() for y in b) ** 0.5
    return float(num / den)


ADVANTAGES = torch.tensor([1.0, -0.5, 0.3, 0.8])


@pytest.mark.parametrize("kind", WAN)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_guidance_gradient_through_both_branches(pipes, kind, dtype):
    g2 = 3.0 if kind == "wan22" else None
    adapter = _wan(pipes[kind], guidance_scale_2=g2)
    model, frozen = _lora_policy(adapter, dtype)
    traj = _sde_rollout(adapter, dtype=dtype, model=frozen)
    assert traj.latents.dtype == dtype and traj.log_probs.dtype == dtype
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    ours = trajectory_log_prob(adapter, model, traj, 0)
    ref = _reference_step(pipes[kind], model, traj, 4.5, g2)
    alone = _reference_step(pipes[kind], model, traj, 4.5, g2, per_sample=True)
    cond_only = trajectory_log_prob(adapter, model, traj, 0, cfg_grad="cond_only")
    g_ours, g_ref, g_alone, g_co = (
        _grads((ADVANTAGES.to(dtype) * o.log_prob).sum(), params)
        for o in (ours, ref, alone, cond_only)
    )
    fp64 = dtype == torch.float64
    assert _rel(g_ours, g_ref) <= (1e-10 if fp64 else 1e-5)  # measured 0 (same batch shapes)
    # each sample alone through its expert: measured <= 3e-14 (fp64), 1.1-2.3e-5 (fp32: the
    # GEMMs' rounding depends on the batch shape)
    assert _rel(g_ours, g_alone) <= (1e-10 if fp64 else 1e-4)
    assert _rel(g_co, g_ref) > 0.5  # measured 2.0-3.5: the unconditional branch's term is there
    if kind == "wan22":  # gradients reach both experts: the micro-batch straddles the boundary
        for expert in ("transformer.", "transformer_2."):
            norm = sum(float(g.abs().sum()) for n, g in zip(names, g_ours) if n.startswith(expert))
            assert norm > 0, expert


def test_bf16_load_keeps_the_fp32_modules(tmp_path):
    """bf16 as users load Wan: ``_keep_in_fp32_modules`` stay fp32 (the on-policy check of
    such a pipeline: tests/models/test_conformance.py)."""
    from flowgrpo.models.registry import load_pipeline

    tiny_pipeline("wan").save_pretrained(tmp_path)
    pipe = load_pipeline(tmp_path, torch_dtype=torch.bfloat16)
    assert pipe.transformer.scale_shift_table.dtype == torch.float32
    assert _wan(pipe).dtype == torch.bfloat16


def test_lora_targets_wrap_attention_and_ffn(pipes):
    from peft import LoraConfig

    model = copy.deepcopy(pipes["wan"].transformer)
    model.add_adapter(
        LoraConfig(r=2, lora_alpha=4, target_modules=list(WanAdapter.lora_target_modules))
    )
    wrapped = {n for n, m in model.named_modules() if hasattr(m, "lora_A")}
    for block in ("blocks.0.", "blocks.1."):
        for a in ("attn1", "attn2"):
            for p in ("to_q", "to_k", "to_v", "to_out.0"):
                assert f"{block}{a}.{p}" in wrapped
        assert {f"{block}ffn.net.0.proj", f"{block}ffn.net.2"} <= wrapped
    assert len(wrapped) == 20  # nothing outside the blocks (embedders, proj_out) trains
    experts = WanAdapter(pipes["wan22"]).transformer
    assert isinstance(experts, WanExperts)
    assert experts.transformer is pipes["wan22"].transformer
    assert experts.transformer_2 is pipes["wan22"].transformer_2
    from flowgrpo.engine.parallelize import transformer_blocks

    assert len(transformer_blocks(experts)) == 4  # FSDP shards each expert's blocks


def test_schedule_sizes_frames_and_schedulers(pipes):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline

    adapter = WanAdapter(pipes["wan"], num_frames=9)
    sched = adapter.schedule(3, *SIZES[0])
    assert torch.allclose(sched.sigmas, torch.tensor([1.0, 0.7511, 0.0089, 0.0]), atol=1e-4)
    assert torch.equal(sched.timesteps, sched.sigmas[:-1] * 1000)
    assert adapter.prepare_latents(1, 32, 48).shape == (1, 4, 3, 8, 12)  # default 9 frames
    for bad in (8, 0, 10):
        with pytest.raises(ValueError, match="num_frames must be 4k"):
            adapter.check_num_frames(bad)
    with pytest.raises(ValueError, match="multiples of 16"):
        adapter.schedule(3, 40, 48)
    with pytest.raises(ValueError, match="multiples of 16"):
        adapter.prepare_latents(1, 32, 56)
    # UniPC (what the hub repos ship) is refused; use_flow_match converts it (same shift)
    unipc = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    pipe = WanPipeline(**{**pipes["wan22"].components, "scheduler": unipc}, boundary_ratio=0.875)
    with pytest.raises(ValueError, match="use_flow_match"):
        WanAdapter(pipe)
    with pytest.warns(UserWarning, match="FlowMatchEulerDiscreteScheduler"):
        use_flow_match(pipe)
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler)
    assert pipe.scheduler.config.shift == 3.0
    with pytest.raises(ValueError, match="cannot convert"):
        use_flow_match(
            WanPipeline(**{**pipes["wan"].components, "scheduler": UniPCMultistepScheduler()})
        )
    # a two-expert adapter refuses a bare expert (it could not route)
    two = _wan(pipes["wan22"])
    x = two.prepare_latents(1, 32, 48, num_frames=5)
    with pytest.raises(ValueError, match="WanExperts"):
        two.forward(
            pipes["wan22"].transformer,
            x,
            torch.ones(1),
            two.encode_prompts(["a"]),
            height=32,
            width=48,
            guidance_scale=1.0,
        )


def test_image_adapters_refuse_num_frames():
    from flowgrpo.models.sd3 import SD3Adapter

    adapter = SD3Adapter(tiny_pipeline("sd3"), max_sequence_length=8)
    with pytest.raises(ValueError, match="generates images"):
        sample_trajectories(
            adapter,
            ["a cat"],
            num_steps=2,
            guidance_scale=1.0,
            noise_level=0.0,
            height=16,
            width=16,
            num_frames=5,
        )
    traj = sample_trajectories(
        adapter,
        ["a cat"],
        num_steps=2,
        guidance_scale=1.0,
        noise_level=0.0,
        height=16,
        width=16,
        decode=False,
    )
    assert traj.num_frames is None


def test_registry_builds_and_loads_wan(pipes, tmp_path):
    from diffusers import UniPCMultistepScheduler, WanPipeline

    from flowgrpo.models.registry import build_adapter, load_pipeline

    assert type(build_adapter(pipes["wan"], num_frames=5)) is WanAdapter
    unipc = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0
    )
    WanPipeline(
        **{**pipes["wan22"].components, "scheduler": unipc}, boundary_ratio=0.875
    ).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="UniPCMultistepScheduler"):
        loaded = load_pipeline(tmp_path)
    assert type(loaded.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert loaded.scheduler.config.shift == 5.0 and loaded.config.boundary_ratio == 0.875
    adapter = build_adapter(loaded, max_sequence_length=SEQ)
    assert isinstance(adapter.transformer, WanExperts)
    traj = _rollout(adapter, PROMPTS, size=SIZES[0], frames=5, steps=3, g=4.0)
    assert traj.final_latents.shape == (2, 4, 2, 8, 12)
