"""The ``flowgrpo`` command line.

    flowgrpo train [PRESET] [KEY=VALUE ...]          train (default preset: toy-digits)
    flowgrpo config show [PRESET] [KEY=VALUE ...]    print the effective config as YAML
    flowgrpo config list                             list the shipped presets
    flowgrpo sample [PRESET] [KEY=VALUE ...] --prompts TEXT ... --out DIR [--checkpoint PATH|best]
    flowgrpo eval [PRESET] [KEY=VALUE ...] [--checkpoint PATH|best] [--prompt-file F]
    flowgrpo export-lora [PRESET] [KEY=VALUE ...] --checkpoint PATH|best --out FILE [--raw]
    flowgrpo memory [PRESET] [KEY=VALUE ...] --gpus N --gpu-gb G   per-GPU memory plan
    flowgrpo toy pretrain ...                        pretrain the toy generator
    flowgrpo reward-server --reward NAME ...         serve a reward over HTTP

With ``--checkpoint`` the run's recorded ``config.yaml`` is the config (PRESET may be left
out; KEY=VALUE overrides win).

PRESET is a shipped preset name or a path to a YAML file. Heavy modules (torch, diffusers) are
imported only by the command that runs, so ``--help`` is fast. Every error prints one line
``flowgrpo: error: ...`` on stderr: configuration and input errors exit with code 2, failures
while a run goes (a reward, divergence, the disk) with 1; ``run.debug=true`` or
FLOWGRPO_TRACEBACK=1 prints the traceback too. In a multi-process run one rank reports.
Multi-process: ``torchrun --nproc_per_node=N -m flowgrpo train ...``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from flowgrpo import __version__
from flowgrpo.settings import DEFAULT_PRESET

# flowgrpo.config is imported inside the handlers: it pulls in flowgrpo.engine (and torch).
# subcommands owned by other modules: (module, function adding the parser, one-line help)
LAZY_COMMANDS = {
    "toy": ("flowgrpo.toy.pretrain", "add_toy_parser", "the built-in toy digits model"),
    "reward-server": (
        "flowgrpo.rewards.server",
        "add_reward_server_parser",
        "serve a registered reward over HTTP",
    ),
}
_OVERRIDE_COMMANDS = ("train", "config", "sample", "eval", "export-lora", "memory")
current_argv: list[str] | None = None  # the arguments of the running command


def _is_main_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def split_config_args(items: Sequence[str]) -> tuple[str | None, list[str]]:
    """[PRESET] [KEY=VALUE ...] -> (preset or None, overrides)."""
    items = list(items)
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, items


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config_args",
        nargs="*",
        metavar="[PRESET] [KEY=VALUE ...]",
        help=f"preset name or YAML file (default {DEFAULT_PRESET}; see `flowgrpo config list`), "
        "then dotted overrides such as trainer.max_steps=2 reward=ocr:1.0,jpeg_compressibility:0.1",
    )


def _checkpoint(text: str | None) -> str | None:
    return None if text is None or text.lower() in ("none", "base", "") else text


def _best(text: str | None, preset: str | None, overrides: Sequence[str]) -> str | None:
    """``--checkpoint best`` (by gold score) / ``best-reward`` (by training reward), each
    optionally ``:RUN_DIR`` (default: the config's ``run.output_dir``) -> the checkpoint the
    run's ``best.json`` names; any other text unchanged."""
    if text is None:
        return None
    name, _, folder = text.partition(":")
    if name not in ("best", "best-reward"):
        return text
    if not folder:
        from flowgrpo.config import load_config

        folder = load_config(preset, list(overrides), check_paths=False).run.output_dir
    from flowgrpo.trainer.guard import resolve_best

    return str(resolve_best(folder, "gold" if name == "best" else "reward"))


def _config_of_checkpoint(args: argparse.Namespace, command: str, extra: Sequence[str] = ()):
    """The config of ``sample`` / ``eval`` / ``export-lora``: the checkpoint's recorded
    ``config.yaml`` when it has one (then a PRESET may be left out), else the preset;
    KEY=VALUE overrides win either way."""
    from flowgrpo.config import load_config

    preset, overrides = split_config_args(args.config_args)
    args.checkpoint = _best(args.checkpoint, preset, overrides)
    recorded, ckpt = None, _checkpoint(args.checkpoint)
    if ckpt is not None and os.path.exists(ckpt):  # a missing one is reported by the run
        from flowgrpo.config.record import checkpoint_record
        from flowgrpo.trainer.run_folder import resolve_checkpoint

        recorded = checkpoint_record(resolve_checkpoint(ckpt))
    return load_config(preset, [*overrides, *extra], command=command, recorded=recorded)


# -- handlers ----------------------------------------------------------------------------------


def _cmd_train(args: argparse.Namespace) -> int:
    from flowgrpo.config import load_config

    preset, overrides = split_config_args(args.config_args)
    if args.help:
        from flowgrpo.config.docs import commented_yaml

        print(args.parser.format_help())
        cfg = load_config(preset, overrides, check_paths=False)
        print(f"effective config (preset {cfg.preset!r}; every key is settable as KEY=VALUE):\n")
        print(commented_yaml(cfg), end="")
        return 0
    cfg = load_config(preset, overrides, command="train")
    from flowgrpo.trainer.loop import run_training

    return _in_process_group(cfg, lambda: run_training(cfg))


def _in_process_group(cfg: Any, job: Any) -> int:
    """Run ``job`` (which joins the process group); a failure is reported (one rank, one
    line) BEFORE the group is torn down, so the other ranks, whose collectives then fail,
    find it claimed and exit quietly instead of hanging or repeating it."""
    from flowgrpo.engine.dist import cleanup

    try:
        job()
        return 0
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - every failure becomes one line and an exit code
        return report_error(e, debug=cfg.run.debug)
    finally:
        cleanup()  # tear the process group down (NCCL warns at exit otherwise)


def _cmd_config_show(args: argparse.Namespace) -> int:
    from flowgrpo.config import load_config
    from flowgrpo.config.docs import commented_yaml, value_origins

    preset, overrides = split_config_args(args.config_args)
    cfg = load_config(preset, overrides, check_paths=args.check)
    header, origins = value_origins(preset, overrides)
    print(f"# preset {cfg.preset}" + (":" if header else ""))
    print("".join(f"#   {line}\n" for line in header), end="")
    print(
        "# Each key's help is above it; where its value came from is at the end of its line:\n"
        "# the preset (with its note: the reference's setting it follows), the command line,\n"
        "# or nothing there: the default.\n"
    )
    print(commented_yaml(cfg, origins), end="")
    return 0


def _cmd_config_list(args: argparse.Namespace) -> int:
    from flowgrpo.config.loader import list_presets

    for name in list_presets():
        print(name + ("  (default)" if name == DEFAULT_PRESET else ""))
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    from flowgrpo.config import ConfigError

    images = None
    if args.prompts:
        prompts = list(args.prompts)
        for text in prompts:  # bytes that are not UTF-8 reach argv as lone surrogates
            if any("\ud800" <= c <= "\udfff" for c in text):
                raise ConfigError(
                    f"--prompts: {text!r} is not UTF-8 text (a lone surrogate): pass UTF-8"
                )
        if args.image:
            from pathlib import Path

            from flowgrpo.data.prompts import load_image, not_a_file

            for f in args.image:
                if not Path(f).is_file():
                    raise ConfigError(f"--image {f}: {not_a_file(Path(f))}")
            try:
                row = [load_image(f) for f in args.image]
            except ValueError as e:  # "image <file> cannot be decoded (...)"
                raise ConfigError(f"--image: {e}") from None
            images = [list(row) for _ in prompts]
    elif args.prompt_file:
        from flowgrpo.data.prompts import load_prompts

        ds = load_prompts(args.prompt_file)
        prompts = ds.prompts
        images = ds.sources(range(len(ds)))  # decoded a batch at a time, as the rollout reads
    else:
        raise ConfigError("flowgrpo sample needs --prompts TEXT ... or --prompt-file FILE")
    cfg = _config_of_checkpoint(args, "sample")
    from flowgrpo.trainer.commands import run_sample

    def job() -> None:
        edits = {} if images is None else {"images": images}  # editing models only
        paths = run_sample(cfg, _checkpoint(args.checkpoint), prompts, args.out, **edits)
        if _is_main_rank():
            print(f"wrote {len(paths)} sample(s) to {args.out}")

    return _in_process_group(cfg, job)


def _cmd_eval(args: argparse.Namespace) -> int:
    extra = [f"data.eval_prompts={args.prompt_file}"] if args.prompt_file else []
    cfg = _config_of_checkpoint(args, "eval", extra)
    from flowgrpo.trainer.commands import run_eval

    def job() -> None:
        metrics = run_eval(cfg, _checkpoint(args.checkpoint))
        if _is_main_rank():
            text = json.dumps(metrics, indent=2, sort_keys=True)
            print(text)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(text + "\n")

    return _in_process_group(cfg, job)


def _cmd_export_lora(args: argparse.Namespace) -> int:
    cfg = _config_of_checkpoint(args, "export")
    from flowgrpo.trainer.commands import run_export_lora

    def job() -> None:
        path = run_export_lora(cfg, args.checkpoint, args.out, full=args.full, raw=args.raw)
        if _is_main_rank():
            what = "the full transformer" if args.full else "LoRA weights"
            if not cfg.ema.enabled:
                which = "the trained weights; this run has no EMA"
            elif args.raw:
                which = "the raw trained weights, not the EMA that eval measures"
            else:
                which = "the EMA weights, which eval measures; --raw for the raw weights"
            print(f"wrote {what} ({which}) to {path}")
            quant = cfg.model.base_quant
            if quant != "none":
                print(
                    f"note: the policy was trained on the {quant}-quantized base (model.base_quant"
                    f"={quant}); "
                    + (
                        "the transformer written holds that dequantized base, LoRA merged"
                        if args.full
                        else "the LoRA is for the unquantized base (model.path), which it "
                        "meets slightly differently than in training"
                    )
                )

    return _in_process_group(cfg, job)


def _cmd_memory(args: argparse.Namespace) -> int:
    from flowgrpo.config import load_config
    from flowgrpo.planner import GIB, format_plan, plan_memory
    from flowgrpo.planner.advice import cheapest_fit, fits_line, suggestions

    if args.gpus <= 0:
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    if not (args.gpu_gb > 0 and args.gpu_gb < float("inf")):
        raise ValueError(f"--gpu-gb must be a finite number > 0, got {args.gpu_gb:g}")
    preset, overrides = split_config_args(args.config_args)
    cfg = load_config(preset, overrides, check_paths=False)
    if not cfg.model.path:  # the preset's own model (its shipped config set), said so
        from flowgrpo.planner import preset_model

        own = preset_model(cfg.preset)
        if own is not None:
            overrides = [*own, *overrides]
            cfg = load_config(preset, overrides, check_paths=False)
            print(f"model.path not given: planning the preset's model, {' '.join(own)}")
    plan = plan_memory(cfg, args.gpus, args.gpu_gb, device=args.device)
    print(format_plan(plan, f"{cfg.preset} ({cfg.model.path})"))
    print(fits_line(preset, overrides, args.gpus))
    if not plan.fits or plan.tight:
        lines = suggestions(preset, overrides, plan, device=args.device)
        print("settings that shrink it (each alone):" if lines else "no single setting shrinks it")
        for line in lines:
            print("  " + line)
        if not plan.fits:  # the cheapest knobs by KNOB_COST (planner.advice), alone or not
            found = cheapest_fit(preset, overrides, plan, device=args.device)
            if found is None:
                print("no combination of these settings fits (up to 8x the GPUs)")
            else:
                extra, other = found
                alone = any(line.endswith(", fits") for line in lines)
                print(
                    f"{'' if alone else 'none fits alone; '}the cheapest combination that fits: "
                    f"{' '.join(extra)}: {other.total / GIB:.1f} GiB"
                )
    return 0


def _cmd_unavailable(args: argparse.Namespace) -> int:
    raise ValueError(f"command {args.command!r} is unavailable: {args.unavailable}")


# -- parser ------------------------------------------------------------------------------------


def _first_command(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def _add_lazy(sub: Any, name: str, wanted: str | None) -> None:
    module, func, help_text = LAZY_COMMANDS[name]
    if name == wanted:
        try:
            getattr(importlib.import_module(module), func)(sub)
            return
        except (ImportError, AttributeError) as e:
            p = sub.add_parser(name, help=help_text, add_help=False)
            p.set_defaults(func=_cmd_unavailable, unavailable=f"{type(e).__name__}: {e}")
            return
    sub.add_parser(name, help=help_text, add_help=False)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argparse tree; the subcommands of other modules (LAZY_COMMANDS) are imported only
    when ``argv`` selects them."""
    from flowgrpo.algorithms import ALGORITHMS, DEFAULT_ALGORITHM

    algorithms = ", ".join(ALGORITHMS)
    parser = argparse.ArgumentParser(
        prog="flowgrpo",
        description="Online RL for flow-matching text-to-image and text-to-video models, with "
        f"one of {len(ALGORITHMS)} algorithms (algorithm=NAME): {algorithms}.",
        epilog="`flowgrpo train --help` prints the effective default config. "
        "Docs: docs/training.md.",
    )
    parser.add_argument("--version", action="version", version=f"flowgrpo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "train",
        help=f"train (algorithm=NAME: {algorithms}; default {DEFAULT_ALGORITHM}, preset "
        "toy-digits)",
        description=f"Train with algorithm=NAME ({algorithms}; default {DEFAULT_ALGORITHM}). "
        "Outputs go to run.output_dir: metrics.jsonl, "
        "checkpoints/step_<N>/, image grids, reward_curve.png. resume=auto continues from the "
        "newest complete checkpoint. Multi-process: torchrun --nproc_per_node=N -m flowgrpo "
        "train ...",
        add_help=False,
    )
    p.add_argument("-h", "--help", action="store_true", help="show this help and the config")
    _add_config_args(p)
    p.set_defaults(func=_cmd_train, parser=p)

    p = sub.add_parser("config", help="show the effective config or list presets")
    csub = p.add_subparsers(dest="config_command", metavar="{show,list}", required=True)
    q = csub.add_parser("show", help="print the effective config as YAML")
    _add_config_args(q)
    q.add_argument(
        "--check", action="store_true", help="also check paths (model.path, prompt files)"
    )
    q.set_defaults(func=_cmd_config_show)
    q = csub.add_parser("list", help="list the shipped presets")
    q.set_defaults(func=_cmd_config_list)

    p = sub.add_parser("sample", help="write PNGs for prompts from a checkpoint or base model")
    _add_config_args(p)
    p.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint or run directory (its recorded config.yaml is the config); none = base; "
        "best = the run's best checkpoint by gold score (best-reward: by training reward; "
        "best:RUN_DIR for another run folder than run.output_dir)",
    )
    p.add_argument(
        "--prompts",
        nargs="+",
        metavar="TEXT",
        help="prompts, one image each (put KEY=VALUE overrides before this option)",
    )
    p.add_argument("--prompt-file", metavar="FILE", help=".txt / .jsonl / .parquet of prompts")
    p.add_argument(
        "--image",
        nargs="+",
        metavar="FILE",
        default=None,
        help="source image(s) of every --prompts prompt (editing models; a .jsonl's records "
        "name their own)",
    )
    p.add_argument("--out", default="samples", metavar="DIR", help="output folder (samples)")
    p.set_defaults(func=_cmd_sample)

    p = sub.add_parser("eval", help="eval reward of a checkpoint or base model")
    _add_config_args(p)
    p.add_argument(
        "--checkpoint",
        default=None,
        help="checkpoint or run directory (its recorded config.yaml is the config); none = base; "
        "best = the run's best checkpoint by gold score (best-reward: by training reward; "
        "best:RUN_DIR for another run folder than run.output_dir)",
    )
    p.add_argument("--prompt-file", metavar="FILE", help="eval prompts (data.eval_prompts)")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the metrics as JSON")
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("export-lora", help="write a diffusers-loadable LoRA from a checkpoint")
    _add_config_args(p)
    p.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint or run directory (its recorded config.yaml is the config); best = the "
        "run's best checkpoint by gold score (best-reward, best:RUN_DIR as for sample)",
    )
    p.add_argument(
        "--out", required=True, metavar="PATH", help="output .safetensors file (--full: a folder)"
    )
    p.add_argument(
        "--full",
        action="store_true",
        help="write the whole transformer (LoRA merged) with save_pretrained instead",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="export the raw trained weights of a run with EMA (default: the EMA weights, "
        "which eval and sample use)",
    )
    p.set_defaults(func=_cmd_export_lora)

    p = sub.add_parser(
        "memory",
        help="per-GPU memory of a run by part, from the model's config files, and whether it fits",
        description="Per-GPU bytes by part (trained weights, grads, optimizer, reference, EMA, "
        "frozen components, activations, rollout buffers) from the model's config files on the "
        "meta device (no weights read). model.path: a local diffusers directory or a shipped "
        "config set (known:qwen-image, known:flux.1-dev, ...). Predicted, not measured.",
    )
    _add_config_args(p)
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="number of GPUs")
    p.add_argument(
        "--gpu-gb",
        type=float,
        required=True,
        metavar="G",
        help="memory per GPU, GiB (the card's, as nvidia-smi gives it / 1024)",
    )
    p.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="dtype rule of `auto` (cuda)"
    )
    p.set_defaults(func=_cmd_memory)

    wanted = _first_command(argv)
    for name in LAZY_COMMANDS:
        _add_lazy(sub, name, wanted)
    return parser


def _exit_code(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)


def _cwd_importable() -> None:
    """Modules in the current folder are importable (``reward=myrewards:fn``) from the
    ``flowgrpo`` console script as from ``python -m flowgrpo``: ``-m`` puts the folder on
    ``sys.path``, a console script puts its own bin folder there instead."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (2: configuration and input errors, 1: failures while
    running, 130: interrupted)."""
    global current_argv
    argv = list(sys.argv[1:] if argv is None else argv)
    before, current_argv = current_argv, argv  # recorded in the run folder's config.yaml
    try:
        return _main(argv)
    finally:  # a later run started from Python records its own command, not this one
        current_argv = before


def _main(argv: list[str]) -> int:
    _cwd_importable()
    parser = build_parser(argv)
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:  # KEY=VALUE given after the options of a command
            if args.command not in _OVERRIDE_COMMANDS or not hasattr(args, "config_args"):
                parser.error(f"unrecognized arguments: {' '.join(extras)}")
            bad = [e for e in extras if e.startswith("-")]
            if bad:
                parser.error(f"unrecognized arguments: {' '.join(bad)}")
            args.config_args = list(args.config_args) + extras
    except SystemExit as e:
        return _exit_code(e)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("flowgrpo: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - every failure becomes one line and an exit code
        return report_error(e, debug=bool(getattr(args, "debug", False)))


def exit_code(e: BaseException) -> int:
    """2 for configuration and input errors (ConfigError, bad values, missing files), 1 for
    failures while a run goes (RunError: rewards, divergence, disk) and anything else."""
    from flowgrpo.errors import RunError

    if isinstance(e, RunError) or getattr(e, "reward_name", None) is not None:
        return 1  # a reward's failure or bad output (tagged with its name) is a run failure
    return 2 if isinstance(e, (FileNotFoundError, ValueError)) else 1


def report_error(e: BaseException, *, debug: bool = False) -> int:
    """Print ``flowgrpo: error: <one line>`` on stderr (the traceback first with ``run.debug``
    or FLOWGRPO_TRACEBACK=1) and return the exit code. In a multi-process run only the rank
    that failed first reports; the others, failing because it left, exit quietly."""
    import traceback

    from flowgrpo.engine.dist import report_failure_once

    def emit() -> None:
        if debug or os.environ.get("FLOWGRPO_TRACEBACK"):
            traceback.print_exception(e, file=sys.stderr)
        message = " ".join(str(e).split()) or type(e).__name__
        if exit_code(e) == 1 and not _names_itself(e):
            message = f"{type(e).__name__}: {message}"
        print(f"flowgrpo: error: {message}", file=sys.stderr, flush=True)

    report_failure_once(emit)
    return exit_code(e)


def _names_itself(e: BaseException) -> bool:
    from flowgrpo.errors import RunError

    return isinstance(e, RunError) or getattr(e, "reward_name", None) is not None


__all__ = ["build_parser", "main", "split_config_args"]
