"""Checks of a ``Config`` that go beyond its sections' own (which ``flowgrpo.settings``
applies from the field declarations): what needs the disk (model and prompt paths, a resume
checkpoint, a run folder that holds another run), as far as a command uses it. The first
problem raises a one-line ``ConfigError``."""

from __future__ import annotations

from pathlib import Path

from flowgrpo.config.schema import Config
from flowgrpo.settings import ConfigError, check_section

BUILTIN = "builtin:"  # model.path / data.*_prompts naming a set shipped in the package
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


def _check_model_size(cfg: Config) -> None:
    """model.height / width / num_frames against the family's rule (its config files only, no
    weights): a size the model would round or fail on is a one-line error here."""
    from flowgrpo.models.base import check_size
    from flowgrpo.models.registry import size_rule_of

    m = cfg.model
    try:
        rule = size_rule_of(m.path)
    except (OSError, ValueError):  # not a pipeline directory: loading it says so
        return
    if rule is None:
        return
    try:
        check_size(rule, m.height, m.width, m.num_frames, key="config key 'model.{}'")
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_paths(cfg: Config, command: str) -> None:
    m, d, preset = cfg.model, cfg.data, cfg.preset or "custom"
    if not m.path:
        raise ConfigError(
            f"model.path is required for preset {preset!r}: point it at a local diffusers "
            "directory (model.path=/path/to/model)"
        )
    if not m.path.startswith(BUILTIN) and not Path(m.path).expanduser().exists():
        raise ConfigError(f"config key 'model.path': {m.path} does not exist")
    _check_model_size(cfg)
    needs_data = command == "train" or (command == "eval" and not d.eval_prompts)
    if needs_data and not d.train_prompts:
        raise ConfigError(
            f"data.train_prompts is required for preset {preset!r}: a .txt, .jsonl or "
            ".parquet prompt file (data.train_prompts=/path/to/prompts.txt)"
        )
    if command in ("train", "eval"):
        for key in ("train_prompts", "eval_prompts"):
            path = getattr(d, key)
            skip = command == "eval" and key == "train_prompts" and d.eval_prompts
            if path and not path.startswith(BUILTIN) and not skip:
                _check_prompt_file(f"data.{key}", path)
        for r in cfg.reward:
            if r.name in PATH_REWARDS and not r.options.get("path"):
                raise ConfigError(
                    f"reward {r.name!r} needs options.path, a local CLIPModel directory: "
                    f"set reward.{r.label}.options.path=/path/to/model"
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
    check_section(cfg)
    if check_paths:
        _check_paths(cfg, command)
    return cfg


__all__ = [
    "BUILTIN",
    "COMMANDS",
    "PROMPT_SUFFIXES",
    "RUN_OUTPUTS",
    "holds_run",
    "validate",
]
