"""Range and consistency checks of a ``Config``: the first problem raises a one-line
``ConfigError`` naming the key, the allowed range and the value."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from flowgrpo.config.schema import (
    CFG_GRAD_MODES,
    DTYPES,
    LR_SCHEDULES,
    MODEL_KINDS,
    REWARD_MODES,
    SDE_TYPES,
    WANDB_MODES,
    Config,
    ConfigError,
)

PROMPT_SUFFIXES = (".txt", ".jsonl", ".parquet")
#: everything a training run writes into run.output_dir (``run.overwrite`` deletes only these)
RUN_OUTPUTS = (
    "metrics.jsonl",
    "eval.jsonl",
    "checkpoints",
    "tensorboard",
    "wandb",
    "grid_before.png",
    "grid_after.png",
    "reward_curve.png",
)


def holds_run(folder: str | Path) -> bool:
    """True when ``folder`` holds an earlier run's checkpoints or metrics."""
    root = Path(folder).expanduser()
    ckpts = root / "checkpoints"
    has_ckpt = ckpts.is_dir() and any(d.name.startswith("step_") for d in ckpts.iterdir())
    return has_ckpt or (root / "metrics.jsonl").is_file()


PATH_REWARDS = ("pickscore", "clip_score")  # CLIP-family rewards that need options.path


def _need(ok: bool, key: str, allowed: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"config key {key!r} must be {allowed}, got {value!r}")


def _one_of(key: str, value: Any, choices: tuple) -> None:
    _need(value in choices, key, "one of " + ", ".join(repr(c) for c in choices), value)


def stochastic_steps(cfg: Config) -> int:
    """Steps that can be SDE (trained) steps: num_steps, minus the deterministic last one."""
    s = cfg.sample
    return s.num_steps - (1 if s.deterministic_last_step else 0)


def _check_sample(cfg: Config) -> None:
    s = cfg.sample
    _need(s.num_steps >= 1, "sample.num_steps", ">= 1", s.num_steps)
    if s.deterministic_last_step:
        _need(s.num_steps >= 2, "sample.num_steps", ">= 2 with deterministic_last_step", 1)
    elif s.sde_type == "sde" and s.noise_level > 0:  # one step starts at sigma = 1 with no
        # second sigma to stand in for it: the 'sde' noise scale sigma / (1 - sigma) is infinite
        _need(s.num_steps >= 2, "sample.num_steps", ">= 2 with sde_type 'sde'", s.num_steps)
    _need(s.eval_num_steps >= 1, "sample.eval_num_steps", ">= 1", s.eval_num_steps)
    _need(s.guidance_scale >= 0, "sample.guidance_scale", ">= 0 (1 = no CFG)", s.guidance_scale)
    if s.eval_guidance_scale is not None:
        _need(
            s.eval_guidance_scale >= 0, "sample.eval_guidance_scale", ">= 0", s.eval_guidance_scale
        )
    _one_of("sample.sde_type", s.sde_type, SDE_TYPES)
    _need(s.noise_level >= 0, "sample.noise_level", ">= 0", s.noise_level)
    if s.sde_type == "cps":
        _need(
            s.noise_level <= 1, "sample.noise_level", "in [0, 1] for sde_type 'cps'", s.noise_level
        )
    _need(
        0 < s.timestep_fraction <= 1, "sample.timestep_fraction", "in (0, 1]", s.timestep_fraction
    )
    _need(s.window_size >= 0, "sample.window_size", ">= 0 (0 = no window)", s.window_size)
    if s.window_size > 0:
        avail = stochastic_steps(cfg)
        hi = avail if s.window_hi is None else s.window_hi
        _need(s.window_lo >= 0, "sample.window_lo", ">= 0", s.window_lo)
        last = " - 1 with deterministic_last_step" if s.deterministic_last_step else ""
        _need(hi <= avail, "sample.window_hi", f"<= {avail} (num_steps{last}) or null", s.window_hi)
        _need(
            s.window_lo + s.window_size <= hi,
            "sample.window_size",
            f"<= {hi - s.window_lo} (window_hi {hi} - window_lo {s.window_lo}: the window must "
            f"fit in the {avail} stochastic steps)",
            s.window_size,
        )
    _need(s.prompts_per_step >= 1, "sample.prompts_per_step", ">= 1", s.prompts_per_step)
    _need(s.group_size >= 2, "sample.group_size", ">= 2 (a group compares samples)", s.group_size)
    _need(s.rollout_batch_size >= 1, "sample.rollout_batch_size", ">= 1", s.rollout_batch_size)


def _check_finite(obj: Any, prefix: str = "") -> None:
    """Every float setting (in sections, lists and tuples) is a finite number: inf or nan in
    e.g. optim.lr would only surface steps later as non-finite weights."""
    if dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            if f.name != "reward":  # reward weights are checked with their labels below
                value = getattr(obj, f.name)
                dot = "." if dataclasses.is_dataclass(value) else ""
                _check_finite(value, f"{prefix}{f.name}{dot}")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_finite(v, f"{prefix}[{i}]")
        return
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ConfigError(f"config key {prefix!r} must be a finite number, got {obj!r}")


def _check_sections(cfg: Config) -> None:
    _check_finite(cfg)
    _need(
        cfg.run.num_threads >= 0,
        "run.num_threads",
        ">= 0 (0 = torch's default)",
        cfg.run.num_threads,
    )
    m = cfg.model
    _one_of("model.kind", m.kind, MODEL_KINDS)
    _one_of("model.dtype", m.dtype, DTYPES)
    _need(m.height >= 1, "model.height", ">= 1", m.height)
    _need(m.width >= 1, "model.width", ">= 1", m.width)
    _need(m.true_cfg_scale >= 1, "model.true_cfg_scale", ">= 1 (1 = off)", m.true_cfg_scale)
    if m.max_sequence_length is not None:
        n = m.max_sequence_length
        _need(n >= 1, "model.max_sequence_length", ">= 1 or null", n)
    _need(cfg.seed >= 0, "seed", ">= 0", cfg.seed)
    _check_sample(cfg)
    d = cfg.data
    _need(0 <= d.eval_fraction < 1, "data.eval_fraction", "in [0, 1)", d.eval_fraction)
    _need(d.eval_num_prompts >= 0, "data.eval_num_prompts", ">= 0 (0 = all)", d.eval_num_prompts)
    n = d.eval_samples_per_prompt
    _need(n >= 1, "data.eval_samples_per_prompt", ">= 1", n)
    _need(len(cfg.reward) >= 1, "reward", "a non-empty list", cfg.reward)
    for i, r in enumerate(cfg.reward):
        _need(
            bool(r.name.strip()), f"reward[{i}].name", "a registry name or module:function", r.name
        )
        label = r.alias or r.name
        _need(math.isfinite(r.weight), f"reward.{label}.weight", "a finite number", r.weight)
        for k, w in (r.key_weights or {}).items():
            _need(math.isfinite(w), f"reward.{label}.key_weights.{k}", "a finite number", w)
    labels = [r.alias or r.name for r in cfg.reward]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    _need(not dup, "reward", "a list of distinct rewards (give repeats an alias)", dup)
    _one_of("advantage.mode", cfg.advantage.mode, REWARD_MODES)
    t = cfg.train
    _need(t.micro_batch_size >= 1, "train.micro_batch_size", ">= 1", t.micro_batch_size)
    _need(t.num_minibatches >= 1, "train.num_minibatches", ">= 1", t.num_minibatches)
    n = t.max_consecutive_skips
    _need(n >= 1, "train.max_consecutive_skips", ">= 1", n)
    _one_of("train.cfg_grad", t.cfg_grad, CFG_GRAD_MODES)
    lo = cfg.lora
    _need(lo.rank >= 1, "lora.rank", ">= 1", lo.rank)
    _need(lo.alpha > 0, "lora.alpha", "> 0", lo.alpha)
    _need(0 <= lo.dropout < 1, "lora.dropout", "in [0, 1)", lo.dropout)
    o = cfg.optim
    _need(o.lr > 0, "optim.lr", "> 0", o.lr)
    for i, b in enumerate(o.betas):
        _need(0 <= b < 1, f"optim.betas[{i}]", "in [0, 1)", b)
    _need(o.weight_decay >= 0, "optim.weight_decay", ">= 0", o.weight_decay)
    _need(o.eps > 0, "optim.eps", "> 0", o.eps)
    _need(o.max_grad_norm > 0, "optim.max_grad_norm", "> 0", o.max_grad_norm)
    _one_of("optim.lr_schedule", o.lr_schedule, LR_SCHEDULES)
    _need(o.warmup_steps >= 0, "optim.warmup_steps", ">= 0", o.warmup_steps)
    _need(o.total_steps >= 0, "optim.total_steps", ">= 0 (0 = trainer.max_steps)", o.total_steps)
    ls = cfg.loss
    _need(ls.clip_range > 0, "loss.clip_range", "> 0", ls.clip_range)
    _need(ls.adv_clip_max > 0, "loss.adv_clip_max", "> 0", ls.adv_clip_max)
    _need(ls.kl_beta >= 0, "loss.kl_beta", ">= 0", ls.kl_beta)
    f = cfg.fsdp
    _one_of("fsdp.param_dtype", f.param_dtype, DTYPES)
    _one_of("fsdp.reduce_dtype", f.reduce_dtype, DTYPES)
    _need(f.replicate_degree >= 1, "fsdp.replicate_degree", ">= 1", f.replicate_degree)
    e = cfg.ema
    if cfg.sample.use_ema_for_rollout:
        _need(e.enabled, "ema.enabled", "true with sample.use_ema_for_rollout=true", e.enabled)
    _need(0 <= e.decay < 1, "ema.decay", "in [0, 1)", e.decay)
    _need(e.update_every >= 1, "ema.update_every", ">= 1", e.update_every)
    tr = cfg.trainer
    _need(tr.max_steps >= 1, "trainer.max_steps", ">= 1", tr.max_steps)
    _need(tr.eval_every >= 0, "trainer.eval_every", ">= 0 (0 = the last step only)", tr.eval_every)
    _need(tr.save_every >= 0, "trainer.save_every", ">= 0 (0 = the last step only)", tr.save_every)
    _need(tr.keep_last >= 1, "trainer.keep_last", ">= 1", tr.keep_last)
    _need(tr.log_every >= 1, "trainer.log_every", ">= 1", tr.log_every)
    _one_of("run.wandb_mode", cfg.run.wandb_mode, WANDB_MODES)
    _need(bool(cfg.run.output_dir), "run.output_dir", "a directory path", cfg.run.output_dir)


def _check_prompt_file(key: str, path: str) -> None:
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory, not a file" if p.is_dir() else "not found"
        raise ConfigError(f"config key {key!r}: prompt file {path} {what}")
    if p.suffix.lower() not in PROMPT_SUFFIXES:
        raise ConfigError(
            f"config key {key!r}: prompt file {path} must end in {', '.join(PROMPT_SUFFIXES)}"
        )
    if p.stat().st_size == 0:
        raise ConfigError(f"config key {key!r}: prompt file {path} is empty")
    if p.suffix.lower() != ".parquet":
        from flowgrpo.data.prompts import read_text

        try:
            text = read_text(p)
        except ValueError as e:  # "<file>:<line>: not UTF-8 text (...)"
            raise ConfigError(f"config key {key!r}: prompt file {e}") from None
        if not text.strip():
            raise ConfigError(f"config key {key!r}: prompt file {path} is empty")


COMMANDS = ("train", "eval", "sample", "export")


def _check_paths(cfg: Config, command: str) -> None:
    m, d, preset = cfg.model, cfg.data, cfg.preset or "custom"
    if m.kind != "toy":
        if not m.path:
            raise ConfigError(
                f"model.path is required for preset {preset!r}: point it at a local diffusers "
                "directory (model.path=/path/to/model)"
            )
        if not Path(m.path).expanduser().exists():
            raise ConfigError(f"config key 'model.path': {m.path} does not exist")
        needs_data = command == "train" or (command == "eval" and not d.eval_prompts)
        if needs_data and not d.train_prompts:
            raise ConfigError(
                f"data.train_prompts is required for preset {preset!r}: a .txt, .jsonl or "
                ".parquet prompt file (data.train_prompts=/path/to/prompts.txt)"
            )
    if command in ("train", "eval"):
        for key in ("train_prompts", "eval_prompts"):
            path = getattr(d, key)
            if path and not (command == "eval" and key == "train_prompts" and d.eval_prompts):
                _check_prompt_file(f"data.{key}", path)
        for r in cfg.reward:
            if r.name in PATH_REWARDS and not r.options.get("path"):
                raise ConfigError(
                    f"reward {r.name!r} needs options.path, a local CLIPModel directory: "
                    f"set reward.{r.alias or r.name}.options.path=/path/to/model"
                )
    res = cfg.trainer.resume
    if command == "train" and res not in (None, "", "auto") and not Path(res).expanduser().exists():
        raise ConfigError(f"config key 'trainer.resume': checkpoint {res} does not exist")
    if command == "train":
        out, resuming = cfg.run.output_dir, res not in (None, "")
        if resuming and cfg.run.overwrite:
            raise ConfigError(
                "run.overwrite=true deletes the run that trainer.resume would continue: "
                "set only one of them"
            )
        if not resuming and not cfg.run.overwrite and holds_run(out):
            raise ConfigError(
                f"run.output_dir {out} already holds a run (checkpoints or metrics.jsonl): "
                "continue it with trainer.resume=auto, or start over with run.overwrite=true "
                "(deletes that run's outputs, nothing else)"
            )


def validate(cfg: Config, *, check_paths: bool = True, command: str = "train") -> Config:
    """Raise ConfigError on the first bad value; returns ``cfg``.

    ``check_paths`` also checks what needs the disk, as far as ``command`` ("train", "eval",
    "sample", "export") uses it: model.path given and existing (real models), prompt files
    present and non-empty, CLIP reward paths given, a resume checkpoint existing.
    """
    if command not in COMMANDS:
        raise ValueError(f"validate: command must be one of {COMMANDS}, got {command!r}")
    _check_sections(cfg)
    if check_paths:
        _check_paths(cfg, command)
    return cfg


__all__ = [
    "COMMANDS",
    "PROMPT_SUFFIXES",
    "RUN_OUTPUTS",
    "holds_run",
    "stochastic_steps",
    "validate",
]
