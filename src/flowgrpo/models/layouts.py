"""Editing batches whose source images differ in size: one transformer call takes one source
layout (Qwen-Image's rotary embedding reads the first sample's ``img_shapes`` for the whole
batch; the source token counts differ), so an editing adapter encodes each layout's rows as a
batch (``encode_by_layout``), a batch that mixes them carries each row's layout
(``SourceLayouts``, the source tokens right-padded), and the velocity runs one call per layout
(``forward_by_layout``), every rank as many calls as the rank with the most layouts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SourceLayouts:
    """``PromptEmbeds.image_shapes`` of a batch whose rows' source images differ in size:
    ``layouts[i]`` is row i's own ``image_shapes``, ``lengths[i]`` its number of source tokens
    (``image_latents`` is right-padded with zeros to the longest; the padding is never
    attended: each transformer call takes the rows of one layout, trimmed)."""

    layouts: tuple
    lengths: tuple[int, ...]

    @staticmethod
    def pack(rows: list[torch.Tensor], layouts: list[Any]) -> tuple[torch.Tensor, Any]:
        """Per-row source tokens [S_i, C] and layouts -> (image_latents, image_shapes): one
        shared layout when all rows agree, else padded latents and a ``SourceLayouts``."""
        if len(set(layouts)) == 1:
            return torch.stack(rows), layouts[0]
        longest = max(r.shape[0] for r in rows)
        pad = [torch.nn.functional.pad(r, (0, 0, 0, longest - r.shape[0])) for r in rows]
        lengths = tuple(r.shape[0] for r in rows)
        return torch.stack(pad), SourceLayouts(tuple(layouts), lengths)


def encode_by_layout(
    adapter: Any,
    groups: list[list[int]],
    prompts: list[str],
    negative_prompts: list[str] | None,
    guidance_scale: float,
    images: list[list[torch.Tensor]],
) -> tuple[Any, Any]:
    """``adapter.encode`` of each layout's rows as a batch, put back in the prompts' order
    (the embeddings' own class joins them: this module never imports ``models.base``)."""
    parts = [
        adapter.encode(
            [prompts[i] for i in rows],
            None if negative_prompts is None else [negative_prompts[i] for i in rows],
            guidance_scale=guidance_scale,
            images=[images[i] for i in rows],
        )
        for rows in groups
    ]
    order = torch.argsort(torch.tensor([i for rows in groups for i in rows]))
    cat = type(parts[0][0]).cat
    embeds = cat([p[0] for p in parts]).select(order)
    if parts[0][1] is None:
        return embeds, None
    return embeds, cat([p[1] for p in parts]).select(order)


def forward_by_layout(
    adapter: Any,
    transformer: torch.nn.Module,
    x: torch.Tensor,
    sigma: torch.Tensor,
    embeds: Any,  # models.base.PromptEmbeds
    kw: dict[str, Any],
) -> torch.Tensor:
    """``adapter.forward`` once per source layout of the batch (one call takes one layout), the
    rows put back in order. With several ranks every rank makes as many calls as the
    rank with the most layouts (FSDP's all-gathers and reduce-scatters are collectives
    that must pair up): an extra call runs the first row again, and its output is dropped
    by the final gather, whose backward gives it an exact zero gradient."""
    groups = embeds.layout_groups() or [list(range(x.shape[0]))]
    calls = most_over_ranks(len(groups), x.device)
    if calls == 1:
        return adapter.forward(transformer, x, sigma, embeds, **kw)
    outs, order = [], []
    for rows in groups + [groups[0][:1]] * (calls - len(groups)):
        idx = torch.tensor(rows, device=x.device)
        outs.append(adapter.forward(transformer, x[idx], sigma[idx], embeds.select(idx), **kw))
        order += rows
    where = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    where[torch.tensor(order[: x.shape[0]], device=x.device)] = torch.arange(
        x.shape[0], device=x.device
    )
    return torch.cat(outs)[where]


def most_over_ranks(n: int, device: torch.device) -> int:
    """The largest ``n`` over all ranks (``n`` itself in one process)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return n
    t = torch.tensor([n], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


__all__ = ["SourceLayouts", "encode_by_layout", "forward_by_layout", "most_over_ranks"]
