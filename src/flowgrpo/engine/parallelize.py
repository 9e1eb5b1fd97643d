"""Parallelising a diffusers transformer for training, in place: LoRA, fp32 masters,
activation checkpointing, the meshes, sequence parallelism, then ``fully_shard`` on every block
and on the root; a model built on the meta device is then filled with this rank's shards.

torchtitan's ``parallelize`` step: ``parallelize(model, ...)`` is everything the engine does to
the model before it builds the optimizer. See docs/engine.md ("Wrapping: LoRA, then FSDP2").
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from flowgrpo.engine import dist as fdist
from flowgrpo.engine.load import adapters_beside_meta, is_empty, materialize
from flowgrpo.engine.quant import base_quant, check_mode, quantize_frozen
from flowgrpo.models.parallel import EngineDeclarations
from flowgrpo.settings import resolve_dtype


def transformer_blocks(
    model: nn.Module, block_classes: Sequence[str] | None = None
) -> list[nn.Module]:
    """The blocks to shard one by one: the modules of ``model`` whose class is one of
    ``block_classes`` (the family's ``EngineDeclarations.fsdp_blocks``), None: of the model's
    ``_no_split_modules`` (diffusers' declaration). ValueError naming the classes when a
    declared list matches no module (a misspelt class would leave the model in one unit)."""
    names = set(block_classes if block_classes is not None else ())
    if block_classes is None:
        names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if block_classes is not None and not blocks:
        raise ValueError(f"fsdp_blocks {sorted(names)} name no module of {type(model).__name__}")
    return blocks


def add_lora(
    model: nn.Module, lora: Any, default_targets: Sequence[str], seed: int, device: torch.device
) -> None:
    """``model.add_adapter`` (peft LoRA, the diffusers way) from the ``lora`` section, with
    ``default_targets`` (the adapter's) when ``lora.target_modules`` is null; initialised under
    an RNG forked and seeded with ``seed`` (identical on every rank). Only ``lora_*`` params
    train afterwards."""
    from peft import LoraConfig as PeftLoraConfig

    targets = lora.target_modules
    if targets is None:
        targets = list(default_targets)
    if not targets:
        raise ValueError("lora.target_modules is empty and the adapter has no defaults")
    init = {"default": True, "true": True, "false": False}.get(str(lora.init).lower(), lora.init)
    peft_cfg = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        init_lora_weights=init,
        target_modules=targets,
        lora_dropout=lora.dropout,
    )
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # identical init on every rank
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        with adapters_beside_meta():  # a meta base keeps its new LoRA on the host
            model.add_adapter(peft_cfg)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def build_meshes(dist: fdist.DistInfo, fsdp: Any) -> tuple[Any, Any]:
    """(the SP meshes or None, the mesh ``fully_shard`` gets) for the ``fsdp`` section: a
    ``ParallelMesh`` when ``fsdp.sp_degree`` > 1, else ``dist.build_mesh``'s (HSDP when
    ``fsdp.replicate_degree`` > 1). Collective."""
    device_type = dist.device.type
    if fsdp.sp_degree > 1:
        from flowgrpo.engine.sp import build_parallel_mesh

        parallel = build_parallel_mesh(
            dist.world_size, fsdp.replicate_degree, fsdp.sp_degree, device_type
        )
        return parallel, parallel.fsdp
    return None, fdist.build_mesh(dist.world_size, fsdp.replicate_degree, device_type=device_type)


def shard(
    model: nn.Module,
    mesh: Any,
    parallel: Any,
    fsdp: Any,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    declared: EngineDeclarations,
) -> None:
    """Sequence parallelism (when ``parallel`` is a ``ParallelMesh``: the family's declared
    spec), then ``fully_shard`` on every declared block and on the root (the root's output in
    fp32), with the ``fsdp`` section's offload and resharding; under SP, gradients summed over
    an SP group."""
    block_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    root_mp = MixedPrecisionPolicy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=torch.float32
    )
    offload = (
        CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if fsdp.cpu_offload
        else OffloadPolicy()
    )
    if parallel is not None:  # after LoRA and checkpointing, before sharding
        from flowgrpo.engine.sp import enable_sequence_parallel

        enable_sequence_parallel(model, parallel, fsdp.sp_degree, spec=declared.sequence_parallel)
    kw = dict(mesh=mesh, reshard_after_forward=fsdp.reshard_after_forward)
    for block in transformer_blocks(model, declared.fsdp_blocks):
        fully_shard(block, mp_policy=block_mp, offload_policy=offload, **kw)
    fully_shard(model, mp_policy=root_mp, offload_policy=offload, **kw)
    if parallel is not None:  # SUM over an SP group, MEAN over data-parallel ranks
        from flowgrpo.engine.sp import set_sp_gradient_scale

        set_sp_gradient_scale(model, parallel)


@dataclass
class Parallelized:
    """What ``parallelize`` made: the sharded ``model`` (the same object it was given), the
    sharded frozen ``reference`` copy (or None), the FSDP ``mesh``, the SP meshes
    ``parallel`` (None without SP) and the compute/reduce dtypes."""

    model: nn.Module
    reference: nn.Module | None
    mesh: Any
    parallel: Any
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype


def parallelize(
    model: nn.Module,
    config: Any,
    dist: fdist.DistInfo,
    declared: EngineDeclarations,
    *,
    reference: bool = False,
) -> Parallelized:
    """Make ``model`` trainable and sharded, in place, from the ``lora`` and ``fsdp`` sections of
    ``config`` (and its ``seed``) and what its family ``declared`` (LoRA targets, SP spec,
    blocks): LoRA, or every param for a full fine-tune, whose ``reference`` is a frozen copy
    made first; fp32 masters for what trains; activation checkpointing; meshes; SP and
    ``fully_shard``. ``model.base_quant`` (nf4/int8, LoRA only) stores the frozen base's
    Linear weights quantized (``engine.quant``). A model built on the meta device (``flowgrpo.engine.load``) is sharded
    there, then each rank's shards are read from its files: no rank holds it whole.
    Collective."""
    fs = config.fsdp
    device = dist.device
    param_dtype = resolve_dtype(fs.param_dtype, device)
    reduce_dtype = resolve_dtype(fs.reduce_dtype, device)

    # built on the meta device (flowgrpo.engine.load): shards are allocated and read from
    # the model's files after sharding, so no rank ever holds the whole model
    empty = is_empty(model)
    ref_model: nn.Module | None = None
    if not config.lora.enabled and reference:  # LoRA's reference is the adapter switched off
        ref_model = copy.deepcopy(model).requires_grad_(False)  # meta: no memory
    quant = base_quant(config)
    check_mode(quant, config.lora.enabled)
    if config.lora.enabled:
        model.requires_grad_(False)
        add_lora(model, config.lora, declared.lora_targets, config.seed, device)
        quantize_frozen(model, quant)  # model.base_quant: the frozen base's codes (meta: empty)
    else:
        model.requires_grad_(True)
    with torch.no_grad():  # fp32 master weights for everything that trains
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
    if fs.activation_checkpointing:
        if not getattr(model, "_supports_gradient_checkpointing", False):
            raise ValueError(f"{type(model).__name__} does not support checkpointing")
        model.enable_gradient_checkpointing()

    parallel, mesh = build_meshes(dist, fs)
    shard(model, mesh, parallel, fs, param_dtype, reduce_dtype, declared)
    if ref_model is not None:
        shard(ref_model, mesh, parallel, fs, param_dtype, reduce_dtype, declared)
    if empty:
        init_device = "cpu" if fs.cpu_offload else device
        for m in (model, ref_model):
            if m is not None:
                materialize(m, init_device)
    return Parallelized(model, ref_model, mesh, parallel, param_dtype, reduce_dtype)


__all__ = [
    "Parallelized",
    "add_lora",
    "build_meshes",
    "parallelize",
    "shard",
    "transformer_blocks",
]
