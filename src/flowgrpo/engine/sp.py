"""Ulysses sequence parallelism (SP) through diffusers' context-parallel attention, on FSDP2.

World = replicate x dp_shard x sp. The ranks of one SP group hold the SAME samples; each runs
its slice of every sequence, and an all-to-all before and after attention swaps sequence
shards for head shards (diffusers' ``TemplatedUlyssesAttention``). FSDP2 shards parameters
over dp_shard x sp together (torchtitan's flattened dp_shard x cp), so parameter memory falls
with SP as well. Three pieces, used in this order (see docs/engine.md, "Sequence parallelism"):

    pm = build_parallel_mesh(world_size, replicate_degree, sp_degree, device_type)
    # LoRA (peft add_adapter) and activation checkpointing first, then:
    enable_sequence_parallel(transformer, pm, sp_degree)
    # fully_shard(block, mesh=pm.fsdp) per block, fully_shard(transformer, mesh=pm.fsdp), then:
    set_sp_gradient_scale(transformer, pm)

Nothing here patches diffusers: every workaround is scoped to our own call or our own modules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from flowgrpo.engine.config import parallel_layout

#: model families with a tested plan and padding rules (others: their own ``_cp_plan``, no padding)
SP_FAMILIES = ("qwen_image", "flux", "sd3")
_CLASS_PREFIX = {
    "QwenImageTransformer": "qwen_image",
    "FluxTransformer": "flux",
    "SD3Transformer": "sd3",
}


# -- meshes -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParallelMesh:
    """Every mesh of one run, and this rank's coordinates.

    fsdp: what ``fully_shard(mesh=)`` gets: ("shard",) with dp_shard x sp ranks, or
      ("replicate", "shard") for HSDP. For sp = 1 it is exactly ``dist.build_mesh``'s mesh.
    cp: ("ring", "ulysses") with ring = 1, what ``ContextParallelConfig(mesh=)`` gets; None
      for sp = 1.
    dp: the data-parallel mesh (the ranks with this rank's sp_rank, one per SP group): gather
      rewards/advantages over it. sp: the ("ulysses",) mesh of this rank's SP group.
    dp_rank/dp_size: the data coordinate. Ranks with equal dp_rank form one SP group and MUST
      get identical inputs; global rank = dp_rank * sp_size + sp_rank.
    """

    full: DeviceMesh
    fsdp: DeviceMesh
    cp: DeviceMesh | None
    dp: DeviceMesh
    sp: DeviceMesh
    dp_rank: int
    dp_size: int
    sp_rank: int
    sp_size: int
    replicate_degree: int


def build_parallel_mesh(
    world_size: int,
    replicate_degree: int = 1,
    sp_degree: int = 1,
    device_type: str | None = None,
) -> ParallelMesh:
    """The run's meshes over the default process group (collective: every rank calls it).

    Layout, outermost first: (replicate, dp_shard, ring = 1, ulysses = sp), so the ranks of an
    SP group are consecutive (on GPUs: keep sp_degree within a node). Built root-first, as
    ("replicate",) "shard" and then *unflattened* into (dp_shard, ring, ulysses): torch 2.13
    deprecates slicing a flattened dim out of a root mesh, which the other way round needs.
    """
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    layout = parallel_layout(world_size, replicate_degree, sp_degree)  # checks it divides
    rep, sp, shard = layout.replicate, layout.sp, layout.dp_shard
    if dist.is_initialized() and dist.get_world_size() != world_size:
        raise ValueError(
            f"world_size={world_size}, but the process group has {dist.get_world_size()} ranks"
        )
    names = ("dp_shard", "ring", "ulysses")
    if rep == 1:
        root = init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
        full = root._unflatten(0, (shard, 1, sp), names)
    else:
        root = init_device_mesh(
            device_type, (rep, shard * sp), mesh_dim_names=("replicate", "shard")
        )
        full = root._unflatten(1, (shard, 1, sp), names)
    if rep > 1 and shard > 1:
        dp = full["replicate", "dp_shard"]._flatten("dp")
    else:
        dp = full["replicate"] if rep > 1 else full["dp_shard"]
    return ParallelMesh(
        full=full,
        fsdp=root,
        cp=full["ring", "ulysses"] if sp > 1 else None,
        dp=dp,
        sp=full["ulysses"],
        dp_rank=dp.get_local_rank(),
        dp_size=rep * shard,
        sp_rank=full["ulysses"].get_local_rank(),
        sp_size=sp,
        replicate_degree=rep,
    )


# -- workaround: diffusers' device lookup on a machine without an accelerator ----------------
@contextlib.contextmanager
def cpu_accelerator_shim() -> Iterator[None]:
    """diffusers 0.42.1 ``ModelMixin._resolve_parallel_config`` (models/modeling_utils.py:1719)
    does ``torch.device(device_type, rank % torch.accelerator.device_count())``: a
    ZeroDivisionError where there is no accelerator (CPU/gloo). The device is only recorded on
    the config (the mesh is ours), so report one device for the duration of the call. A no-op
    where an accelerator exists."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    original = torch.accelerator.device_count
    torch.accelerator.device_count = lambda *args, **kwargs: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = original


# -- SD3: a CP-capable joint-attention processor and a cp plan --------------------------------
def _local_chunk(mask: torch.Tensor, parallel_config: Any) -> torch.Tensor:
    """This rank's chunk of a full-length [B, L] text mask: the same chunk diffusers' split
    hook took of the text (``EquipartitionSharder``: chunk i of the flattened CP mesh)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or cp._flattened_mesh is None:
        return mask
    mesh = cp._flattened_mesh
    return mask.chunk(mesh.size(), dim=1)[dist.get_rank(mesh.get_group())]


class CPJointAttnProcessor:
    """diffusers' ``JointAttnProcessor2_0`` (SD3/SD3.5: q/k RMS-norm, [image, text] joint
    order, ``context_pre_only``, the image-only ``attn2`` of SD3.5 dual layers) computed through
    ``dispatch_attention_fn``, so ``enable_parallelism`` hands it the Ulysses config. The stock
    processor calls F.scaled_dot_product_attention directly and has no ``_parallel_config``:
    diffusers skips it silently and every rank attends to its own tokens only (1.3e-2 off).

    ``text_key_mask`` [B, L] (True = real token, full length, never split) masks the padding
    that ``enable_sequence_parallel`` appends to the text."""

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        text_key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if attention_mask is not None:
            raise ValueError("CPJointAttnProcessor takes text_key_mask, not attention_mask")
        heads = attn.heads

        def split(x: torch.Tensor) -> torch.Tensor:  # [B, S, H * D] -> [B, S, H, D]
            return x.unflatten(-1, (heads, x.shape[-1] // heads))

        query, key, value = (split(f(hidden_states)) for f in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        n_img, mask = hidden_states.shape[1], None
        if encoder_hidden_states is not None:
            projs = (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            eq, ek, ev = (split(f(encoder_hidden_states)) for f in projs)
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query, key, value = (torch.cat(p, dim=1) for p in ((query, eq), (key, ek), (value, ev)))
            if text_key_mask is not None:
                txt = _local_chunk(text_key_mask.bool(), self._parallel_config)
                img = txt.new_ones(txt.shape[0], n_img)
                mask = torch.cat([img, txt], dim=1)[:, None, None, :]  # [B, 1, 1, S_local]
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        out, enc = out[:, :n_img], out[:, n_img:]
        if not attn.context_pre_only:
            enc = attn.to_add_out(enc)
        return attn.to_out[1](attn.to_out[0](out)), enc


def sd3_cp_plan() -> dict[str, Any]:
    """``SD3Transformer2DModel`` has no ``_cp_plan`` in diffusers 0.42.1. Its input is a latent
    image [B, C, H, W]; PatchEmbed adds a cropped 2-D position embedding that needs the full H
    and W, so the image is split *after* ``pos_embed`` (its [B, S, D] output, dim 1), the text
    at the root (``context_embedder`` is per token), and the output is gathered after
    ``proj_out``, before the unpatchify that reads H and W from the unsplit input."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        "": {"encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
        "pos_embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _maskable_flux_processor(old: Any) -> Any:
    """diffusers' ``FluxAttnProcessor`` that also takes ``text_key_mask`` [B, L] (full length)
    for padded T5 tokens; the joint sequence is [text, image] in double and single blocks."""
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    class MaskableFluxAttnProcessor(FluxAttnProcessor):
        def __call__(
            self,
            attn,
            hidden_states,
            encoder_hidden_states=None,
            attention_mask=None,
            image_rotary_emb=None,
            text_key_mask=None,
        ):
            if text_key_mask is not None:
                if attention_mask is not None:
                    raise ValueError("pass text_key_mask or attention_mask, not both")
                txt = _local_chunk(text_key_mask.bool(), self._parallel_config)
                total = hidden_states.shape[1]
                if encoder_hidden_states is not None:
                    total += encoder_hidden_states.shape[1]
                rest = txt.new_ones(txt.shape[0], total - txt.shape[1])
                attention_mask = torch.cat([txt, rest], dim=1)[:, None, None, :]
            return super().__call__(
                attn,
                hidden_states,
                encoder_hidden_states,
                attention_mask=attention_mask,
                image_rotary_emb=image_rotary_emb,
            )

    new = MaskableFluxAttnProcessor()
    new._attention_backend = getattr(old, "_attention_backend", None)
    return new


# -- checks and padding -----------------------------------------------------------------------
def model_family(transformer: nn.Module) -> str | None:
    """The family ("qwen_image", "flux", "sd3") from the class (FSDP subclasses too), or None."""
    for cls in type(transformer).__mro__:
        for prefix, family in _CLASS_PREFIX.items():
            if cls.__name__.startswith(prefix):
                return family
    return None


def _attention_modules(transformer: nn.Module) -> list[tuple[str, nn.Module]]:
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    kinds = (Attention, MochiAttention, AttentionModuleMixin)
    return [(n, m) for n, m in transformer.named_modules() if isinstance(m, kinds)]


def check_cp_processors(transformer: nn.Module) -> None:
    """Raise unless every attention module's processor takes part in context parallelism
    (has the ``_parallel_config`` that ``enable_parallelism`` set). diffusers skips processors
    without ``_attention_backend``/``_parallel_config`` silently (modeling_utils.py:1791, 1821):
    such a layer would attend to its rank's tokens only and give wrong results, no error."""
    modules = _attention_modules(transformer)
    if not modules:
        raise RuntimeError(f"{type(transformer).__name__} has no attention modules to parallelise")
    for name, module in modules:
        proc = getattr(module, "processor", None)
        if getattr(proc, "_parallel_config", None) is None:
            raise RuntimeError(
                f"attention module {name!r} uses {type(proc).__name__}, which does not take part "
                "in context parallelism: under SP it would attend only to this rank's tokens. "
                "Use a processor that calls diffusers' dispatch_attention_fn (enable SP again "
                "after changing processors, or do not change them after enabling)."
            )


def _pad(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def _image_tokens(family: str, module: nn.Module, hidden_states: torch.Tensor) -> int:
    if family == "sd3":  # [B, C, H, W] latents, patchified inside
        p = module.config.patch_size
        return (hidden_states.shape[-2] // p) * (hidden_states.shape[-1] // p)
    return hidden_states.shape[1]  # packed [B, S, C]


class _SPForwardCheck:
    """Forward pre-hook on the transformer (runs before diffusers' split hooks, which live in
    ``forward``): checks the call, pads the text to a multiple of sp with masked tokens, checks
    the image tokens divide, and optionally that the SP group got identical inputs."""

    def __init__(self, family, sp, group, attention, hooked, verify_inputs):
        self.family, self.sp, self.group = family, sp, group
        self.attention, self.hooked, self.verify_inputs = attention, hooked, verify_inputs

    def __call__(self, module, args, kwargs):
        if args:
            raise TypeError("call a sequence-parallel transformer with keyword arguments only")
        for name, sub in self.hooked:  # a wrapper added later would bypass diffusers' hooks
            if module.get_submodule(name) is not sub:
                raise RuntimeError(
                    f"{name!r} was replaced after enable_sequence_parallel (LoRA added after "
                    "it?): add LoRA adapters before enabling sequence parallelism"
                )
        for _, attn in self.attention:
            if getattr(attn.processor, "_parallel_config", None) is None:
                check_cp_processors(module)  # raises, naming the module
        if self.family is None:
            return None
        hs, ehs = kwargs["hidden_states"], kwargs["encoder_hidden_states"]
        n_img = _image_tokens(self.family, module, hs)
        if n_img % self.sp:
            raise ValueError(
                f"{n_img} image tokens do not split over sp_degree={self.sp}: choose a height "
                f"and width whose token count (latent h/2 x w/2) is a multiple of {self.sp}"
            )
        if self.verify_inputs:
            self._verify(hs, ehs, kwargs.get("timestep"))
        pad = (-ehs.shape[1]) % self.sp
        if pad == 0:
            return None
        kwargs = dict(kwargs)
        kwargs["encoder_hidden_states"] = _pad(ehs, pad, 1)
        if self.family == "qwen_image":  # the model honours its own text mask
            mask = kwargs.get("encoder_hidden_states_mask")
            if mask is None:
                mask = torch.ones(ehs.shape[:2], dtype=torch.long, device=ehs.device)
            kwargs["encoder_hidden_states_mask"] = _pad(mask, pad, 1)
            return args, kwargs
        # sd3, flux: a full-length key mask through joint_attention_kwargs to our processors
        jak = dict(kwargs.get("joint_attention_kwargs") or {})
        if "text_key_mask" in jak:
            raise ValueError("text_key_mask is set by enable_sequence_parallel's padding")
        jak["text_key_mask"] = _pad(
            torch.ones(ehs.shape[:2], dtype=torch.bool, device=ehs.device), pad, 1
        )
        kwargs["joint_attention_kwargs"] = jak
        if self.family == "flux":  # zero position ids, as every T5 token has
            ids = kwargs["txt_ids"]
            kwargs["txt_ids"] = _pad(ids, pad, ids.ndim - 2)
        return args, kwargs

    def _verify(self, *tensors: torch.Tensor | None) -> None:
        sums = torch.stack([t.double().sum() for t in tensors if t is not None])
        gathered = [torch.empty_like(sums) for _ in range(self.sp)]
        dist.all_gather(gathered, sums, group=self.group)
        if not all(torch.equal(g, sums) for g in gathered):
            raise RuntimeError(
                "the ranks of an SP group got different inputs: give every rank of a group the "
                "same samples (shard data by ParallelMesh.dp_rank, not the global rank)"
            )


@dataclass(frozen=True)
class SequenceParallel:
    """What ``enable_sequence_parallel`` did (also stored as ``transformer._flowgrpo_sp``)."""

    family: str | None
    sp_degree: int
    parallel_config: Any
    hook: Any  # a list of hooks for a module of several transformers


def enable_sequence_parallel(
    transformer: nn.Module,
    mesh: ParallelMesh | DeviceMesh,
    sp_degree: int,
    *,
    verify_inputs: bool = False,
) -> SequenceParallel | None:
    """Turn on diffusers' Ulysses attention on ``transformer`` over our mesh (never a default
    one: diffusers would build ranks 0..sp-1 only). ``mesh``: a ParallelMesh or its ("ring",
    "ulysses") mesh. Returns None (and does nothing) for sp_degree 1.

    Call AFTER peft's ``add_adapter`` (FLUX's LoRA targets ``proj_out``, whose gather hook a
    later wrapper would bypass; a later replacement raises at the next forward) and before or
    after ``fully_shard``; once per model copy (diffusers refuses a second call). Call the
    transformer with keyword arguments and give every rank of an SP group the full, identical
    inputs: diffusers takes each rank's chunk itself. ``verify_inputs`` checks that on every
    forward (one small all-gather; for debugging).

    Qwen-Image, FLUX, SD3: text shorter than a multiple of sp is padded with masked tokens (the
    result is the unpadded one); image tokens must divide by sp (clear error). Heads must
    divide by sp. Other models with a diffusers ``_cp_plan`` (e.g. Wan) run without padding:
    every split length must divide by sp. A module holding several transformers (Wan2.2's
    two experts) names them in ``sequence_parallel_parts()``: each gets SP on the same mesh.
    """
    from diffusers import ContextParallelConfig

    if sp_degree == 1:
        return None
    cp = mesh.cp if isinstance(mesh, ParallelMesh) else mesh
    if cp is None or tuple(cp.mesh_dim_names or ()) != ("ring", "ulysses"):
        raise ValueError(
            "enable_sequence_parallel needs a ('ring', 'ulysses') mesh "
            "(build_parallel_mesh(..., sp_degree > 1).cp)"
        )
    if cp["ring"].size() != 1 or cp["ulysses"].size() != sp_degree:
        raise ValueError(
            f"the mesh has ring={cp['ring'].size()}, ulysses={cp['ulysses'].size()}; "
            f"expected ring=1, ulysses=sp_degree={sp_degree}"
        )
    parts = getattr(transformer, "sequence_parallel_parts", None)
    if callable(parts):  # several transformers in one module (Wan2.2's experts): each gets SP
        infos = [
            enable_sequence_parallel(p, cp, sp_degree, verify_inputs=verify_inputs) for p in parts()
        ]
        info = SequenceParallel(
            infos[0].family, sp_degree, infos[0].parallel_config, [i.hook for i in infos]
        )
        transformer._flowgrpo_sp = info
        return info
    if getattr(transformer, "_parallel_config", None) is not None:
        raise RuntimeError("parallelism is already enabled on this transformer (once per model)")
    family = model_family(transformer)
    plan = sd3_cp_plan() if family == "sd3" else getattr(transformer, "_cp_plan", None)
    if plan is None:
        raise ValueError(f"{type(transformer).__name__} has no context-parallel plan (_cp_plan)")
    heads = getattr(transformer.config, "num_attention_heads", None)
    if heads is None or heads % sp_degree:
        raise ValueError(
            f"{type(transformer).__name__} has {heads} attention heads, which do not split "
            f"over sp_degree={sp_degree}: Ulysses gives each rank heads / sp of them"
        )
    attention = _attention_modules(transformer)
    for _, module in attention:  # our processors (same math, CP-capable, text mask)
        if family == "sd3":
            module.set_processor(CPJointAttnProcessor())
        elif family == "flux":
            module.set_processor(_maskable_flux_processor(module.processor))
    config = ContextParallelConfig(ulysses_degree=sp_degree, mesh=cp)
    with cpu_accelerator_shim():
        transformer.enable_parallelism(config=config, cp_plan=plan)
    check_cp_processors(transformer)
    hooked = [(name, transformer.get_submodule(name)) for name in plan if name and "*" not in name]
    check = _SPForwardCheck(
        family, sp_degree, cp["ulysses"].get_group(), attention, hooked, verify_inputs
    )
    handle = transformer.register_forward_pre_hook(check, with_kwargs=True)
    info = SequenceParallel(family, sp_degree, transformer._parallel_config, handle)
    transformer._flowgrpo_sp = info
    return info


# -- gradient scale under FSDP2 ---------------------------------------------------------------
def set_sp_gradient_scale(model: nn.Module, mesh: ParallelMesh) -> int:
    """Make FSDP2 reduce gradients as SUM over the SP ranks and MEAN over the data-parallel
    ranks. Call after ``fully_shard`` (on every sharded model copy); a no-op for sp = 1.
    Returns how many FSDP modules were set.

    Why: the gathered output makes the loss identical on every rank of an SP group, and each
    rank's backward carries only its own tokens' share, so the group's gradients SUM to the
    full one; FSDP2 by default AVERAGES over its whole mesh (dp x sp ranks), giving grad / sp
    (measured: exactly 0.5 at sp = 2). The fix sets the divide factor to dp_size on every FSDP
    module (the setting is per module) and forces SUM-only collectives: without that FSDP
    reduces with ``ReduceOp.PREMUL_SUM(1 / factor)``, which gloo does not support (NCCL
    does); SUM-then-divide works on both at the cost of one local division. Chosen over scaling
    the loss by sp because it is set once on the model: no loss, metric or algorithm needs to
    know about SP, and logged losses stay unscaled.
    """
    from torch.distributed.fsdp import FSDPModule

    if mesh.sp_size == 1:
        return 0
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("set_sp_gradient_scale needs a model sharded with fully_shard first")
    for m in modules:
        m.set_gradient_divide_factor(float(mesh.dp_size))
        m.set_force_sum_reduction_for_comms(True)
    return len(modules)


__all__ = [
    "SP_FAMILIES",
    "CPJointAttnProcessor",
    "ParallelMesh",
    "SequenceParallel",
    "build_parallel_mesh",
    "check_cp_processors",
    "cpu_accelerator_shim",
    "enable_sequence_parallel",
    "model_family",
    "sd3_cp_plan",
    "set_sp_gradient_scale",
]
