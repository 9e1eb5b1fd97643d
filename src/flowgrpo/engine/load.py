"""Sharded construction and loading of the trained transformer(s), apart from the step code.

torchtitan's order: build the model on the meta device, apply LoRA and ``fully_shard`` there,
then allocate only this rank's shards (``to_empty``) and fill them from the model folder's
safetensors files, reading only the slices this rank holds. No rank ever holds a whole
transformer, on the host or on a device.

``build_empty`` (``flowgrpo.models.weights``, called by ``load_pipeline`` for the components
the adapter trains) builds a module exactly as diffusers' ``from_pretrained`` does (same construction contexts and default
dtype, so non-persistent buffers and plain tensors are bit-identical; persistent buffers read
from the file), except that its parameters stay on the meta device in the dtype diffusers would
load them in, and tags it with where each weight lives (``WeightFiles``). The engine then calls
``materialize`` after sharding. Values are cast as today's whole-model path casts them: file
dtype -> the load dtype (``model.dtype``, fp32 for ``_keep_in_fp32_modules``) -> the parameter's
dtype (fp32 masters for what trains), so the loaded shards equal the old path bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flowgrpo.engine.ema import local
from flowgrpo.engine.quant import QuantLinear, quantize
from flowgrpo.models.weights import (  # noqa: F401 - re-exported: the loading API in one place
    INDEX_NAME,
    ST_DTYPES,
    WEIGHTS_ATTR,
    WEIGHTS_NAME,
    Stored,
    WeightFiles,
    build_empty,
    is_empty,
    read_header,
    weight_files,
)


@contextmanager
def adapters_beside_meta() -> Iterator[None]:
    """peft moves a new LoRA layer to its base layer's device (and dtype): for a base on the
    meta device the LoRA goes to the host instead, in that dtype, so its seeded initial values
    survive (they are tiny; ``materialize`` copies each rank's shard of them). A base that is
    not on the meta device is served as peft does."""
    from peft.tuners.lora.model import LoraModel
    from peft.tuners.tuners_utils import BaseTunerLayer

    move_original = BaseTunerLayer._move_adapter_to_device_of_base_layer
    replace_original = LoraModel._replace_module

    def on_meta(layer: nn.Module) -> bool:
        layer = getattr(layer, "base_layer", layer)
        weight = getattr(layer, "weight", None)
        return weight is not None and weight.is_meta

    def move(self, adapter_name, device=None):
        if device is None and on_meta(self.get_base_layer()):
            device = torch.device("cpu")
        return move_original(self, adapter_name, device)

    def replace(self, parent, child_name, new_module, child):
        if not on_meta(child):
            return replace_original(self, parent, child_name, new_module, child)
        setattr(parent, child_name, new_module)  # its LoRA stays where `move` put it

    BaseTunerLayer._move_adapter_to_device_of_base_layer = move
    LoraModel._replace_module = replace
    try:
        yield
    finally:
        BaseTunerLayer._move_adapter_to_device_of_base_layer = move_original
        LoraModel._replace_module = replace_original


def _sources(model: nn.Module) -> list[tuple[str, WeightFiles]]:
    """(name prefix, WeightFiles) of each submodule built by ``build_empty``, longest first."""
    out = [
        (f"{name}." if name else "", wf)
        for name, m in model.named_modules()
        if (wf := getattr(m, WEIGHTS_ATTR, None)) is not None
    ]
    return sorted(out, key=lambda s: -len(s[0]))


def file_key(name: str, sources: list[tuple[str, WeightFiles]]) -> tuple[WeightFiles, str]:
    """The WeightFiles and the file key of parameter ``name`` of the (LoRA-wrapped) model:
    the submodule's prefix dropped, peft's ``.base_layer`` infix removed."""
    for prefix, wf in sources:
        if name.startswith(prefix):
            key = name[len(prefix) :].replace(".base_layer.", ".")
            if key in wf.stored:
                return wf, key
    raise KeyError(f"no weight file holds parameter {name!r}")


def local_region(p: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the whole tensor that this rank's shard of ``p`` holds (every dim)."""
    if not isinstance(p, DTensor):
        return tuple(slice(0, n) for n in p.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Allocate this rank's shard of every meta parameter of the sharded ``model`` on
    ``device`` (``to_empty``) and fill it from the safetensors files: only this rank's slice
    of each tensor is read, cast file dtype -> load dtype -> parameter dtype. Parameters
    that were not on the meta device (new LoRA layers) and all buffers keep their values."""
    sources = _sources(model)
    quantized = {  # model.base_quant: QuantLinear codes, quantized from this rank's rows
        f"{name}.{leaf}": (name, m)
        for name, m in model.named_modules()
        if isinstance(m, QuantLinear)
        for leaf in ("weight_q", "weight_scale")
    }
    kept = {n: local(p).clone() for n, p in model.named_parameters() if not p.is_meta}
    buffers = [(model.get_submodule(n.rpartition(".")[0]), n) for n, _ in model.named_buffers()]
    buffers = [(m, n.rpartition(".")[2], m._buffers[n.rpartition(".")[2]]) for m, n in buffers]
    model.to_empty(device=device)
    for module, leaf, value in buffers:  # to_empty emptied them too
        module._buffers[leaf] = value
    with ExitStack() as stack:
        handles: dict[Path, BinaryIO] = {}
        for name, p in model.named_parameters():
            shard = local(p)
            if name in kept:
                shard.copy_(kept[name])
                continue
            if name in quantized:
                if name.endswith(".weight_q"):  # weight_scale: filled with its codes
                    _load_quantized(model, *quantized[name], sources, handles, stack)
                continue
            wf, key = file_key(name, sources)
            stored = wf.stored[key]
            if shard.numel() == 0:
                continue
            if stored.path not in handles:
                handles[stored.path] = stack.enter_context(open(stored.path, "rb"))
            region = local_region(p)
            if any(r != slice(0, n) for r, n in zip(region[1:], p.shape[1:], strict=True)):
                raise NotImplementedError(f"{name}: only dim-0 shards are read ({region})")
            value = stored.read(handles[stored.path], region[0] if p.ndim else None)
            shard.copy_(value.to(wf.dtypes[key]))


def _load_quantized(
    model: nn.Module,
    name: str,
    module: QuantLinear,
    sources: list[tuple[str, WeightFiles]],
    handles: dict[Path, BinaryIO],
    stack: ExitStack,
) -> None:
    """Fill ``module``'s shard of codes and scales: this rank's rows of the file's weight,
    cast file dtype -> load dtype, quantized (the rows of the whole weight's codes)."""
    codes, scale = local(module.weight_q), local(module.weight_scale)
    region = local_region(module.weight_q)[0]
    if region != local_region(module.weight_scale)[0]:
        raise NotImplementedError(f"{name}: codes and scales sharded apart")
    if codes.shape[0] == 0:
        return
    wf, key = file_key(f"{name}.weight", sources)
    stored = wf.stored[key]
    if stored.path not in handles:
        handles[stored.path] = stack.enter_context(open(stored.path, "rb"))
    rows = stored.read(handles[stored.path], region).to(wf.dtypes[key])
    q, s = quantize(rows, module.mode)
    codes.copy_(q)
    scale.copy_(s)


def move_components(pipe: Any, device: torch.device) -> None:
    """``pipe.to(device)`` for every component but those built empty (the engine puts their
    shards on the device)."""
    components = getattr(pipe, "components", {})
    if not any(isinstance(m, nn.Module) and is_empty(m) for m in components.values()):
        pipe.to(device)
        return
    for module in components.values():
        if isinstance(module, nn.Module) and not is_empty(module):
            module.to(device)


__all__ = [
    "ST_DTYPES",
    "Stored",
    "WeightFiles",
    "adapters_beside_meta",
    "build_empty",
    "file_key",
    "is_empty",
    "local_region",
    "materialize",
    "move_components",
    "read_header",
    "weight_files",
]
