"""The engine's config sections: each setting declared once, with its help and its check.

The run config (``flowgrpo.config.Config``) holds these very sections (``lora``, ``optim``,
``fsdp``, ``ema``); the engine reads them from it directly. Standalone
users and tests build an ``EngineConfig``, which holds the same sections and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowgrpo.settings import (
    DTYPES,
    between,
    check_section,
    ge,
    gt,
    need,
    one_of,
    setting,
)

LR_SCHEDULES = ("constant", "cosine")


@dataclass
class LoraConfig:
    """peft LoRA on the transformer."""

    enabled: bool = setting(True, "Train LoRA adapters (false = full fine-tune).")
    rank: int = setting(32, "LoRA rank r.", check=ge(1))
    alpha: float = setting(64, "LoRA alpha (scale alpha / r).", check=gt(0))
    init: str = setting("gaussian", "peft `init_lora_weights`: `gaussian`, `default`, `pissa`, ...")
    target_modules: list[str] | str | None = setting(
        None,
        "Module names to adapt; null = the model family's defaults; `all-linear` = every Linear.",
    )
    dropout: float = setting(0.0, "LoRA dropout.", check=between(0, 1, hi_open=True))
    # With enabled=false the other keys are ignored: a preset's LoRA targets stay harmless when
    # a user turns LoRA off; a LoRA key given on the command line with LoRA off is refused
    # (flowgrpo.config.loader).


@dataclass
class OptimConfig:
    """AdamW, the LR schedule (linear warm-up, then constant or cosine) and the non-finite rule."""

    lr: float = setting(3e-4, "AdamW learning rate.", check=gt(0))
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas.")
    weight_decay: float = setting(1e-4, "AdamW weight decay.", check=ge(0))
    eps: float = setting(1e-8, "AdamW epsilon.", check=gt(0))
    max_grad_norm: float = setting(1.0, "Gradient clipping norm.", check=gt(0))
    lr_schedule: str = setting(
        "constant",
        "`constant` or `cosine`, both after a linear warm-up.",
        check=one_of(*LR_SCHEDULES),
    )
    warmup_steps: int = setting(0, "Linear warm-up length in optimizer steps.", check=ge(0))
    total_steps: int = setting(
        0,
        "Cosine length in optimizer steps; 0 = `trainer.max_steps` x `update.num_minibatches` "
        "(constant after warm-up when the engine runs on its own).",
        check=ge(0, " (0 = trainer.max_steps)"),
    )
    max_consecutive_skips: int = setting(
        3,
        "Stop (training diverged) after this many optimizer steps in a row skipped for a "
        "non-finite loss, gradient or update.",
        check=ge(1),
    )

    def check(self) -> None:
        for i, b in enumerate(self.betas):
            need(0 <= b < 1, f"optim.betas[{i}]", "in [0, 1)", b)


@dataclass
class FSDPConfig:
    """FSDP2 wrapping."""

    param_dtype: str = setting(
        "auto",
        "FSDP2 compute dtype: `auto` (`model.dtype` if explicit, else bf16 on CUDA, fp32 on "
        "CPU), `fp32`, `bf16`, `fp16`.",
        check=one_of(*DTYPES),
    )
    reduce_dtype: str = setting("fp32", "Gradient reduce dtype.", check=one_of(*DTYPES))
    cpu_offload: bool = setting(False, "Offload parameters and optimizer state to CPU.")
    activation_checkpointing: bool = setting(
        False, "Recompute transformer blocks in backward (saves memory)."
    )
    reshard_after_forward: bool = setting(
        True, "Free gathered parameters after each block's forward."
    )
    replicate_degree: int = setting(
        1,
        "HSDP: shard within groups of world/replicate_degree ranks, replicate across them "
        "(1 = plain FSDP).",
        check=ge(1),
    )
    sp_degree: int = setting(
        1,
        "Ulysses sequence parallelism: each group of this many ranks shares one sample's "
        "tokens (diffusers' context-parallel attention); world = replicate x shard x sp. "
        "1 = off.",
        check=ge(1),
    )


@dataclass(frozen=True)
class ParallelLayout:
    """How a run's ranks split, outermost first: ``replicate`` (HSDP replica groups) x
    ``dp_shard`` x ``sp`` (the ranks of one sequence-parallel group, which share one sample's
    tokens). ``dp``: the data-parallel ranks (distinct samples); ``shard_group``: the ranks one
    FSDP shard group spans (SP ranks shard the parameters too)."""

    replicate: int
    dp_shard: int
    sp: int

    @property
    def world_size(self) -> int:
        return self.replicate * self.dp_shard * self.sp

    @property
    def dp(self) -> int:
        return self.replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        return self.dp_shard * self.sp


def parallel_layout(
    world_size: int, replicate_degree: int = 1, sp_degree: int = 1
) -> ParallelLayout:
    """The ``ParallelLayout`` of ``world_size`` ranks under ``fsdp.replicate_degree`` and
    ``fsdp.sp_degree``: the one place the data-parallel size and the shard group are derived.
    ValueError when they do not divide the world."""
    rep, sp = int(replicate_degree), int(sp_degree)
    if rep < 1 or sp < 1 or world_size % (rep * sp):
        raise ValueError(
            f"world size {world_size} must be divisible by replicate_degree {replicate_degree} "
            f"x sp_degree {sp_degree} (both >= 1)"
        )
    return ParallelLayout(rep, world_size // (rep * sp), sp)


@dataclass
class EMAConfig:
    """EMA of the trainable params (Flow-GRPO's warm-up schedule)."""

    enabled: bool = setting(
        False, "Keep an EMA of the trainable parameters (used by eval and checkpoints)."
    )
    decay: float = setting(
        0.9, "EMA decay (warm-up min((1+s)/(10+s), decay)).", check=between(0, 1, hi_open=True)
    )
    update_every: int = setting(8, "Update the EMA every this many optimizer steps.", check=ge(1))


@dataclass
class EngineConfig:
    """The sections the engine reads (the run config has them all, and more)."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    seed: int = 0

    def validate(self) -> EngineConfig:
        """Raise ConfigError (a ValueError) naming the first bad field; returns self."""
        check_section(self)
        return self


__all__ = [
    "DTYPES",
    "EMAConfig",
    "EngineConfig",
    "FSDPConfig",
    "LR_SCHEDULES",
    "LoraConfig",
    "OptimConfig",
    "ParallelLayout",
    "parallel_layout",
]
