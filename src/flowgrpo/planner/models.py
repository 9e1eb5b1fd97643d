"""The planner's inputs read from config files alone: a pipeline's component configs (a local
diffusers folder or a shipped set, ``known:NAME``), each component built on the meta device
(no weight read, nothing allocated) and its parameters counted, and a reward model's size from
its own config file (``reward_models``)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

KNOWN_PREFIX = "known:"
#: components counted on the meta device, by (kind, library, class, config, ...): the advice
#: plans many variants of one run, and building a 20B transformer on meta takes ~0.5 s
MEMO: dict[tuple, Any] = {}


def _configs_root() -> Any:
    return resources.files("flowgrpo") / "assets" / "model_configs"


def known_models() -> list[str]:
    """Names of the shipped config sets (``model.path=known:NAME``)."""
    return sorted(
        p.name[: -len(".json")] for p in _configs_root().iterdir() if p.name.endswith(".json")
    )


def read_model_configs(path: str) -> dict[str, Any]:
    """{"model_index": ..., component: config} from a local diffusers directory (its
    model_index.json and each component's config.json) or a shipped set (``known:NAME``)."""
    if path.startswith(KNOWN_PREFIX):
        name = path[len(KNOWN_PREFIX) :]
        if name not in known_models():
            raise ValueError(
                f"model.path {path!r}: no shipped config set {name!r}; known: "
                + ", ".join(KNOWN_PREFIX + n for n in known_models())
            )
        return json.loads((_configs_root() / f"{name}.json").read_text())
    from flowgrpo.models.registry import read_model_index, resolve_model_path

    index = read_model_index(path)
    root = resolve_model_path(path)
    out: dict[str, Any] = {"model_index": index}
    for comp, spec in index.items():
        if not (
            isinstance(spec, list) and len(spec) == 2 and spec[0] in ("diffusers", "transformers")
        ):
            continue
        cfg = root / comp / "config.json"
        if cfg.is_file():
            out[comp] = json.loads(cfg.read_text())
    if "transformer" not in out:
        raise ValueError(f"model.path '{path}': no transformer/config.json to plan from")
    return out


def preset_model(preset: str | None) -> list[str] | None:
    """The settings that plan shipped preset ``preset`` on its own model: ``model.path`` of
    its first config set (its ``made_for.models``, ``flowgrpo.config.shipped``) and what that
    row adds; None for other presets."""
    from flowgrpo.config.shipped import preset_models

    for name, model, extra in preset_models():
        if name == preset:
            return [f"model.path={KNOWN_PREFIX}{model}", *extra]
    return None


def build_on_meta(library: str, class_name: str, config: dict[str, Any]) -> Any:
    """The component instantiated from ``config`` on the meta device (no memory, no weights)."""
    import torch

    with torch.device("meta"):
        if library == "diffusers":
            import diffusers

            return getattr(diffusers, class_name).from_config(config)
        import transformers

        klass = getattr(transformers, class_name)
        return klass(klass.config_class.from_dict(config))


def numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def linear_weights(module: Any) -> tuple[int, int]:
    """(elements, output rows) of every ``nn.Linear`` weight in ``module``: what a weight-only
    quantization (``model.base_quant``) stores quantized, and its per-row scales."""
    import torch

    n = rows = 0
    for mod in module.modules():
        if isinstance(mod, torch.nn.Linear):
            n += mod.weight.numel()
            rows += mod.out_features
    return n, rows


def component_counts(library: str, class_name: str, config: dict[str, Any]) -> tuple[int, int, int]:
    """(parameters, Linear weight elements, Linear output rows) of one frozen component."""
    key = ("counts", library, class_name, json.dumps(config, sort_keys=True))
    if key not in MEMO:
        model = build_on_meta(library, class_name, config)
        MEMO[key] = (numel(model), *linear_weights(model))
    return MEMO[key]


# -- reward models -------------------------------------------------------------------------------
#: the model a reward loads when its options name no path: (config set under
#: assets/model_configs/rewards/, what it is). Rewards not listed hold no model on the GPU
#: (ocr: rapidocr's ONNX engine on the host; jpeg, temporal_consistency: no model;
#: vlm_judge, remote: served elsewhere) or one the planner does not know (``UNSIZED``).
REWARD_MODELS = {
    "pickscore": ("clip-vit-h-14", "PickScore_v1, a CLIP ViT-H/14"),
    "hpsv2": ("clip-vit-h-14", "HPSv2.1, a CLIP ViT-H/14"),
    "clip_score": ("clip-vit-l-14", "CLIP ViT-L/14"),
    "aesthetic": ("clip-vit-l-14", "the LAION aesthetic MLP on CLIP ViT-L/14"),
}
#: rewards with a model whose size the planner does not know: counted 0, and the plan says so
UNSIZED = ("image_reward", "geneval", "image_similarity")


def reward_config_set(name: str) -> dict[str, Any]:
    """A shipped reward-model config set (``assets/model_configs/rewards/NAME.json``)."""
    return json.loads((_configs_root() / "rewards" / f"{name}.json").read_text())


def _reward_defaults(name: str) -> dict[str, Any]:
    """The keyword defaults of reward ``name``'s constructor (its ``device``, ``dtype``)."""
    import inspect

    from flowgrpo.rewards.base import _resolve

    obj = _resolve(name)
    fn = obj.__init__ if isinstance(obj, type) else obj
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def reward_models(
    specs: Any, run_device: str, section: str = "reward"
) -> list[tuple[str, int, int, str, str]]:
    """Per reward of ``specs`` (the config list ``section``: ``reward``, ``eval_reward`` or
    ``eval.gold_reward``) that holds a model on the run's GPUs: (label, parameters, bytes per
    parameter, device, what was assumed); the label is the reward's, prefixed with its section
    outside ``reward``. A reward whose options give a local ``path`` (``clip_path`` for
    aesthetic) is sized from that folder's config.json; without one, from the model it is made
    for (``REWARD_MODELS``), said so."""
    from flowgrpo.rewards.clip import _DTYPES

    out = []
    for spec in specs or []:
        name = spec.name
        if name not in REWARD_MODELS and name not in UNSIZED:
            continue
        label = spec.label if section == "reward" else f"{section}.{spec.label}"
        defaults = _reward_defaults(name)
        opts = dict(spec.options or {})
        device = str(opts.get("device") or (run_device if "device" in defaults else "cpu"))
        dtype = str(opts.get("dtype") or defaults.get("dtype", "float32"))
        nbytes = _DTYPES[dtype].itemsize if dtype in _DTYPES else 4
        if name in UNSIZED:
            out.append((label, 0, nbytes, device, f"{label}: model size unknown, counted 0"))
            continue
        set_name, what = REWARD_MODELS[name]
        path = opts.get("clip_path" if name == "aesthetic" else "path")
        config = None
        if path:
            from pathlib import Path

            cfg_file = Path(str(path)) / "config.json"
            if cfg_file.is_file():
                config = json.loads(cfg_file.read_text())
                assumed = f"{label}: {cfg_file}"
        if config is None:
            config = reward_config_set(set_name)["config"]
            assumed = (
                f"{label}: no model path given ({section}.{spec.label}.options.path): "
                f"assumed {what} ({set_name}), {dtype}"
            )
        n = component_counts("transformers", "CLIPModel", config)[0]
        if name == "aesthetic":
            n += 768 * 1024 + 1024 + 1024 * 128 + 128 + 128 * 64 + 64 + 64 * 16 + 16 + 16 + 1
        out.append((label, n, nbytes, device, assumed))
    return out
