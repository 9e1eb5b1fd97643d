"""Image figures of a run: captioned eval grids (``make_grid``), videos [N, C, F, H, W] as
animated GIFs (PIL), the PNG/GIF files of ``flowgrpo sample`` with their prompt index, and the
reward curve. Pure functions of their inputs; ``trainer.logging`` writes them where a run logs.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

VIDEO_FPS = 8  # of the GIFs (flow_grpo writes its Wan videos at 8 fps too)
PROMPT_INDEX = "prompts.jsonl"  # beside `flowgrpo sample` outputs: which prompt made which file


# -- image grids -----------------------------------------------------------------------------


def make_grid(
    images: torch.Tensor,
    nrow: int | None = None,
    min_cell: int = 64,
    captions: Sequence[str] | None = None,
    notes: Sequence[str] | None = None,
    sources: torch.Tensor | None = None,
) -> np.ndarray:
    """images [N, C, H, W] in [0, 1] -> uint8 [rows*S, cols*S, 3] with square cells.

    Each image is padded to a square, then upscaled by an integer factor with nearest
    neighbour so that an 8x8 toy digit becomes crisp 64x64 pixels (S >= ``min_cell``). A 2-px
    grey border separates the cells. ``captions`` (one per image, e.g. its prompt) are written
    in a band above each row: once across the row when the row's images share it (a prompt's
    seeds), else above each cell; ``notes`` (one per image, e.g. its reward) in a band below
    each cell. Text too wide for its space is shortened with "...".

    ``sources`` [N, C, H, W] (an edit run's source images, fitted to the results' size with
    ``fit_image``): each cell shows source | result side by side, S x 2S, the source on the left
    (squared and upscaled like its result).
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
    if sources is not None and (sources.shape[0], *sources.shape[2:]) != (n, h, w):
        raise ValueError(
            f"make_grid: sources {tuple(sources.shape)} for images {tuple(images.shape)} "
            "(fit them to the images' size first: fit_image)"
        )
    side = max(h, w)
    scale = max(1, math.ceil(min_cell / side))
    cell = side * scale
    x = _square_cells(x, scale)
    if sources is not None:  # source | result: one cell two squares wide
        s = _square_cells(sources.detach().float().cpu().clamp(0, 1).expand(-1, 3, -1, -1), scale)
        x = torch.cat([s, x], dim=3)
    cell_w = x.shape[-1]
    cols = nrow or max(1, math.ceil(math.sqrt(n)))
    rows = max(1, math.ceil(n / cols))
    pad = 2
    font = _font() if captions is not None or notes is not None else None
    cap_h = _text_height(font) if captions is not None else 0
    note_h = _text_height(font) if notes is not None else 0
    row_h = cap_h + cell + note_h + pad
    grid = torch.full((3, rows * row_h + pad, cols * (cell_w + pad) + pad), 0.5)
    for i in range(n):
        r, c = divmod(i, cols)
        top, left = pad + r * row_h + cap_h, pad + c * (cell_w + pad)
        grid[:, top : top + cell, left : left + cell_w] = x[i]
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
                left = pad + (i % cols) * (cell_w + pad)
                _draw_text(draw, (left, top), k * (cell_w + pad) - pad, captions[i], font)
        if notes is not None:
            for i in members:
                left = pad + (i % cols) * (cell_w + pad)
                _draw_text(draw, (left, top + cap_h + cell), cell_w, notes[i], font)
    return np.asarray(pil)


def _square_cells(x: torch.Tensor, scale: int) -> torch.Tensor:
    """[N, 3, H, W] centred on square canvases, upscaled ``scale`` x (nearest neighbour)."""
    n, _, h, w = x.shape
    side = max(h, w)
    if h != w:  # centre on a square canvas
        canvas = torch.zeros(n, 3, side, side)
        top, left = (side - h) // 2, (side - w) // 2
        canvas[:, :, top : top + h, left : left + w] = x
        x = canvas
    if scale > 1:
        x = x.repeat_interleave(scale, dim=2).repeat_interleave(scale, dim=3)
    return x


def fit_image(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[C, h, w] -> [C, ``height``, ``width``]: scaled to fit (aspect kept, antialiased
    bilinear), centred on black; unchanged when already that size. How an edit's source image
    is shown beside its result."""
    c, h, w = image.shape
    if (h, w) == (height, width):
        return image
    f = min(height / h, width / w)
    nh, nw = max(1, round(h * f)), max(1, round(w * f))
    small = torch.nn.functional.interpolate(
        image[None].float(), size=(nh, nw), mode="bilinear", antialias=True, align_corners=False
    )[0]
    out = image.new_zeros((c, height, width), dtype=small.dtype)
    top, left = (height - nh) // 2, (width - nw) // 2
    out[:, top : top + nh, left : left + nw] = small
    return out


def fitted_sources(
    rows: Sequence[Sequence[torch.Tensor]] | None, height: int, width: int
) -> torch.Tensor | None:
    """Each sample's first source image fitted to the results' size -> [N, 3, H, W] in
    [0, 1] (what ``make_grid(sources=)`` shows beside each result), or None without any."""
    if rows is None:
        return None
    blank = torch.zeros(3, height, width)
    return torch.stack(
        [fit_image(r[0].float().clamp(0, 1), height, width) if r else blank for r in rows]
    )


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
    sources: torch.Tensor | None = None,
) -> Path:
    """Write ``make_grid(images, nrow, captions=..., notes=..., sources=...)`` as a PNG, or
    videos [N, C, F, H, W] as an animated GIF beside it (``grid_path``); returns the path
    written."""
    from PIL import Image

    path = grid_path(path, images)
    path.parent.mkdir(parents=True, exist_ok=True)
    if images.dim() == 5:
        path.write_bytes(gif_bytes(video_grid(images, nrow, captions, notes)))
    else:
        grid = make_grid(images, nrow, captions=captions, notes=notes, sources=sources)
        Image.fromarray(grid).save(path)
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


def reward_notes(rewards: Sequence[float]) -> list[str]:
    """Each grid image's note: its reward, 3 decimals."""
    return [f"{float(r):.3f}" for r in rewards]
