"""Engine settings: plain dataclasses with defaults (the trainer's config nests them as sections)."""

from __future__ import annotations

from dataclasses import dataclass, field

_DTYPES = ("auto", "fp32", "bf16", "fp16")


@dataclass
class LoraConfig:
    """peft LoRA on the transformer. ``target_modules`` None = the adapter's per-family
    defaults; "all-linear" = every nn.Linear. ``init`` is peft's ``init_lora_weights``
    ("gaussian", "default" (= True), "pissa", ...)."""

    enabled: bool = True
    rank: int = 32
    alpha: float = 64
    init: str = "gaussian"
    target_modules: list[str] | str | None = None
    dropout: float = 0.0


@dataclass
class OptimConfig:
    """AdamW and the LR schedule ("constant" or "cosine"; both with linear warm-up).
    ``total_steps`` 0 = unknown: the LR stays constant after warm-up."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0


@dataclass
class LossConfig:
    """Flow-GRPO clipped surrogate + kl_beta * KL(policy || reference)."""

    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    kl_beta: float = 0.0


@dataclass
class FSDPConfig:
    """FSDP2 wrapping. param_dtype "auto" = bf16 on CUDA, fp32 on CPU. ``replicate_degree`` > 1
    = HSDP: shard inside groups of world/replicate_degree ranks, replicate across them."""

    param_dtype: str = "auto"
    reduce_dtype: str = "fp32"
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    replicate_degree: int = 1


@dataclass
class EMAConfig:
    """EMA of the trainable params: decay warm-up min((1 + s) / (10 + s), decay) at optimizer
    step s (0-based), applied every ``update_every`` optimizer steps."""

    enabled: bool = False
    decay: float = 0.9
    update_every: int = 8


@dataclass
class EngineConfig:
    """Everything the engine needs. ``num_minibatches`` = optimizer steps per train_step call;
    ``micro_batch_size`` = samples per forward/backward; ``skip_zero_advantage`` drops samples
    whose advantage is exactly 0 before training; ``cfg_grad`` "both" (exact) or "cond_only"
    (the guidance gradient through the conditional branch only: cheaper, biased)."""

    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    micro_batch_size: int = 4
    num_minibatches: int = 1
    max_consecutive_skips: int = 3
    skip_zero_advantage: bool = True
    cfg_grad: str = "both"
    seed: int = 0

    def validate(self) -> EngineConfig:
        """Raise ValueError naming the first bad field; returns self."""
        checks = [
            (self.micro_batch_size >= 1, "micro_batch_size must be >= 1"),
            (self.num_minibatches >= 1, "num_minibatches must be >= 1"),
            (self.max_consecutive_skips >= 1, "max_consecutive_skips must be >= 1"),
            (
                self.cfg_grad in ("both", "cond_only"),
                f"cfg_grad must be 'both' or 'cond_only', got {self.cfg_grad!r}",
            ),
            (self.lora.rank >= 1, "lora.rank must be >= 1"),
            (
                self.optim.lr_schedule in ("constant", "cosine"),
                f"optim.lr_schedule must be 'constant' or 'cosine', got {self.optim.lr_schedule!r}",
            ),
            (self.optim.warmup_steps >= 0, "optim.warmup_steps must be >= 0"),
            (self.optim.total_steps >= 0, "optim.total_steps must be >= 0"),
            (self.loss.clip_range > 0, "loss.clip_range must be > 0"),
            (self.loss.kl_beta >= 0, "loss.kl_beta must be >= 0"),
            (
                self.fsdp.param_dtype in _DTYPES,
                f"fsdp.param_dtype must be one of {_DTYPES}, got {self.fsdp.param_dtype!r}",
            ),
            (
                self.fsdp.reduce_dtype in _DTYPES,
                f"fsdp.reduce_dtype must be one of {_DTYPES}, got {self.fsdp.reduce_dtype!r}",
            ),
            (self.fsdp.replicate_degree >= 1, "fsdp.replicate_degree must be >= 1"),
            (0 <= self.ema.decay < 1, "ema.decay must be in [0, 1)"),
            (self.ema.update_every >= 1, "ema.update_every must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)
        return self


__all__ = ["EMAConfig", "EngineConfig", "FSDPConfig", "LoraConfig", "LossConfig", "OptimConfig"]
