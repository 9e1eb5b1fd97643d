"""Run logging: metrics.jsonl, tensorboard, optional wandb, a progress bar, and the end of a
run (reward curve, before/after image grids, a base-vs-final table). The figures themselves
(grids; videos [N, C, F, H, W] as animated GIFs) are drawn by ``trainer.figures``.

Only rank 0 logs: every other rank gets a ``RunLogger(enabled=False)`` whose methods do
nothing. tensorboard and wandb are imported only when enabled; wandb's offline mode works
without a network (``run.wandb="offline"``).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowgrpo.config.secrets import redact, redact_args
from flowgrpo.engine.config import parallel_layout
from flowgrpo.trainer.figures import (
    gif_bytes,
    grid_path,
    make_grid,
    plot_reward_curve,
    reward_notes,
    save_grid,
    video_grid,
)

TIME_PREFIX = "time/"
NON_DETERMINISTIC_KEYS = ("images_per_s", "images_per_s_per_gpu")  # and "time/", "memory/"
MEMORY_PREFIX = "memory/"  # peak memory figures (GiB): they vary with the allocator
# the progress bar: tqdm's default with the remaining time labelled as the ETA
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, ETA {remaining}, {rate_fmt}{postfix}]"


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """All complete JSON lines of ``path`` (a torn last line from a killed run is skipped)."""
    rows = []
    p = Path(path)
    if not p.exists():
        return rows
    for line in p.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def truncate_jsonl(path: str | Path, max_step: int) -> None:
    """Keep only rows with ``step <= max_step`` (on resume: drop steps done after the last
    complete checkpoint, which the resumed run will log again); no row left: no file."""
    p = Path(path)
    if not p.exists():
        return
    rows = [r for r in read_jsonl(p) if int(r.get("step", 0)) <= max_step]
    if rows:
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        p.unlink()


def deterministic_view(row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` without wall-clock and memory keys: what must match between a straight and a
    resumed run."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith((TIME_PREFIX, MEMORY_PREFIX)) and k not in NON_DETERMINISTIC_KEYS
    }


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (np.floating, np.integer)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


# -- end of a run ------------------------------------------------------------------------------


def write_final_report(
    out: Path, grid: Any, nrow: int, summary: Mapping[str, Any], logger: RunLogger
) -> dict[str, str]:
    """End of a run (rank 0): ``grid_after.png`` (.gif for videos), ``reward_curve.png`` and the
    printed base-vs-final table. ``grid``: images [N, C, H, W] (videos [N, C, F, H, W]), or
    (images, prompts, rewards[, sources]) to caption each row with its prompt and each image
    with its reward (an edit run's sources beside each image). Returns the figure paths."""
    images, captions, notes, sources = grid, None, None, None
    if isinstance(grid, tuple):
        images, captions, rewards, *rest = grid
        notes = reward_notes(rewards)
        sources = rest[0] if rest else None
    after = save_grid(images, out / "grid_after.png", nrow, captions, notes, sources)
    paths = {
        "grid_before": str(grid_path(out / "grid_before.png", images)),
        "grid_after": str(after),
        "reward_curve": str(
            plot_reward_curve(
                read_jsonl(out / "metrics.jsonl"),
                read_jsonl(out / "eval.jsonl"),
                out / "reward_curve.png",
            )
        ),
    }
    logger.close_progress()  # the bar ends once, above the table (not redrawn around it)
    logger.write(summary_table(summary["base"], summary["final"]))
    logger.write(
        f"{steps_done(summary['steps'], logger.start_step)}, {summary['wall_s']:.0f} s, "
        f"outputs in {out}"
    )
    return paths


def steps_done(last: int, start: int) -> str:
    """What this process trained: ``40 steps``; resumed: ``steps 31-40 (resumed at step 30)``;
    none: ``no step to train (the run had finished at step 40; its final weights evaluated
    again)``."""
    if start > 0 and last <= start:
        return (
            f"no step to train (the run had finished at step {last}; its final weights "
            "evaluated again)"
        )
    if start > 0:
        return f"steps {start + 1}-{last} (resumed at step {start})"
    return f"{last} steps"


def summary_table(base: Mapping[str, float], final: Mapping[str, float]) -> str:
    """A plain-text table of every ``eval/...`` metric: base model vs final model."""
    keys = [k for k in base if k.startswith("eval/") and k in final]
    width = max([len(k) for k in keys] + [6])
    lines = [f"{'metric':<{width}}  {'base':>8}  {'final':>8}  {'change':>8}"]
    lines.append("-" * len(lines[0]))
    for k in keys:
        b, f = float(base[k]), float(final[k])
        lines.append(f"{k:<{width}}  {b:8.3f}  {f:8.3f}  {f - b:+8.3f}")
    return "\n".join(lines)


def step_line(row: Mapping[str, Any], total: int, eta_s: float | None) -> str:
    """One printed line for a training step (the log without a progress bar):
    ``step 4/40  reward 0.612  loss 0.0031  eval 0.700  1.23 s/step  9.8 img/s/GPU  ETA 0:00:43``.
    """
    parts = [f"step {int(row['step'])}/{total}"]
    for key, label, fmt in (
        ("reward_mean", "reward", ".3f"),
        ("train/loss", "loss", ".4g"),
        ("eval/reward_mean", "eval", ".3f"),
        ("eval/accuracy", "acc", ".3f"),
        ("time/step_s", "", ".2f"),
        ("images_per_s_per_gpu", "", ".3g"),
    ):
        v = row.get(key)
        if isinstance(v, (int, float)):
            unit = {"time/step_s": " s/step", "images_per_s_per_gpu": " img/s/GPU"}.get(key, "")
            parts.append(f"{label} {v:{fmt}}".strip() + unit)
    if eta_s is not None:
        parts.append(f"ETA {_clock(eta_s)}")
    return "  ".join(parts)


def _clock(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def startup_banner(
    cfg: Any,
    *,
    world_size: int,
    device: str,
    trainable: int,
    total: int,
    output_dir: str | Path,
    resumed_from: str | Path | None = None,
    planned: str | None = None,
    num_frames: int | None = None,
) -> str:
    """What a run is about to do, printed once by rank 0 before the base eval: the algorithm,
    the ranks and how they split (replicas x FSDP shards x sequence-parallel groups), the
    trainable parameters, the images (videos of ``num_frames`` frames) of a step, the output
    folder and ``planned`` (the memory planner's line, when it can plan the model)."""
    fs, s = cfg.fsdp, cfg.sample
    lay = parallel_layout(world_size, fs.replicate_degree, fs.sp_degree)
    rep, sp, dp, shard = lay.replicate, lay.sp, lay.dp, lay.dp_shard
    images = s.prompts_per_step * s.group_size
    what = "images" if num_frames is None else "videos"
    if cfg.lora.enabled:
        how = f"LoRA r {cfg.lora.rank}, alpha {cfg.lora.alpha:g}"
    else:
        how = "full fine-tune"
    layout = f"{world_size} rank(s) on {device}: {rep} replica(s) x {shard} FSDP shard(s)"
    layout += f" x sequence-parallel {sp}" + (" (HSDP)" if rep > 1 else "")
    lines = [
        f"flowgrpo train: {cfg.algorithm} on {cfg.model.path} (preset {cfg.preset})",
        f"  ranks      {layout}; {dp} data-parallel rank(s)",
        f"  trainable  {trainable:,} of {total:,} parameters ({how})",
        f"  each step  {s.prompts_per_step} prompts x {s.group_size} samples = {images} {what}"
        f" ({images // dp} per data-parallel rank), {cfg.model.width}x{cfg.model.height} px"
        + ("" if num_frames is None else f", {num_frames} frames"),
        f"  steps      {cfg.trainer.max_steps} (eval every {cfg.trainer.eval_every}, "
        f"checkpoint every {cfg.trainer.save_every})",
        f"  output     {output_dir}",
    ]
    if planned is not None:
        lines.append(planned)
    if resumed_from is not None:
        lines.append(f"  resumed    from {resumed_from}")
    return "\n".join(lines)


# -- the per-run logger ----------------------------------------------------------------------

#: without the bar, a line at least this often (s) whatever ``log_every`` says
LINE_EVERY_S = 60.0


def wants_bar(requested: bool, stream: Any = None) -> bool:
    """Whether a run draws the progress bar: asked for (``run.progress_bar``) and its stream
    (stderr) is a terminal. A pipe or a log file gets plain step lines instead: a bar redrawn
    with carriage returns shows nothing there until the run ends."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return bool(requested and isatty is not None and isatty())


class RunLogger:
    """Writes metrics (jsonl always, every step; tensorboard / wandb every ``log_every`` steps
    and on eval steps) and drives a tqdm bar with step, reward and ETA; without the bar
    (``progress=False``, cluster logs) it prints one line every ``log_every`` steps instead.

    ``metrics.jsonl``: one object per training step; ``eval.jsonl``: one per evaluation
    (step 0 = base model). Both are flushed line by line so a killed run keeps what it logged.
    """

    def __init__(
        self,
        out_dir: str | Path,
        *,
        enabled: bool = True,
        total_steps: int = 0,
        start_step: int = 0,
        tensorboard: bool = True,
        wandb: str | bool | None = None,
        wandb_project: str = "flowgrpo",
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        progress: bool = True,
        log_every: int = 1,
    ) -> None:
        self.enabled = enabled
        self.log_every = max(1, int(log_every))
        self.out_dir = Path(out_dir)
        self._tb = None
        self._wandb = None
        self._bar = None
        self.total_steps, self.start_step = int(total_steps), int(start_step)
        self._t0 = self._last_line = time.perf_counter()
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # a run from step 0 logs its base eval again: rows of a run that stopped before its
        # first checkpoint go (a resumed run keeps the rows up to its checkpoint's step)
        keep = start_step if start_step > 0 else -1
        truncate_jsonl(self.out_dir / "metrics.jsonl", keep)
        truncate_jsonl(self.out_dir / "eval.jsonl", keep)
        self._files: dict[str, Any] = {}  # opened at their first row: a run that fails
        # before step 1 leaves no metrics.jsonl (which would mark the folder as a run's)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start_step + 1)
        mode = _wandb_mode(wandb)
        if mode is not None:
            try:
                import wandb as wandb_lib
            except ImportError as err:
                raise ImportError(
                    f"run.wandb={wandb!r} but wandb is not installed: pip install wandb, or "
                    "'flowgrpo[wandb]' (or set run.wandb=false)"
                ) from err
            argv = sys.argv
            sys.argv = [*argv[:1], *redact_args(argv[1:])]  # wandb records the command line
            try:
                self._wandb = wandb_lib.init(
                    project=wandb_project,
                    name=run_name,
                    mode=mode,
                    dir=str(self.out_dir),
                    config=redact(dict(config or {})),  # a reward's token never reaches wandb
                    resume="allow",
                )
            finally:
                sys.argv = argv
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                desc="flowgrpo",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                bar_format=BAR_FORMAT,
                disable=os.environ.get("FLOWGRPO_NO_PROGRESS") == "1",
            )

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        """One training step's metrics (must contain ``step``)."""
        if not self.enabled:
            return
        row = {k: _jsonable(v) for k, v in metrics.items()}
        self._append("metrics.jsonl", row)
        if int(row["step"]) % self.log_every == 0 or any(k.startswith("eval/") for k in row):
            self._scalars(row)
        if self._bar is not None:
            post = {"reward": f"{row.get('reward_mean', float('nan')):.3f}"}
            if "eval/accuracy" in row:
                post["acc"] = f"{row['eval/accuracy']:.3f}"
            elif "eval/reward_mean" in row:
                post["eval"] = f"{row['eval/reward_mean']:.3f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)
        elif (
            int(row["step"]) % self.log_every == 0
            or int(row["step"]) == self.total_steps
            or time.perf_counter() - self._last_line >= LINE_EVERY_S
        ):
            self._last_line = time.perf_counter()
            self.write(step_line(row, self.total_steps, self.eta_s(int(row["step"]))))

    def eta_s(self, step: int) -> float | None:
        """Seconds left after ``step``, at the mean pace of this process's steps so far."""
        done = step - self.start_step
        if done <= 0 or self.total_steps <= 0:
            return None
        return (time.perf_counter() - self._t0) / done * max(0, self.total_steps - step)

    def warn(self, text: str) -> None:
        """A ``warning: ...`` line (rank 0), without breaking the progress bar."""
        self.write(f"warning: {text}")

    def log_eval(self, metrics: Mapping[str, Any]) -> None:
        """One evaluation (``step`` + ``eval/...`` keys) to eval.jsonl (and tb/wandb at step 0,
        which has no training row)."""
        if not self.enabled:
            return
        row = {k: _jsonable(v) for k, v in metrics.items()}
        self._append("eval.jsonl", row)
        if int(row.get("step", 0)) == 0:
            self._scalars(row)

    def log_images(
        self,
        tag: str,
        images: torch.Tensor,
        step: int,
        nrow: int | None = None,
        prompts: Sequence[str] | None = None,
        rewards: Sequence[float] | None = None,
        sources: torch.Tensor | None = None,
    ) -> None:
        """An image grid [N, C, H, W] in [0, 1] (videos [N, C, F, H, W]: an animated GIF) to
        tensorboard / wandb, each row captioned with its prompt and each image with its reward
        when given; an edit run's ``sources`` (fitted to the images' size) beside each image. wandb also gets each image captioned "prompt | reward" and a per-prompt
        table (``TAG_table``: prompt, reward, image)."""
        if not self.enabled or (self._tb is None and self._wandb is None):
            return
        notes = None if rewards is None else reward_notes(rewards)
        if images.dim() == 5:
            self._log_video(tag, video_grid(images, nrow, prompts, notes), step)
        else:
            grid = make_grid(images, nrow, captions=prompts, notes=notes, sources=sources)
            if self._tb is not None:
                self._tb.add_image(tag, grid, step, dataformats="HWC")
            if self._wandb is not None:
                import wandb as wandb_lib

                self._wandb.log({tag: wandb_lib.Image(grid)}, step=step)
        if self._wandb is not None and prompts is not None:
            self._wandb_table(tag, images, step, prompts, rewards)

    def _wandb_table(self, tag, images, step, prompts, rewards) -> None:
        """Each eval image as its own captioned wandb image, and the per-prompt table."""
        import tempfile

        import wandb as wandb_lib

        columns = ["prompt", "reward", "image"]
        table, media = wandb_lib.Table(columns=columns), []
        with tempfile.TemporaryDirectory() as tmp:  # videos: GIF files, copied by wandb
            for i, img in enumerate(images):
                reward = None if rewards is None else float(rewards[i])
                caption = str(prompts[i]) + ("" if reward is None else f" | reward {reward:.3f}")
                if img.dim() == 4:  # a video [C, F, H, W]: a GIF (no moviepy needed)
                    path = Path(tmp) / f"video_{i}.gif"
                    path.write_bytes(
                        gif_bytes([g[2:-2, 2:-2] for g in video_grid(img[None], nrow=1)])
                    )
                    item = wandb_lib.Video(str(path), format="gif", caption=caption)
                else:
                    cell = make_grid(img[None], nrow=1)[2:-2, 2:-2]
                    item = wandb_lib.Image(cell, caption=caption)
                table.add_data(str(prompts[i]), reward, item)
                media.append(item)
            self._wandb.log({f"{tag}_captioned": media, f"{tag}_table": table}, step=step)

    def _log_video(self, tag: str, frames: list[np.ndarray], step: int) -> None:
        """An animated GIF grid: to tensorboard as an encoded image summary (what
        ``add_video`` writes, without its moviepy dependency), to wandb as a Video."""
        gif = gif_bytes(frames)
        if self._tb is not None:
            from tensorboard.compat.proto.summary_pb2 import Summary

            h, w = frames[0].shape[:2]
            image = Summary.Image(height=h, width=w, colorspace=3, encoded_image_string=gif)
            summary = Summary(value=[Summary.Value(tag=tag, image=image)])
            self._tb._get_file_writer().add_summary(summary, step)
        if self._wandb is not None:
            import tempfile

            import wandb as wandb_lib

            with tempfile.TemporaryDirectory() as tmp:  # wandb copies the file when logging
                path = Path(tmp) / "video.gif"
                path.write_bytes(gif)
                self._wandb.log({tag: wandb_lib.Video(str(path), format="gif")}, step=step)

    def _append(self, name: str, row: Mapping[str, Any]) -> None:
        """One JSON line to ``name`` in the run folder, flushed (a killed run keeps it)."""
        self.check_folder()
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(self.out_dir / name, "a")  # noqa: SIM115
        f.write(json.dumps(row) + "\n")
        f.flush()

    def check_folder(self) -> None:
        """RunError when the run folder, or a log file in it, was deleted while the run goes
        (its writes would vanish and the run would end as if all were well)."""
        from flowgrpo.errors import RunError

        gone = not self.out_dir.is_dir() or any(
            os.fstat(f.fileno()).st_nlink == 0 for f in self._files.values()
        )
        if gone:
            raise RunError(
                f"run.output_dir {self.out_dir} (or a log file in it) was deleted while the run "
                "was writing to it: its metrics are lost; start the run again"
            )

    def write(self, text: str) -> None:
        """Print without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def _scalars(self, row: Mapping[str, Any]) -> None:
        step = int(row.get("step", 0))
        nums = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self._tb is not None:
            for k, v in nums.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(nums, step=step)

    def close_progress(self) -> None:
        """Close the progress bar (idempotent): later ``write`` calls are plain prints."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """Close every output; RunError (``check_folder``) if the run folder went meanwhile."""
        if not self.enabled:
            return
        try:
            self.check_folder()
        finally:
            for f in self._files.values():
                f.close()
            self._files.clear()
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                self._wandb.finish()
            self.close_progress()


def _wandb_mode(value: str | bool | None) -> str | None:
    """run.wandb: false/None/"disabled" -> off; true/"online" -> online; "offline" -> offline."""
    if value in (None, False, "", "false", "disabled", "off", "none"):
        return None
    if value in (True, "true", "online"):
        return "online"
    if value == "offline":
        return "offline"
    raise ValueError(f"run.wandb must be false, true, 'online' or 'offline', got {value!r}")
