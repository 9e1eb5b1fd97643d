"""The commands that use a checkpoint without training it: ``flowgrpo sample`` (``run_sample``),
``flowgrpo eval`` (``run_eval``) and ``flowgrpo export-lora`` (``run_export_lora``). Each builds
what it needs (``Run`` with its purpose) and loads the checkpoint's weights, or keeps the base
model's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from flowgrpo.engine.dist import init_distributed
from flowgrpo.trainer.figures import fitted_sources, save_grid, save_images
from flowgrpo.trainer.run import Run, eval_images, evaluate, marking_checkpoint, rollout
from flowgrpo.trainer.run_folder import resolve_checkpoint
from flowgrpo.trainer.seeds import SAMPLE_SALT


def _restored(
    cfg: Any, checkpoint: str | Path | None, purpose: str, prompts: tuple[str, ...] = ()
) -> Run:
    """The run of a command (``purpose`` "sample", "eval" or "export"), with the weights of
    ``checkpoint`` (a checkpoint, or a run folder: its newest) or the base model's (None)."""
    run = Run(cfg, init_distributed(), purpose, prompts)
    if checkpoint is not None:
        from flowgrpo.engine.checkpoint import load_checkpoint

        if run.reward is not None and run.reward.pairwise_labels:  # judged against the base
            run.base_images = eval_images(run)[4].detach().cpu().clone()

        load_checkpoint(run.engine, resolve_checkpoint(checkpoint))
    return run


#: beside an edit's ``flowgrpo sample`` outputs: each prompt's source | result
EDIT_GRID = "grid.png"


def run_sample(
    cfg: Any,
    checkpoint: str | Path | None,
    prompts: list[str],
    out_dir: str | Path,
    images: list[list[torch.Tensor]] | None = None,
) -> list[Path]:
    """ODE samples (eval steps/guidance) of ``prompts`` from the base model or a checkpoint,
    one PNG each in ``out_dir`` (GIF for videos) and ``prompts.jsonl`` saying which prompt
    made which file; sample i's noise comes from (seed, i). ``images``: each prompt's source
    images (editing models); then ``grid.png`` shows each prompt's source | result."""
    if not prompts:
        raise ValueError("run_sample needs at least one prompt")
    run = _restored(cfg, checkpoint, "sample", tuple(prompts))  # prompts reach the cache
    with run.ema(), marking_checkpoint(run):  # no checkpoint to mark: the error line
        plan = run.eval_plan()
        result = rollout(
            run,
            list(prompts),
            list(range(len(prompts))),
            SAMPLE_SALT,
            plan,
            eval=True,
            images=images,
        ).images
    if not run.dist.is_main:
        return []
    paths = save_images(result, out_dir, prompts=list(prompts))
    if images is not None and result.dim() == 4:  # an edit: source | result, a prompt a row
        fitted = fitted_sources(images, *result.shape[-2:])
        save_grid(result, Path(out_dir) / EDIT_GRID, 1, list(prompts), sources=fitted)
    return paths


def run_eval(cfg: Any, checkpoint: str | Path | None) -> dict[str, float]:
    """Eval metrics (``eval/...``) of the base model or a checkpoint on the eval prompts."""
    return evaluate(_restored(cfg, checkpoint, "eval"))[0]


def run_export_lora(
    cfg: Any, checkpoint: str | Path, out_file: str | Path, *, full: bool = False, raw: bool = False
) -> Path:
    """Write the checkpoint's LoRA as a diffusers-loadable safetensors file, or with ``full``
    the whole transformer (LoRA merged) as a diffusers ``save_pretrained`` directory. A run
    with EMA exports its EMA weights (what eval and sample use) unless ``raw``."""
    if not full and not cfg.lora.enabled:
        raise ValueError(
            "this run is a full fine-tune (lora.enabled=false): there is no LoRA to export; "
            "add --full to write the whole transformer with save_pretrained"
        )
    run = _restored(cfg, checkpoint, "export")
    ema, steps = run.engine.ema, run.engine.optimizer_steps
    if not raw and ema is not None and steps < ema.update_every and run.dist.is_main:
        print(  # the EMA still holds the initial weights: an export of them changes nothing
            f"flowgrpo: warning: the EMA has not been updated yet ({steps} optimizer steps, "
            f"ema.update_every={ema.update_every}): it holds the initial weights, so this "
            "export equals the untrained model; --raw exports the trained weights",
            file=sys.stderr,
        )
    with run.ema(not raw):
        return Path(run.engine.save_full(out_file) if full else run.engine.export_lora(out_file))


__all__ = ["EDIT_GRID", "run_eval", "run_export_lora", "run_sample"]
