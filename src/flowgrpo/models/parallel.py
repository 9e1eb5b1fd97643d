"""What a family tells the engine: ``EngineDeclarations`` (its LoRA targets, its sequence-
parallel spec, its FSDP blocks), which the trainer passes to the engine as an input
(``DiffusersFSDPEngine(declared=)``): the engine imports no adapter and names no family.

Sequence parallelism (``flowgrpo.engine.sp``): diffusers declares a transformer's context-
parallel plan on the model class (``_cp_plan``); a family declares the rest here, as a
``SequenceParallelSpec`` its adapter class exposes (``DiffusionAdapter.sequence_parallel``):
the plan when diffusers has none, the attention processors that take part in context
parallelism, how many image tokens a hidden-state tensor holds, and how text shorter than a
multiple of sp is padded so that the result stays the unpadded one.

Two padding rules exist: the transformer's own text mask (``text_mask_kwarg``: zeros appended
to it), or a full-length key mask ``text_key_mask`` [B, L] (True = real token) passed through
``joint_attention_kwargs`` to the family's processors, which mask their local chunk of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

#: the ``joint_attention_kwargs`` key of the key mask over padded text tokens
TEXT_KEY_MASK = "text_key_mask"


def pad_tokens(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``x`` with ``n`` zeros appended along ``dim``."""
    shape = list(x.shape)
    shape[dim] = n
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def local_chunk(mask: torch.Tensor, parallel_config: Any) -> torch.Tensor:
    """This rank's chunk of a full-length [B, L] text mask: the same chunk diffusers' split
    hook took of the text (``EquipartitionSharder``: chunk i of the flattened CP mesh)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    if cp is None or cp._flattened_mesh is None:
        return mask
    mesh = cp._flattened_mesh
    return mask.chunk(mesh.size(), dim=1)[dist.get_rank(mesh.get_group())]


class SequenceParallelSpec:
    """A family's sequence-parallel declaration; the defaults are diffusers' own (the
    transformer's ``_cp_plan``, its processors, packed [B, S, C] latents) with padding through
    the ``text_key_mask`` of the family's processors. A family overrides what differs."""

    #: the family's name, recorded as ``SequenceParallel.family``
    name: str = ""
    #: the transformer class (a name in its MRO, so FSDP's subclasses match too)
    transformer_class: str = ""
    #: the transformer's own text-mask keyword, which padding extends with zeros; None: pad
    #: through ``joint_attention_kwargs[TEXT_KEY_MASK]`` to the family's processors
    text_mask_kwarg: str | None = None
    #: other per-text-token inputs, zero-padded along their token dim (dim -2)
    zero_padded_kwargs: tuple[str, ...] = ()
    #: the transformer's keywords for its image (latent) input, text input and timestep, which
    #: the engine's forward check reads (a tensor or a list of tensors each)
    image_kwarg: str = "hidden_states"
    text_kwarg: str = "encoder_hidden_states"
    timestep_kwarg: str = "timestep"
    #: what ``image_tokens`` counts, for the error when they do not split over sp
    image_token_rule: str = "latent h/2 x w/2"

    def cp_plan(self, transformer: nn.Module) -> dict[str, Any] | None:
        """The context-parallel plan for ``enable_parallelism``: diffusers' ``_cp_plan``."""
        return getattr(transformer, "_cp_plan", None)

    def attention_processor(self, module: nn.Module) -> Any | None:
        """The processor to install on attention ``module`` before enabling; None: keep."""
        return None

    def processor_for(self, name: str, module: nn.Module) -> Any | None:
        """The processor for the attention module called ``name`` (its path in the
        transformer); a family whose modules need different processors by position overrides
        this, the others ``attention_processor``."""
        return self.attention_processor(module)

    def text_padding(self, transformer: nn.Module, kwargs: dict[str, Any], sp: int) -> int:
        """How many masked text tokens ``pad_text`` appends so that the text splits over
        ``sp``: the text input's length up to a multiple of sp."""
        return (-kwargs[self.text_kwarg].shape[1]) % sp

    def image_tokens(self, transformer: nn.Module, hidden_states: torch.Tensor) -> int:
        """Image tokens of the transformer's ``hidden_states`` input (packed [B, S, C])."""
        return hidden_states.shape[1]

    def pad_text(self, kwargs: dict[str, Any], pad: int) -> dict[str, Any]:
        """The transformer's keyword arguments with ``pad`` masked text tokens appended."""
        ehs = kwargs["encoder_hidden_states"]
        kwargs = dict(kwargs)
        kwargs["encoder_hidden_states"] = pad_tokens(ehs, pad, 1)
        if self.text_mask_kwarg is not None:  # the model honours its own text mask
            mask = kwargs.get(self.text_mask_kwarg)
            if mask is None:
                mask = torch.ones(ehs.shape[:2], dtype=torch.long, device=ehs.device)
            kwargs[self.text_mask_kwarg] = pad_tokens(mask, pad, 1)
            return kwargs
        # a full-length key mask through joint_attention_kwargs to the family's processors
        jak = dict(kwargs.get("joint_attention_kwargs") or {})
        if TEXT_KEY_MASK in jak:
            raise ValueError("text_key_mask is set by enable_sequence_parallel's padding")
        jak[TEXT_KEY_MASK] = pad_tokens(
            torch.ones(ehs.shape[:2], dtype=torch.bool, device=ehs.device), pad, 1
        )
        kwargs["joint_attention_kwargs"] = jak
        for name in self.zero_padded_kwargs:
            value = kwargs[name]
            kwargs[name] = pad_tokens(value, pad, value.ndim - 2)
        return kwargs


@dataclass(frozen=True)
class EngineDeclarations:
    """What a family declares to the engine (``DiffusionAdapter.engine_declarations``).

    lora_targets: peft ``target_modules`` when the config's ``lora.target_modules`` is null;
    sequence_parallel: the family's ``SequenceParallelSpec``, or None: diffusers' ``_cp_plan``
    and processors, no padding (every split length must divide by sp); fsdp_blocks: class
    names of the modules FSDP shards one by one, or None: the transformer's
    ``_no_split_modules`` (diffusers' declaration of its repeated blocks)."""

    lora_targets: tuple[str, ...] = ()
    sequence_parallel: SequenceParallelSpec | None = None
    fsdp_blocks: tuple[str, ...] | None = None


__all__ = [
    "TEXT_KEY_MASK",
    "EngineDeclarations",
    "SequenceParallelSpec",
    "local_chunk",
    "pad_tokens",
]
