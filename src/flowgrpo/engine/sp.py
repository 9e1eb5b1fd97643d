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


# -- checks and padding -----------------------------------------------------------------------
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


class _SPForwardCheck:
    """Forward pre-hook on the transformer (runs before diffusers' split hooks, which live in
    ``forward``): checks the call and, for a family that declares a ``SequenceParallelSpec``,
    checks the image tokens divide, optionally that the SP group got identical inputs, and pads
    the text to a multiple of sp with masked tokens (the spec's padding rule)."""

    def __init__(self, spec, sp, group, attention, hooked, verify_inputs):
        self.spec, self.sp, self.group = spec, sp, group
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
        if self.spec is None:
            return None
        hs, ehs = kwargs[self.spec.image_kwarg], kwargs[self.spec.text_kwarg]
        n_img = self.spec.image_tokens(module, hs)
        if n_img % self.sp:
            raise ValueError(
                f"{n_img} image tokens do not split over sp_degree={self.sp}: choose a height "
                f"and width whose token count ({self.spec.image_token_rule}) is a multiple of "
                f"{self.sp}"
            )
        if self.verify_inputs:
            self._verify(hs, ehs, kwargs.get(self.spec.timestep_kwarg))
        pad = self.spec.text_padding(module, kwargs, self.sp)
        if pad == 0:
            return None
        return args, self.spec.pad_text(kwargs, pad)

    def _verify(self, *inputs: torch.Tensor | list[torch.Tensor] | None) -> None:
        tensors = [t for x in inputs if x is not None for t in (x if isinstance(x, list) else [x])]
        sums = torch.stack([t.double().sum() for t in tensors])
        gathered = [torch.empty_like(sums) for _ in range(self.sp)]
        dist.all_gather(gathered, sums, group=self.group)
        if not all(torch.equal(g, sums) for g in gathered):
            raise RuntimeError(
                "the ranks of an SP group got different inputs: give every rank of a group the "
                "same samples (shard data by ParallelMesh.dp_rank, not the global rank)"
            )


@dataclass(frozen=True)
class SequenceParallel:
    """What ``enable_sequence_parallel`` did (also stored as ``transformer._flowgrpo_sp``).
    family: the name of the family's ``SequenceParallelSpec`` (None: diffusers' plan alone)."""

    family: str | None
    sp_degree: int
    parallel_config: Any
    hook: Any  # a list of hooks for a module of several transformers


def enable_sequence_parallel(
    transformer: nn.Module,
    mesh: ParallelMesh | DeviceMesh,
    sp_degree: int,
    *,
    spec: Any = None,
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

    ``spec``: the family's ``flowgrpo.models.parallel.SequenceParallelSpec``, as its adapter
    declares it (``EngineDeclarations.sequence_parallel``; nothing is looked up from the
    transformer's class); it must name a class of the transformer (``transformer_class``).
    With a spec, the spec's plan and attention processors are installed, text shorter than a
    multiple of sp is padded with masked tokens (the result is the unpadded one) and image
    tokens must divide by sp (clear error). Without one (None), diffusers' ``_cp_plan`` runs
    without padding: every split length must divide by sp. Heads must divide by sp. A module holding several transformers (two experts)
    names them in ``sequence_parallel_parts()``: each gets SP on the same mesh.
    """
    from diffusers import ContextParallelConfig

    if sp_degree == 1:
        return None
    parts = getattr(transformer, "sequence_parallel_parts", None)
    classes = {c.__name__ for c in type(transformer).__mro__}  # FSDP's subclasses match too
    if spec is not None and spec.transformer_class not in classes and not callable(parts):
        raise ValueError(
            f"the sequence-parallel spec {spec.name!r} is for {spec.transformer_class}, not "
            f"{type(transformer).__name__}: pass the spec its family declares"
        )
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
    if callable(parts):  # several transformers in one module (experts): each gets SP
        infos = [
            enable_sequence_parallel(p, cp, sp_degree, spec=spec, verify_inputs=verify_inputs)
            for p in parts()
        ]
        info = SequenceParallel(
            infos[0].family, sp_degree, infos[0].parallel_config, [i.hook for i in infos]
        )
        transformer._flowgrpo_sp = info
        return info
    if getattr(transformer, "_parallel_config", None) is not None:
        raise RuntimeError("parallelism is already enabled on this transformer (once per model)")
    plan = getattr(transformer, "_cp_plan", None) if spec is None else spec.cp_plan(transformer)
    if plan is None:
        raise ValueError(
            f"{type(transformer).__name__} has no context-parallel plan (_cp_plan) and its family "
            "declares no sequence-parallel spec: sequence parallelism (fsdp.sp_degree > 1) is "
            "not supported for it"
        )
    attention = _attention_modules(transformer)
    heads = getattr(transformer.config, "num_attention_heads", None)
    if heads is None:  # a config that names them otherwise: the attention modules' count
        heads = next((m.heads for _, m in attention if hasattr(m, "heads")), None)
    if heads is None or heads % sp_degree:
        raise ValueError(
            f"{type(transformer).__name__} has {heads} attention heads, which do not split "
            f"over sp_degree={sp_degree}: Ulysses gives each rank heads / sp of them"
        )
    for name, module in attention:  # the family's processors (same math, CP-capable, text mask)
        processor = None if spec is None else spec.processor_for(name, module)
        if processor is not None:
            module.set_processor(processor)
    config = ContextParallelConfig(ulysses_degree=sp_degree, mesh=cp)
    with cpu_accelerator_shim():
        transformer.enable_parallelism(config=config, cp_plan=plan)
    check_cp_processors(transformer)
    hooked = [(name, transformer.get_submodule(name)) for name in plan if name and "*" not in name]
    check = _SPForwardCheck(
        spec, sp_degree, cp["ulysses"].get_group(), attention, hooked, verify_inputs
    )
    handle = transformer.register_forward_pre_hook(check, with_kwargs=True)
    family = None if spec is None else spec.name
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
    "ParallelMesh",
    "SequenceParallel",
    "build_parallel_mesh",
    "check_cp_processors",
    "cpu_accelerator_shim",
    "enable_sequence_parallel",
    "set_sp_gradient_scale",
]
