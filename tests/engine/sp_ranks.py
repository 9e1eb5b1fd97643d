"""The spawned ranks of tests/engine/test_sp.py (Ulysses SP through diffusers' context
parallelism): each rank builds the tiny pipelines, an SP copy of the transformer and an
unsharded single-process reference copy, runs both on the same inputs and records the worst
relative difference over ranks; rank 0 saves every figure for the test process to assert on.
"""

from __future__ import annotations

import copy
import traceback
from pathlib import Path

import torch

from flowgrpo.models.base import PromptEmbeds
from flowgrpo.testing.families import (
    core,
    double,
    kinds,
    sequence_parallel,
    sequence_parallel_spec,
)

#: the detailed checks run on the families of the "core" cost tier that run under SP, images
#: (the one place CI time picks a subset: flowgrpo.testing.families.core); every family that
#: runs under SP trains through the engine under it in tests/engine/sp_train_ranks.py
KINDS = kinds(lambda f: sequence_parallel(f) and core(f) and not f.num_frames)
HW = (32, 48)  # 8 x 12 = 96 image tokens
ODD_HW = (36, 44)  # 9 x 11 = 99 image tokens: not divisible by 2
TEXT = 16  # even: no padding
GUIDANCE = 4.0


def own_plan(fam) -> bool:
    """Whether ``fam``'s adapter writes its transformer's context-parallel plan itself
    (diffusers has none for it)."""
    from flowgrpo.models.parallel import SequenceParallelSpec

    spec = sequence_parallel_spec(fam)
    return spec is not None and type(spec).cp_plan is not SequenceParallelSpec.cp_plan


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def make_embeds(adapter, batch: int, text_len: int, gen, lengths=None):
    """Random prompt embeddings in the adapter's layout: masked (``lengths`` real tokens) for a
    transformer without a pooled projection (Qwen-Image), else with a pooled vector."""
    cfg = adapter.transformer.config
    emb = torch.randn(batch, text_len, cfg.joint_attention_dim, generator=gen)
    if getattr(cfg, "pooled_projection_dim", None) is None:
        mask = torch.zeros(batch, text_len, dtype=torch.long)
        for i, n in enumerate(lengths or [text_len] * batch):
            mask[i, :n] = 1
        return PromptEmbeds(emb, mask, None)
    return PromptEmbeds(emb, None, torch.randn(batch, cfg.pooled_projection_dim, generator=gen))


def latent_shape(adapter, batch: int, hw) -> tuple[int, ...]:
    """The shape of ``batch`` latents at ``hw`` pixels in the adapter's layout ([B, C, h, w]
    or packed [B, S, C]), scaled from its own latents at ``HW`` (``hw`` need not be a size
    the pipeline accepts: the odd token count)."""
    probe = adapter.prepare_latents(1, *HW, torch.Generator().manual_seed(0)).shape
    if len(probe) == 4:
        return (batch, probe[1], probe[2] * hw[0] // HW[0], probe[3] * hw[1] // HW[1])
    return (batch, probe[1] * hw[0] * hw[1] // (HW[0] * HW[1]), probe[2])


def make_inputs(adapter, *, seed: int, batch: int = 2, hw=HW, text_len=TEXT):
    """latents (pipeline layout), sigma [B], positive and negative embeddings (masked text:
    the negative prompts shorter, so the doubled CFG batch is padded with a mask)."""
    gen = torch.Generator().manual_seed(seed)
    lat = torch.randn(latent_shape(adapter, batch, hw), generator=gen)
    sigma = torch.rand(batch, generator=gen) * 0.9 + 0.05
    pos = make_embeds(adapter, batch, text_len, gen, [text_len, text_len - 3])
    neg = make_embeds(adapter, batch, text_len, gen, [4, text_len - 1])
    return lat, sigma, pos, neg


def add_lora(model, adapter, targets=None) -> None:
    """peft LoRA r4 on the adapter's targets, B randomised (B = 0 would zero every A grad)."""
    from peft import LoraConfig

    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        targets = targets or list(adapter.lora_target_modules)
        model.add_adapter(
            LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian", target_modules=targets)
        )
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.data.normal_(0, 0.05)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def shard(model, pm, scale: bool = True) -> None:
    """The engine's layout: fully_shard per block, then the root (fp32 output), on pm.fsdp;
    then the SP gradient scale (``scale=False``: FSDP's default mean over all ranks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from flowgrpo.engine.parallelize import transformer_blocks
    from flowgrpo.engine.sp import set_sp_gradient_scale

    for block in transformer_blocks(model):
        fully_shard(block, mesh=pm.fsdp)
    fully_shard(model, mesh=pm.fsdp, mp_policy=MixedPrecisionPolicy(output_dtype=torch.float32))
    if scale:
        set_sp_gradient_scale(model, pm)


def grads(model) -> dict[str, torch.Tensor]:
    """Full (unsharded) grads of the trainable params (collective under FSDP); zeros where a
    param got none (e.g. the text stream of Qwen-Image's last block feeds no output)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            g = p.grad
            if g is None:
                out[name] = torch.zeros(p.shape)
            else:
                out[name] = g.full_tensor() if isinstance(g, DTensor) else g.detach().clone()
    return out


def compare_grads(got: dict, ref: dict) -> dict[str, float]:
    """grad_rel: max over params of max|g - g_ref| / (max |g_ref| over all params);
    grad_ratio: <g, g_ref> / <g_ref, g_ref> (1 = the right scale)."""
    assert got.keys() == ref.keys()
    top = max(float(r.abs().max()) for r in ref.values())
    err = max(float((got[n] - ref[n]).abs().max()) for n in ref) / top
    num = sum(float((got[n] * ref[n]).sum()) for n in ref)
    den = sum(float((ref[n] * ref[n]).sum()) for n in ref)
    return {"grad_rel": err, "grad_ratio": num / den, "n_grads": len(ref)}


def velocity(adapter, model, inputs, hw=HW):
    lat, sigma, pos, neg = inputs
    return adapter.velocity(
        model, lat, sigma, pos, neg, guidance_scale=GUIDANCE, height=hw[0], width=hw[1]
    )


def loss_grads(adapter, model, inputs_list, weight) -> dict[str, torch.Tensor]:
    """Grads of sum((v * weight)) through both CFG branches, averaged over ``inputs_list``
    (one entry per data-parallel group: what FSDP's mean over dp gives)."""
    total = None
    for inputs in inputs_list:
        model.zero_grad(set_to_none=True)
        (velocity(adapter, model, inputs) * weight).sum().backward()
        g = grads(model)
        total = g if total is None else {n: total[n] + g[n] for n in g}
    return {n: t / len(inputs_list) for n, t in total.items()}


def _adapter(kind: str):
    """The family's tiny adapter as its SP case drives it (FLUX.1-dev: true CFG gives the
    second branch, its guidance being distilled)."""
    return double(kind).sp_adapter()


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return ""


def check_kind(kind: str, pm) -> dict:
    """Every 2-rank check of one family; figures are this rank's."""
    from flowgrpo.engine.sp import enable_sequence_parallel

    adapter = _adapter(kind)
    base = adapter.transformer
    inputs = make_inputs(adapter, seed=1)
    lat, sigma, pos, _ = inputs
    res: dict = {}

    def fwd(model, lat=lat, embeds=pos, hw=HW):
        return adapter.forward(
            model, lat, sigma, embeds, height=hw[0], width=hw[1], guidance_scale=GUIDANCE
        )

    # forward and the guided velocity (CFG doubled batch), no grad
    model = copy.deepcopy(base)
    info = enable_sequence_parallel(model, pm, 2, spec=adapter.sequence_parallel)
    res["family"] = info.family
    with torch.no_grad():
        res["forward_rel"] = rel(fwd(model), fwd(base))
        res["velocity_rel"] = rel(velocity(adapter, model, inputs), velocity(adapter, base, inputs))
        odd = make_inputs(adapter, seed=2, hw=ODD_HW)
        res["odd_image_error"] = _error(lambda: fwd(model, odd[0], hw=ODD_HW))
        # the text padding: a length that does not divide by 2 (Qwen: masked prompts)
        padded = make_inputs(adapter, seed=3, text_len=TEXT + 1)
        res["pad_text_len"] = padded[2].embeds.shape[1]
        res["pad_forward_rel"] = rel(
            fwd(model, padded[0], padded[2]), fwd(base, padded[0], padded[2])
        )
        res["pad_velocity_rel"] = rel(
            velocity(adapter, model, padded), velocity(adapter, base, padded)
        )
    # bf16 weights (what GPUs run): SP is no farther from fp32 than one process in bf16 is
    sp16 = copy.deepcopy(base).to(torch.bfloat16)
    one16 = copy.deepcopy(sp16)
    res["bf16_family"] = enable_sequence_parallel(
        sp16, pm, 2, spec=adapter.sequence_parallel
    ).family
    with torch.no_grad():
        v32, v_sp, v_one = (velocity(adapter, m, inputs) for m in (base, sp16, one16))
    res["bf16_sp_vs_fp32_rel"] = rel(v_sp, v32)
    res["bf16_one_vs_fp32_rel"] = rel(v_one, v32)
    res["bf16_sp_vs_one_rel"] = rel(v_sp, v_one)
    if kind == "sd3":  # a stock (non-CP) processor put back: refused, never silently local
        from diffusers.models.attention_processor import JointAttnProcessor2_0

        model.transformer_blocks[1].attn.set_processor(JointAttnProcessor2_0())
        res["stock_processor_error"] = _error(lambda: fwd(model))
    if kind == "qwen_image":  # ranks of an SP group fed different samples: refused
        checked = copy.deepcopy(base)
        enable_sequence_parallel(checked, pm, 2, spec=adapter.sequence_parallel, verify_inputs=True)
        mine = make_inputs(adapter, seed=10 + pm.sp_rank)
        with torch.no_grad():
            res["mismatch_error"] = _error(lambda: fwd(checked, mine[0], mine[2]))
    if kind == "flux":  # LoRA added after SP on the output layer (its gather hook): refused
        late = copy.deepcopy(base)
        enable_sequence_parallel(late, pm, 2, spec=adapter.sequence_parallel)
        add_lora(late, adapter, targets=["proj_out"])
        with torch.no_grad():
            res["lora_after_sp_error"] = _error(lambda: fwd(late))

    # gradients through both CFG branches: LoRA (added first) + SP + FSDP2, +- checkpointing,
    # and with text padding
    weight = torch.randn(lat.shape, generator=torch.Generator().manual_seed(7))
    cases = [("lora_fsdp", False, inputs), ("lora_fsdp_ckpt", True, inputs)]
    cases.append(("pad_lora_fsdp", False, padded))
    if kind == "sd3":  # without set_sp_gradient_scale: FSDP's mean over dp x sp ranks
        cases.append(("no_scale", False, inputs))
    for case, ckpt, data in cases:
        model = copy.deepcopy(base)
        add_lora(model, adapter)
        ref = copy.deepcopy(model)
        if ckpt:
            model.enable_gradient_checkpointing()
        enable_sequence_parallel(model, pm, 2, spec=adapter.sequence_parallel)
        shard(model, pm, scale=case != "no_scale")
        calls: list[int] = []  # block 0 runs twice per forward + backward under checkpointing
        model.transformer_blocks[0].register_forward_pre_hook(lambda *_, c=calls: c.append(1))
        got = loss_grads(adapter, model, [data], weight)
        out = compare_grads(got, loss_grads(adapter, ref, [data], weight))
        out["block0_calls"] = len(calls)
        res.update({f"{case}_{k}": v for k, v in out.items()})
    return res


#: the other families whose adapters write their own plan (diffusers has none), checked on
#: their adapters' own prompt embeddings at their SP case's size
OWN_KINDS = kinds(lambda f: sequence_parallel(f) and own_plan(f) and f.kind not in KINDS)
OWN_PROMPTS = ["a red cat", "a photo of a big old house with a tree"]


def check_own_plan(kind: str, pm) -> dict:
    """Forward, guided velocity (CFG batch, negatives of other lengths), bf16 and LoRA + FSDP2
    gradients +- activation checkpointing (the blocks then get positional arguments, which the
    plan's hooks find by the forward's signature) for a family with its own plan. A case with
    ``odd_text`` (Qwen-Image 2.1) cuts its positive prompts to odd lengths: its text is padded
    after the image."""
    from flowgrpo.engine.sp import enable_sequence_parallel

    sp_case = double(kind).sp
    adapter = _adapter(kind)
    base = adapter.transformer
    hw = sp_case.hw
    pos = adapter.encode_prompts(OWN_PROMPTS)
    neg = adapter.encode_prompts(["", "blurry"])
    pos = sp_case.text(pos)
    lat = adapter.prepare_latents(2, hw[0], hw[1], torch.Generator().manual_seed(1))
    inputs = (lat, torch.tensor([0.8, 0.35]), pos, neg)
    res: dict = {}
    model = copy.deepcopy(base)
    res["family"] = enable_sequence_parallel(model, pm, 2, spec=adapter.sequence_parallel).family
    with torch.no_grad():
        f_sp, f_one = (
            adapter.forward(m, lat, inputs[1], pos, height=hw[0], width=hw[1], guidance_scale=4.0)
            for m in (model, base)
        )
        res["forward_rel"] = rel(f_sp, f_one)
        res["velocity_rel"] = rel(*(velocity(adapter, m, inputs, hw) for m in (model, base)))
    sp16 = copy.deepcopy(base).to(torch.bfloat16)
    one16 = copy.deepcopy(sp16)
    res["bf16_family"] = enable_sequence_parallel(
        sp16, pm, 2, spec=adapter.sequence_parallel
    ).family
    with torch.no_grad():
        v32, v_sp, v_one = (velocity(adapter, m, inputs, hw) for m in (base, sp16, one16))
    res["bf16_sp_vs_fp32_rel"] = rel(v_sp, v32)
    res["bf16_one_vs_fp32_rel"] = rel(v_one, v32)
    weight = torch.randn(lat.shape, generator=torch.Generator().manual_seed(7))

    def loss_grads_hw(m) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        (velocity(adapter, m, inputs, hw) * weight).sum().backward()
        return grads(m)

    for case, ckpt in (("lora_fsdp", False), ("lora_fsdp_ckpt", True)):
        model = copy.deepcopy(base)
        add_lora(model, adapter)
        ref = copy.deepcopy(model)
        if ckpt:
            model.enable_gradient_checkpointing()
        enable_sequence_parallel(model, pm, 2, spec=adapter.sequence_parallel)
        shard(model, pm)
        calls: list[int] = []
        block = model.get_submodule(sp_case.first_block)
        block.register_forward_pre_hook(lambda *_, c=calls: c.append(1))
        out = compare_grads(loss_grads_hw(model), loss_grads_hw(ref))
        out["block0_calls"] = len(calls)
        res.update({f"{case}_{k}": v for k, v in out.items()})
    return res


def _heads_error(pm) -> str:
    from diffusers import FluxTransformer2DModel

    from flowgrpo.engine.sp import enable_sequence_parallel
    from flowgrpo.testing.tiny import transformer_config

    model = FluxTransformer2DModel(**{**transformer_config("flux"), "num_attention_heads": 3})
    return _error(lambda: enable_sequence_parallel(model, pm, 2))


def _merge(results: list[dict]) -> dict:
    """Worst value over ranks for figures (``*_rel``; ``*_ratio`` farthest from 1), errors of
    rank 0 (every rank raises the same)."""
    out = dict(results[0])
    for key in out:
        if key.endswith("_rel"):
            out[key] = max(r[key] for r in results)
        elif key.endswith("_ratio"):
            out[key] = max((r[key] for r in results), key=lambda v: abs(v - 1))
    return out


def _setup(rank: int, world: int, port: int):
    from flowgrpo.testing.ranks import rank_env

    rank_env(rank, world, port)
    import warnings

    import diffusers

    warnings.filterwarnings("ignore", message=".*experimental feature.*")
    diffusers.utils.logging.set_verbosity_error()
    from flowgrpo.engine import init_distributed

    return init_distributed()


def sp_job(rank: int, world: int, port: int, workdir: str) -> None:
    """2 ranks = one SP group (sp 2, dp 1)."""
    import torch.distributed as dist

    from flowgrpo.engine import cleanup
    from flowgrpo.engine.sp import build_parallel_mesh

    _setup(rank, world, port)
    pm = build_parallel_mesh(world, 1, 2, "cpu")
    results: dict = {
        "mesh": dict(
            dp_rank=pm.dp_rank,
            dp_size=pm.dp_size,
            sp_rank=pm.sp_rank,
            sp_size=pm.sp_size,
            fsdp=pm.fsdp.size(),
        )
    }
    for kind in KINDS + OWN_KINDS:
        try:
            check = check_kind if kind in KINDS else check_own_plan
            results[kind] = check(kind, pm)
        except Exception:  # noqa: BLE001 - reported to the test process
            results[kind] = {"crash": traceback.format_exc()}
    results["heads_error"] = _heads_error(pm)
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        merged = {k: v for k, v in results.items() if k not in KINDS + OWN_KINDS}
        merged["meshes"] = [g["mesh"] for g in gathered]
        for kind in KINDS + OWN_KINDS:
            per_rank = [g[kind] for g in gathered]
            crash = [r["crash"] for r in per_rank if "crash" in r]
            merged[kind] = {"crash": crash[0]} if crash else _merge(per_rank)
        torch.save(merged, Path(workdir) / "sp2.pt")
    cleanup()


def dp_sp_job(rank: int, world: int, port: int, workdir: str) -> None:
    """4 ranks: dp2 x sp2 (FSDP over all 4) and HSDP replicate2 x sp2; the SP groups get
    different samples, the reference is the mean over the dp groups' gradients."""
    import torch.distributed as dist

    from flowgrpo.engine import cleanup
    from flowgrpo.engine.sp import build_parallel_mesh, enable_sequence_parallel

    _setup(rank, world, port)
    kind = "sd3"  # the cheapest tiny pipeline to build
    adapter = _adapter(kind)
    base = adapter.transformer
    res: dict = {"rank": rank}
    for name, replicate in (("dp2sp2", 1), ("hsdp2sp2", 2)):
        pm = build_parallel_mesh(world, replicate, 2, "cpu")
        res[name] = {"dp_rank": pm.dp_rank, "sp_rank": pm.sp_rank, "dp_size": pm.dp_size}
        data = [make_inputs(adapter, seed=20 + d) for d in range(pm.dp_size)]
        weight = torch.randn(data[0][0].shape, generator=torch.Generator().manual_seed(7))
        model = copy.deepcopy(base)
        add_lora(model, adapter)
        ref = copy.deepcopy(model)
        enable_sequence_parallel(model, pm, 2, spec=adapter.sequence_parallel)
        shard(model, pm)
        got = loss_grads(adapter, model, [data[pm.dp_rank]], weight)  # FSDP: mean over dp
        res[name].update(compare_grads(got, loss_grads(adapter, ref, data, weight)))
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        torch.save(gathered, Path(workdir) / "dp2sp2.pt")
    cleanup()
