"""Build a ``Config`` from defaults + a YAML preset + ``key=value`` overrides, and back to YAML.

Type checking follows the dataclass annotations: an int is accepted for a float, "1e-4" (a
string to PyYAML) for a float, "none"/"null" for an optional field; nothing else is converted.
A string field given a number keeps the override's text (``sample.negative_prompt=7``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import json
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Union

import yaml

from flowgrpo.algorithms import ALGORITHMS, DEFAULT_ALGORITHM, algorithm_class
from flowgrpo.config.schema import Config
from flowgrpo.config.shipped import list_presets, preset_dir, without_made_for
from flowgrpo.config.validate import validate
from flowgrpo.models.registry import MOVED_KEYS
from flowgrpo.rewards.spec import RewardSpec, parse_reward_specs
from flowgrpo.settings import DEFAULT_PRESET, ConfigError, short_repr

#: keys that moved (old -> new; the registry's table, where families are named): the old key
#: still works on the command line, in YAML files (and their per-algorithm overlays) and in
#: recorded run configs (``renamed``); the new key is the documented one
MOVED = MOVED_KEYS
#: other names of a key: `flowgrpo train resume=auto`, and the moved keys
ALIASES = {"resume": "trainer.resume", **MOVED}
REWARD_LISTS = (
    "reward",
    "eval_reward",
    "eval.gold_reward",
)  # list-of-RewardSpec keys, entries named by label
_NONE_TYPE = type(None)
_MISSING = object()


# -- keys and types ----------------------------------------------------------------------------


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass (works with ``from __future__ import annotations``)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in typing.get_type_hints(cls).items() if k in names}


def _union_args(tp: Any) -> tuple | None:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return None


def _is_dict_type(tp: Any) -> bool:
    args = _union_args(tp)
    return any(_is_dict_type(a) for a in args) if args else typing.get_origin(tp) is dict


def _type_name(tp: Any) -> str:
    args = _union_args(tp)
    if args:
        return " or ".join(_type_name(a) for a in args)
    if tp is _NONE_TYPE:
        return "null"
    if tp is Any:
        return "any value"
    if is_dataclass(tp):
        return "a mapping"
    origin, sub = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return f"a list of {_type_name(sub[0])}" if sub else "a list"
    if origin is tuple:
        return f"a list of {len(sub)} {_type_name(sub[0])}" if sub else "a list"
    if origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


@functools.cache
def valid_keys() -> tuple[str, ...]:
    """Every settable dotted key (sections and leaves), in declaration order."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in _hints(cls).items():
            out.append(prefix + name)
            if is_dataclass(tp):
                walk(tp, prefix + name + ".")

    walk(Config, "")
    for key in REWARD_LISTS:
        out += [f"{key}.NAME.{f}" for f in _hints(RewardSpec)]
    return tuple(out)


def _suggest(key: str, candidates: Iterable[str]) -> str | None:
    """The closest valid key: a unique one with the same last component, else difflib's."""
    cands = [c for c in candidates if "NAME" not in c]
    last = key.rsplit(".", 1)[-1]
    same_leaf = [c for c in cands if c.rsplit(".", 1)[-1] == last and c != key]
    if len(same_leaf) == 1:
        return same_leaf[0]
    close = difflib.get_close_matches(key, cands, n=1, cutoff=0.6)
    if close:
        return close[0]
    close = difflib.get_close_matches(last, [c.rsplit(".", 1)[-1] for c in cands], 1, 0.75)
    if close:
        matches = [c for c in cands if c.rsplit(".", 1)[-1] == close[0]]
        return matches[0] if len(matches) == 1 else None
    return None


def unknown_key(key: str, origin: str = "", candidates: Iterable[str] | None = None) -> ConfigError:
    """ConfigError "unknown config key 'x' [in FILE] (did you mean 'y'?)"."""
    where = f" in {origin}" if origin else ""
    guess = _suggest(key, valid_keys() if candidates is None else candidates)
    hint = f" (did you mean {guess!r}?)" if guess else " (see `flowgrpo config show`)"
    return ConfigError(f"unknown config key {key!r}{where}{hint}")


def _type_error(key: str, tp: Any, value: Any) -> ConfigError:
    from flowgrpo.config.secrets import REDACTED, is_secret_name, redact, redact_value_text

    if any(is_secret_name(word) for word in key.split(".")):
        value = REDACTED  # the error line is printed: a secret's value is not
    else:
        value = redact_value_text(value) if isinstance(value, str) else redact(value)
    return ConfigError(f"config key {key!r} expects {_type_name(tp)}, got {short_repr(value)}")


# -- coercion ----------------------------------------------------------------------------------


def _coerce(value: Any, tp: Any, key: str, current: Any = _MISSING, origin: str = "") -> Any:
    """``value`` checked/converted to annotation ``tp``; dataclass sections merge a mapping
    into ``current``. Raises ConfigError naming ``key``."""
    if key in REWARD_LISTS:
        return parse_reward_specs(value, key)
    args = _union_args(tp)
    if args:
        if _NONE_TYPE in args and (
            value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        ):
            return None
        for sub in args:  # the first alternative that accepts the value wins
            if sub is _NONE_TYPE:
                continue
            try:
                return _coerce(value, sub, key, current, origin)
            except ConfigError:
                continue
        raise _type_error(key, tp, value)
    if tp is Any:
        return value
    if is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"config key {key!r} is a section: set its keys (e.g. "
                f"{key}.{fields(tp)[0].name}=...) or give a mapping, got {short_repr(value)}"
            )
        obj = copy.deepcopy(current) if is_dataclass(current) else tp()
        apply_mapping(obj, value, key + ".", origin)
        return obj
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key, tp, value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(key, tp, value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise _type_error(key, tp, value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(key, tp, value)
    origin_t, sub = typing.get_origin(tp), typing.get_args(tp)
    if origin_t is list:
        if not isinstance(value, (list, tuple)):
            raise _type_error(key, tp, value)
        return [_coerce(v, sub[0], f"{key}[{i}]") if sub else v for i, v in enumerate(value)]
    if origin_t is tuple:
        if not isinstance(value, (list, tuple)) or (sub and len(value) != len(sub)):
            raise _type_error(key, tp, value)
        return tuple(_coerce(v, t, f"{key}[{i}]") for i, (v, t) in enumerate(zip(value, sub)))
    if origin_t is dict:
        if not isinstance(value, Mapping):
            raise _type_error(key, tp, value)
        vt = sub[1] if sub else Any
        return {str(k): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    raise _type_error(key, tp, value)  # pragma: no cover - no other annotation is used


def renamed(data: Mapping, origin: str = "") -> dict:
    """A copy of ``data`` (a nested config mapping: a YAML file, a recorded run config) with
    each moved key (``MOVED``) at its new place; the old and the new key both given is a
    ConfigError naming ``origin``."""
    out = dict(data)
    for old, new in MOVED.items():
        section, leaf = old.split(".")
        node = out.get(section)
        if not isinstance(node, Mapping) or leaf not in node:
            continue
        node = dict(node)
        value = node.pop(leaf)
        out[section] = node
        new_section, new_leaf = new.split(".")
        target = out.get(new_section) or {}
        if not isinstance(target, Mapping):
            continue  # apply_mapping names the section's wrong type
        if new_leaf in target:
            where = f" in {origin}" if origin else ""
            raise ConfigError(
                f"config key {old!r}{where} is the old name of {new!r}, which is also given: "
                f"keep {new}"
            )
        out[new_section] = {**target, new_leaf: value}
    return out


def apply_mapping(obj: Any, mapping: Mapping, prefix: str = "", origin: str = "") -> None:
    """Set ``obj``'s fields from a nested mapping (sections merge, leaves replace); at the
    top (``prefix`` empty) moved keys are read at their new place (``renamed``)."""
    hints = _hints(type(obj))
    if not prefix:
        mapping = renamed(mapping, origin)
    for k, v in mapping.items():
        here = f"{prefix}{k}"
        if k not in hints:
            local = [prefix + h for h in hints] if prefix.startswith(REWARD_LISTS) else None
            raise unknown_key(here, origin, local)
        setattr(obj, k, _coerce(v, hints[k], here, getattr(obj, k), origin))


# -- rewards ----------------------------------------------------------------------------------


def _select_reward(rewards: list[RewardSpec], sel: str, key: str = "reward") -> RewardSpec:
    """The entry of a reward list named ``sel``: its label (or registry name / import path),
    or its index."""
    if sel.lstrip("-").isdigit():
        i = int(sel)
        if not 0 <= i < len(rewards):
            raise ConfigError(f"config key '{key}.{sel}': index out of range 0..{len(rewards) - 1}")
        return rewards[i]
    for r in rewards:
        if sel in (r.label, r.name):
            return r
    names = [r.label for r in rewards]
    raise ConfigError(
        f"config key '{key}.{sel}': no reward {sel!r} in the reward list {names}; "
        f"set the list first, e.g. {key}=ocr,jpeg_compressibility:0.1"
    )


# -- overrides ---------------------------------------------------------------------------------


def _parse_value(raw: str) -> Any:
    if not raw.strip():
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _admits_str(tp: Any) -> bool:
    args = _union_args(tp)
    return str in args if args else tp is str


def apply_override(cfg: Config, text: str) -> None:
    """Apply one ``dotted.key=value`` (value parsed as YAML) to ``cfg`` in place."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} must look like key=value (e.g. trainer.max_steps=2)")
    parts = ALIASES.get(key, key).split(".")
    value = _parse_value(raw)
    obj: Any = cfg
    prefix, i = "", 0
    while True:
        name, last = parts[i], i == len(parts) - 1
        hints = _hints(type(obj))
        here = prefix + name
        if name not in hints:
            local = [prefix + h for h in hints] if prefix.startswith(REWARD_LISTS) else None
            raise unknown_key(key if local is None else here, candidates=local)
        tp, current = hints[name], getattr(obj, name)
        if last:
            if _admits_str(tp) and not isinstance(value, (str, list, dict, type(None))):
                value = raw.strip()  # a string field keeps the text as typed
            setattr(obj, name, _coerce(value, tp, here, current))
            return
        if is_dataclass(current):
            obj, prefix, i = current, here + ".", i + 1
        elif here in REWARD_LISTS:
            if i + 1 == len(parts):
                raise unknown_key(key)
            sel = parts[i + 1]
            obj, prefix, i = _select_reward(current, sel, here), f"{here}.{sel}.", i + 2
            if i == len(parts):
                raise ConfigError(
                    f"config key {key!r} names a reward, not a field: use {key}.weight=... "
                    f"or {key}.options.KEY=..."
                )
        elif _is_dict_type(tp):
            root = dict(current or {})
            node = root
            for p in parts[i + 1 : -1]:
                node = node.setdefault(p, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"config key {key!r}: {p!r} is not a mapping")
            node[parts[-1]] = value
            setattr(obj, name, _coerce(root, tp, here))
            return
        else:
            raise unknown_key(key)


def rollback_config(cfg: Config) -> Config:
    """A copy of ``cfg`` with ``guard.on_rollback`` applied (what a guard rollback resumes
    with); a ConfigError naming ``guard.on_rollback.KEY`` for an unknown key or a value of
    the wrong type."""
    from flowgrpo.config.schema import flat_keys

    return apply_settings(cfg, flat_keys(cfg.guard.on_rollback), "guard.on_rollback.")


def apply_settings(cfg: Config, settings: Mapping[str, Any], origin: str = "") -> Config:
    """A copy of ``cfg`` with ``{dotted key: value}`` set (ConfigError prefixed ``origin``)."""
    out = copy.deepcopy(cfg)
    for key, value in settings.items():
        try:
            apply_override(out, f"{key}={json.dumps(value)}")
        except ConfigError as e:
            raise ConfigError(f"{origin}{key}: {e}") from None
    return out


# -- presets -----------------------------------------------------------------------------------


def _preset_dir() -> Any:
    return preset_dir()


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, first: int, again: int) -> None:
        super().__init__(f"key {key!r} appears twice (lines {first} and {again})")
        self.key, self.first, self.again = key, first, again


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader refusing a key given twice in one mapping (YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(
                key_node, yaml.ScalarNode
            ):
                continue
            key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(key_node.value, seen[key], line)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _read_yaml(text: str, origin: str) -> dict:
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader
    except _DuplicateKey as e:
        raise ConfigError(f"{origin}: {e}; keep one (YAML would silently use the last)") from None
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"cannot parse {origin}: {msg}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{origin} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def _deep_merge(base: dict, top: Mapping) -> dict:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and k not in REWARD_LISTS:
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _looks_like_path(name: str) -> bool:
    return name.endswith((".yaml", ".yml")) or "/" in name or name.startswith("~")


def preset_dict(name: str, _seen: tuple[str, ...] = (), _via: str = "") -> tuple[dict, str]:
    """(raw mapping, label) of a shipped preset name or a YAML file path. A file may start from
    another preset with ``base: NAME_OR_PATH``; a relative path there is relative to the folder
    of the file that names it (not the current folder), like an include."""
    is_path = _looks_like_path(name) or Path(name).is_file()
    if is_path:
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"config file not found: {name}{_via}")
        data, label = _read_yaml(path.read_text(), str(path)), path.stem
        key = str(path.resolve())
    else:
        res = _preset_dir() / f"{name}.yaml"
        if not res.is_file():
            names = list_presets()
            guess = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
            hint = f"did you mean {guess[0]!r}? " if guess else ""
            raise ConfigError(
                f"unknown preset {name!r}{_via} ({hint}available: {', '.join(names)}; "
                "or give a path to a .yaml file)"
            )
        data, label = _read_yaml(res.read_text(), f"preset {name!r}"), name
        key = name
    origin = str(path) if is_path else f"preset {name!r}"
    data = renamed(without_made_for(data, origin), origin)
    overlays = data.get(OVERLAYS)
    if isinstance(overlays, Mapping):  # each algorithm's values, moved keys at their place
        data[OVERLAYS] = {
            k: renamed(v, f"{origin} ({OVERLAYS}.{k})") if isinstance(v, Mapping) else v
            for k, v in overlays.items()
        }
    base = data.pop("base", None)
    if base is not None:
        if key in _seen:
            raise ConfigError(f"preset {name!r} inherits from itself via 'base'")
        parent_name = str(base)
        if is_path:
            beside = path.parent / Path(parent_name).expanduser()  # an absolute base stays
            if _looks_like_path(parent_name) or beside.is_file():
                parent_name = str(beside)
        parent, _ = preset_dict(parent_name, (*_seen, key), f" (the 'base' of {name})")
        data = _deep_merge(parent, data)
    return data, label


OVERLAYS = "algorithms"  # a preset's per-algorithm values of the shared sections


def _algorithm_overlays(raw: Any, origin: str) -> dict[str, dict]:
    """A preset's ``algorithms: {NAME: {section: {...}}}``, checked whole (every algorithm's
    keys and types, not only the selected one's): values of the shared sections that apply
    when ``algorithm=NAME`` is chosen."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"config key {OVERLAYS!r} in {origin} must map algorithm names to sections, got "
            f"{short_repr(raw)}"
        )
    out = {}
    for name, body in raw.items():
        if name not in ALGORITHMS:
            guess = difflib.get_close_matches(str(name), ALGORITHMS, n=1, cutoff=0.6)
            hint = f"did you mean {guess[0]!r}? " if guess else ""
            raise ConfigError(
                f"unknown algorithm {name!r} under {OVERLAYS!r} in {origin} ({hint}one of "
                f"{', '.join(ALGORITHMS)})"
            )
        where = f"{origin} ({OVERLAYS}.{name})"
        if not isinstance(body, Mapping):
            raise ConfigError(f"config key '{OVERLAYS}.{name}' in {origin} must be a mapping")
        for key in ("algorithm", OVERLAYS, "preset"):
            if key in body:
                raise ConfigError(f"config key {key!r} cannot be set per algorithm in {where}")
        apply_mapping(Config(), body, "", where)  # unknown keys and wrong types, named
        out[str(name)] = dict(body)
    return out


def _chosen_algorithm(overrides: list[str]) -> str | None:
    """The algorithm the overrides select (the last ``algorithm=X``), if any."""
    chosen = None
    for text in overrides:
        key, sep, raw = text.partition("=")
        if sep and key.strip() == "algorithm":
            value = _parse_value(raw)
            chosen = value if isinstance(value, str) else None
    return chosen


def resolve_defaults(cfg: Config) -> Config:
    """Fill the derived values, once, where they live: ``eval_guidance_scale`` null ->
    the algorithm's (``guidance_scale``; nft: ``nft.guidance_scale``); ``fsdp.param_dtype`` auto -> ``model.dtype`` when that is explicit;
    a cosine schedule's ``optim.total_steps`` 0 -> ``trainer.max_steps`` x
    ``update.num_minibatches``; ``{preset}`` in ``run.output_dir`` -> the preset name."""
    if cfg.sample.eval_guidance_scale is None:
        known = cfg.algorithm in ALGORITHMS  # else validation names the unknown algorithm
        algo = algorithm_class(cfg.algorithm if known else DEFAULT_ALGORITHM)
        cfg.sample.eval_guidance_scale = algo.eval_guidance_scale(cfg)
    if cfg.fsdp.param_dtype == "auto" and cfg.model.dtype != "auto":
        cfg.fsdp.param_dtype = cfg.model.dtype
    o = cfg.optim
    if o.lr_schedule == "cosine" and o.total_steps == 0:
        o.total_steps = cfg.trainer.max_steps * cfg.update.num_minibatches
    if "{preset}" in cfg.run.output_dir:
        cfg.run.output_dir = cfg.run.output_dir.replace("{preset}", cfg.preset or "custom")
    return cfg


def algorithm_output_dir(folder: str, algorithm: str) -> str:
    """The run folder of a preset trained with another algorithm than its own:
    ``runs/toy-digits`` -> ``runs/toy-digits-nft``."""
    return f"{folder.rstrip('/')}-{algorithm}"


def _check_recorded_preset(preset: str | None, recorded: Mapping[str, Any]) -> None:
    if preset is None:
        return
    name = Path(preset).stem if _looks_like_path(preset) else preset
    if name != recorded.get("preset"):
        raise ConfigError(
            f"the checkpoint's run used preset {recorded.get('preset')!r}, not {preset!r}: "
            "leave the preset out (the run's recorded config.yaml is used; KEY=VALUE "
            "overrides still apply)"
        )


def load_config(
    preset: str | None = None,
    overrides: Iterable[str] = (),
    *,
    check_paths: bool = True,
    command: str = "train",
    recorded: Mapping[str, Any] | None = None,
) -> Config:
    """Defaults <- preset (name or YAML path; default ``toy-digits``) <- the preset's
    ``algorithms.<chosen algorithm>`` values <- overrides, validated.

    ``recorded`` (a run's ``config.yaml``, ``flowgrpo.config.record``) replaces the preset as
    the base; a ``preset`` given with it must be the one the run used. An ``algorithm=``
    override that changes the preset's algorithm also changes the default run folder
    (``algorithm_output_dir``), so that each algorithm's run gets its own folder.

    ``check_paths=False`` skips the checks that need the files (model.path required/existing,
    prompt files readable): ``flowgrpo config show`` and ``--help`` use it. ``command``
    ("train", "eval", "sample", "export") limits those checks to what the command reads.
    """
    overrides = list(overrides)
    preset_keys: set[str] = set()  # the dotted keys the preset (or its overlay) set
    origin = "the run's recorded config.yaml"
    if recorded is not None:  # a run's config.yaml: the base, in place of the preset
        _check_recorded_preset(preset, recorded)
        cfg = Config()
        apply_mapping(cfg, recorded, "", origin)
    else:
        data, label = preset_dict(preset or DEFAULT_PRESET)
        origin = label if Path(label).suffix else f"preset {label!r}"
        overlays = _algorithm_overlays(data.pop(OVERLAYS, None), origin)
        cfg = Config()
        apply_mapping(cfg, data, "", origin)
        preset_keys = _dotted_keys(data)
        if cfg.preset is None:
            cfg.preset = label
        chosen = _chosen_algorithm(overrides) or cfg.algorithm
        if chosen in overlays:  # the preset's values for this algorithm; the overrides win
            apply_mapping(cfg, overlays[chosen], "", f"{origin} ({OVERLAYS}.{chosen})")
            preset_keys |= _dotted_keys(overlays[chosen])
    base_algorithm, default_dir = cfg.algorithm, cfg.run.output_dir
    for text in overrides:
        apply_override(cfg, text)
    if recorded is None and cfg.algorithm != base_algorithm and cfg.run.output_dir == default_dir:
        cfg.run.output_dir = algorithm_output_dir(default_dir, cfg.algorithm)
    given = _override_keys(overrides)
    _refuse_ignored(cfg, given)
    resolve_defaults(cfg)
    try:
        validate(cfg, check_paths=check_paths, command=command)
        if cfg.guard.on_rollback:  # each key known and its value of the key's type
            rollback_config(cfg)
    except ConfigError as e:
        raise _note_preset_value(e, preset_keys - set(given), origin) from None
    return cfg


def _dotted_keys(data: Any, prefix: str = "") -> set[str]:
    """Every dotted key a preset mapping sets: its sections and their leaves."""
    out: set[str] = set()
    if isinstance(data, Mapping):
        for k, v in data.items():
            key = f"{prefix}{k}"
            out |= {key, *_dotted_keys(v, key + ".")}
    return out


def _override_keys(overrides: Iterable[str]) -> list[str]:
    """The dotted keys the ``key=value`` overrides set (aliases resolved)."""
    keys = [text.partition("=")[0].strip() for text in overrides if "=" in text]
    return [ALIASES.get(k, k) for k in keys]


def _note_preset_value(e: ConfigError, preset_keys: set[str], origin: str) -> ConfigError:
    """``e`` with "(set by preset 'X'...)" when the key it names is the preset's value, not
    one the command line gave: the user sees which value to override."""
    msg = str(e)
    key = msg.split("config key '", 1)[1].split("'", 1)[0] if "config key '" in msg else None
    if key is None or key not in preset_keys or "\n" in msg:
        return e
    return ConfigError(f"{msg} (set by {origin}: override it with {key}=...)")


def _refuse_ignored(cfg: Config, given: list[str]) -> None:
    """One line for a command-line setting the run would silently ignore: a LoRA setting (not
    its default) of a full fine-tune, or the section of another algorithm than the run's. A
    preset's own values are not refused (its LoRA targets when LoRA is turned off)."""
    for key in given:
        section = key.split(".", 1)[0]
        if section == "lora" and key != "lora.enabled" and not cfg.lora.enabled:
            value = functools.reduce(getattr, key.split(".")[1:], cfg.lora)
            default = getattr(type(cfg.lora)(), key.split(".")[-1], _MISSING)
            if "." in key and value != default:
                raise ConfigError(
                    f"config key {key!r} is set ({short_repr(value)}) but lora.enabled=false: a "
                    f"full fine-tune trains every parameter and has no LoRA; remove {key} or "
                    "set lora.enabled=true"
                )
        if section in ALGORITHMS and section != cfg.algorithm:
            leaf = key.partition(".")[2]
            own = f"{cfg.algorithm}.{leaf}" if leaf else cfg.algorithm
            alt = f" (this run's is {own})" if leaf and own in valid_keys() else ""
            raise ConfigError(
                f"config key {key!r} is a setting of algorithm={section}, but this run's "
                f"algorithm is {cfg.algorithm}: it would be ignored; remove it{alt} or set "
                f"algorithm={section}"
            )


# -- back to plain data ------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict (tuples as lists): YAML/JSON-able, and ``config_from_dict``'s input."""
    return _plain(cfg)


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of scalars and empty mappings stay on one line."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> Any:
    flat = all(not isinstance(v, (list, dict)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


def _represent_dict(dumper: yaml.SafeDumper, data: dict) -> Any:
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=not data)


_Dumper.add_representer(list, _represent_list)
_Dumper.add_representer(dict, _represent_dict)


def config_to_yaml(cfg: Config, *, redacted: bool = False) -> str:
    """The effective config as YAML (round-trips through ``config_from_dict``); with
    ``redacted``, every secret (``flowgrpo.config.secrets.redact``) replaced, for printing."""
    data = config_to_dict(cfg)
    if redacted:
        from flowgrpo.config.secrets import redact

        data = redact(data)
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, width=100)


def config_from_dict(data: Mapping[str, Any], *, check: bool = False) -> Config:
    """A Config from a (possibly partial) nested dict over the defaults; no preset applied."""
    cfg = Config()
    apply_mapping(cfg, data)
    if check:
        validate(cfg, check_paths=False)
    return cfg


__all__ = [
    "ALIASES",
    "MOVED",
    "algorithm_output_dir",
    "apply_mapping",
    "apply_override",
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "list_presets",
    "load_config",
    "preset_dict",
    "renamed",
    "resolve_defaults",
    "unknown_key",
    "valid_keys",
]
