"""The checks of a run that need the model's config files (never a weight) and the world size:
one set, used by ``flowgrpo train`` (``validate``, before anything loads) and by ``flowgrpo
memory`` (``plan_memory``), so that the planner never plans a run the trainer refuses.

Each problem is a one-line ``ConfigError`` naming the setting: the preset against the model's
pipeline, family options the model does not take (a setting of another family's section,
a shared ``model.*`` one it has no use for) or values it refuses, the size
(``model.height``/``width``/``num_frames`` against the family's ``SizeRule``), the attention
heads against ``fsdp.sp_degree``, and the world size against ``fsdp.replicate_degree`` x
``fsdp.sp_degree`` and the step's global batch.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from flowgrpo.settings import DEFAULT_PRESET, ConfigError


def local_model_configs(path: str) -> dict[str, Any] | None:
    """{"model_index": ..., component: config} of a local pipeline folder (components without a
    ``config.json`` left out); None when ``path`` is not a pipeline folder (loading says so)."""
    from flowgrpo.models.registry import read_model_index, resolve_model_path

    try:
        index = read_model_index(path)
        root = resolve_model_path(path)
    except (OSError, ValueError):
        return None
    out: dict[str, Any] = {"model_index": index}
    for comp in index:
        try:
            data = json.loads((Path(root) / comp / "config.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict):
            out[comp] = data
    return out


def check_preset_pipeline(preset: str | None, pipeline: str, model_path: str) -> None:
    """A shipped preset names the pipeline classes it is made for (its ``made_for``): another
    one is refused."""
    from flowgrpo.config.shipped import preset_pipelines

    made_for = preset_pipelines().get(preset or "")
    if made_for is None or pipeline in made_for:
        return
    fits = [name for name, classes in preset_pipelines().items() if pipeline in classes]
    default = " (the default, used when no preset is named)" if preset == DEFAULT_PRESET else ""
    advice = (
        f"name the preset that fits it: flowgrpo train {fits[0]} model.path=..."
        if len(fits) == 1
        else f"name a preset that fits it: flowgrpo train PRESET model.path=... with PRESET "
        f"one of {', '.join(fits)}"
        if fits
        else "no shipped preset fits it; start a YAML file from the closest (docs/training.md)"
    )
    raise ConfigError(
        f"config key 'model.path': {model_path} holds a {pipeline}, but preset {preset!r}"
        f"{default} is made for {', '.join(made_for)}: {advice}"
    )


def option_keys() -> dict[str, str]:
    """{adapter option: its config key} for every option some adapter takes
    (``registry.family_options``): a family's own setting in its family's section
    (``flux.true_cfg_scale``), one several families read in ``model``
    (``model.max_sequence_length``)."""
    from flowgrpo.models.registry import family_options, family_settings

    own = {
        f.name: f"{family}.{f.name}"
        for family, settings in family_settings().items()
        for f in dataclasses.fields(settings)
    }
    return {name: own.get(name, f"model.{name}") for name in sorted(family_options())}


def _value(cfg: Any, key: str) -> Any:
    section, leaf = key.split(".")
    return getattr(getattr(cfg, section), leaf)


def _default(cfg: Any, key: str) -> Any:
    section, leaf = key.split(".")
    return getattr(type(getattr(cfg, section))(), leaf)


def set_options(cfg: Any) -> dict[str, Any]:
    """{config key: value} of the adapter options (``option_keys``) that differ from their
    defaults: what the run asks of the family."""
    keys = option_keys().values()
    return {k: _value(cfg, k) for k in keys if _value(cfg, k) != _default(cfg, k)}


def adapter_kwargs(cfg: Any, pipeline: type | str) -> dict[str, Any]:
    """The keyword options for the adapter of ``pipeline`` (a class or a supported class's
    name): every option set away from its default. One the adapter does not take (the setting
    of another family, or a shared one it has no use for) is a one-line ConfigError naming
    the key, the loaded family and the family the setting belongs to."""
    from flowgrpo.models.registry import (
        SUPPORTED_PIPELINES,
        adapter_options,
        family_of,
        resolve_adapter_path,
    )

    name = pipeline if isinstance(pipeline, str) else pipeline.__name__
    path = SUPPORTED_PIPELINES[name] if isinstance(pipeline, str) else None
    family = family_of(path or resolve_adapter_path(pipeline))
    takes = adapter_options(pipeline)
    out = {}
    for key, value in set_options(cfg).items():
        option = key.split(".")[1]
        if option not in takes:
            owner, _, _ = key.partition(".")
            whose = f"a setting of family {owner}, " if owner != "model" else ""
            raise ConfigError(
                f"config key {key!r} does not apply to {name} (family {family}): it is "
                f"{whose}not one of the options {name} takes "
                f"({', '.join(sorted(takes)) or 'none'}); unset it"
            )
        out[option] = value
    return out


def planner_options(cfg: Any) -> dict[str, Any]:
    """{adapter option: value} of every option, set or not: what the planner's class-level
    questions (``plans_cfg``, ``token_counts``, ``check_options``) read."""
    return {name: _value(cfg, key) for name, key in option_keys().items()}


def _heads(config: dict[str, Any]) -> int | None:
    for key in ("num_attention_heads", "n_heads", "num_heads"):
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


def _check_sp_declared(adapter: Any, pipeline: str, index: dict[str, Any]) -> None:
    """ConfigError unless the family declares a sequence-parallel spec or each trained
    component's diffusers class has a context-parallel plan (``_cp_plan``): what
    ``enable_sequence_parallel`` needs, checked before any weight loads."""
    if adapter.sequence_parallel is not None:
        return
    import importlib

    for comp in adapter.trained_components(index):
        entry = index.get(comp)
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] == "diffusers"):
            continue
        klass = getattr(importlib.import_module("diffusers"), str(entry[1]), None)
        if klass is not None and getattr(klass, "_cp_plan", None) is None:
            raise ConfigError(
                f"config key 'fsdp.sp_degree': {pipeline}'s {comp} ({entry[1]}) has no "
                "context-parallel plan in diffusers and its family declares none: sequence "
                "parallelism is not supported for it (fsdp.sp_degree=1)"
            )


def check_world(cfg: Any, world_size: int, label: str = "world size") -> None:
    """``world_size`` ranks against ``fsdp.replicate_degree`` x ``fsdp.sp_degree`` and the
    step's global batch (each data-parallel rank takes an equal share), and
    ``trainer.off_policy_overlap`` (one process only); ``label`` names the count in the error
    (the planner's ``--gpus``)."""
    from flowgrpo.data.prompts import check_divides
    from flowgrpo.engine.config import parallel_layout

    fs = cfg.fsdp
    try:
        layout = parallel_layout(world_size, fs.replicate_degree, fs.sp_degree)
        check_divides(cfg.sample.prompts_per_step * cfg.sample.group_size, layout.dp)
    except ValueError as e:
        raise ConfigError(str(e).replace(f"world size {world_size}", label)) from None
    if cfg.trainer.off_policy_overlap and world_size > 1:
        raise ConfigError(
            f"config key 'trainer.off_policy_overlap' must be false with {label} "
            "(the copy's collectives would run beside the update's); the sequential schedule "
            "is the same math"
        )


def check_prompt_cache(edits: bool, embed_cache_dir: Any) -> None:
    """An editing family's prompt embeddings depend on each sample's source images, so they
    are not cached: ``model.embed_cache_dir`` with one is refused (the trainer's prompt cache
    setup and the planner ask this one function)."""
    if edits and embed_cache_dir:
        raise ConfigError(
            "model.embed_cache_dir: an editing model's prompt embeddings depend on each "
            "sample's source images, so they are not cached; unset model.embed_cache_dir"
        )


def check_model_run(
    cfg: Any, configs: dict[str, Any], *, world_size: int | None = None, label: str = "world size"
) -> None:
    """Every check of ``cfg`` against the model's config files (``configs``: model_index and
    each component's config) and, given ``world_size``, against the ranks (``check_world``;
    ``label`` names that count in the error).
    ConfigError on the first problem; a pipeline without an adapter is left to the loader."""
    from flowgrpo.models.base import check_size
    from flowgrpo.models.registry import SUPPORTED_PIPELINES, import_adapter

    m = cfg.model
    pipeline = str(configs.get("model_index", {}).get("_class_name", ""))
    if pipeline not in SUPPORTED_PIPELINES:
        return
    check_preset_pipeline(cfg.preset, pipeline, str(m.path))
    adapter = import_adapter(SUPPORTED_PIPELINES[pipeline])

    def config(component: str) -> dict:
        data = configs.get(component)
        return data if isinstance(data, dict) else {}

    try:
        rule = adapter.size_rule(config)
        if rule is not None:
            check_size(rule, m.height, m.width, m.num_frames, key="config key 'model.{}'")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    options = adapter_kwargs(cfg, pipeline)

    check_prompt_cache(getattr(adapter, "edits", False), m.embed_cache_dir)
    check_options = getattr(adapter, "check_options", None)
    if check_options is not None:
        try:
            check_options(config, options)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    sp = cfg.fsdp.sp_degree
    if sp > 1:
        _check_sp_declared(adapter, pipeline, configs["model_index"])
        for comp in adapter.trained_components(configs["model_index"]):
            heads = _heads(config(comp))
            if heads is not None and heads % sp:
                raise ConfigError(
                    f"config key 'fsdp.sp_degree': {pipeline}'s {comp} has {heads} attention "
                    f"heads, which do not split over sp_degree={sp} (Ulysses gives each rank "
                    "heads / sp of them): use a divisor of the heads"
                )
    if world_size is not None:
        check_world(cfg, world_size, f"{label} {world_size}")


def base_fingerprint(model_path: str) -> str | None:
    """A short hash of the base transformer(s) at ``model_path``: each trained component's
    ``config.json`` and the names and sizes of its weight files (no weight is read). Equal for
    two copies of one model, different for another model; None where it cannot be read (a
    path that is not a pipeline folder). A run records it; a resume compares it."""
    import hashlib

    from flowgrpo.models.registry import (
        SUPPORTED_PIPELINES,
        import_adapter,
        read_model_index,
        resolve_model_path,
    )

    try:
        index = read_model_index(model_path)
        root = Path(resolve_model_path(model_path))
    except (OSError, ValueError):
        return None
    name = index.get("_class_name")
    comps = ["transformer"]
    if name in SUPPORTED_PIPELINES:
        comps = list(import_adapter(SUPPORTED_PIPELINES[name]).trained_components(index))
    h = hashlib.sha256(str(name).encode())
    for comp in comps:
        folder = root / comp
        if not folder.is_dir():
            continue
        try:
            config = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            config = {}
        config = {k: v for k, v in config.items() if not k.startswith("_")}  # versions, paths
        h.update(comp.encode() + json.dumps(config, sort_keys=True).encode())
        for f in sorted(folder.iterdir()):
            if f.is_file() and f.suffix in (".safetensors", ".bin", ".pt", ".pth", ".gguf"):
                h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


__all__ = [
    "base_fingerprint",
    "check_model_run",
    "check_preset_pipeline",
    "check_world",
    "adapter_kwargs",
    "local_model_configs",
    "option_keys",
    "planner_options",
    "set_options",
]
