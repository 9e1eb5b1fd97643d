"""A diffusers model built on the meta device from its folder, and where its weights live.

``build_empty`` (called by ``load_pipeline`` for the components the adapter trains) builds a
module exactly as diffusers' ``from_pretrained`` does (same construction contexts and default
dtype, so non-persistent buffers and plain tensors are bit-identical; persistent buffers read
from the file), except that its parameters stay on the meta device in the dtype diffusers would
load them in, and tags it with where each weight lives (``WeightFiles``: the safetensors
headers only, no tensor read). ``flowgrpo.engine.load.materialize`` fills it after sharding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import torch
from torch import nn

#: the attribute ``build_empty`` sets on a module built empty (read by ``materialize``)
WEIGHTS_ATTR = "_flowgrpo_weights"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"


#: safetensors' dtype names
ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Stored:
    """One tensor in a safetensors file: dtype and shape, and where its bytes start."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file

    def read(self, f: BinaryIO, rows: slice | None = None) -> torch.Tensor:
        """The tensor, or its rows ``rows`` (dim 0): only those bytes are read from ``f``."""
        shape = self.shape
        r0, r1 = (0, shape[0] if shape else 1) if rows is None else (rows.start, rows.stop)
        inner = math.prod(shape[1:])
        out = torch.empty((r1 - r0, *shape[1:]) if shape else (), dtype=self.dtype)
        if out.numel():
            itemsize = out.element_size()
            f.seek(self.start + r0 * inner * itemsize)
            f.readinto(memoryview(out.reshape(-1).view(torch.uint8).numpy()))
        return out


def read_header(path: Path) -> dict[str, Stored]:
    """{key: Stored} from a safetensors file's header (the tensors are not read)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {
        key: Stored(path, ST_DTYPES[e["dtype"]], tuple(e["shape"]), 8 + n + e["data_offsets"][0])
        for key, e in header.items()
    }


@dataclass
class WeightFiles:
    """Where the weights of a module built empty live: ``stored`` {state-dict key: Stored};
    ``dtypes`` {key: the dtype diffusers' ``from_pretrained`` loads it in}."""

    folder: Path
    stored: dict[str, Stored]
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)


def weight_files(folder: str | Path) -> dict[str, Stored] | None:
    """{key: Stored} of a diffusers model folder's safetensors weights (one file, or several
    with their ``.index.json``); None when the folder has neither (e.g. .bin weights)."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / WEIGHTS_NAME).is_file():
        names = [WEIGHTS_NAME]
    else:
        return None
    out: dict[str, Stored] = {}
    for name in names:
        out.update(read_header(folder / name))
    return out


def build_empty(cls: type, folder: str | Path, dtype: torch.dtype | None) -> nn.Module:
    """``cls.from_pretrained(folder, dtype=dtype)`` with every parameter left on the meta
    device (persistent buffers loaded, they are small). Raises ValueError when the folder
    has no safetensors weights or lacks a parameter."""
    from accelerate import init_empty_weights
    from diffusers.models.modeling_utils import no_init_weights

    folder = Path(folder)
    files = weight_files(folder)
    if files is None:
        raise ValueError(f"{folder}: no {WEIGHTS_NAME} (or {INDEX_NAME}) to load sharded")
    config = cls.load_config(folder)
    before = cls._set_default_torch_dtype(dtype) if dtype is not None else None
    try:  # diffusers' own construction: buffers built in `dtype` on the host, params on meta
        with no_init_weights(), init_empty_weights():
            model = cls.from_config(config)
    finally:
        if before is not None:
            torch.set_default_dtype(before)
    keep = list(cls._keep_in_fp32_modules or [])
    state = model.state_dict(keep_vars=True)
    params = {n for n, _ in model.named_parameters()}
    missing = sorted(n for n in params if n not in files)
    if missing:
        raise ValueError(f"{folder}: the weights lack {missing[0]} ({len(missing)} missing)")
    dtypes: dict[str, torch.dtype] = {}
    for key, old in state.items():
        stored = files.get(key)
        if stored is None:
            continue  # a buffer the file lacks keeps its constructed value, as in diffusers
        if dtype is None:
            target = old.dtype
        elif not stored.dtype.is_floating_point:
            target = stored.dtype  # ints stay as stored
        elif any(m in key.split(".") for m in keep):
            target = torch.float32
        else:
            target = dtype
        if tuple(old.shape) != stored.shape:
            raise ValueError(
                f"{folder}: {key} has shape {stored.shape}, expected {tuple(old.shape)}"
            )
        if key in params:
            dtypes[key] = target
            if old.dtype != target:
                old.data = old.data.to(target)  # meta: no memory
        else:  # a persistent buffer: read whole, as diffusers does (buffers are small)
            module_name, _, leaf = key.rpartition(".")
            with open(stored.path, "rb") as f:
                value = stored.read(f).to(target)
            model.get_submodule(module_name)._buffers[leaf] = value
    model.register_to_config(_name_or_path=str(folder))
    model.eval()
    setattr(model, WEIGHTS_ATTR, WeightFiles(folder, files, dtypes))
    return model


def is_empty(module: nn.Module) -> bool:
    """True when some parameter of ``module`` is still on the meta device."""
    return any(p.is_meta for p in module.parameters())
