"""What a run remembers of itself: its resolved config and command line, written as
``config.yaml`` into the run folder and into every checkpoint, and read back by the later
commands (``flowgrpo sample / eval / export-lora --checkpoint ...``) and by a resume.

Secrets are redacted (``flowgrpo.config.secrets.redact``) before anything is written; a
redacted value read back is dropped, so the default (or the environment) applies again.

A resume compares the run-defining settings (``RUN_DEFINING``, minus ``NOT_RUN_DEFINING``)
of the checkpoint's recorded config with the current one and refuses a difference unless
``trainer.allow_config_change=true``: those settings change what a step computes, so a run
that mixed two of them would compare two different things in one table.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from flowgrpo.config.secrets import REDACTED, redact, redact_args
from flowgrpo.settings import ConfigError

RUN_CONFIG = "config.yaml"  # in the run folder and in each checkpoint folder
#: dotted prefixes of the settings that define what a run computes; the families' sections
#: and the run's own algorithm's (``flow_grpo``, ``nft``, ...) are added by ``run_defining_keys``
RUN_DEFINING = (
    "seed",
    "algorithm",
    "model",
    "sample",
    "data",
    "reward",
    "eval_reward",
    "advantage",
    "update",
    "lora",
    "ema",
)
#: ... except these: where files live (a run may move between machines), and how work is
#: split into batches, overlapped, or which dtype a device runs (the same math)
NOT_RUN_DEFINING = (
    "model.path",
    "model.dtype",
    "data.train_prompts",
    "data.eval_prompts",
    "sample.rollout_batch_size",
    "update.micro_batch_size",
    "advantage.async_reward",
    "model.embed_cache_dir",  # the same embeddings, read from a cache
    "model.vae_slicing",  # the same decode, a sample at a time
)
#: config.yaml's header line holding the base model's fingerprint (``checks.base_fingerprint``)
BASE_LINE = "# base model: "


def command_line() -> str:
    """The command, quoted for a shell: ``flowgrpo ARGS`` as the CLI received them
    (``flowgrpo.cli.main`` keeps them), else this process's own command line; secret values
    redacted; bytes that are not UTF-8 (lone surrogates in ``argv``) written as ``\\udcXX``."""
    argv = getattr(sys.modules.get("flowgrpo.cli"), "current_argv", None)
    if argv is not None:
        line = shlex.join(["flowgrpo", *redact_args(argv)])
    else:
        argv = list(getattr(sys, "orig_argv", sys.argv))
        line = shlex.join(argv[:1] + redact_args(argv[1:]))
    return line.encode("utf-8", "backslashreplace").decode("utf-8")


def record_text(cfg: Any) -> str:
    """``config.yaml``'s text: a header with the command line, then the resolved config with
    its secrets redacted (loadable by ``read_record``)."""
    from flowgrpo.config.checks import base_fingerprint
    from flowgrpo.config.loader import config_to_yaml

    body = config_to_yaml(cfg, redacted=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    base = base_fingerprint(cfg.model.path) if cfg.model.path else None
    base_line = f"{BASE_LINE}{base} (the trained transformer's config and weight files)\n"
    return (
        f"# the resolved config of this run ({stamp}; secrets redacted)\n"
        f"# command: {command_line()}\n{base_line if base else ''}{body}"
    )


def write_record(folder: str | Path, cfg: Any) -> Path:
    """Write ``folder/config.yaml`` (see ``record_text``)."""
    path = Path(folder) / RUN_CONFIG
    path.write_text(record_text(cfg))
    return path


def _drop_redacted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_redacted(v) for k, v in value.items() if v != REDACTED}
    if isinstance(value, list):
        return [_drop_redacted(v) for v in value]
    return value


def read_record(folder: str | Path) -> dict[str, Any] | None:
    """The config recorded in ``folder/config.yaml`` as a nested dict (redacted values left
    out, moved keys at their new place: ``loader.renamed``), or None when the folder has none
    (runs from before records)."""
    from flowgrpo.config.loader import renamed

    path = Path(folder) / RUN_CONFIG
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        msg = " ".join(str(e).split())
        raise ConfigError(f"cannot read the recorded config {path}: {msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the recorded config {path} does not hold a mapping")
    return renamed(_drop_redacted(data), f"the recorded config {path}")


def checkpoint_record(checkpoint: str | Path) -> dict[str, Any] | None:
    """The config recorded with a checkpoint: its own ``config.yaml``, else its run folder's
    (``<run>/checkpoints/step_N`` -> ``<run>/config.yaml``), else None."""
    ckpt = Path(checkpoint)
    for folder in (ckpt, ckpt.parent.parent):
        found = read_record(folder)
        if found is not None:
            return found
    return None


def run_defining_keys(algorithm: str) -> tuple[str, ...]:
    """The dotted prefixes a resume compares for a run of ``algorithm``: ``RUN_DEFINING``, the
    families' own sections (``flux``, ``wan``, ...: the model's settings) and the
    algorithm's."""
    from flowgrpo.models.registry import family_settings

    return (*RUN_DEFINING, *family_settings(), algorithm)


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}  # a list (the reward list) compares as a whole


def changed_keys(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """The run-defining dotted keys whose values differ between two config dicts (the
    current one redacted like the record), sorted."""
    current = _drop_redacted(redact(dict(current)))
    keys = run_defining_keys(str(current.get("algorithm")))
    a, b = _flat(dict(recorded)), _flat(current)

    def defining(k: str) -> bool:
        within = any(k == p or k.startswith(p + ".") for p in keys)
        return within and not any(k == p or k.startswith(p + ".") for p in NOT_RUN_DEFINING)

    return sorted(k for k in set(a) | set(b) if defining(k) and a.get(k) != b.get(k))


def check_resume(cfg: Any, checkpoint: str | Path) -> None:
    """Refuse (ConfigError, one line naming the keys) to resume ``checkpoint`` with a config
    whose run-defining settings differ from the recorded ones, unless
    ``trainer.allow_config_change``. A checkpoint without a record is not checked."""
    from flowgrpo.config.loader import config_to_dict

    recorded = checkpoint_record(checkpoint)
    if recorded is None or cfg.trainer.allow_config_change:
        return
    _check_base(cfg, Path(checkpoint))
    diff = changed_keys(recorded, config_to_dict(cfg))
    if diff:
        shown = ", ".join(diff[:8]) + (f" and {len(diff) - 8} more" if len(diff) > 8 else "")
        raise ConfigError(
            f"cannot resume {checkpoint}: this config changes what the run computes ({shown} "
            "differ from the checkpoint's config.yaml); undo the change, start a new run "
            "(another run.output_dir), or pass trainer.allow_config_change=true if intended"
        )


def _check_base(cfg: Any, checkpoint: Path) -> None:
    """Refuse a resume on another base model than the recorded one (LoRA adapters and a
    reference policy sit on the base: the run would continue on other weights)."""
    from flowgrpo.config.checks import base_fingerprint

    for folder in (checkpoint, checkpoint.parent.parent):
        path = folder / RUN_CONFIG
        if path.is_file():
            lines = path.read_text().splitlines()[:4]
            old = next(
                (x[len(BASE_LINE) :].split()[0] for x in lines if x.startswith(BASE_LINE)), None
            )
            break
    else:
        return
    now = base_fingerprint(cfg.model.path) if cfg.model.path else None
    if old is not None and now is not None and old != now:
        raise ConfigError(
            f"cannot resume {checkpoint}: config key 'model.path' {cfg.model.path} is another "
            f"base model than the run's (fingerprint {now}, recorded {old}: the transformer's "
            "config or weight files differ); point model.path at the run's base model, or "
            "pass trainer.allow_config_change=true if intended"
        )


__all__ = [
    "BASE_LINE",
    "NOT_RUN_DEFINING",
    "RUN_CONFIG",
    "RUN_DEFINING",
    "changed_keys",
    "check_resume",
    "checkpoint_record",
    "command_line",
    "read_record",
    "record_text",
    "run_defining_keys",
    "write_record",
]
