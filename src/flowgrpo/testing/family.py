"""``Family``: one model family's test double (its tiny pipeline builder and cost tier) and
its conformance entry (how the checks of ``flowgrpo.testing.conformance`` drive it). Each
family's lines live in ``flowgrpo.testing.families.<family>``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: cost tiers of a test double (``flowgrpo.testing.families.params`` and ``core``, the one
#: place they act): "core" families run every cross-product (every algorithm x LoRA/full);
#: "fast" ones their own rows of every per-family test; "slow" ones too, but only in
#: ``make test`` (their rows are marked ``slow``: ``make test-fast`` skips them)
TIERS = ("core", "fast", "slow")


@dataclass(frozen=True)
class PublishedSizes:
    """A family's size rule as its published checkpoint states it, checked without weights
    under every shipped preset made for the family (tests/config/test_config_sizes.py): the
    numbers of the hub's ``vae`` and ``transformer`` config.json files that the adapter's
    ``size_rule`` reads, and what the rule must then say, written by hand from the model card
    (an independent reference): a side must be a multiple of ``multiple`` pixels, the error
    names the family ``name``, and ``valid`` (overrides of a published size) passes."""

    vae: dict[str, Any]
    transformer: dict[str, Any]
    multiple: int
    name: str
    valid: tuple[str, ...]


@dataclass(frozen=True)
class SequenceParallelCase:
    """How the sequence-parallel tests (tests/engine/sp_ranks.py, sp_train_ranks.py) drive a
    family that runs under SP (``flowgrpo.testing.families.sequence_parallel``); the defaults
    fit a text-to-image family with diffusers' layout.

    ``options``: adapter options (a text length that splits with the image tokens, video
    frames); ``prepare(pipe)``: changes the tiny pipeline before its adapter is built (a text
    length that does not divide by 2); ``hw``: the rollout's (H, W) pixels; ``guidance``: the
    guidance scale; ``output_module``: the module whose input is split (its output gathered);
    ``padded_text``: the transformer keyword whose token length grows when its text is padded
    for sp (a family whose text does not divide by 2; checked by a forward with such text);
    ``odd_text``: the positive prompts are cut to odd lengths through their mask for that
    forward (else the text is odd as built); ``first_block``: the first block the plan splits
    (activation checkpointing runs it twice); ``edit``: an editing family's (H, W, each
    prompt's source images as (h, w) pixels, the VAE view's pixel area or None, the source
    tokens the transformer sees beside the noised ones).
    """

    options: dict[str, Any] = field(default_factory=dict)
    prepare: Callable[[Any], None] | None = None
    hw: tuple[int, int] = (32, 32)
    guidance: float = 4.0
    output_module: str = "proj_out"
    padded_text: str | None = None
    odd_text: bool = False
    first_block: str = "transformer_blocks.0"
    edit: tuple[int, int, tuple[tuple[int, int], ...], int | None, int] | None = None

    def text(self, embeds: Any) -> Any:
        """``embeds`` (``PromptEmbeds`` with a mask) as the padding checks feed them: with
        ``odd_text``, every prompt cut to an odd length through its mask; else unchanged."""
        if not self.odd_text:
            return embeds
        n = embeds.mask.sum(1)
        n = n - (1 - n % 2)  # odd lengths
        mask = (torch.arange(embeds.mask.shape[1])[None] < n[:, None]).long()
        return type(embeds)(embeds.embeds, mask, embeds.pooled)


@dataclass(frozen=True)
class Family:
    """One model family as the conformance checks drive it.

    ``kind``: a ``tiny_pipeline`` kind, or any name with ``make``; ``sizes``: two (H, W) for
    the pipeline comparison; ``size``: the other checks'; ``options``: adapter options for
    every check, ``cfg_options`` added for the training checks (log-probs, bf16);
    ``guidance_arg`` and ``call_options``: the stock pipeline call's guidance argument and
    extra arguments; ``stock``: False for a pipeline without diffusers'
    ``__call__(latents=, output_type="latent")`` (the toy); ``x0_seed``: the SDE rollouts'
    initial latents from this seed (else drawn by the per-sample generators);
    ``rollout_check``: asserts on the SDE rollout (Wan2.2: its steps straddle the experts);
    ``train_size`` / ``guidance``: the algorithm tests' image size and guidance scale;
    ``stock_layout(pipe, latents, (H, W))``: the rollout's final latents in the layout of the
    stock pipeline's ``output_type="latent"`` when it differs (the pipeline's own ops);
    ``stock_negative``: False for a pipeline that takes no ``negative_prompt`` (it uses its
    own, which ``negative`` must equal); ``train_options``: adapter options of the algorithm
    tests (a short text length for a family whose default is long).
    ``stock_guidance(pipe, scale)``: for a pipeline whose guidance is a component (a diffusers
    guider), sets it and returns the call's guidance arguments (else ``guidance_arg``).
    ``ode_solver``: the sampler's ODE solver that the stock scheduler's steps are ("dpm2" for
    a DPM-Solver++ 2M pipeline, SANA); the noise-0 comparison rolls out with it.
    Editing families: ``sources()`` gives each of ``prompts`` its source images (PIL, in
    order): the stock pipeline gets them as ``image=``, the rollout as tensors in [0, 1];
    ``stock_batch`` False calls the stock pipeline one prompt at a time (Edit-Plus takes
    batch 1; a single PIL image is the pipelines' documented call).

    The test double (``tiny_pipeline``): ``pipeline_class`` (the diffusers class it builds,
    one the registry supports), ``build(transformer_config, seeds)`` returning it, its tiny
    ``transformer`` config (``tiny_pipeline``'s overrides replace entries) and the ``vae``
    config its adapter's ``size_rule`` reads (``tiny_size``); ``tier``: one of ``TIERS``, the
    cost of its rows (``flowgrpo.testing.families``, the one place that acts on it);
    ``saves``: False for a double ``save_pretrained`` cannot write; ``sp``: how the
    sequence-parallel tests drive it (a family that runs under SP); ``published``: its
    published checkpoint's size rule (``PublishedSizes``), where the size tests check it.
    """

    kind: str
    sizes: tuple[tuple[int, int], tuple[int, int]]
    size: tuple[int, int] = (16, 24)
    prompts: tuple[str, ...] = (
        "a red cat",
        "a photo of a big old house with a tree",
        "dog",
        "two blue birds",
    )
    negative: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    cfg_options: dict[str, Any] = field(default_factory=dict)
    guidance_arg: str = "guidance_scale"
    call_options: dict[str, Any] = field(default_factory=dict)
    num_frames: int | None = None
    stock: bool = True
    sde_window: tuple[int, int, int] | None = None  # (size, lo, hi) of the SDE window
    x0_seed: int | None = None
    rollout_check: Callable[[Any], None] | None = None
    bf16_split_atol: float = 0.0
    bf16_via_load: bool = False  # bf16 as users load it (load_pipeline: fp32-kept modules)
    train_size: tuple[int, int] = (16, 16)
    guidance: float = 4.5
    make: Callable[[], Any] | None = None
    load_lora: Callable[[Any, Path], None] | None = None
    stock_layout: Callable[[Any, torch.Tensor, tuple[int, int]], torch.Tensor] | None = None
    stock_negative: bool = True
    train_options: dict[str, Any] = field(default_factory=dict)
    stock_guidance: Callable[[Any, float], dict[str, Any]] | None = None
    ode_solver: str = "euler"
    sources: Callable[[], list[list[Any]]] | None = None
    stock_batch: bool = True
    pipeline_class: str = ""
    build: Callable[[dict[str, Any], Iterator[int]], Any] | None = None
    transformer: dict[str, Any] = field(default_factory=dict)
    vae: dict[str, Any] = field(default_factory=dict)
    tier: str = "fast"
    sp: SequenceParallelCase = field(default_factory=SequenceParallelCase)
    saves: bool = True  # False: the double cannot be saved (a component diffusers can't write)
    published: PublishedSizes | None = None

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"Family {self.kind!r}: tier {self.tier!r} is not one of {TIERS}")

    def source_images(self, prompts: Sequence[str]) -> list[list[torch.Tensor]] | None:
        """The rollout's ``images=`` for ``prompts`` (each one of ``self.prompts``): its
        sources as [3, H, W] tensors in [0, 1]; None for a text-to-image family."""
        if self.sources is None:
            return None
        import numpy as np

        table = self.sources()
        rows = [table[self.prompts.index(p)] for p in prompts]
        return [
            [torch.from_numpy(np.asarray(im, dtype=np.float32) / 255).permute(2, 0, 1) for im in r]
            for r in rows
        ]

    def __str__(self) -> str:
        return self.kind

    def pipeline(self) -> Any:
        """A fresh pipeline of this family (fp32, random tiny weights)."""
        if self.make is not None:
            return self.make()
        return self.tiny()

    def tiny(self, seed: int = 0, **overrides: Any) -> Any:
        """The test double: ``build`` with the tiny transformer config (``overrides`` replace
        entries), deterministic per ``seed``, the global torch RNG left untouched; every
        module fp32, on CPU, in eval mode with ``requires_grad`` left on, as
        ``from_pretrained`` returns them (``flowgrpo.testing.tiny.tiny_pipeline``)."""
        if self.build is None:
            raise ValueError(f"family {self.kind!r} has no tiny builder")
        tcfg = dict(self.transformer)
        unknown = sorted(set(overrides) - set(tcfg))
        if unknown:
            raise ValueError(
                f"unknown transformer option(s) {unknown} for tiny {self.kind!r}; "
                f"known: {sorted(tcfg)}"
            )
        tcfg.update(overrides)
        seeds = iter(range(seed * 1000, seed * 1000 + 100))
        with torch.random.fork_rng(devices=[]):
            pipe = self.build(tcfg, seeds)
        for _, module in pipe.components.items():
            if isinstance(module, torch.nn.Module):
                module.eval()  # like from_pretrained: eval mode, parameters keep requires_grad
        if hasattr(pipe, "set_progress_bar_config"):  # a diffusers pipeline (not the toy)
            pipe.set_progress_bar_config(disable=True)
        return pipe

    def sp_adapter(self) -> Any:
        """A fresh tiny pipeline's adapter as the sequence-parallel tests drive it: the ``sp``
        case's ``prepare`` and options, and the family's frames."""
        from flowgrpo.models import build_adapter

        pipe = self.tiny()
        if self.sp.prepare is not None:
            self.sp.prepare(pipe)
        frames = {"num_frames": self.num_frames} if self.num_frames else {}
        return build_adapter(pipe, **frames, **self.sp.options)

    def adapter(self, pipe: Any, *, cfg: bool = False) -> Any:
        """The registry's adapter for ``pipe`` with this family's options."""
        from flowgrpo.models import build_adapter

        return build_adapter(pipe, **self.options, **(self.cfg_options if cfg else {}))
