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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flowgrpo.config.secrets import redact, redact_args

TIME_PREFIX = "time/"
VIDEO_FPS = 8  # of the GIFs (flow_grpo writes its Wan videos at 8 fps too)
NON_DETERMINISTIC_KEYS = ("images_per_s",)  # with every "time/..." key: wall-clock figures


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
    complete checkpoint, which the resumed run will log again)."""
    p = Path(path)
    if not p.exists():
        return
    rows = [r for r in read_jsonl(p) if int(r.get("step", 0)) <= max_step]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))


def deterministic_view(row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` without wall-clock keys: what must match between a straight and a resumed run."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(TIME_PREFIX) and k not in NON_DETERMINISTIC_KEYS
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


def make_grid(images: torch.Tensor, nrow: int | None = None, min_cell: int = 64) -> np.ndarray:
    """images [N, C, H, W] in [0, 1] -> uint8 [rows*S, cols*S, 3] with square cells.

    Each image is padded to a square, then upscaled by an integer factor with nearest
    neighbour so that an 8x8 toy digit becomes crisp 64x64 pixels (S >= ``min_cell``). A 2-px
    grey border separates the cells.
    """
    if images.dim() != 4:
        raise ValueError(f"make_grid needs images [N, C, H, W], got {tuple(images.shape)}")
    x = images.detach().float().cpu().clamp(0, 1)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    n, _, h, w = x.shape
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
    grid = torch.full((3, rows * (cell + pad) + pad, cols * (cell + pad) + pad), 0.5)
    for i in range(n):
        r, c = divmod(i, cols)
        top, left = pad + r * (cell + pad), pad + c * (cell + pad)
        grid[:, top : top + cell, left : left + cell] = x[i]
    return (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


def video_grid(videos: torch.Tensor, nrow: int | None = None) -> list[np.ndarray]:
    """videos [N, C, F, H, W] in [0, 1] -> F grid frames (``make_grid`` of each frame)."""
    if videos.dim() != 5:
        raise ValueError(f"video_grid needs videos [N, C, F, H, W], got {tuple(videos.shape)}")
    return [make_grid(videos[:, :, f], nrow) for f in range(videos.shape[2])]


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


def save_grid(images: torch.Tensor, path: str | Path, nrow: int | None = None) -> Path:
    """Write ``make_grid(images, nrow)`` as a PNG, or videos [N, C, F, H, W] as an animated
    GIF beside it (``grid_path``); returns the path written."""
    from PIL import Image

    path = grid_path(path, images)
    path.parent.mkdir(parents=True, exist_ok=True)
    if images.dim() == 5:
        path.write_bytes(gif_bytes(video_grid(images, nrow)))
    else:
        Image.fromarray(make_grid(images, nrow)).save(path)
    return path


def save_images(images: torch.Tensor, out_dir: str | Path, stem: str = "sample") -> list[Path]:
    """One PNG per image [N, C, H, W] in [0, 1], or one animated GIF per video
    [N, C, F, H, W] (tiny ones upscaled like the grids)."""
    from PIL import Image

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
    out: Path, grid: torch.Tensor, nrow: int, summary: Mapping[str, Any], logger: RunLogger
) -> dict[str, str]:
    """End of a run (rank 0): ``grid_after.png`` (.gif for videos), ``reward_curve.png`` and the printed
    base-vs-final table. Returns the figure paths."""
    paths = {
        "grid_before": str(grid_path(out / "grid_before.png", grid)),
        "grid_after": str(save_grid(grid, out / "grid_after.png", nrow)),
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


# -- the per-run logger ----------------------------------------------------------------------


class RunLogger:
    """Writes metrics (jsonl always, every step; tensorboard / wandb every ``log_every`` steps
    and on eval steps) and drives a tqdm bar with step, reward and ETA.

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
        if not enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        truncate_jsonl(self.out_dir / "metrics.jsonl", start_step)
        truncate_jsonl(self.out_dir / "eval.jsonl", start_step)
        self._metrics = open(self.out_dir / "metrics.jsonl", "a")  # noqa: SIM115
        self._evals = open(self.out_dir / "eval.jsonl", "a")  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tensorboard"), purge_step=start_step + 1)
        mode = _wandb_mode(wandb)
        if mode is not None:
            try:
                import wandb as wandb_lib
            except ImportError as err:
                raise ImportError(
                    f"run.wandb={wandb!r} but wandb is not installed: pip install wandb "
                    "(or set run.wandb=false)"
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
                disable=os.environ.get("FLOWGRPO_NO_PROGRESS") == "1",
            )

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        """One training step's metrics (must contain ``step``)."""
        if not self.enabled:
            return
        row = {k: _jsonable(v) for k, v in metrics.items()}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
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

    def log_eval(self, metrics: Mapping[str, Any]) -> None:
        """One evaluation (``step`` + ``eval/...`` keys) to eval.jsonl (and tb/wandb at step 0,
        which has no training row)."""
        if not self.enabled:
            return
        row = {k: _jsonable(v) for k, v in metrics.items()}
        self._evals.write(json.dumps(row) + "\n")
        self._evals.flush()
        if int(row.get("step", 0)) == 0:
            self._scalars(row)

    def log_images(self, tag: str, images: torch.Tensor, step: int, nrow: int | None = None):
        """An image grid [N, C, H, W] in [0, 1] to tensorboard / wandb."""
        if not self.enabled or (self._tb is None and self._wandb is None):
            return
        if images.dim() == 5:
            self._log_video(tag, video_grid(images, nrow), step)
            return
        grid = make_grid(images, nrow)
        if self._tb is not None:
            self._tb.add_image(tag, grid, step, dataformats="HWC")
        if self._wandb is not None:
            import wandb as wandb_lib

            self._wandb.log({tag: wandb_lib.Image(grid)}, step=step)

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
        if not self.enabled:
            return
        for f in (self._metrics, self._evals):
            f.close()
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
