"""The toy digits model: prompt parsing, the tiny text encoder, the pipeline (save/load, shipped
weights) and its adapter, in one file as a model family is.

``ToyDigitsPipeline`` holds a real diffusers ``SD3Transformer2DModel`` (583k parameters, patch
2, 16 image tokens), a tiny learned text encoder (``ToyTextEncoder``: 4 tokens of dim 32 plus a
pooled vector per digit, and an extra entry for the empty prompt used by CFG) and a
``FlowMatchEulerDiscreteScheduler``. Latents ARE the images: [B, 1, 8, 8] in [-1, 1], no VAE.
Its adapter is ``ToyAdapter`` (below; the registry names it by import path, so nothing below
the toy package imports it). The base model pretrained by
``flowgrpo toy pretrain`` ships as a pipeline directory, ``flowgrpo/assets/toy-digits``, which
``load_pipeline("builtin:toy-digits")`` loads like any model.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from flowgrpo.models.base import DiffusionAdapter, PromptEmbeds, Schedule, SizeRule
from flowgrpo.models.sd3 import SD3Adapter

IMAGE_SIZE = 8
NUM_DIGITS = 10
EMPTY_ID = NUM_DIGITS  # text-encoder row of the empty (unconditional) prompt
SHIPPED = "toy-digits"  # flowgrpo/assets/toy-digits/: the pretrained pipeline directory

TRANSFORMER_CONFIG: dict[str, Any] = dict(
    sample_size=8,
    patch_size=2,
    in_channels=1,
    out_channels=1,
    num_layers=4,
    num_attention_heads=2,
    attention_head_dim=32,
    joint_attention_dim=32,
    caption_projection_dim=64,
    pooled_projection_dim=32,
    pos_embed_max_size=4,
)
TEXT_ENCODER_CONFIG: dict[str, Any] = dict(num_tokens=4, dim=32, pooled_dim=32)
SCHEDULER_CONFIG: dict[str, Any] = dict(num_train_timesteps=1000, shift=1.0)

_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_DIGIT_RE = re.compile(r"(?<!\d)\d(?!\d)")
_NUMBER_RE = re.compile(r"\d{2,}")
_WORD_RE = re.compile(r"\b(" + "|".join(_WORDS) + r")\b", re.IGNORECASE)


def parse_digit(prompt: str) -> int | None:
    """The digit a prompt asks for: "a handwritten 7", "7", "the digit seven" -> 7.

    The empty (or blank) prompt -> None (unconditional). A prompt naming no digit, several
    different digits, or a number of two or more digits raises ValueError naming it.
    """
    if not isinstance(prompt, str):
        raise ValueError(f"toy prompt must be a string, got {type(prompt).__name__}: {prompt!r}")
    if not prompt.strip():
        return None
    if _NUMBER_RE.search(prompt):
        raise ValueError(f"toy prompt {prompt!r} names a number, not a single digit 0-9")
    found = {int(m) for m in _DIGIT_RE.findall(prompt)}
    if not found:
        found = {_WORDS.index(w.lower()) for w in _WORD_RE.findall(prompt)}
    if len(found) != 1:
        what = "no digit" if not found else f"several digits {sorted(found)}"
        raise ValueError(
            f"toy prompt {prompt!r} names {what}; expected one digit 0-9 (e.g. 'a handwritten 7')"
        )
    return found.pop()


class ToyTextEncoder(torch.nn.Module):
    """Digit id (0-9, or EMPTY_ID = 10 for "") -> tokens [B, num_tokens, dim], pooled [B, P]."""

    def __init__(self, num_tokens: int = 4, dim: int = 32, pooled_dim: int = 32):
        super().__init__()
        self.config = dict(num_tokens=num_tokens, dim=dim, pooled_dim=pooled_dim)
        self.tokens = torch.nn.Parameter(torch.randn(NUM_DIGITS + 1, num_tokens, dim))
        self.pooled = torch.nn.Parameter(torch.randn(NUM_DIGITS + 1, pooled_dim))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tokens[ids], self.pooled[ids]


class ToyDigitsPipeline:
    """transformer (SD3Transformer2DModel), text_encoder (ToyTextEncoder), scheduler.

    ``pipe(prompts, num_inference_steps=10)`` samples images [B, 1, 8, 8] in [0, 1] (Euler ODE).
    Saved as one safetensors file (``transformer.*``, ``text_encoder.*``) plus one JSON config
    (``model_index.json`` in a directory; ``_class_name`` = "ToyDigitsPipeline").
    """

    weights_name = "model.safetensors"
    config_name = "model_index.json"

    def __init__(self, transformer: Any, text_encoder: ToyTextEncoder, scheduler: Any):
        self.transformer = transformer
        self.text_encoder = text_encoder
        self.scheduler = scheduler
        self.info: dict[str, Any] = {}  # free provenance (pretraining figures), saved in the JSON

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: dict[str, Any] | None = None, seed: int = 0) -> ToyDigitsPipeline:
        """Random weights from ``seed`` (the global RNG is left untouched)."""
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

        config = config or {}
        state = torch.random.get_rng_state()
        try:
            torch.manual_seed(seed)
            transformer = SD3Transformer2DModel(**config.get("transformer", TRANSFORMER_CONFIG))
            text_encoder = ToyTextEncoder(**config.get("text_encoder", TEXT_ENCODER_CONFIG))
        finally:
            torch.random.set_rng_state(state)
        scheduler = FlowMatchEulerDiscreteScheduler(**config.get("scheduler", SCHEDULER_CONFIG))
        return cls(transformer, text_encoder, scheduler)

    def config(self) -> dict[str, Any]:
        sched = {k: v for k, v in self.scheduler.config.items() if not k.startswith("_")}
        return {
            "_class_name": type(self).__name__,
            "transformer": {k: _plain(self.transformer.config[k]) for k in TRANSFORMER_CONFIG},
            "text_encoder": dict(self.text_encoder.config),
            "scheduler": sched,
            "info": self.info,
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"transformer.{k}": v for k, v in self.transformer.state_dict().items()}
        out.update({f"text_encoder.{k}": v for k, v in self.text_encoder.state_dict().items()})
        return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}

    def save_files(self, weights_path: str | Path, config_path: str | Path) -> None:
        """Write the weights (fp32 safetensors) and the JSON config to the given paths."""
        Path(weights_path).parent.mkdir(parents=True, exist_ok=True)
        save_file(self.state_dict(), str(weights_path))
        Path(config_path).write_text(json.dumps(self.config(), indent=2, default=str) + "\n")

    @classmethod
    def from_files(cls, weights_path: str | Path, config_path: str | Path) -> ToyDigitsPipeline:
        for p in (weights_path, config_path):
            if not Path(p).is_file():
                raise FileNotFoundError(f"toy pipeline file '{p}' does not exist")
        config = json.loads(Path(config_path).read_text())
        if config.get("_class_name") != cls.__name__:
            raise ValueError(f"'{config_path}' is not a {cls.__name__} config")
        pipe = cls.from_config(config)
        state = load_file(str(weights_path))
        for prefix, module in (
            ("transformer.", pipe.transformer),
            ("text_encoder.", pipe.text_encoder),
        ):
            sub = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            module.load_state_dict(sub, strict=True)
        pipe.info = dict(config.get("info") or {})
        return pipe

    def save_pretrained(self, save_directory: str | Path) -> None:
        """``save_directory/model.safetensors`` + ``save_directory/model_index.json``."""
        root = Path(save_directory)
        root.mkdir(parents=True, exist_ok=True)
        self.save_files(root / self.weights_name, root / self.config_name)

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, *, dtype: torch.dtype | None = None, **_: Any
    ) -> ToyDigitsPipeline:
        """Load ``save_pretrained``'s directory (``dtype``: cast, as diffusers' ``dtype=``)."""
        root = Path(directory)
        if not root.is_dir():
            raise FileNotFoundError(f"toy pipeline directory '{directory}' does not exist")
        pipe = cls.from_files(root / cls.weights_name, root / cls.config_name)
        return pipe if dtype is None or dtype == torch.float32 else pipe.to(dtype=dtype)

    # -- diffusers-like conveniences --------------------------------------------------------
    def to(self, device: Any = None, dtype: torch.dtype | None = None) -> ToyDigitsPipeline:
        self.transformer.to(device=device, dtype=dtype)
        self.text_encoder.to(device=device, dtype=dtype)
        return self

    @property
    def components(self) -> dict[str, Any]:
        return {
            "transformer": self.transformer,
            "text_encoder": self.text_encoder,
            "scheduler": self.scheduler,
        }

    @classmethod
    def save_lora_weights(cls, save_directory: str | Path, transformer_lora_layers: Any, **kw: Any):
        """Write transformer LoRA weights in diffusers' SD3 LoRA format (pass
        ``transformer_lora_adapter_metadata=peft_config.to_dict()`` to keep rank/alpha)."""
        from diffusers.loaders.lora_pipeline import SD3LoraLoaderMixin

        SD3LoraLoaderMixin.save_lora_weights(
            save_directory, transformer_lora_layers=transformer_lora_layers, **kw
        )

    def load_lora_weights(self, path_or_dict: Any, adapter_name: str | None = None, **kw: Any):
        """Load a LoRA written by ``save_lora_weights`` (folder, file or dict) into the
        transformer (peft)."""
        from diffusers.loaders.lora_pipeline import SD3LoraLoaderMixin

        state, metadata = SD3LoraLoaderMixin.lora_state_dict(
            path_or_dict, return_lora_metadata=True, **kw
        )
        self.transformer.load_lora_adapter(
            state, prefix="transformer", adapter_name=adapter_name, metadata=metadata
        )

    @torch.no_grad()
    def __call__(
        self,
        prompts: str | list[str],
        num_inference_steps: int = 10,
        guidance_scale: float = 1.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """Euler ODE samples for ``prompts``: images [B, 1, 8, 8] in [0, 1] on CPU."""
        from flowgrpo.rollout.sampler import sample_trajectories

        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        traj = sample_trajectories(
            ToyAdapter(self),
            prompts,
            num_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            noise_level=0.0,
            height=IMAGE_SIZE,
            width=IMAGE_SIZE,
            generator=generator,
        )
        return traj.images


class ToyAdapter(DiffusionAdapter):
    """Drives a ``ToyDigitsPipeline``: latents [B, 1, 8, 8] (the image in [-1, 1]), prompt
    embeds [B, 4, 32] without mask plus pooled [B, 32], timestep = sigma * 1000."""

    lora_target_modules = (
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "add_q_proj",
        "add_k_proj",
        "add_v_proj",
        "to_add_out",
    )
    #: its transformer is an SD3 one: SD3's sequence-parallel spec (processors, padding)
    sequence_parallel = SD3Adapter.sequence_parallel

    def __init__(self, pipe: Any):
        super().__init__(pipe)
        self.num_train_timesteps = int(pipe.scheduler.config.num_train_timesteps)

    @staticmethod
    def digits(prompts: list[str]) -> list[int | None]:
        """Parsed digit per prompt (None for ""); raises ValueError on a prompt without one."""
        return [parse_digit(p) for p in prompts]

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeds:
        ids = [EMPTY_ID if d is None else d for d in self.digits(list(prompts))]
        enc = self.pipe.text_encoder
        idx = torch.tensor(ids, dtype=torch.long, device=enc.tokens.device)
        embeds, pooled = enc(idx)
        return PromptEmbeds(embeds.detach().clone(), None, pooled.detach().clone()).to(
            self.device, self.dtype
        )

    @classmethod
    def size_rule(cls, config: Any) -> SizeRule:
        """Exactly IMAGE_SIZE x IMAGE_SIZE."""
        side = (IMAGE_SIZE, IMAGE_SIZE)
        return SizeRule("the toy", side, f"it makes {IMAGE_SIZE}x{IMAGE_SIZE} images", side)

    def _check_size(self, height: int, width: int) -> None:
        if (height, width) != (IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(
                f"the toy model makes {IMAGE_SIZE}x{IMAGE_SIZE} images, got height={height}, "
                f"width={width}"
            )

    def schedule(self, num_steps: int, height: int, width: int) -> Schedule:
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        self._check_size(height, width)
        return self.scheduler_schedule(num_steps)

    def prepare_latents(
        self,
        batch_size: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> torch.Tensor:
        """fp32 noise [B, 1, 8, 8] (one generator, or one per sample as diffusers' randn_tensor)."""
        from diffusers.utils.torch_utils import randn_tensor

        self._check_size(height, width)
        shape = (batch_size, 1, height, width)
        return randn_tensor(shape, generator=generator, device=self.device, dtype=torch.float32)

    #: the toy's transformer is an SD3Transformer2DModel: the same call as SD3's (raw velocity
    #: [B, 1, 8, 8], timestep = sigma * 1000 in fp32)
    forward = SD3Adapter.forward

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Latents in [-1, 1] -> images [B, 1, 8, 8] fp32 in [0, 1] on CPU (clamped)."""
        return ((latents.float() + 1) / 2).clamp(0, 1).cpu()


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def shipped_dir() -> Path:
    """The shipped pretrained pipeline directory (``builtin:toy-digits``)."""
    return Path(str(resources.files("flowgrpo") / "assets" / SHIPPED))


def toy_pipeline(pretrained: bool = True, seed: int = 0) -> ToyDigitsPipeline:
    """The shipped base model, or random weights from ``seed``."""
    if not pretrained:
        return ToyDigitsPipeline.from_config(seed=seed)
    return ToyDigitsPipeline.from_pretrained(shipped_dir())


__all__ = [
    "ToyAdapter",
    "SHIPPED",
    "EMPTY_ID",
    "IMAGE_SIZE",
    "ToyDigitsPipeline",
    "ToyTextEncoder",
    "parse_digit",
    "shipped_dir",
    "toy_pipeline",
]
