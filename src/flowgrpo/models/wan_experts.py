"""Wan2.2's two experts as one module, and the dtype a Wan transformer runs in.

Part of the Wan adapter (``flowgrpo.models.wan``), apart so that each file stays small.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.loaders.peft import PeftAdapterMixin

from flowgrpo.models.base import param_dtype


class WanExperts(PeftAdapterMixin, torch.nn.Module):
    """Wan2.2's two experts as the ONE module the engine wraps (LoRA, FSDP per block).

    ``transformer`` (high noise) runs the samples whose timestep >= ``boundary_timestep``,
    ``transformer_2`` the others; a batch that straddles the boundary is split, each part runs
    through its expert, and the outputs are put back in order. Both experts are trainable, as in
    Flow-Factory's Wan2.2 recipe (``target_components: [transformer, transformer_2]``). The
    experts are the pipeline's own modules, so ``pipe(...)`` sees every change. Parameter and
    state-dict names start with ``transformer.`` / ``transformer_2.``: ``split_state_dict``
    gives each pipeline component its part.
    """

    _no_split_modules = ["WanTransformerBlock"]  # the FSDP unit of both experts
    _supports_gradient_checkpointing = True

    def __init__(self, transformer: Any, transformer_2: Any, boundary_timestep: float):
        super().__init__()
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = float(boundary_timestep)

    @property
    def config(self) -> Any:
        return self.transformer.config

    def sequence_parallel_parts(self) -> list[torch.nn.Module]:
        """The transformers that sequence parallelism splits, each with diffusers' Wan
        ``_cp_plan`` (``flowgrpo.engine.sp.enable_sequence_parallel``)."""
        return [self.transformer, self.transformer_2]

    def enable_gradient_checkpointing(self) -> None:
        self.transformer.enable_gradient_checkpointing()
        self.transformer_2.enable_gradient_checkpointing()

    @staticmethod
    def split_state_dict(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """{"transformer": ..., "transformer_2": ...} with the expert prefix removed."""
        out: dict[str, dict[str, Any]] = {"transformer": {}, "transformer_2": {}}
        for key, value in state.items():
            name, _, rest = key.partition(".")
            if name not in out:
                raise KeyError(f"{key!r} belongs to neither expert")
            out[name][rest] = value
        return out

    @staticmethod
    def lora_file_name(name: str, component: str) -> str:
        """The LoRA file of ``component`` beside ``name`` (``expert_file``): the engine's export
        asks the module (``flowgrpo.engine.export``)."""
        return expert_file(name, component)

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=False, **kw):
        t = timestep if timestep.ndim == 1 else timestep[:, 0]
        high = t >= self.boundary_timestep  # WanPipeline: `t >= boundary_timestep`
        parts = [
            (m, sel.nonzero().squeeze(1))
            for m, sel in ((self.transformer, high), (self.transformer_2, ~high))
        ]
        if _ranks_share_collectives():
            return (self._forward_both(parts, hidden_states, timestep, encoder_hidden_states, kw),)
        parts = [(m, idx) for m, idx in parts if idx.numel()]
        if len(parts) == 1:
            return parts[0][0](
                hidden_states=hidden_states,
                timestep=timestep,
                encoder_hidden_states=encoder_hidden_states,
                return_dict=False,
                **kw,
            )
        outs = [
            m(
                hidden_states=hidden_states[idx],
                timestep=timestep[idx],
                encoder_hidden_states=encoder_hidden_states[idx],
                return_dict=False,
                **kw,
            )[0]
            for m, idx in parts
        ]
        order = torch.cat([idx for _, idx in parts])
        return (torch.cat(outs)[torch.argsort(order)],)

    @staticmethod
    def _forward_both(parts, hidden_states, timestep, encoder_hidden_states, kw):
        """On several ranks every rank runs BOTH experts, in the same order, through the same
        ops, whatever its samples: FSDP's all-gathers and reduce-scatters are collectives that
        must match across ranks, and the experts' blocks have equal shapes, so a rank whose
        micro-batch holds only high-noise samples would otherwise pair its collectives with
        another rank's low-noise ones (a hang, or gradients summed across experts). An expert
        without samples runs on the first sample, and that row is dropped by the final
        gather, whose backward gives it an exact zero gradient (its backward still runs, so
        the gradient collectives match too)."""
        outs, rows, offset = [], [], 0
        for m, idx in parts:
            real = idx.numel() > 0
            take = idx if real else idx.new_zeros(1)
            outs.append(
                m(
                    hidden_states=hidden_states[take],
                    timestep=timestep[take],
                    encoder_hidden_states=encoder_hidden_states[take],
                    return_dict=False,
                    **kw,
                )[0]
            )
            if real:
                rows.append((idx, torch.arange(offset, offset + idx.numel(), device=idx.device)))
            offset += take.numel()
        where = torch.empty(hidden_states.shape[0], dtype=torch.long, device=hidden_states.device)
        for idx, at in rows:
            where[idx] = at
        return torch.cat(outs)[where]


def _ranks_share_collectives() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def compute_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype the transformer runs in, as ``WanPipeline`` takes it (``transformer.dtype``): the
    first floating parameter outside ``_keep_in_fp32_modules`` (a bf16 checkpoint keeps rope,
    time_embedder, scale_shift_table and the norms in fp32, and ``scale_shift_table`` is the first
    parameter). Name-based like diffusers' ``get_parameter_dtype``, so it sees through LoRA
    wrappers and ``WanExperts``."""
    from diffusers import WanTransformer3DModel

    keep = WanTransformer3DModel._keep_in_fp32_modules
    for name, p in module.named_parameters():
        if p.is_floating_point() and not any(k in name for k in keep):
            return p.dtype
    return param_dtype(module)


def expert_file(name: str, component: str) -> str:
    """The LoRA file of a pipeline component: ``name`` for the transformer, ``<stem>_2.<ext>``
    for Wan2.2's ``transformer_2`` (``pipe.load_lora_weights(dir, weight_name=...,
    load_into_transformer_2=True)`` loads it)."""
    if component == "transformer":
        return name
    stem, dot, ext = name.rpartition(".")
    return f"{stem}_2{dot}{ext}" if dot else f"{name}_2"


__all__ = ["WanExperts", "compute_dtype", "expert_file"]
