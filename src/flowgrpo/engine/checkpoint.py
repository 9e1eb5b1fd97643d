"""Crash-safe, resharding checkpoints of a ``DiffusersFSDPEngine`` with torch.distributed.checkpoint.

What is saved is the engine's ``state_dict()``: its sharded sections go to DCP, its host
section ``engine`` to ``engine_state.pt``; loading fills the same sections and hands them to
``engine.load_state_dict()``. Layout of ``<root>/step_<N>/`` (written as ``step_<N>.tmp`` and renamed when complete):

- DCP shards (``*.distcp`` + ``.metadata``): ``model`` (LoRA params only under LoRA, else all),
  ``optim`` (AdamW state, keyed by param name), ``ema`` (EMA shadows, when enabled),
  ``shadow.<name>`` (an algorithm's copies of the params, e.g. DiffusionNFT's old policy). DCP stores
  them by global tensor, so a checkpoint written by W ranks loads into any world size.
- ``engine_state.pt``: step counters, LR scheduler, the engine's shuffle-generator state.
- ``rng/rank_<r>.pt``: python, numpy, torch (and CUDA) RNG states of every rank.
- ``trainer_state.json``: the trainer's ``extra`` dict (rank 0).
- ``meta.json``: world size, step, LoRA or full; ``COMPLETE``: written last, before the rename.
- the caller's text ``files`` (the trainer's ``config.yaml``: the run's resolved config).

A checkpoint that does not fit the engine (other shapes or tensor names: another LoRA rank,
target modules or model family) is refused in one line (``CheckpointMismatchError``), checked
against the DCP metadata before anything loads; DCP's own multi-rank report (a BaseException)
is turned into one line too.

Loading never runs code from the checkpoint: the ``.pt`` files hold only tensors, numbers,
strings and containers and are read with ``torch.load(weights_only=True)``; DCP's non-tensor
entries are read the same way (its default planner would unpickle them freely), and its
pickled ``.metadata`` is unpickled with an allow-list of DCP's own classes. Anything else is
refused with a ValueError naming the file; an unreadable one (corrupt, truncated) is a
``CheckpointDamagedError`` naming it and the previous complete checkpoint. Which folders are
complete, good or a run's own, pruning and leftovers: ``checkpoint_dirs``.
"""

from __future__ import annotations

import errno
import io
import json
import pickle
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from flowgrpo.engine import dist as fdist
from flowgrpo.engine.checkpoint_dirs import (
    DIVERGED,
    MARKER,
    ROLLOUT_OK,
    _prune,
    _set_aside_foreign,
    is_good,
    last_good_checkpoint,
    latest_checkpoint,
    mark_checkpoint,
    remove_leftovers,
    resume_advice,
    run_id_of,
    written_by_save,
)
from flowgrpo.errors import RunError, TrainingDiverged

HOST = "engine"  # the engine state's section of plain host data (engine_state.pt)
SHADOW = "shadow."  # the sections of the algorithms' parameter copies


def _split_state(engine) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine's ``state_dict()`` as (its sharded sections, for DCP; its host section)."""
    state = engine.state_dict()
    return state, state.pop(HOST)


def _rng_state() -> dict[str, Any]:
    """Every RNG state as tensors, numbers and strings (loadable with weights_only=True)."""
    version, internal, gauss_next = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {
            "version": int(version),
            "internal": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    if isinstance(py, dict):
        internal = tuple(int(x) for x in py["internal"].tolist())
        random.setstate((py["version"], internal, py["gauss_next"]))
    else:  # checkpoints before weights-only loading: python's own tuple
        random.setstate(py)
    if isinstance(npy, dict):
        keys = npy["keys"].numpy().astype(np.uint32)
        np.random.set_state(
            (npy["name"], keys, npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
        )
    else:  # older checkpoints: numpy's tuple with an ndarray
        np.random.set_state(npy)
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# Older rng files hold a numpy array: rebuilding one runs no code beyond numpy's constructor.
_NUMPY_ARRAY_GLOBALS = [
    np.ndarray((0,)).__reduce__()[0],  # numpy's multiarray._reconstruct, wherever numpy puts it
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]
_TRUST = "only load checkpoints you or your own runs wrote"


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds pickled objects beyond plain data: loading it could run code."""


def _refuse(what: str, why: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"refusing to load {what}: {why}; {_TRUST}")


def _load_plain(file: Path | io.BytesIO, what: str, *, numpy_arrays: bool = False) -> Any:
    """``torch.load(weights_only=True)``: tensors, numbers, strings and containers only; a
    pickle that would build anything else (run code) is refused with a ValueError."""
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS if numpy_arrays else []):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        culprit = re.search(r"GLOBAL (\S+)", str(e))
        why = f"it holds a pickled {culprit.group(1)}" if culprit else first
        raise _refuse(what, f"{why}, not only tensors, numbers and strings") from None


class CheckpointDamagedError(RunError):
    """A checkpoint file is unreadable (truncated, corrupt, missing): one line naming it and
    the previous complete checkpoint to resume from instead."""


def _damaged(path: Path, file: Path, why: str) -> CheckpointDamagedError:
    """The error for ``file`` of checkpoint ``path``, offering the newest complete earlier
    checkpoint beside it (not DIVERGED)."""
    from flowgrpo.engine.checkpoint_dirs import DIVERGED, STEP_DIR, _complete_steps

    m = STEP_DIR.match(path.name)
    step = int(m.group(1)) if m else None
    earlier = [
        d
        for n, d in _complete_steps(path.parent)
        if step is not None and n < step and not (d / DIVERGED).exists()
    ]
    offer = (
        f"resume from the previous checkpoint with trainer.resume={earlier[-1]}"
        if earlier
        else f"no earlier complete checkpoint is in {path.parent}"
    )
    return CheckpointDamagedError(f"checkpoint {path} is damaged: {file} {why}; {offer}")


def _read_json(path: Path, name: str) -> dict[str, Any]:
    """``path/name`` as a JSON object, or ``CheckpointDamagedError`` naming it."""
    file = path / name
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise _damaged(path, file, "is missing") from None
    except (OSError, ValueError) as e:
        raise _damaged(path, file, f"cannot be read ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise _damaged(path, file, "does not hold a JSON object")
    return data


def _check_shards(path: Path, metadata: Any) -> None:
    """Every DCP data file the metadata names exists and is as long as its entries need: a
    truncated or missing shard is named here (DCP would say EOFError or a zip error)."""
    need: dict[str, int] = {}
    for info in getattr(metadata, "storage_data", {}).values():
        rel = str(getattr(info, "relative_path", ""))
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        need[rel] = max(need.get(rel, 0), end)
    for rel, size in sorted(need.items()):
        file = path / rel
        if not file.is_file():
            raise _damaged(path, file, "is missing")
        have = file.stat().st_size
        if have < size:
            raise _damaged(path, file, f"is truncated ({have} of {size} bytes)")


def _load_file(path: Path, file: Path, *, numpy_arrays: bool = False) -> Any:
    """``_load_plain`` of a file of checkpoint ``path``; an unreadable (truncated) file is a
    ``CheckpointDamagedError`` naming it."""
    try:
        return _load_plain(file, str(file), numpy_arrays=numpy_arrays)
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError:
        raise _damaged(path, file, "is missing") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = " ".join(str(e).split(".")[0].split()) or type(e).__name__
        raise _damaged(path, file, f"cannot be read ({first})") from None


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default planner, except that non-tensor entries (optimizer hyper-parameters) are
    read with weights_only=True (DCP itself unpickles them with weights_only=False)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = _load_plain(value, f"{self.path} (entry {read_item.dest_index.fqn!r})")
        clean = io.BytesIO()
        torch.save(obj, clean)  # re-serialised plain data: safe for DCP's own unpickling
        clean.seek(0)
        super().load_bytes(read_item, clean)


# Every global a DCP ``.metadata`` of this project holds (torch 2.13), and nothing else.
_DCP_MD = "torch.distributed.checkpoint.metadata"
_DCP_GLOBALS = {
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(
        (_DCP_MD, n)
        for n in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it holds a pickled {module}.{name}")


def _check_dcp_metadata(path: Path) -> Any:
    """DCP unpickles ``.metadata`` with plain pickle: unpickle it first with DCP's classes
    allowed and nothing else, so a tampered file is refused before DCP reads it. Returns
    the metadata."""
    file = path / ".metadata"
    try:
        with open(file, "rb") as f:
            return _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise _damaged(path, file, "is missing (the DCP metadata)") from None
    except EOFError:
        raise _damaged(path, file, "is truncated") from None
    except pickle.UnpicklingError as e:
        if "truncated" in str(e) or "ran out of input" in str(e).lower():
            raise _damaged(path, file, "is truncated") from None
        raise _refuse(str(file), f"{e}, not only DCP's own metadata") from None
    except Exception as e:
        why = str(e) if isinstance(e, pickle.UnpicklingError) else f"{type(e).__name__}: {e}"
        raise _refuse(str(file), f"{why}, not only DCP's own metadata") from None


def _save(obj: Any, path: Path) -> None:
    """``torch.save`` through a Python file, so that a failed write is an OSError naming
    ``path`` (a full disk: ENOSPC); torch's own file writer reports only
    "inline_container.cc:672 unexpected pos"."""
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def _write_text(path: Path, text: str) -> None:
    """``path.write_text`` whose OSError names ``path``."""
    try:
        path.write_text(text)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from None


def _write_files(
    engine,
    tmp: Path,
    step: int,
    sharded: dict[str, Any],
    host: dict[str, Any],
    extra: dict | None,
    run_id: str | None,
    files: dict[str, str] | None = None,
) -> None:
    """Everything but the DCP shards (``sharded``: what they hold, named in meta.json):
    per-rank RNG, and (rank 0) the engine's ``host`` state, the trainer state and the caller's
    text ``files`` (name -> text, e.g. the run's config.yaml)."""
    rank = engine.dist.rank
    (tmp / "rng").mkdir(exist_ok=True)
    _save(_rng_state(), tmp / "rng" / f"rank_{rank}.pt")
    if not engine.dist.is_main:
        return
    _save(host, tmp / "engine_state.pt")
    _write_text(tmp / "trainer_state.json", json.dumps(extra or {}, indent=2))
    meta = {
        "step": step,
        "world_size": engine.dist.world_size,
        "lora": engine.use_lora,
        "ema": "ema" in sharded,
        "shadows": sorted(k[len(SHADOW) :] for k in sharded if k.startswith(SHADOW)),
        "run_id": run_id,
        "time": time.time(),
    }
    _write_text(tmp / "meta.json", json.dumps(meta, indent=2))
    for name, text in (files or {}).items():
        _write_text(tmp / name, text)


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model it is loaded into (another LoRA rank, family)."""


def _mismatch(path: Path, metadata: Any, state: dict[str, Any]) -> CheckpointMismatchError | None:
    """The first difference between the tensors the engine expects (``state``, DCP's nested
    dict) and those the checkpoint holds (its ``.metadata``), as one line; None if none."""
    saved = getattr(metadata, "state_dict_metadata", {})
    shapes, missing = [], []
    for section, tensors in state.items():
        if not isinstance(tensors, dict) or section == "optim":
            continue
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                continue
            entry = saved.get(f"{section}.{name}")
            size = getattr(entry, "size", None)
            if entry is None:
                missing.append(name)
            elif size is not None and tuple(size) != tuple(t.shape):
                shapes.append((name, tuple(size), tuple(t.shape)))
    if shapes:
        name, a, b = shapes[0]
        more = f" (and {len(shapes) - 1} more)" if len(shapes) > 1 else ""
        hint = "; another LoRA rank?" if "lora_" in name else ""
        return CheckpointMismatchError(
            f"checkpoint {path} does not match the model: {name} has shape {list(a)} in the "
            f"checkpoint, {list(b)} in the model{more}{hint}"
        )
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        return CheckpointMismatchError(
            f"checkpoint {path} does not match the model: it has no {missing[0]}{more}; "
            "was it trained on another model family or with other LoRA target modules?"
        )
    return None


def _drop_unsaved_optim_states(metadata: Any, state: dict[str, Any]) -> None:
    """Leave out of the load the AdamW states of parameters that had none when saved: no
    gradient ever reached them (a model output the model discards: AdamW skips a parameter
    without a gradient), so they keep the fresh engine's unused state."""
    prefix = "optim.state."
    saved = {
        k[len(prefix) :].rsplit(".", 1)[0]
        for k in getattr(metadata, "state_dict_metadata", {})
        if k.startswith(prefix)
    }
    optim = state.get("optim", {}).get("state", {})
    for name in [n for n in optim if n not in saved]:
        optim.pop(name)


def _write_marker(tmp: Path) -> None:
    _write_text(tmp / MARKER, "ok\n")


def save_checkpoint(
    engine,
    root: str | Path,
    step: int,
    extra: dict | None = None,
    keep_last: int | None = None,
    run_id: str | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """Save to ``<root>/step_<step>`` (collective). Writes ``step_<step>.tmp``, marks it
    COMPLETE once every rank has written, then renames it; keeps the newest ``keep_last``
    complete checkpoints of the same ``run_id`` (None/0 = all; another run's checkpoints are
    never pruned) and removes stale ``.tmp`` directories. ``files`` (name -> text) are
    written beside the state by rank 0 (the trainer's config.yaml).

    Refuses (``TrainingDiverged``) to write non-finite weights. A write that fails (e.g. a
    full disk) removes its ``.tmp`` and raises ``RunError`` in one line; the previous
    checkpoint stays complete and loadable."""
    root = Path(root)
    try:
        json.dumps(extra or {})
    except TypeError as err:
        raise TypeError(f"save_checkpoint extra must be JSON-serialisable: {err}") from None
    if not engine.weights_are_finite():
        raise TrainingDiverged(
            f"training diverged: refusing to save non-finite weights at step {step} in {root}; "
            + resume_advice(root)
        )
    final, tmp = root / f"step_{step}", root / f"step_{step}.tmp"
    try:
        if engine.dist.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            _set_aside_foreign(final, run_id)
        fdist.barrier()
        sharded, host = _split_state(engine)
        dcp.save(sharded, checkpoint_id=str(tmp))
        _write_files(engine, tmp, step, sharded, host, extra, run_id, files)
        fdist.barrier()
        if engine.dist.is_main:
            _write_marker(tmp)
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
    except (OSError, CheckpointException) as e:
        why, free = _first_os_error(e), _free_mib(tmp)
        if not why.startswith(_DISK_FULL) and free < _NEARLY_FULL_MIB:  # the errno was lost
            why = f"{_DISK_FULL} ({free:.0f} MiB free; {why})"
        if engine.dist.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        kept = latest_checkpoint(root)
        raise RunError(
            f"cannot write checkpoint {tmp}: {why}; "
            + (
                f"the previous checkpoint {kept.name} is kept (resume with trainer.resume=auto)"
                if kept is not None
                else f"no earlier checkpoint is in {root}"
            )
        ) from e
    if engine.dist.is_main:
        _prune(root, keep_last, run_id)
    fdist.barrier()
    return final


_DISK_FULL = "the disk is full"
#: free space under which a failed write is reported as a full disk: DCP writes its items
#: through torch's zip writer, whose failure ("inline_container.cc ... unexpected pos") carries
#: no errno, so ENOSPC is only seen as a disk with (almost) nothing left
_NEARLY_FULL_MIB = 64


def _free_mib(path: Path) -> float:
    """Free space (MiB) for unprivileged writes on ``path``'s filesystem (its nearest existing
    folder); inf when it cannot be read."""
    for p in (path, *path.parents):
        if p.exists():
            try:
                return shutil.disk_usage(p).free / 2**20
            except OSError:
                break
    return float("inf")


def _first_os_error(e: BaseException) -> str:
    """The OSError inside DCP's multi-rank report (or ``e`` itself), as one line."""
    if isinstance(e, CheckpointException):
        for err, _ in e.failures.values():
            if isinstance(err, BaseException):
                return _first_os_error(err)
    cause = e
    while cause.__cause__ is not None and not isinstance(cause, OSError):
        cause = cause.__cause__
    text = " ".join(str(cause).split()) or type(cause).__name__
    if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{_DISK_FULL} ({text})"
    return text


def _first_failure(e: BaseException) -> str:
    """The first rank's error inside DCP's multi-rank report, as one line."""
    if isinstance(e, CheckpointException):
        for err, _ in e.failures.values():
            if isinstance(err, BaseException):
                return _first_failure(err)
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines[0].split()) if lines else type(e).__name__


def load_checkpoint(engine, path: str | Path) -> tuple[int, dict]:
    """Restore ``engine`` from a checkpoint directory, or from the newest complete one under a
    root (collective). Works across world sizes. Returns (step, extra).

    The configured optimizer settings replace the checkpoint's
    (``engine.apply_configured_optim``; what changed is left in ``engine.optim_changes``).

    Runs no code from the checkpoint: a file holding anything but plain data (tensors,
    numbers, strings; DCP's own metadata classes) is refused with a ValueError naming it,
    before the engine is changed."""
    path = Path(path)
    if not (path / MARKER).is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint at or under {path}")
        path = found
    meta = _read_json(path, "meta.json")
    extra = _read_json(path, "trainer_state.json")  # read before the engine changes
    if meta.get("lora") != engine.use_lora:
        kinds = {True: "a LoRA", False: "a full fine-tune"}
        raise CheckpointMismatchError(
            f"checkpoint {path} does not match the model: it is {kinds[bool(meta['lora'])]}, "
            f"the config is {kinds[bool(engine.use_lora)]} (lora.enabled={engine.use_lora})"
        )
    # Everything that is unpickled is checked before the engine is touched.
    es = _load_file(path, path / "engine_state.pt")
    rng_file = path / "rng" / f"rank_{engine.dist.rank}.pt"
    rng = _load_file(path, rng_file, numpy_arrays=True) if rng_file.is_file() else None
    metadata = _check_dcp_metadata(path)
    _check_shards(path, metadata)
    state, _ = _split_state(engine)
    if meta["ema"] and "ema" not in state:
        warnings.warn(f"{path} holds EMA weights but EMA is off: ignoring them", stacklevel=2)
    if not meta["ema"]:
        state.pop("ema", None)
    for key in [k for k in state if k.startswith(SHADOW)]:
        name = key[len(SHADOW) :]
        if name not in meta.get("shadows", []):  # e.g. another algorithm wrote it
            warnings.warn(
                f"{path} holds no '{name}' copy: starting it from the loaded weights", stacklevel=2
            )
            state.pop(key)
    mismatch = _mismatch(path, metadata, state)
    if mismatch is not None:
        raise mismatch
    _drop_unsaved_optim_states(metadata, state)
    try:
        dcp.load(state, checkpoint_id=str(path), planner=_WeightsOnlyPlanner(path))
    except CheckpointException as e:  # DCP wraps every rank's error in a multi-line report;
        # it is a BaseException: turned into one line here, where checkpoints load
        refused = [x for x, _ in e.failures.values() if isinstance(x, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise CheckpointMismatchError(
            f"cannot load checkpoint {path}: {_first_failure(e)}"
        ) from None
    engine.load_state_dict({**state, HOST: es})
    if rng is not None:
        _set_rng_state(rng)
    else:
        warnings.warn(
            f"{path} has no RNG state for rank {engine.dist.rank} (saved with world size "
            f"{meta['world_size']}): reseeding from the engine seed",
            stacklevel=2,
        )
        fdist.seed_everything(engine.config.seed + 1000 * es["step"], engine.dist.rank)
    fdist.barrier()
    return int(meta["step"]), extra


__all__ = [
    "DIVERGED",
    "MARKER",
    "CheckpointDamagedError",
    "CheckpointMismatchError",
    "ROLLOUT_OK",
    "UnsafeCheckpointError",
    "is_good",
    "last_good_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "mark_checkpoint",
    "remove_leftovers",
    "resume_advice",
    "run_id_of",
    "save_checkpoint",
    "written_by_save",
]
