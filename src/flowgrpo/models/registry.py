"""Which adapter drives which diffusers pipeline, and loading pipelines from local directories.

Adding a model family = one line in ``SUPPORTED_PIPELINES`` (pipeline class name -> adapter
import path ``module:Class``). Adapters are imported lazily, so a missing optional family never
breaks the others.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch

SUPPORTED_PIPELINES: dict[str, str] = {
    "QwenImagePipeline": "flowgrpo.models.qwen_image:QwenImageAdapter",
    "StableDiffusion3Pipeline": "flowgrpo.models.sd3:SD3Adapter",
    "FluxPipeline": "flowgrpo.models.flux:FluxAdapter",
    "WanPipeline": "flowgrpo.models.wan:WanAdapter",
    "ToyDigitsPipeline": "flowgrpo.toy.pipeline:ToyAdapter",
}
#: pipelines shipped in the package: ``model.path=builtin:NAME`` -> a function returning the
#: directory (import paths as strings: nothing below the toy package imports it)
BUILTIN_PIPELINES: dict[str, str] = {"toy-digits": "flowgrpo.toy.pipeline:shipped_dir"}
BUILTIN = "builtin:"


def resolve_model_path(path: str | Path) -> Path:
    """A local directory, or ``builtin:NAME`` -> the shipped pipeline's directory."""
    text = str(path)
    if not text.startswith(BUILTIN):
        return Path(text).expanduser()
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


def adapter_options(pipeline_cls: type) -> set[str]:
    """The keyword options the adapter of ``pipeline_cls`` takes (e.g. ``true_cfg_scale``)."""
    import inspect

    init = import_adapter(resolve_adapter_path(pipeline_cls)).__init__
    params = list(inspect.signature(init).parameters.values())[2:]  # self, pipe
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


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


def load_pipeline(path: str | Path, *, torch_dtype: torch.dtype | None = None) -> Any:
    """Load a supported diffusers pipeline from a local directory or a built-in one
    (``builtin:toy-digits``; never downloads).

    The pipeline class named in ``model_index.json`` is checked before any weight is read.
    A class diffusers does not ship (``ToyDigitsPipeline``) is taken from its adapter's module.
    An adapter's optional ``prepare_pipeline(pipe)`` is applied last (Wan: the hub's UniPC
    scheduler becomes the flow-matching Euler scheduler with the same shift).
    """
    name = read_model_index(path).get("_class_name")
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
    pipe = cls.from_pretrained(str(resolve_model_path(path)), **kwargs)
    module_name, _, attr = SUPPORTED_PIPELINES[name].partition(":")
    adapter_cls = getattr(importlib.import_module(module_name), attr, None)
    prepare = getattr(adapter_cls, "prepare_pipeline", None)
    return pipe if prepare is None else prepare(pipe)
