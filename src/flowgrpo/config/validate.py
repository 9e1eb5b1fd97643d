"""Checks of a ``Config`` that go beyond its sections' own (which ``flowgrpo.settings``
applies from the field declarations): what needs the disk (model and prompt paths, a resume
checkpoint, a run folder that holds another run), as far as a command uses it. The first
problem raises a one-line ``ConfigError``."""

from __future__ import annotations

import os
from pathlib import Path

from flowgrpo.config.schema import Config
from flowgrpo.config.shipped import preset_pipelines  # which pipelines each preset is for
from flowgrpo.rewards.spec import RewardSpec
from flowgrpo.settings import BUILTIN, ConfigError, check_section

PROMPT_SUFFIXES = (".txt", ".jsonl", ".parquet")


def holds_run(folder: str | Path) -> bool:
    """True when ``folder`` holds an earlier run's checkpoints or metrics (an empty
    metrics.jsonl, of a run that failed before its first step, does not count)."""
    root = Path(folder).expanduser()
    ckpts = root / "checkpoints"
    has_ckpt = ckpts.is_dir() and any(d.name.startswith("step_") for d in ckpts.iterdir())
    metrics = root / "metrics.jsonl"
    return has_ckpt or (metrics.is_file() and metrics.stat().st_size > 0)


PATH_REWARDS = ("pickscore", "clip_score", "image_similarity")  # CLIP rewards: options.path
#: preference-model rewards: the options naming their local files (docs/rewards.md)
FILE_REWARDS = {
    "hpsv2": ("path", "processor_path"),
    "image_reward": ("path", "processor_path"),
    "aesthetic": ("path", "clip_path"),
}


def file_options(name: str) -> tuple[str, ...]:
    """The options of reward ``name`` that must name its local files: ``path`` for the CLIP
    rewards, the preference models' ``FILE_REWARDS`` entries; () for any other reward."""
    return ("path",) if name in PATH_REWARDS else FILE_REWARDS.get(name, ())


def checked_rewards(cfg: Config) -> list[tuple[str, RewardSpec]]:
    """(config key, RewardSpec) of every reward a run loads before its first step: the
    training rewards and the gold rewards."""
    return [("reward", r) for r in cfg.reward] + [
        ("eval.gold_reward", r) for r in cfg.eval.gold_reward
    ]


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
#: reward options that name a file or folder (checked to exist before anything loads)
_PATH_OPTION = ("path", "dir")


def _check_model(cfg: Config, preset: str) -> None:
    """model.path exists (a local folder, or a hub id in the local Hugging Face cache) and,
    for a shipped preset, holds the pipeline the preset is made for."""
    from flowgrpo.config.checks import check_preset_pipeline
    from flowgrpo.models.registry import read_model_index, resolve_model_path

    try:
        root = resolve_model_path(cfg.model.path)
    except FileNotFoundError as e:
        raise ConfigError(f"config key 'model.path': {e}") from None
    if not root.exists():
        raise ConfigError(f"config key 'model.path': {cfg.model.path} does not exist")
    if preset_pipelines().get(preset) is None or not (root / "model_index.json").is_file():
        return  # a custom preset, or not a pipeline folder (load_pipeline says so)
    try:
        found = read_model_index(root).get("_class_name")
    except ValueError:
        return
    check_preset_pipeline(preset, str(found), cfg.model.path)


def _check_reward_paths(cfg: Config) -> None:
    """Every reward option naming a file or folder (``path``, ``*_path``, ``*_dir``) exists."""
    lists = (("reward", cfg.reward), ("eval_reward", cfg.eval_reward))
    for key, specs in (*lists, ("eval.gold_reward", cfg.eval.gold_reward)):
        for r in specs:
            for name, value in r.options.items():
                if not isinstance(value, str) or not value:
                    continue
                if name.rsplit("_", 1)[-1] not in _PATH_OPTION:
                    continue
                if not Path(value).expanduser().exists():
                    raise ConfigError(
                        f"config key '{key}.{r.label}.options.{name}': {value} does not exist"
                    )


def _edits(model_path: str) -> tuple[str, bool] | None:
    """(pipeline class, whether its adapter edits images) of ``model_path``; None when not
    known here (not a pipeline folder, no adapter: loading it says so)."""
    from flowgrpo.models.registry import SUPPORTED_PIPELINES, import_adapter, read_model_index

    try:
        name = read_model_index(model_path).get("_class_name")
    except (OSError, ValueError):
        return None
    if name not in SUPPORTED_PIPELINES:
        return None
    return name, bool(getattr(import_adapter(SUPPORTED_PIPELINES[name]), "edits", False))


def _max_images(pipeline: str) -> int | None:
    """How many source images a prompt may have for the editing ``pipeline`` (None: any)."""
    from flowgrpo.models.registry import SUPPORTED_PIPELINES, import_adapter

    return getattr(import_adapter(SUPPORTED_PIPELINES[pipeline]), "max_images", None)


def _check_source_images(cfg: Config, key: str, path: str) -> bool:
    """Every source image of the prompt file decodes, and the records fit the model: source
    images for an editing model, none for a text-to-image one (first culprit's file:line).
    Returns whether the file's records have source images."""
    from flowgrpo.data.prompts import load_prompts

    try:
        ds = load_prompts(path)
    except ValueError as e:
        raise ConfigError(f"config key {key!r}: {e}") from None
    if not ds.has_images and not cfg.model.path:
        return False
    known = _edits(cfg.model.path) if cfg.model.path else None
    if known is None:
        return ds.has_images
    name, edits = known
    most = _max_images(name) if edits else None
    for where, images in zip(ds.locations, ds.images, strict=True):
        if most is not None and len(images) > most:
            raise ConfigError(
                f"config key {key!r}: {where}: {len(images)} source images, but model.path "
                f"holds a {name}, which takes {most} per prompt"
            )
        if edits and not images:
            raise ConfigError(
                f"config key {key!r}: {where}: no 'image' or 'images' field, but model.path "
                f"holds a {name}, which edits images: every record needs its source image(s)"
            )
        if images and not edits:
            raise ConfigError(
                f"config key {key!r}: {where}: the record has source images, but model.path "
                f"holds a {name}, which generates from text: use an editing model or drop "
                "the images"
            )
    return ds.has_images


def _check_source_rewards(cfg: Config, key: str) -> None:
    """No reward that compares results with their source images (``image_similarity``) on
    prompts without any (a text-to-image run): one line naming the reward."""
    from flowgrpo.rewards.base import needs_source_images

    for field, specs in (("reward", cfg.reward), ("eval_reward", cfg.eval_reward)):
        for r in specs:
            try:
                needs = needs_source_images(r.name)
            except Exception:  # noqa: BLE001 - a reward that does not resolve fails at build
                continue
            if needs:
                raise ConfigError(
                    f"config key {field!r}: reward {r.label!r} compares each result with its "
                    f"source image(s), but the prompts of {key} have none (a text-to-image "
                    "run): it needs an editing model and .jsonl records with 'image'/'images'"
                )


def _check_model_run(cfg: Config, command: str) -> None:
    """The checks shared with the memory planner (``flowgrpo.config.checks``): the size, the
    family options, the heads against fsdp.sp_degree, from the model's config files alone (no
    weights); for ``train`` also the world size (``WORLD_SIZE``, set by torchrun; 1 without)
    against the parallel layout and the global batch."""
    from flowgrpo.config.checks import check_model_run, local_model_configs

    configs = local_model_configs(cfg.model.path)
    world = int(os.environ.get("WORLD_SIZE", "1") or 1) if command == "train" else None
    if configs is not None:
        check_model_run(cfg, configs, world_size=world)


def _check_paths(cfg: Config, command: str) -> None:
    m, d, preset = cfg.model, cfg.data, cfg.preset or "custom"
    if not m.path:
        raise ConfigError(
            f"model.path is required for preset {preset!r}: point it at a local diffusers "
            "directory (model.path=/path/to/model)"
        )
    if not m.path.startswith(BUILTIN):
        _check_model(cfg, preset)
    _check_model_run(cfg, command)
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
            if not path or skip:
                continue
            has_images = False
            if not path.startswith(BUILTIN):
                _check_prompt_file(f"data.{key}", path)
                has_images = _check_source_images(cfg, f"data.{key}", path)
            if not has_images:
                _check_source_rewards(cfg, f"data.{key}")
        for key, r in checked_rewards(cfg):
            if r.name in PATH_REWARDS and not r.options.get("path"):
                raise ConfigError(
                    f"reward {r.name!r} needs options.path, a local CLIPModel directory: "
                    f"set {key}.{r.label}.options.path=/path/to/model"
                )
            if r.name == "geneval":  # its model folders, before the generator loads
                from flowgrpo.rewards.geneval import missing_options

                missing = missing_options(r.options)
                if missing:
                    opt, what = missing[0]
                    raise ConfigError(
                        f"reward 'geneval' needs {what}: set {key}.{r.label}.options.{opt}"
                    )
            for opt in file_options(r.name):
                if not r.options.get(opt):
                    raise ConfigError(
                        f"reward {r.name!r} needs options.{opt} (a local file or folder, "
                        f"docs/rewards.md): set {key}.{r.label}.options.{opt}=..."
                    )
        _check_reward_paths(cfg)
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
                "continue it with trainer.resume=auto, write this one elsewhere with "
                "run.output_dir=DIR, or start over with run.overwrite=true (deletes that "
                "run's outputs, nothing else)"
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
    "holds_run",
    "validate",
]
