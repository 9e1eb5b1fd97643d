"""Which adapter drives which diffusers pipeline, and loading pipelines from local directories.

Adding a model family = one line in ``SUPPORTED_PIPELINES`` (pipeline class name -> adapter
import path ``module:Class``). Adapters are imported lazily, so a missing optional family never
breaks the others.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from typing import Any

import torch

from flowgrpo.settings import BUILTIN

SUPPORTED_PIPELINES: dict[str, str] = {
    "QwenImagePipeline": "flowgrpo.models.qwen_image:QwenImageAdapter",
    "StableDiffusion3Pipeline": "flowgrpo.models.sd3:SD3Adapter",
    "FluxPipeline": "flowgrpo.models.flux:FluxAdapter",
    "WanPipeline": "flowgrpo.models.wan:WanAdapter",
    "ToyDigitsPipeline": "flowgrpo.toy.pipeline:ToyAdapter",
    "Flux2Pipeline": "flowgrpo.models.flux2:Flux2Adapter",
    "Flux2KleinPipeline": "flowgrpo.models.flux2:Flux2KleinAdapter",
    "ZImagePipeline": "flowgrpo.models.zimage:ZImageAdapter",
    "QwenImage21Pipeline": "flowgrpo.models.qwen_image21:QwenImage21Adapter",
    "HunyuanVideo15Pipeline": "flowgrpo.models.hunyuan_video15:HunyuanVideo15Adapter",
    "QwenImageEditPipeline": "flowgrpo.models.qwen_image_edit:QwenImageEditAdapter",
    "QwenImageEditPlusPipeline": "flowgrpo.models.qwen_image_edit:QwenImageEditPlusAdapter",
    "FluxKontextPipeline": "flowgrpo.models.flux_kontext:FluxKontextAdapter",
    "ChromaPipeline": "flowgrpo.models.chroma:ChromaAdapter",
    "SanaPipeline": "flowgrpo.models.sana:SanaAdapter",
}
#: pipelines shipped in the package: ``model.path=builtin:NAME`` -> a function returning the
#: directory (import paths as strings: nothing below the toy package imports it)
BUILTIN_PIPELINES: dict[str, str] = {"toy-digits": "flowgrpo.toy.pipeline:shipped_dir"}


#: config keys that moved, old -> new: each family's own settings left ``model`` for its
#: family's section (issue 35); the config loader reads the old key as the new one on the
#: command line, in YAML files and in the config a run recorded (``config.loader.renamed``)
MOVED_KEYS: dict[str, str] = {
    "model.true_cfg_scale": "flux.true_cfg_scale",
    "model.guidance_scale_2": "wan.guidance_scale_2",
    "model.cfg_normalization": "zimage.cfg_normalization",
    "model.cfg_truncation": "zimage.cfg_truncation",
    "model.source_size": "flux_kontext.source_size",
}


def family_of(adapter_path: str) -> str:
    """A family's name: its adapter module's (``flowgrpo.models.wan:WanAdapter`` -> ``wan``),
    or its package's for an adapter outside ``flowgrpo.models`` (the toy -> ``toy``)."""
    parts = adapter_path.partition(":")[0].split(".")
    return parts[2] if parts[1:2] == ["models"] and len(parts) > 2 else parts[1]


def families() -> dict[str, tuple[str, ...]]:
    """{family name (``family_of``): the pipeline class names its adapter module drives}, in
    ``SUPPORTED_PIPELINES`` order: the one list of families every other list derives from
    (test doubles, docs tables, the planner's checks). Imports nothing."""
    out: dict[str, tuple[str, ...]] = {}
    for pipeline, path in SUPPORTED_PIPELINES.items():
        name = family_of(path)
        out[name] = (*out.get(name, ()), pipeline)
    return out


def family_settings() -> dict[str, type]:
    """{family name: its settings dataclass}, in ``SUPPORTED_PIPELINES`` order, for each family
    whose adapter module declares one (an adapter's ``settings_class`` defined in that module):
    the config gets one section per entry, named as the family (``flux.true_cfg_scale``), so a
    new family adds its section by its registry line. Imports the adapters (none imports
    diffusers at import time)."""
    out: dict[str, type] = {}
    for path in dict.fromkeys(SUPPORTED_PIPELINES.values()):
        settings = getattr(import_adapter(path), "settings_class", None)
        module = path.partition(":")[0]
        if settings is not None and settings.__module__ == module:
            out.setdefault(family_of(path), settings)
    return out


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hub_id(text: str) -> bool:
    """``org/name`` (one slash, no leading ``.``, ``/`` or ``~``): a Hugging Face hub id."""
    return bool(_HUB_ID.fullmatch(text))


def hub_snapshot(repo_id: str) -> Path:
    """The local Hugging Face cache's snapshot of ``repo_id`` (no network: huggingface_hub's
    offline lookup); FileNotFoundError saying how to download it when it is not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise FileNotFoundError(
            f"model.path '{repo_id}' is not a local folder, and as a Hugging Face hub id it is "
            "not in the local cache: flowgrpo never downloads; download it first "
            f"(`hf download {repo_id}`, or `huggingface-cli download {repo_id}`), then pass the "
            "same model.path (or the folder)"
        ) from None


def resolve_model_path(path: str | Path) -> Path:
    """A local directory; ``builtin:NAME`` -> the shipped pipeline's directory; a hub id
    (``org/name``) that is not a local folder -> its snapshot in the local Hugging Face cache
    (FileNotFoundError when it is not there)."""
    text = str(path)
    if not text.startswith(BUILTIN):
        local = Path(text).expanduser()
        if not local.exists() and looks_like_hub_id(text):
            return hub_snapshot(text)
        return local
    name = text[len(BUILTIN) :]
    if name not in BUILTIN_PIPELINES:
        raise ValueError(
            f"model.path {text!r}: no built-in pipeline {name!r}; built-in: "
            + ", ".join(BUILTIN + n for n in BUILTIN_PIPELINES)
        )
    return Path(import_adapter(BUILTIN_PIPELINES[name])())


def _supported() -> str:
    return ", ".join(SUPPORTED_PIPELINES)


def resolve_adapter_path(pipeline_cls: type) -> str:
    """The adapter import path for ``pipeline_cls`` (exact class name first, then its MRO)."""
    for klass in pipeline_cls.__mro__:
        if klass.__name__ in SUPPORTED_PIPELINES:
            return SUPPORTED_PIPELINES[klass.__name__]
    raise ValueError(
        f"unsupported pipeline class {pipeline_cls.__name__!r}; supported: {_supported()}"
    )


def import_adapter(path: str) -> Any:
    """Import ``package.module:name`` and return the object (an adapter class, ...)."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"adapter path {path!r} must look like 'package.module:ClassName'")
    return getattr(importlib.import_module(module_name), attr)


def _init_options(adapter_cls: type) -> set[str]:
    import inspect

    params = list(inspect.signature(adapter_cls.__init__).parameters.values())[2:]  # self, pipe
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def adapter_options(pipeline_cls: type | str) -> set[str]:
    """The keyword options the adapter of ``pipeline_cls`` (a class, or a supported class's
    name) takes (e.g. ``true_cfg_scale``): its ``__init__`` keywords after the pipeline, each a
    setting of the config (a family setting in its family's section, a shared one in
    ``model``)."""
    if isinstance(pipeline_cls, str):
        return _init_options(import_adapter(SUPPORTED_PIPELINES[pipeline_cls]))
    return _init_options(import_adapter(resolve_adapter_path(pipeline_cls)))


def family_options() -> set[str]:
    """Every option some registered adapter takes: the settings that belong to a family (the
    trainer passes those that are set, and refuses one the model does not take)."""
    return set().union(*(_init_options(cls) for cls in adapter_classes()))


def adapter_classes() -> list[Any]:
    """Every registered adapter class, in ``SUPPORTED_PIPELINES`` order (imports them)."""
    return [import_adapter(path) for path in dict.fromkeys(SUPPORTED_PIPELINES.values())]


def build_adapter(pipe: Any, **kwargs: Any) -> Any:
    """Wrap ``pipe`` in the adapter for its class: ``AdapterClass(pipe, **kwargs)``."""
    return import_adapter(resolve_adapter_path(type(pipe)))(pipe, **kwargs)


def read_model_index(path: str | Path) -> dict[str, Any]:
    """``model_index.json`` of a local diffusers directory, with clear errors for bad paths."""
    root = resolve_model_path(path)
    if not root.exists():
        raise FileNotFoundError(f"model.path '{path}' does not exist")
    index = root / "model_index.json"
    if not root.is_dir() or not index.is_file():
        raise ValueError(
            f"model.path '{path}' is not a diffusers pipeline directory (no model_index.json)"
        )
    try:
        index_data = json.loads(index.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"model.path '{path}': model_index.json is not valid JSON ({err})"
        ) from err
    if not isinstance(index_data, dict):
        raise ValueError(f"model.path '{path}': model_index.json is not a JSON object")
    return index_data


def size_rule_of(path: str | Path) -> Any:
    """The ``SizeRule`` of the pipeline at ``path`` (its adapter's ``size_rule`` over the
    components' ``config.json`` files), read without loading a weight; None for a class
    without an adapter or a rule."""
    name = read_model_index(path).get("_class_name")
    if name not in SUPPORTED_PIPELINES:
        return None
    root = resolve_model_path(path)

    def config(component: str) -> dict:
        try:
            data = json.loads((root / component / "config.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    return import_adapter(SUPPORTED_PIPELINES[name]).size_rule(config)


def load_pipeline(
    path: str | Path, *, torch_dtype: torch.dtype | None = None, empty_trained: bool = False
) -> Any:
    """Load a supported diffusers pipeline from a local directory or a built-in one
    (``builtin:toy-digits``; never downloads).

    The pipeline class named in ``model_index.json`` is checked before any weight is read.
    A class diffusers does not ship (``ToyDigitsPipeline``) is taken from its adapter's module.
    An adapter's optional ``load_components(root)`` gives components it builds itself (passed
    to ``from_pretrained``); its optional ``prepare_pipeline(pipe)`` is applied last (Wan: the hub's UniPC
    scheduler becomes the flow-matching Euler scheduler with the same shift).

    ``empty_trained``: the components the adapter trains (``trained_components``) are built
    on the meta device instead (``flowgrpo.models.weights.build_empty``, no weight read) for the
    engine to load sharded; a pipeline diffusers does not ship, or a component without
    safetensors weights, loads whole.
    """
    index = read_model_index(path)
    name = index.get("_class_name")
    if name not in SUPPORTED_PIPELINES:
        raise ValueError(
            f"model.path '{path}' holds an unsupported pipeline {name!r}; supported: {_supported()}"
        )
    import diffusers

    # A pipeline class that diffusers does not ship (the toy) lives beside its adapter.
    cls = getattr(diffusers, name, None)
    if cls is None:
        module = importlib.import_module(SUPPORTED_PIPELINES[name].partition(":")[0])
        cls = getattr(module, name)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if torch_dtype is not None:
        kwargs["dtype"] = torch_dtype  # diffusers 0.42 name (torch_dtype is deprecated)
    module_name, _, attr = SUPPORTED_PIPELINES[name].partition(":")
    adapter_cls = getattr(importlib.import_module(module_name), attr, None)
    root = resolve_model_path(path)
    if empty_trained and getattr(diffusers, name, None) is not None:
        kwargs.update(
            _empty_components(root, index, adapter_cls.trained_components(index), torch_dtype)
        )
    # components the adapter builds itself (Qwen-Image-Edit: its VL processor)
    own = getattr(adapter_cls, "load_components", None)
    if own is not None:
        kwargs.update(own(root))
    pipe = cls.from_pretrained(str(root), **kwargs)
    prepare = getattr(adapter_cls, "prepare_pipeline", None)
    return pipe if prepare is None else prepare(pipe)


def _empty_components(
    root: Path, index: dict[str, Any], names: tuple[str, ...], dtype: torch.dtype | None
) -> dict[str, Any]:
    """{component: the module built on the meta device} for each of ``names`` the folder holds
    as safetensors (the others load whole)."""
    from flowgrpo.models.weights import build_empty, weight_files

    out: dict[str, Any] = {}
    for component in names:
        entry = index.get(component)
        if (
            not isinstance(entry, list)
            or entry[0] is None
            or weight_files(root / component) is None
        ):
            continue
        library, class_name = entry
        out[component] = build_empty(
            getattr(importlib.import_module(library), class_name), root / component, dtype
        )
    return out
