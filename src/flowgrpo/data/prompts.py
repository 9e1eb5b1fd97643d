"""Prompt datasets and the distributed K-repeat sampler.

Files: ``.txt`` (one prompt a line, blank lines skipped), ``.jsonl`` (a ``prompt`` field; every
other field goes to the prompt's metadata dict, which rewards receive, e.g. an OCR target) and
``.parquet`` (same columns; needs pyarrow); editing: a record's ``image`` (a path relative to
the file) or ``images`` (a list of them) names its source images, whose headers are checked
when the file loads (nothing is decoded then); ``select`` decodes them when a batch needs them
(each distinct source once, a group's samples sharing it) into the sample's metadata as
``source_images``, a list of [3, H, W] tensors in [0, 1], decoded as diffusers' ``load_image``
does (``load_image``); ``builtin:NAME`` names a set shipped in the package
(``builtin:digits``, the toy's). Lines are split on "\\n" only (``text_lines``).

``KRepeatSampler``: each step draws m prompts (epoch-wise shuffles without replacement), repeats
each K times (a group) and shuffles the m*K samples; ``rank_slice`` gives rank r its contiguous
slice. A step's draw is a pure function of (seed, step), so resuming only needs the step.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from flowgrpo.settings import BUILTIN

_SALT_EPOCH = 0x0E90C4  # stream of the per-epoch prompt permutations
_SALT_STEP = 0x57E9  # stream of the per-step sample shuffles
_SALT_SPLIT = 0x5A117  # stream of the train/eval split


@dataclass
class PromptDataset:
    """Prompts with one metadata dict each; ``source`` names where they came from and
    ``locations`` where each row did ("file:line"), for errors that name the culprit;
    ``images`` each row's source image paths (editing; empty tuples: text only)."""

    prompts: list[str]
    metadata: list[dict[str, Any]] = field(default_factory=list)
    source: str = "<memory>"
    locations: list[str] = field(default_factory=list)
    images: list[tuple[str, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if not self.images:
            self.images = [() for _ in self.prompts]
        if not self.locations:
            self.locations = [f"{self.source} prompt {i + 1}" for i in range(len(self.prompts))]
        if not len(self.metadata) == len(self.locations) == len(self.images) == len(self.prompts):
            raise ValueError(
                f"{self.source}: {len(self.prompts)} prompts but {len(self.metadata)} metadata"
            )

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> tuple[str, dict[str, Any]]:
        return self.prompts[i], self.metadata[i]

    @property
    def has_images(self) -> bool:
        """True when any row carries source images (an editing data set)."""
        return any(self.images)

    def select(self, indices: Sequence[int]) -> tuple[list[str], list[dict[str, Any]]]:
        """(prompts, metadata copies) at ``indices`` (repeats allowed); a row with source
        images gets them decoded as ``metadata["source_images"]`` ([3, H, W] in [0, 1]):
        each distinct row once per call, its repeats (a group's samples) sharing the tensors
        (read-only: nothing may modify them in place)."""
        meta, decoded = [], {}
        for i in indices:
            m = dict(self.metadata[i])
            if self.images[i]:
                if i not in decoded:
                    decoded[i] = self.decode(i)
                m["source_images"] = list(decoded[i])
            meta.append(m)
        return [self.prompts[i] for i in indices], meta

    def decode(self, i: int) -> list[Any]:
        """Row ``i``'s source images decoded ([3, H, W] in [0, 1]); ValueError naming the
        prompt file's line and the image when one cannot be decoded (the file's load checked
        headers only)."""
        out = []
        for p in self.images[i]:
            try:
                out.append(load_image(p))
            except ValueError as e:
                raise ValueError(f"{self.locations[i]}: {e}") from None
        return out

    def sources(self, indices: Sequence[int]) -> SourceRows | None:
        """The source images of rows ``indices`` as a sequence that decodes a row when it is
        read (``sample --prompt-file``: a batch at a time); None when no row has any."""
        if not any(self.images[i] for i in indices):
            return None
        return SourceRows(self, list(indices))

    def subset(self, indices: Sequence[int]) -> PromptDataset:
        p = [self.prompts[i] for i in indices]
        m = [dict(self.metadata[i]) for i in indices]
        return PromptDataset(
            p,
            m,
            self.source,
            [self.locations[i] for i in indices],
            [self.images[i] for i in indices],
        )


class SourceRows(Sequence):
    """Rows of a dataset's source images, each decoded when read (``PromptDataset.sources``):
    ``rows[i]`` a list of [3, H, W] tensors, ``rows[a:b]`` a list of such lists."""

    def __init__(self, ds: PromptDataset, indices: list[int]):
        self.ds, self.indices = ds, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self.ds.decode(j) for j in self.indices[i]]
        return self.ds.decode(self.indices[i])


#: PIL modes whose pixels have no fixed range to read as [0, 1]
_NO_RANGE = {"I": "32-bit integer", "F": "32-bit float"}
#: 16-bit greyscale (PNG, TIFF): read at full range (``convert("RGB")`` would clip at 255)
_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")


class _Refused(ValueError):
    """An image that decodes but cannot be read right (its message names the file)."""


def _check_mode(im: Any, path: str | Path) -> None:
    """_Refused when ``im``'s pixels cannot be read as [0, 1] without guessing a range."""
    if im.mode in _NO_RANGE and not (im.mode == "I" and im.format == "PNG"):
        raise _Refused(
            f"image {path} has {_NO_RANGE[im.mode]} pixels (PIL mode {im.mode!r}), which have "
            "no fixed range to read as [0, 1]: save it as an 8- or 16-bit PNG or a JPEG"
        )


def check_image(path: str | Path) -> None:
    """The image's header only (format, size, mode; no pixels decoded): ValueError when it
    is no image PIL reads or its pixels have no fixed range (``load_image`` refuses it)."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            _check_mode(im, path)
    except _Refused:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure is the file's
        raise ValueError(f"image {path} cannot be decoded ({_why(e)})") from None


def _why(e: Exception) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def load_image(path: str | Path) -> Any:
    """An image file as a [3, H, W] float32 tensor in [0, 1] (RGB), decoded as diffusers'
    ``load_image`` does (EXIF orientation applied, ``convert("RGB")``: alpha dropped, palette
    and greyscale expanded); 16-bit greyscale at its full range (/65535, where
    ``convert("RGB")`` clips at 255). ValueError naming the file when it cannot be decoded
    or its pixels (float, 32-bit integer) have no fixed range."""
    import torch
    from PIL import Image, ImageOps

    try:
        with Image.open(path) as im:
            _check_mode(im, path)
            im = ImageOps.exif_transpose(im)  # as diffusers.utils.load_image
            if im.mode in _SIXTEEN_BIT or im.mode == "I":  # "I": a 16-bit PNG (_check_mode)
                grey = np.asarray(im).astype(np.float32)
                grey /= 65535.0
                arr = np.repeat(grey[None], 3, axis=0)
            else:  # [3, H, W] float32 in one copy of the pixels (a 6000² source: 432 MB)
                arr = np.ascontiguousarray(
                    np.asarray(im.convert("RGB")).transpose(2, 0, 1), dtype=np.float32
                )
                arr /= 255.0
    except _Refused:
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure is the file's
        raise ValueError(f"image {path} cannot be decoded ({_why(e)})") from None
    return torch.from_numpy(arr)


def source_images(metadata: Sequence[dict[str, Any]]) -> list[list[Any]] | None:
    """Each sample's ``source_images`` (editing), or None when no sample has any."""
    rows = [list(m.get("source_images") or []) for m in metadata]
    return rows if any(rows) else None


def _image_paths(row: dict[str, Any], base: Path, where: str) -> tuple[str, ...]:
    """A record's ``image`` / ``images`` as checked absolute paths (each an image file whose
    header PIL reads and whose pixels have a fixed range; decoded only when a batch needs it)."""
    if "image" in row and "images" in row:
        raise ValueError(f"{where}: give 'image' or 'images', not both")
    raw = row.get("image", row.get("images"))
    if raw is None:
        return ()
    names = [raw] if isinstance(raw, str) else raw
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"{where}: 'image' must be a path and 'images' a non-empty list of paths, got {raw!r}"
        )
    out = []
    for name in names:
        p = (base / name).expanduser()
        if not p.is_file():
            raise ValueError(f"{where}: image {p} {not_a_file(p)}")
        try:
            check_image(p)  # the header only: a batch decodes it (``select``)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        out.append(str(p))
    return tuple(out)


def not_a_file(path: Path, kind: str = "an image") -> str:
    """Why ``path`` is no readable file, for "<path> <why>": a directory, a symlink loop, a
    broken symlink (and its target), or not found (``kind``: "an image", "a prompt")."""
    import errno
    import os

    if path.is_dir():
        return f"is a directory, not {kind} file"
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:  # Python < 3.13 says "Symlink loop" so
            return "is a symlink loop"
        except OSError as e:
            if e.errno == errno.ELOOP:
                return "is a symlink loop"
            return f"is a broken symlink (to {os.readlink(path)})"
    if path.exists():
        return f"is not a regular file (it cannot be read as {kind} file)"
    return "not found"


#: prompt sets shipped in the package: ``builtin:NAME`` -> a function returning the dataset
#: (import paths as strings: nothing below the toy package imports it)
BUILTIN_PROMPTS: dict[str, str] = {"digits": "flowgrpo.toy.data:digit_prompt_set"}


def builtin_prompts(name: str) -> PromptDataset:
    """The shipped prompt set ``name`` (ValueError listing the known ones otherwise)."""
    import importlib

    if name not in BUILTIN_PROMPTS:
        known = ", ".join(BUILTIN + n for n in BUILTIN_PROMPTS)
        raise ValueError(f"no built-in prompt set {BUILTIN + name!r}; built-in: {known}")
    module, _, attr = BUILTIN_PROMPTS[name].partition(":")
    return getattr(importlib.import_module(module), attr)()


def read_text(path: str | Path) -> str:
    """A prompt file's text as UTF-8 (a leading BOM dropped); ValueError naming the file, the
    line and the offending byte otherwise (Python's own error names neither file nor line)."""
    raw = Path(path).expanduser().read_bytes()
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}); save the file as UTF-8"
        ) from None


def _from_records(rows: list[tuple[int, Any]], path: Path, unit: str) -> PromptDataset:
    """rows: (line or row number, record) -> dataset; errors name ``path`` and the number."""
    prompts, meta, where_all, images = [], [], [], []
    for n, row in rows:
        where = f"{path}:{n}" if unit == "line" else f"{path} row {n}"
        where_all.append(where)
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object with a 'prompt' field")
        if "prompt" not in row:
            raise ValueError(f"{where}: missing 'prompt' field (has {sorted(row)[:8]})")
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
        prompts.append(prompt)
        meta.append({k: v for k, v in row.items() if k != "prompt"})
        images.append(_image_paths(row, path.parent, where))
    return PromptDataset(prompts, meta, str(path), where_all, images)


def text_lines(text: str) -> list[str]:
    """A file's lines split on "\\n" only, a trailing "\\r" dropped: ``str.splitlines`` also
    splits on U+2028, U+0085, \\v, \\f and others, which may sit inside a prompt (and, raw,
    inside a JSON string), and would shift every later line number."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [s[:-1] if s.endswith("\r") else s for s in lines]


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: a key given twice is an error (JSON keeps the last)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


class _DuplicateKey(Exception):
    pass


def _surrogate_field(value: Any) -> bool:
    """True when ``value`` (a JSON value) holds a string with a lone surrogate (a "\\ud800"
    escape without its pair): not text, which no tokenizer or UTF-8 file can take."""
    if isinstance(value, str):
        return any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(_surrogate_field(k) or _surrogate_field(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_surrogate_field(v) for v in value)
    return False


def _load_jsonl(path: Path) -> PromptDataset:
    rows = []
    for n, line in enumerate(text_lines(read_text(path)), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        except _DuplicateKey as e:
            raise ValueError(
                f"{path}:{n}: duplicate key {e.args[0]!r} in the record (JSON would keep the "
                "last silently): give each key once"
            ) from None
        if isinstance(row, dict):
            for key, value in row.items():
                if _surrogate_field(key) or _surrogate_field(value):
                    raise ValueError(
                        f"{path}:{n}: field {key!r} holds a lone surrogate (a \\ud800-\\udfff "
                        "escape without its pair), which is not text: fix the escape"
                    )
        rows.append((n, row))
    return _from_records(rows, path, "line")


def _load_parquet(path: Path) -> PromptDataset:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{path}: reading .parquet needs pyarrow (pip install 'flowgrpo[parquet]'), or convert it to .jsonl"
        ) from None
    return _from_records(list(enumerate(pq.read_table(path).to_pylist())), path, "row")


def load_prompts(path: str | Path) -> PromptDataset:
    """A PromptDataset from a .txt, .jsonl or .parquet file.

    Raises FileNotFoundError for a missing file, ValueError (naming file and line) for an
    empty file, text that is not UTF-8, a bad JSON line or a row without a ``prompt``.
    """
    if str(path).startswith(BUILTIN):
        return builtin_prompts(str(path)[len(BUILTIN) :])
    p = Path(path).expanduser()
    if not p.is_file():
        what = not_a_file(p, "a prompt")
        if what == "not found":
            raise FileNotFoundError(f"prompt file not found: {path}")
        raise ValueError(f"prompt file {path} {what}")
    suffix = p.suffix.lower()
    if suffix == ".txt":
        lines = [(n, s.strip()) for n, s in enumerate(text_lines(read_text(p)), 1) if s.strip()]
        ds = PromptDataset(
            [s for _, s in lines], source=str(p), locations=[f"{p}:{n}" for n, _ in lines]
        )
    elif suffix == ".jsonl":
        ds = _load_jsonl(p)
    elif suffix == ".parquet":
        ds = _load_parquet(p)
    else:
        raise ValueError(f"unsupported prompt file {path}: use .txt, .jsonl or .parquet")
    if not len(ds):
        raise ValueError(f"prompt file {path} contains no prompts")
    return ds


def split_dataset(
    ds: PromptDataset, eval_fraction: float, seed: int = 0
) -> tuple[PromptDataset, PromptDataset]:
    """(train, eval): a seeded random ``eval_fraction`` of the prompts held out (at least one,
    and at least one left for training); fraction 0 gives (ds, ds)."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if eval_fraction == 0:
        return ds, ds
    if len(ds) < 2:
        raise ValueError(f"{ds.source}: cannot split {len(ds)} prompt(s) into train and eval")
    n_eval = min(len(ds) - 1, max(1, round(len(ds) * eval_fraction)))
    perm = np.random.default_rng([seed, _SALT_SPLIT]).permutation(len(ds))
    ev, tr = sorted(perm[:n_eval].tolist()), sorted(perm[n_eval:].tolist())
    return ds.subset(tr), ds.subset(ev)


def prompt_splits(data: Any, seed: int = 0) -> tuple[PromptDataset, PromptDataset]:
    """(train, eval) datasets for a ``DataConfig``-like object (train_prompts, eval_prompts,
    eval_fraction, eval_num_prompts). Eval: ``eval_prompts`` if given, else a held-out ``eval_fraction``, else the train
    prompts; then the first ``eval_num_prompts`` (0 = all)."""
    if not data.train_prompts:
        raise ValueError("data.train_prompts is required: a prompt file or a built-in set")
    train = load_prompts(data.train_prompts)
    if data.eval_prompts:
        ev = load_prompts(data.eval_prompts)
    else:
        train, ev = split_dataset(train, float(data.eval_fraction or 0.0), seed)
    n = int(getattr(data, "eval_num_prompts", 0) or 0)
    if 0 < n < len(ev):
        ev = ev.subset(range(n))
    return train, ev


def repeat_for_eval(ds: PromptDataset, samples_per_prompt: int) -> PromptDataset:
    """Each eval prompt ``samples_per_prompt`` times in a row (fixed order: p0 p0 .. p1 p1 ..)."""
    idx = [i for i in range(len(ds)) for _ in range(samples_per_prompt)]
    return ds.subset(idx)


def check_divides(n: int, world_size: int) -> None:
    """ValueError when a step's ``n`` samples do not divide evenly over ``world_size``
    data-parallel ranks (each rank takes an equal share, ``rank_slice``)."""
    if n % world_size:
        raise ValueError(
            f"the global batch (sample.prompts_per_step x sample.group_size = {n} images per "
            f"step) must divide evenly over {world_size} data-parallel ranks (the world size / "
            "fsdp.sp_degree): adjust sample.prompts_per_step or sample.group_size"
        )


def rank_slice(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, count): rank ``rank``'s equal, contiguous share of a step's ``n`` samples;
    ValueError when ``n`` does not divide over the ranks (``check_divides``)."""
    check_divides(n, world_size)
    count = n // world_size
    return rank * count, count


class KRepeatSampler:
    """m prompts x K samples per step (the global draw; ``rank_slice`` gives a rank its share).

    ``global_step_samples(step)`` -> (indices, group_ids) of all m*K samples: dataset indices
    and group ids in [0, m) (the prompt's slot in the step, so a prompt drawn twice in one step,
    possible only when m > num_prompts, forms two groups). Prompts are drawn epoch by epoch: a
    seeded permutation of all prompts per epoch (identity when ``shuffle=False``), m at a time
    (see ``step_prompts``). The m*K samples are then shuffled with a step-seeded permutation,
    so a group's K samples spread over ranks; with ``whole_groups`` (branching rollouts, whose
    group is one tree) the groups are shuffled instead and each keeps its K samples
    consecutive. A step's draw depends only on (seed, step).
    """

    def __init__(
        self,
        num_prompts: int,
        prompts_per_step: int,
        group_size: int,
        seed: int = 0,
        shuffle: bool = True,
        whole_groups: bool = False,
    ) -> None:
        if num_prompts < 1:
            raise ValueError(f"KRepeatSampler needs at least one prompt, got {num_prompts}")
        if prompts_per_step < 1 or group_size < 1:
            raise ValueError(
                f"prompts_per_step and group_size must be >= 1, got {prompts_per_step}, "
                f"{group_size}"
            )
        self.num_prompts, self.m, self.k = num_prompts, prompts_per_step, group_size
        self.seed, self.shuffle, self.whole_groups = seed, shuffle, whole_groups
        self._perm_cache: dict[int, np.ndarray] = {}

    def _epoch_perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            if len(self._perm_cache) > 4:
                self._perm_cache.clear()
            if self.shuffle:
                rng = np.random.default_rng([self.seed, _SALT_EPOCH, epoch])
                self._perm_cache[epoch] = rng.permutation(self.num_prompts)
            else:
                self._perm_cache[epoch] = np.arange(self.num_prompts)
        return self._perm_cache[epoch]

    @property
    def steps_per_epoch(self) -> int:
        """Whole steps per pass over the prompts (0 when m > num_prompts)."""
        return self.num_prompts // self.m

    def step_prompts(self, step: int) -> list[int]:
        """The m prompt indices of ``step`` (0-based), in group-id order: slice ``step`` of its
        epoch's permutation (the last num_prompts mod m prompts of an epoch are dropped, so a
        step never draws a prompt twice; the next epoch's reshuffle gives them their turn).
        With m > num_prompts a step takes consecutive epochs' permutations end to end."""
        spe = self.steps_per_epoch
        if spe:
            epoch, j = divmod(step, spe)
            return self._epoch_perm(epoch)[j * self.m : (j + 1) * self.m].tolist()
        out = []
        for pos in range(step * self.m, (step + 1) * self.m):
            epoch, offset = divmod(pos, self.num_prompts)
            out.append(int(self._epoch_perm(epoch)[offset]))
        return out

    def global_step_samples(self, step: int) -> tuple[list[int], list[int]]:
        """(indices, group_ids) of all m*K samples of ``step``, in global sample order."""
        prompts = self.step_prompts(step)
        groups = np.repeat(np.arange(self.m), self.k)
        rng = np.random.default_rng([self.seed, _SALT_STEP, step])
        if self.whole_groups:  # branching rollouts: a group's K samples stay together, in order
            groups = np.repeat(rng.permutation(self.m), self.k)
        else:
            groups = groups[rng.permutation(groups.size)]
        return [prompts[g] for g in groups.tolist()], groups.tolist()

    def state_dict(self) -> dict[str, int]:
        """What defines the draw (JSON-able): a step's samples depend only on these and the
        step number, so resuming needs no position, only a check that these did not change."""
        return {
            "seed": self.seed,
            "num_prompts": self.num_prompts,
            "prompts_per_step": self.m,
            "group_size": self.k,
            "shuffle": int(self.shuffle),
            **({"whole_groups": 1} if self.whole_groups else {}),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Check that a resumed run draws what ``state``'s run drew (world_size may differ)."""
        mine = self.state_dict()
        for key in ("seed", "num_prompts", "prompts_per_step", "group_size", "shuffle"):
            if key in state and int(state[key]) != int(mine[key]):
                raise ValueError(
                    f"cannot resume the prompt sampler: {key} was {state[key]}, now {mine[key]}"
                )
        was, now = int(state.get("whole_groups", 0)), int(mine.get("whole_groups", 0))
        if was != now:  # sample.branching on/off lays a step's samples out differently
            raise ValueError(
                f"cannot resume the prompt sampler: whole_groups (sample.branching) was {was}, "
                f"now {now}"
            )


__all__ = [
    "KRepeatSampler",
    "PromptDataset",
    "SourceRows",
    "builtin_prompts",
    "check_divides",
    "check_image",
    "load_image",
    "load_prompts",
    "not_a_file",
    "rank_slice",
    "prompt_splits",
    "repeat_for_eval",
    "source_images",
    "split_dataset",
    "text_lines",
]
