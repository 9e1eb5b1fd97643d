"""Offline tiny random diffusers pipelines for tests, benchmarks and docs.

``tiny_pipeline(kind)`` returns a REAL pipeline of a registered family (``kinds()``: every
``Family`` of ``flowgrpo.testing.families``) whose every component (tokenizers included) is
built in code from a seed: no hub, no download. Weights are random, so images are noise, but
every code path of the real pipeline runs and shapes/semantics match the real models (each
family's module says how: the real scheduler configs, the prompt templates' token counts, the
VAE factors). ``tiny_size(kind)`` gives a small non-square size the family's own size rule
accepts (32 x 48 for the VAE-x2 families: 8 x 12 = 96 tokens).

Construction is deterministic per ``seed`` and leaves the global torch RNG untouched.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from flowgrpo.testing.families import double, doubles, kinds

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

__all__ = [
    "double",
    "doubles",
    "kinds",
    "size_rule",
    "tiny_pipeline",
    "tiny_size",
    "transformer_config",
]


def transformer_config(kind: str) -> dict[str, Any]:
    """A copy of the tiny transformer config of ``kind`` (``tiny_pipeline``'s defaults)."""
    return dict(double(kind).transformer)


def tiny_pipeline(kind: str, seed: int = 0, **overrides: Any) -> DiffusionPipeline:
    """A real diffusers pipeline of family ``kind`` with tiny random weights, built offline.

    ``overrides`` replace entries of the transformer config (``transformer_config(kind)``),
    e.g. ``num_layers=1``; text encoders follow the text width (``joint_attention_dim``,
    ``text_dim``, ...), the VAE's latent channels ``in_channels`` where the family says so.
    All modules are fp32, on CPU, in eval mode with ``requires_grad`` left on, as
    ``from_pretrained`` returns them. The global torch RNG is left untouched.
    """
    return double(kind).tiny(seed, **overrides)


def size_rule(kind: str) -> Any:
    """The ``SizeRule`` of ``kind``'s adapter over its tiny VAE and transformer configs."""
    from flowgrpo.models.registry import SUPPORTED_PIPELINES, import_adapter

    fam = double(kind)
    configs = {"vae": fam.vae, "transformer": fam.transformer}
    adapter = import_adapter(SUPPORTED_PIPELINES[fam.pipeline_class])
    return adapter.size_rule(lambda name: dict(configs.get(name, {})))


def tiny_size(kind: str) -> tuple[int, int]:
    """A small valid (height, width) in pixels for tests, from the family's own size rule:
    height the multiple of its step from 32 up, width the next multiple from 1.5 x height
    (non-square on purpose, to catch H/W mix-ups), within its maximum. The VAE-x2 families:
    32 x 48; the editing families (VAE x32): 64 x 128; Qwen-Image 2.1 (x32): 32 x 64."""
    rule = size_rule(kind)
    mh, mw = rule.multiple
    h = math.ceil(32 / mh) * mh
    w = math.ceil(1.5 * h / mw) * mw
    if w == h:
        w += mw
    if rule.max_size is not None:
        h, w = min(h, rule.max_size[0]), min(w, rule.max_size[1])
    return h, w
