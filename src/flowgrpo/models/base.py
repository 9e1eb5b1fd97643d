"""What every model family provides to the sampler and the trainer: ``DiffusionAdapter``.

An adapter drives one diffusers pipeline exactly as the pipeline's ``__call__`` does (prompt
encoding, schedule, latent layout, guidance, decoding) but exposes each piece separately, and
takes the transformer as an argument so that the engine can pass a sharded or LoRA-wrapped
one. It knows nothing of Flow-GRPO.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from flowgrpo.models.layouts import SourceLayouts, encode_by_layout, forward_by_layout
from flowgrpo.models.parallel import EngineDeclarations


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch of B prompts.

    embeds: [B, L, D]; mask: [B, L] (1 = real token, left-aligned) or None when the model
    attends to all L tokens; pooled: [B, P] or None.

    Editing (source images are conditioning): ``image_latents`` [B, S, C] are the source
    images' encoded tokens (never noised, never trained), ``image_shapes`` their layout,
    shared by the batch (a family's own meaning, e.g. one (frames, h, w) per source image).
    They ride with the prompt embeddings so that the training pass sees what the rollout saw.
    A batch whose rows' sources differ in size (``cat`` / ``select`` of such rows) holds a
    ``SourceLayouts`` (each row's layout and token count) and ``image_latents`` right-padded
    to the longest; ``layout_groups`` splits it into batches of one layout, which is what one
    transformer call takes (``DiffusionAdapter.velocity`` makes a call per layout).
    """

    embeds: torch.Tensor
    mask: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    image_latents: torch.Tensor | None = None
    image_shapes: tuple | None = None

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def select(self, index: torch.Tensor | slice | list[int]) -> PromptEmbeds:
        """Rows ``index``; with a mask, padding is trimmed to the subset's longest prompt."""
        if self.mask is not None:
            from flowgrpo.data.padding import repad

            embeds, mask = repad(self.embeds, self.mask, index)
        else:
            embeds, mask = self.embeds[index], None
        pooled = self.pooled[index] if self.pooled is not None else None
        if isinstance(self.image_shapes, SourceLayouts):
            at = index.cpu() if isinstance(index, torch.Tensor) else index
            rows = torch.arange(len(self))[at].reshape(-1).tolist()
            layouts, lengths = self.image_shapes.layouts, self.image_shapes.lengths
            images, shapes = SourceLayouts.pack(
                [self.image_latents[i, : lengths[i]] for i in rows], [layouts[i] for i in rows]
            )
            return PromptEmbeds(embeds, mask, pooled, images, shapes)
        images = self.image_latents[index] if self.image_latents is not None else None
        return PromptEmbeds(embeds, mask, pooled, images, self.image_shapes)

    def layout_groups(self) -> list[list[int]] | None:
        """The rows of each source layout (in order of first appearance) when the rows'
        source images differ in size; None when they share one layout (or have none)."""
        if not isinstance(self.image_shapes, SourceLayouts):
            return None
        groups: dict[Any, list[int]] = {}
        for i, layout in enumerate(self.image_shapes.layouts):
            groups.setdefault(layout, []).append(i)
        return list(groups.values())

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        """Move (and cast floating tensors; masks keep their dtype)."""

        def mv(t, cast):
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if cast else None)

        return PromptEmbeds(
            mv(self.embeds, True),
            mv(self.mask, False),
            mv(self.pooled, True),
            mv(self.image_latents, True),
            self.image_shapes,
        )

    @staticmethod
    def cat(parts: list[PromptEmbeds]) -> PromptEmbeds:
        """Concatenate along the batch, right-padding embeddings (mask 0) to the longest L."""
        longest = max(p.embeds.shape[1] for p in parts)
        has_mask = any(p.mask is not None for p in parts)
        embeds, masks = [], []
        for p in parts:
            pad = longest - p.embeds.shape[1]
            e = torch.nn.functional.pad(p.embeds, (0, 0, 0, pad))
            embeds.append(e)
            if has_mask:
                m = p.mask
                if m is None:
                    m = torch.ones(p.embeds.shape[:2], dtype=torch.long, device=p.embeds.device)
                masks.append(torch.nn.functional.pad(m, (0, pad)))
            elif pad:
                raise ValueError("cannot pad prompt embeddings of different lengths without masks")
        pooled = None
        if parts[0].pooled is not None:
            pooled = torch.cat([p.pooled for p in parts])
        mask = torch.cat(masks) if has_mask else None
        images, shapes = None, parts[0].image_shapes
        if any(p.image_latents is not None for p in parts):
            if any(p.image_latents is None for p in parts):
                raise ValueError("cannot batch prompts with source images and prompts without")
            if len({p.image_shapes for p in parts}) == 1 and not isinstance(shapes, SourceLayouts):
                images = torch.cat([p.image_latents for p in parts])
            else:  # rows of different source sizes: padded, each row's layout kept
                rows, layouts = [], []
                for p in parts:
                    for i in range(len(p)):
                        layout, n = p.row_layout(i)
                        rows.append(p.image_latents[i, :n])
                        layouts.append(layout)
                images, shapes = SourceLayouts.pack(rows, layouts)
        return PromptEmbeds(torch.cat(embeds), mask, pooled, images, shapes)

    def row_layout(self, i: int) -> tuple[Any, int]:
        """Row ``i``'s (source layout, number of source tokens)."""
        if isinstance(self.image_shapes, SourceLayouts):
            return self.image_shapes.layouts[i], self.image_shapes.lengths[i]
        return self.image_shapes, self.image_latents.shape[1]


#: how the guidance gradient flows in training: "both" branches (exact, the default) or
#: "cond_only" (the unconditional branch under no_grad: cheaper, biased; opt-in)
CFG_GRAD_MODES = ("both", "cond_only")


def param_dtype(module: torch.nn.Module) -> torch.dtype:
    """The dtype of ``module``'s parameters: adapters cast transformer inputs to it."""
    return next(module.parameters()).dtype


class Schedule(NamedTuple):
    """sigmas: [N + 1] fp32 from ~1 down to 0 (the final 0 included); timesteps: [N], what the
    scheduler reports (sigma * num_train_timesteps)."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor


@dataclass(frozen=True)
class SizeRule:
    """The sizes a family can generate, from its config files alone (``size_rule``): height
    and width multiples of ``multiple`` (h, w) and at most ``max_size``; videos: frames
    ``frame_step``·k + 1, at most ``max_frames`` (image families: ``frame_step`` None)."""

    family: str
    multiple: tuple[int, int]
    why: str
    max_size: tuple[int, int] | None = None
    frame_step: int | None = None
    max_frames: int | None = None


def check_size(
    rule: SizeRule, height: int, width: int, num_frames: int | None, key: str = "{}"
) -> None:
    """ValueError in one line naming ``key.format('height')`` (width, num_frames) when the
    size breaks ``rule``; the model is never rounded to another size."""
    for name, value, m, top in (
        ("height", height, rule.multiple[0], rule.max_size and rule.max_size[0]),
        ("width", width, rule.multiple[1], rule.max_size and rule.max_size[1]),
    ):
        if value <= 0 or value % m:
            raise ValueError(
                f"{key.format(name)} must be a positive multiple of {m} for {rule.family} "
                f"({rule.why}), got {value}"
            )
        if top and value > top:
            raise ValueError(f"{key.format(name)} must be <= {top} for {rule.family}, got {value}")
    if num_frames is None:
        return
    t = rule.frame_step
    if t is None:
        raise ValueError(
            f"{key.format('num_frames')} applies to video models only; {rule.family} generates "
            "images"
        )
    if num_frames < 1 or (num_frames - 1) % t:
        raise ValueError(
            f"{key.format('num_frames')} must be {t}k + 1 (1, {t + 1}, {2 * t + 1}, ...) for "
            f"{rule.family}, got {num_frames}"
        )
    if rule.max_frames is not None and num_frames > rule.max_frames:
        raise ValueError(
            f"{key.format('num_frames')} must be <= {rule.max_frames} for {rule.family} (its rotary "
            f"position table), got {num_frames}"
        )


def vae_scale(vae_config: dict) -> int:
    """The spatial VAE factor diffusers' SD3/FLUX pipelines use: 2^(len(block_out_channels)-1)."""
    return 2 ** (len(vae_config.get("block_out_channels", (0,) * 4)) - 1)


@dataclass(frozen=True)
class TokenCounts:
    """One sample's sizes as the memory planner (``flowgrpo.planner``) counts them."""

    image: int  # image (video) tokens in the transformer's sequence
    text: int  # text tokens in the joint sequence (0: the text is cross-attended)
    latent: int  # latent elements per sample
    prompt: tuple[int, int]  # (tokens, width) of one prompt's embedding
    frames: int = 1  # decoded frames per sample


def planner_vae(vae_config: dict) -> tuple[int, int]:
    """(spatial factor, latent channels) of a VAE config as the planner reads it: AutoencoderKL
    2^(levels - 1), a VAE without ``block_out_channels`` 8; ``latent_channels`` or ``z_dim``."""
    blocks = vae_config.get("block_out_channels")
    f = 2 ** (len(blocks) - 1) if blocks else 8
    return f, int(vae_config.get("latent_channels", vae_config.get("z_dim", 16)))


class DiffusionAdapter(ABC):
    """Base class of the per-family adapters (one file each: qwen_image, sd3, flux, wan, toy)."""

    #: default LoRA target module names for this family (peft ``target_modules``)
    lora_target_modules: tuple[str, ...] = ()
    #: run the unconditional and conditional branches as one doubled batch (else two calls)
    batch_cfg: bool = True
    #: negative prompt used when guidance is on and none is given
    default_negative_prompt: str = ""
    #: a ``PromptEmbedCache`` (models/prompt_cache.py) that ``encode`` reads and fills; None = off
    prompt_cache: Any = None
    #: what the engine's sequence parallelism needs of this family (``models/parallel.py``);
    #: None: diffusers' ``_cp_plan`` and processors, no padding (every split length divides)
    sequence_parallel: Any = None
    #: class names of the modules FSDP shards one by one; None: the transformer's
    #: ``_no_split_modules`` (diffusers' declaration of its repeated blocks)
    fsdp_blocks: tuple[str, ...] | None = None
    #: loggers of the pipeline's prompt encoders that warn about truncated prompts (the
    #: trainer drops the warning when nothing but blanks was cut: ``trainer/quiet.py``)
    truncation_loggers: tuple[str, ...] = ()
    #: an editing family: every prompt comes with source images (``encode(images=...)``),
    #: which ``encode_sources(images)`` encodes once per ``encode`` and
    #: ``encode_prompts(prompts, images, sources=)`` turns into conditioning (``PromptEmbeds``'s
    #: ``image_latents``); a text-to-image family takes none
    edits: bool = False
    #: the pipeline trims each batch's prompt embeddings to its longest prompt (else they are
    #: padded to ``max_sequence_length``) and masks the padding in attention: the memory
    #: planner sizes the text at a typical prompt, not the maximum, and counts the mask
    prompt_trimmed: bool = False
    #: the family's own settings: a dataclass of ``flowgrpo.settings.setting`` fields declared
    #: in the adapter's module, the config section named as the family
    #: (``registry.family_settings``); its fields are ``__init__`` keywords; None: no section
    settings_class: type | None = None

    def __init__(self, pipe: Any):
        self.pipe = pipe

    @classmethod
    def trained_components(cls, model_index: dict[str, Any]) -> tuple[str, ...]:
        """The pipeline components the engine trains, by their ``model_index.json`` names:
        ``load_pipeline`` builds them on the meta device and the engine loads each rank's
        shards. The transformer; a family that trains more (Wan2.2's second expert) adds it."""
        return ("transformer",)

    # -- what the engine and trainer need to know ------------------------------------------
    def engine_declarations(self) -> EngineDeclarations:
        """What this family declares to the engine: its LoRA targets, SP spec and FSDP blocks
        (the trainer passes them as ``DiffusersFSDPEngine(declared=)``)."""
        return EngineDeclarations(
            tuple(self.lora_target_modules), self.sequence_parallel, self.fsdp_blocks
        )

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return param_dtype(self.transformer)

    @classmethod
    def size_rule(cls, config: Callable[[str], dict]) -> SizeRule | None:
        """The family's ``SizeRule`` from ``config(component)`` (a component's config dict:
        "vae", "transformer"), read before any weight loads; None: no rule known."""
        return None

    def uses_cfg(self, guidance_scale: float) -> bool:
        """True when a negative/unconditional branch is evaluated (guidance_scale > 1)."""
        return guidance_scale > 1.0

    # -- what the memory planner reads (config files and options only, no weights) ----------
    @classmethod
    def plans_cfg(cls, guidance_scale: float, options: dict[str, Any]) -> bool:
        """``uses_cfg`` before the adapter exists: ``options`` are the adapter options
        (``registry.family_options``) as configured (``config.checks.planner_options``)."""
        return guidance_scale > 1.0

    @classmethod
    def prompt_tokens(cls, max_sequence_length: int | None) -> tuple[int, int]:
        """(tokens, width) of one prompt's embedding as the adapter encodes it."""
        return max_sequence_length or 512, 4096

    @classmethod
    def token_counts(
        cls, configs: dict[str, Any], height: int, width: int, options: dict[str, Any]
    ) -> TokenCounts:
        """One sample's tokens from the components' config dicts (``configs["vae"]``, ...):
        here an image family of 2x2 patches (or 2x2 packed latents) with joint text."""
        f, channels = planner_vae(configs.get("vae", {}))
        prompt = cls.prompt_tokens(options.get("max_sequence_length"))
        image = (height // (2 * f)) * (width // (2 * f))
        return TokenCounts(image, prompt[0], channels * (height // f) * (width // f), prompt)

    # -- per family -------------------------------------------------------------------------
    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        """Run the text encoder(s) exactly as the pipeline does; no grad."""

    @abstractmethod
    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        """The pipeline's sigma schedule for this many steps at this image size."""

    def shifted_schedule(
        self,
        num_steps: int,
        sigmas: Any = None,
        *,
        image_seq_len: int | None = None,
        mu: float | None = None,
        max_shift: float = 1.15,
    ) -> Schedule:
        """``retrieve_timesteps(N, sigmas=, mu=)`` on a copy of the pipeline's scheduler (its
        state untouched), as the pipelines call it. Given ``image_seq_len``, ``mu`` is
        ``calculate_shift(image_seq_len, ...)`` with the scheduler config's base/max sequence
        lengths and shifts (diffusers' defaults 256, 4096, 0.5, ``max_shift``): the dynamic
        shift of FLUX, SD3.5, Qwen-Image (2.1) and Z-Image, one function copied into each."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps

        scheduler = copy.deepcopy(self.pipe.scheduler)
        conf = scheduler.config
        if image_seq_len is not None:
            mu = calculate_shift(
                image_seq_len,
                conf.get("base_image_seq_len", 256),
                conf.get("max_image_seq_len", 4096),
                conf.get("base_shift", 0.5),
                conf.get("max_shift", max_shift),
            )
        kwargs = {k: v for k, v in (("sigmas", sigmas), ("mu", mu)) if v is not None}
        timesteps, _ = retrieve_timesteps(scheduler, num_steps, "cpu", **kwargs)
        return Schedule(scheduler.sigmas.float().cpu(), timesteps.float().cpu())

    def scheduler_schedule(self, num_steps: int) -> Schedule:
        """``set_timesteps(N)`` on a copy of the pipeline's scheduler, as a pipeline that passes
        neither sigmas nor mu does (Wan, the toy); the pipeline's own scheduler is untouched."""
        scheduler = copy.deepcopy(self.pipe.scheduler)
        scheduler.set_timesteps(num_steps, device="cpu")
        return Schedule(scheduler.sigmas.float().cpu(), scheduler.timesteps.float().cpu())

    @abstractmethod
    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Initial noise in the layout the pipeline takes as ``latents=``, drawn in fp32 whatever
        the transformer's dtype (trajectories stay fp32)."""

    @abstractmethod
    def forward(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeds: PromptEmbeds,
        *,
        height: int,
        width: int,
        guidance_scale: float,
    ) -> torch.Tensor:
        """One unguided transformer call (each family repeats this signature on purpose: one
        adapter file per family). latents: pipeline layout [B, ...] (fp32: cast to the
        transformer's dtype here); sigma: [B] fp32. Returns the raw velocity in the transformer's
        output dtype, same shape as latents (never modified in place; ``velocity`` casts it)."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Final latents (pipeline layout) -> images [B, C, H, W] fp32 in [0, 1] on CPU
        (video families: videos [B, C, F, H, W])."""

    def check_num_frames(self, num_frames: int | None) -> int | None:
        """The frame count a rollout generates. Image families return None and refuse a
        ``num_frames``; video families (Wan) validate it, default it, and take it as the
        ``num_frames`` keyword of ``prepare_latents``."""
        if num_frames is not None:
            raise ValueError(
                f"{type(self).__name__} generates images: num_frames={num_frames} applies to "
                "video models only"
            )
        return None

    def guidance_at(self, guidance_scale: float, sigma: torch.Tensor) -> float | torch.Tensor:
        """The guidance scale in effect at noise level ``sigma`` [B]: ``guidance_scale`` itself
        (a float) unless the family changes it along the schedule (Wan2.2's low-noise expert
        has its own ``guidance_scale_2``), then a [B] tensor, one scale per sample."""
        return guidance_scale

    def guide(
        self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance_scale: float | torch.Tensor
    ) -> torch.Tensor:
        """Standard classifier-free guidance: v_u + g (v_c - v_u). Families override this.
        ``guidance_scale`` is a float or a tensor that broadcasts against the velocities."""
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    # -- shared ------------------------------------------------------------------------------
    def check_images(self, images: Any, batch: int) -> None:
        """ValueError (one line) unless ``images`` fits this family: for an editing family a
        list of ``batch`` lists of source images ([3, H, W] tensors in [0, 1]), one or more
        each; for a text-to-image family None."""
        name = type(self).__name__
        if not self.edits:
            if images is not None and any(images):
                raise ValueError(
                    f"{name} generates from text: source images apply to editing models only"
                )
            return
        if images is None or len(images) != batch or not all(images):
            raise ValueError(f"{name} edits images: every prompt needs its source image(s)")
        for row in images:
            for im in row:
                if not (isinstance(im, torch.Tensor) and im.ndim == 3 and im.shape[0] == 3):
                    raise ValueError(
                        f"{name}: a source image must be a [3, H, W] tensor in [0, 1], got "
                        f"{getattr(im, 'shape', type(im).__name__)}"
                    )

    def encode_sources(self, images: list[list[torch.Tensor]] | None) -> Any:
        """An editing family's source images encoded (VAE latents, ...) for ``encode_prompts``'s
        ``sources``: once per ``encode``, shared by both guidance branches."""
        raise NotImplementedError(f"{type(self).__name__} is not an editing family")

    def encode(
        self,
        prompts: list[str],
        negative_prompts: list[str] | None = None,
        *,
        guidance_scale: float = 1.0,
        images: list[list[torch.Tensor]] | None = None,
    ) -> tuple[PromptEmbeds, PromptEmbeds | None]:
        """Positive embeddings and, when guidance is on, the negative ones
        (``default_negative_prompt`` for each prompt when none are given). With a
        ``prompt_cache``, each prompt's embeddings come from it (encoded alone, once).
        An editing family (``edits``) takes each prompt's source ``images`` and encodes them
        with both (never cached: the embeddings depend on the image)."""
        self.check_images(images, len(prompts))
        if self.edits and images is not None:
            groups: dict[Any, list[int]] = {}
            for i, row in enumerate(images):
                groups.setdefault(self.source_layout(row), []).append(i)
            if len(groups) > 1:  # sources of different sizes: each size encoded as a batch
                return encode_by_layout(
                    self, list(groups.values()), prompts, negative_prompts, guidance_scale, images
                )
        if self.edits:  # the sources encoded once, for both guidance branches
            sources = self.encode_sources(images)
            encode = lambda texts: self.encode_prompts(texts, images, sources=sources)  # noqa: E731
        elif self.prompt_cache is None:
            encode = self.encode_prompts
        else:
            encode = self.prompt_cache.encode
        embeds = encode(list(prompts))
        if not self.uses_cfg(guidance_scale):
            return embeds, None
        if negative_prompts is None:
            negative_prompts = [self.default_negative_prompt] * len(prompts)
        if len(negative_prompts) != len(prompts):
            raise ValueError(
                f"got {len(negative_prompts)} negative prompts for {len(prompts)} prompts"
            )
        return embeds, encode(list(negative_prompts))

    def source_layout(self, row: list[torch.Tensor]) -> Any:
        """An editing family's layout of one prompt's source images ([3, H, W] each) as one
        transformer call needs it alike for a whole batch (e.g. the sizes they resize to);
        rows of different layouts are encoded and run as separate batches."""
        return None

    def velocity(
        self,
        transformer: torch.nn.Module,
        latents: torch.Tensor,
        sigma: torch.Tensor,
        embeds: PromptEmbeds,
        negative_embeds: PromptEmbeds | None = None,
        *,
        guidance_scale: float,
        height: int,
        width: int,
        cfg_grad: str = "both",
    ) -> torch.Tensor:
        """The guided velocity: the policy's mean drift, shared by the sampler and the trainer.

        Returns [B, ...] in the latents' dtype promoted to at least fp32: the transformer runs
        in its own dtype, its output is cast up, and guidance is combined in fp32.

        Both branches depend on the weights, so with grad enabled the gradient flows through
        both: d v = g d v_c + (1 - g) d v_u (plus the rescale's norms for Qwen-Image). They run
        as one doubled batch (``batch_cfg``) or as two calls, with or without grad alike, so the
        training pass repeats the rollout's arithmetic exactly. ``cfg_grad="cond_only"`` is the
        cheaper, biased approximation of the original Flow-GRPO paper: with grad enabled, v_u
        runs under no_grad and only v_c is differentiated. Opt-in only.
        """
        if cfg_grad not in CFG_GRAD_MODES:
            raise ValueError(f"cfg_grad must be one of {CFG_GRAD_MODES}, got {cfg_grad!r}")
        out_dtype = torch.promote_types(latents.dtype, torch.float32)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
        if sigma.ndim == 0:
            sigma = sigma.expand(latents.shape[0])
        kw = dict(height=height, width=width, guidance_scale=guidance_scale)

        def call(x: torch.Tensor, s: torch.Tensor, e: PromptEmbeds) -> torch.Tensor:
            if self.edits:  # one call per source layout (PromptEmbeds.layout_groups)
                return forward_by_layout(self, transformer, x, s, e, kw).to(out_dtype)
            return self.forward(transformer, x, s, e, **kw).to(out_dtype)

        if not self.uses_cfg(guidance_scale):
            return call(latents, sigma, embeds)
        if negative_embeds is None:
            raise ValueError("guidance is on but no negative prompt embeddings were given")
        if cfg_grad == "cond_only" and torch.is_grad_enabled():
            with torch.no_grad():
                v_uncond = call(latents, sigma, negative_embeds)
            v_cond = call(latents, sigma, embeds)
        elif self.batch_cfg:
            both = PromptEmbeds.cat([negative_embeds, embeds])
            v_uncond, v_cond = call(
                torch.cat([latents, latents]), torch.cat([sigma, sigma]), both
            ).chunk(2)
        else:
            v_cond = call(latents, sigma, embeds)
            v_uncond = call(latents, sigma, negative_embeds)
        scale = self.guidance_at(guidance_scale, sigma)
        if isinstance(scale, torch.Tensor):  # one scale per sample: [B, 1, ...]
            scale = scale.to(v_cond.device, out_dtype).view(-1, *[1] * (v_cond.ndim - 1))
        return self.guide(v_cond, v_uncond, scale)


__all__ = [
    "CFG_GRAD_MODES",
    "DiffusionAdapter",
    "EngineDeclarations",
    "PromptEmbeds",
    "Schedule",
    "SourceLayouts",
    "param_dtype",
]
