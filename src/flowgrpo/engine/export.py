"""Exports of a trained engine: the unsharded state dict, the LoRA as diffusers'
``pytorch_lora_weights.safetensors``, and the full transformer (LoRA merged) via
``save_pretrained``. Collective: every rank calls them, rank 0 writes.

A trained module that holds several pipeline components (two experts trained as one module)
says so itself; the engine names no family:

- ``split_state_dict(state) -> {component: its part}``: the components and their parts
  (each saved to ``<path>/<component>`` by ``save_full``, from the class and config of
  ``getattr(module, component)``);
- ``lora_file_name(name, component) -> str``: the LoRA file of each component beside ``name``.

A module without them is one component, the pipeline's ``transformer``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flowgrpo.engine import dist as fdist


def component_classes(model: nn.Module) -> dict[str, type]:
    """{component: class} of a module that holds several pipeline components (see the module
    docstring; {} for one that does not), taken before sharding renames classes."""
    if not hasattr(model, "split_state_dict"):
        return {}
    return {name: type(child) for name, child in model.named_children()}


def readable_by_all(*paths: Path) -> None:
    """Give exported files (recursively under folders) the mode of a normal file, 0666 less
    the umask (0644 under the usual 022): safetensors writes its files 0600, and an export
    holds no secret. Rank 0, after writing."""
    mask = os.umask(0)
    os.umask(mask)
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for f in files:
            os.chmod(f, 0o666 & ~mask)


def full_state_dict(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict on rank 0 ({} elsewhere). Collective: call on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    opts = StateDictOptions(
        full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
    )
    return get_model_state_dict(model, options=opts)


def export_lora(
    model: nn.Module,
    pipe_cls: type,
    dist: fdist.DistInfo,
    path: str | Path,
    note: dict[str, str] | None = None,
) -> Path:
    """Write the LoRA of ``model`` (peft, adapter "default") as diffusers'
    ``pytorch_lora_weights.safetensors`` (with the peft config as adapter metadata) that
    ``pipe.load_lora_weights(dir)`` loads; ``pipe_cls``: the pipeline's class, whose
    ``save_lora_weights`` writes it (a pipeline without one: diffusers' generic writer, the
    same ``transformer.*`` keys, which ``pipe.transformer.load_lora_adapter(file,
    prefix="transformer")`` loads). ``path`` is a directory, or a file name ending in
    .safetensors. Collective. Returns the file. A module of several components writes each
    one's file (``lora_file_name``) beside it. ``note``: extra safetensors metadata (a LoRA
    trained on a quantized base says so: it is written for the unquantized base)."""
    path = Path(path)
    folder, name = (
        (path.parent, path.name)
        if path.suffix == ".safetensors"
        else (path, "pytorch_lora_weights.safetensors")
    )
    state = full_state_dict(model, trainable_only=True)
    if dist.is_main:
        from peft.utils import get_peft_model_state_dict

        lora = get_peft_model_state_dict(model, state_dict=state)
        meta = model.peft_config["default"].to_dict()
        folder.mkdir(parents=True, exist_ok=True)
        split = getattr(model, "split_state_dict", None)  # a module of several components
        parts = {"transformer": lora} if split is None else split(lora)
        file_name = getattr(model, "lora_file_name", None)
        for component, layers in parts.items():
            weight_name = name if file_name is None else file_name(name, component)
            if hasattr(pipe_cls, "save_lora_weights"):
                pipe_cls.save_lora_weights(
                    folder,
                    transformer_lora_layers=layers,
                    transformer_lora_adapter_metadata=meta,
                    weight_name=weight_name,
                )
            else:  # no LoRA loader in diffusers: the same file, by its generic writer
                from diffusers.loaders.lora_base import LoraBaseMixin

                LoraBaseMixin._save_lora_weights(
                    folder, {"transformer": layers}, {"transformer": meta}, weight_name=weight_name
                )
            if note:
                add_metadata(folder / weight_name, note)
            readable_by_all(folder / weight_name)
    fdist.barrier()
    return folder / name


def add_metadata(file: Path, note: dict[str, str]) -> None:
    """Rewrite the safetensors ``file`` with ``note`` added to its metadata."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(file), metadata={**meta, **note})


def save_full(
    model: nn.Module,
    model_class: type,
    classes: dict[str, type],
    dist: fdist.DistInfo,
    path: str | Path,
    lora: bool,
) -> Path:
    """``save_pretrained`` of the full ``model`` (its LoRA merged into the base weights when
    ``lora``), so ``model_class.from_pretrained(path)`` loads it; a module of several
    components (``classes``: ``component_classes``) writes ``path/<component>`` for each.
    Collective. Returns ``path``."""
    path = Path(path)
    state = full_state_dict(model)
    if dist.is_main:
        from flowgrpo.engine.quant import dequantize_state

        state = dequantize_state(model, state)  # model.base_quant: the base it trained on
        if lora:
            state = merge_lora(state, model.peft_config["default"])
        split = getattr(model, "split_state_dict", None)  # a module of several components
        parts = {"": state} if split is None else split(state)
        for component, part in parts.items():
            cls = classes[component] if component else model_class
            module = getattr(model, component) if component else model
            with torch.device("meta"):
                fresh = cls.from_config(module.config)
            fresh.load_state_dict(part, strict=True, assign=True)
            fresh.save_pretrained(path / component if component else path)
        readable_by_all(path)
    fdist.barrier()
    return path


def merge_lora(state: dict[str, torch.Tensor], peft_config: Any) -> dict[str, torch.Tensor]:
    """Fold peft LoRA Linear layers into their base weights: W + s B A with s = alpha / r
    (alpha / sqrt(r) with rslora), and drop the peft key infixes."""
    r, alpha = peft_config.r, peft_config.lora_alpha
    scale = alpha / math.sqrt(r) if getattr(peft_config, "use_rslora", False) else alpha / r
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if ".base_layer." in key:
            prefix, leaf = key.split(".base_layer.")
            a_key = f"{prefix}.lora_A.default.weight"
            if leaf == "weight" and a_key in state:
                a, b = state[a_key].float(), state[f"{prefix}.lora_B.default.weight"].float()
                if value.ndim != 2:
                    raise ValueError(f"cannot merge a LoRA into non-Linear weight {key}")
                value = (value.float() + scale * (b @ a)).to(value.dtype)
            key = f"{prefix}.{leaf}"
        out[key] = value
    return out


__all__ = ["component_classes", "export_lora", "full_state_dict", "merge_lora", "save_full"]
