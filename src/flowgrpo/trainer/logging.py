"""Run logging: metrics.jsonl, tensorboard, optional wandb, a progress bar, and end-of-run
figures (reward curve, before/after image grids, a base-vs-final table). Videos
[N, C, F, H, W] become animated GIFs (PIL): grids, tensorboard, wandb and sample files.

Only rank 0 logs: every other rank gets a ``RunLogger(enabled=False)`` whose methods do
nothing. tensorboard and wandb are imported only when enabled; wandb's offline mode works
without a network (``run.wandb="offline"``).
"""

from __future__ import annotations

import io
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

TIME_PREFIX = "time/"
VIDEO_FPS = 8  # of the GIFs (flow_grpo writes its Wan videos at 8 fps too)
NON_DETERMINISTIC_KEYS = ("images_per_s", "images_per_s_per_gpu")  # and "time/", "memory/"
MEMORY_PREFIX = "memory/"  # peak memory figures (GiB): they vary with the allocator
PROMPT_INDEX = "prompts.jsonl"  # beside `flowgrpo sample` outputs: which prompt made which file
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


# -- image grids -----------------------------------------------------------------------------


def make_grid(
    images: torch.Tensor,
    nrow: int | None = None,
    min_cell: int = 64,
    captions: Sequence[str] | None = None,
    notes: Sequence[str] | None = None,
) -> np.ndarray:
    """images [N, C, H, W] in [0, 1] -> uint8 [rows*S, cols*S, 3] with square cells.

    Each image is padded to a square, then upscaled by an integer factor with nearest
    neighbour so that an 8x8 toy digit becomes crisp 64x64 pixels (S >= ``min_cell``). A 2-px
    grey border separates the cells. ``captions`` (one per image, e.g. its prompt) are written
    in a band above each row: once across the row when the row's images share it (a prompt's
    seeds), else above each cell; ``notes`` (one per image, e.g. its reward) in a band below
    each cell. Text too wide for its space is shortened with "...".
    """
    if images.dim() != 4:
        raise ValueError(f"make_grid needs images [N, C, H, W], got {tuple(images.shape)}")
    x = images.detach().float().cpu().clamp(0, 1)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    n, _, h, w = x.shape
    for name, texts in (("captions", captions), ("notes", notes)):
        if texts is not None and len(texts) != n:
            raise ValueError(f"make_grid: {len(texts)} {name} for {n} images")
    side = max(h, w)
    if h != w:  # centre on a square canvas
        canvas = torch.zeros(n, 3, side, side)
        top, left = (side - h) // 2, (side - w) // 2
        canvas[:, :, top : top + h, left : left + w] = x
        x = canvas
    scale = max(1, math.ceil(min_cell / side))
    if scale > 1:
        x = x.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
    cell = side * scale
    cols = nrow or max(1, math.ceil(math.sqrt(n)))
    rows = max(1, math.ceil(n / cols))
    pad = 2
    font = _font() if captions is not None or notes is not None else None
    cap_h = _text_height(font) if captions is not None else 0
    note_h = _text_height(font) if notes is not None else 0
    row_h = cap_h + cell + note_h + pad
    grid = torch.full((3, rows * row_h + pad, cols * (cell + pad) + pad), 0.5)
    for i in range(n):
        r, c = divmod(i, cols)
        top, left = pad + r * row_h + cap_h, pad + c * (cell + pad)
        grid[:, top : top + cell, left : left + cell] = x[i]
    out = (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    if font is None:
        return out
    from PIL import Image, ImageDraw

    pil = Image.fromarray(out)
    draw = ImageDraw.Draw(pil)
    for r in range(rows):
        members = list(range(r * cols, min(n, (r + 1) * cols)))
        top = pad + r * row_h
        if captions is not None:
            if len({captions[i] for i in members}) == 1:  # one prompt across the row
                spans = [(members[0], len(members))]
            else:
                spans = [(i, 1) for i in members]
            for i, k in spans:
                left = pad + (i % cols) * (cell + pad)
                _draw_text(draw, (left, top), k * (cell + pad) - pad, captions[i], font)
        if notes is not None:
            for i in members:
                left = pad + (i % cols) * (cell + pad)
                _draw_text(draw, (left, top + cap_h + cell), cell, notes[i], font)
    return np.asarray(pil)


def _font() -> Any:
    from PIL import ImageFont

    return ImageFont.load_default()


def _text_height(font: Any) -> int:
    """Height of a one-line text band in ``font`` (a 2-px margin above and below)."""
    top, bottom = font.getbbox("Ag")[1::2]
    return int(bottom) + max(0, int(top)) + 4


def _draw_text(draw: Any, at: tuple[int, int], width: int, text: str, font: Any) -> None:
    """``text`` in white at ``at`` (+2 px margins), shortened with "..." to fit ``width``."""
    room = width - 4
    text = " ".join(str(text).split())
    if draw.textlength(text, font=font) > room:
        while text and draw.textlength(text + "...", font=font) > room:
            text = text[:-1]
        text = text + "..." if text else ""
    if text:
        draw.text((at[0] + 2, at[1] + 2), text, fill=(255, 255, 255), font=font)


def video_grid(
    videos: torch.Tensor,
    nrow: int | None = None,
    captions: Sequence[str] | None = None,
    notes: Sequence[str] | None = None,
) -> list[np.ndarray]:
    """videos [N, C, F, H, W] in [0, 1] -> F grid frames (``make_grid`` of each frame, with
    its ``captions`` / ``notes``)."""
    if videos.dim() != 5:
        raise ValueError(f"video_grid needs videos [N, C, F, H, W], got {tuple(videos.shape)}")
    return [
        make_grid(videos[:, :, f], nrow, captions=captions, notes=notes)
        for f in range(videos.shape[2])
    ]


def gif_bytes(frames: list[np.ndarray], fps: int = VIDEO_FPS) -> bytes:
    """uint8 [H, W, 3] frames -> an animated GIF that loops (PIL; diffusers' export_to_gif)."""
    from PIL import Image

    pils = [Image.fromarray(f) for f in frames]
    buf = io.BytesIO()
    pils[0].save(
        buf,
        format="GIF",
        save_all=True,
        append_images=pils[1:],
        duration=max(1, round(1000 / fps)),
        loop=0,
    )
    return buf.getvalue()


def grid_path(path: str | Path, images: torch.Tensor) -> Path:
    """Where ``save_grid`` writes ``images``: ``path`` as .png, or as .gif for videos."""
    path = Path(path)
    return path.with_suffix(".gif") if images.dim() == 5 else path


def save_grid(
    images: torch.Tensor,
    path: str | Path,
    nrow: int | None = None,
    captions: Sequence[str] | None = None,
    notes: Sequence[str] | None = None,
) -> Path:
    """Write ``make_grid(images, nrow, captions=..., notes=...)`` as a PNG, or videos
    [N, C, F, H, W] as an animated GIF beside it (``grid_path``); returns the path written."""
    from PIL import Image

    path = grid_path(path, images)
    path.parent.mkdir(parents=True, exist_ok=True)
    if images.dim() == 5:
        path.write_bytes(gif_bytes(video_grid(images, nrow, captions, notes)))
    else:
        Image.fromarray(make_grid(images, nrow, captions=captions, notes=notes)).save(path)
    return path


def save_images(
    images: torch.Tensor,
    out_dir: str | Path,
    stem: str = "sample",
    prompts: Sequence[str] | None = None,
) -> list[Path]:
    """One PNG per image [N, C, H, W] in [0, 1], or one animated GIF per video
    [N, C, F, H, W] (tiny ones upscaled like the grids). With ``prompts`` (one per image),
    ``prompts.jsonl`` beside them says which prompt made which file: one
    ``{"file", "index", "prompt"}`` object per image, in order."""
    from PIL import Image

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if prompts is not None and len(prompts) != len(images):
        raise ValueError(f"save_images: {len(prompts)} prompts for {len(images)} images")
    paths = []
    for i, img in enumerate(images):
        if img.dim() == 4:  # a video [C, F, H, W]
            p = out_dir / f"{stem}_{i:04d}.gif"
            p.write_bytes(gif_bytes([g[2:-2, 2:-2] for g in video_grid(img[None], nrow=1)]))
        else:
            p = out_dir / f"{stem}_{i:04d}.png"
            arr = make_grid(img[None], nrow=1)[2:-2, 2:-2]  # strip the border
            Image.fromarray(arr).save(p)
        paths.append(p)
    if prompts is not None:
        rows = [
            {"file": p.name, "index": i, "prompt": str(t)}
            for i, (p, t) in enumerate(zip(paths, prompts))
        ]
        (out_dir / PROMPT_INDEX).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


# -- end-of-run figures ----------------------------------------------------------------------


def plot_reward_curve(
    metrics: list[dict[str, Any]], evals: list[dict[str, Any]], path: str | Path
) -> Path:
    """Training reward (and eval reward / accuracy when logged) against step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    tr = [(r["step"], r["reward_mean"]) for r in metrics if r.get("reward_mean") is not None]
    if tr:
        ax.plot(*zip(*tr), label="train reward (mean)", color="tab:blue", alpha=0.8)
    for key, color in (
        ("eval/reward_mean", "tab:orange"),
        ("eval/accuracy", "tab:green"),
        ("eval/judge_accuracy", "tab:red"),
    ):
        pts = [(r["step"], r[key]) for r in evals if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", label=key, color=color, markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("reward / accuracy")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_final_report(
    out: Path, grid: Any, nrow: int, summary: Mapping[str, Any], logger: RunLogger
) -> dict[str, str]:
    """End of a run (rank 0): ``grid_after.png`` (.gif for videos), ``reward_curve.png`` and the
    printed base-vs-final table. ``grid``: images [N, C, H, W] (videos [N, C, F, H, W]), or
    (images, prompts, rewards) to caption each row with its prompt and each image with its
    reward. Returns the figure paths."""
    images, captions, notes = grid, None, None
    if isinstance(grid, tuple):
        images, captions, rewards = grid
        notes = [f"{float(r):.3f}" for r in rewards]
    paths = {
        "grid_before": str(grid_path(out / "grid_before.png", images)),
        "grid_after": str(save_grid(images, out / "grid_after.png", nrow, captions, notes)),
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
    logger.write(f"{summary['steps']} steps, {summary['wall_s']:.0f} s, outputs in {out}")
    return paths


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
) -> str:
    """What a run is about to do, printed once by rank 0 before the base eval: the algorithm,
    the ranks and how they split (replicas x FSDP shards x sequence-parallel groups), the
    trainable parameters, the images of a step, the output folder and ``planned`` (the memory
    planner's line, when it can plan the model)."""
    fs, s = cfg.fsdp, cfg.sample
    lay = parallel_layout(world_size, fs.replicate_degree, fs.sp_degree)
    rep, sp, dp, shard = lay.replicate, lay.sp, lay.dp, lay.dp_shard
    images = s.prompts_per_step * s.group_size
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
        f"  each step  {s.prompts_per_step} prompts x {s.group_size} samples = {images} images"
        f" ({images // dp} per data-parallel rank), {cfg.model.width}x{cfg.model.height} px",
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
        self._t0 = time.perf_counter()
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
        elif int(row["step"]) % self.log_every == 0 or int(row["step"]) == self.total_steps:
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
    ) -> None:
        """An image grid [N, C, H, W] in [0, 1] (videos [N, C, F, H, W]: an animated GIF) to
        tensorboard / wandb, each row captioned with its prompt and each image with its reward
        when given. wandb also gets each image captioned "prompt | reward" and a per-prompt
        table (``TAG_table``: prompt, reward, image)."""
        if not self.enabled or (self._tb is None and self._wandb is None):
            return
        notes = None if rewards is None else [f"{float(r):.3f}" for r in rewards]
        if images.dim() == 5:
            self._log_video(tag, video_grid(images, nrow, prompts, notes), step)
        else:
            grid = make_grid(images, nrow, captions=prompts, notes=notes)
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
