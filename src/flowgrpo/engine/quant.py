"""A quantized frozen base for LoRA runs (``model.base_quant``): weight-only NF4 or int8.

Every frozen ``nn.Linear`` of the trained transformer (the base under its LoRA, and the layers
LoRA does not touch) becomes a ``QuantLinear``: its weight kept as integer codes plus fp32
scales, dequantized to the compute dtype in each forward. The rollout, the training recompute
and the reference (the adapter switched off) all call the same module, so log-probs stay
exact. The frozen text encoders are quantized the same way (``quantize_frozen``).

The formats are bitsandbytes' (tests compare the codes with it bit for bit): NF4 = the QLoRA
codebook, absmax blocks of 64 along each row, fp32 absmax, no double quantization
(``quantize_4bit(blocksize=64, compress_statistics=False, quant_type="nf4")``); int8 = LLM.int8's
row-wise absmax (``int8_vectorwise_quant``). The codes are plain integer tensors, stored as
frozen parameters of the row count of the weight: FSDP2 shards and all-gathers them like any
parameter (integer parameters skip mixed-precision casts), and every block lives inside one
row, so quantizing each rank's rows as they load gives the codes of quantizing the whole
weight: 2 ranks = 1. Neither library's own tensors survive ``fully_shard`` on a CPU at our
sizes (docs/training.md, "A quantized frozen base"), so no library is needed at run time.

Bytes per quantized parameter: int8 1 + 4/in_features, NF4 0.5 + 4/64 = 0.5625.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("nf4", "int8")
NF4_BLOCK = 64
# the NF4 codebook (QLoRA; bitsandbytes backends/utils.py _NF4_QUANT_TABLE), sorted
NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
_TABLES: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _nf4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codebook, the midpoints between neighbouring codes, each byte's two code values
    [256, 2]) as fp32 tensors on ``device``."""
    if device not in _TABLES:
        code = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
        byte = torch.arange(256, device=device)
        pairs = torch.stack((code[byte >> 4], code[byte & 0xF]), dim=-1)
        _TABLES[device] = code, (code[:-1] + code[1:]) / 2, pairs
    return _TABLES[device]


def base_quant(config: Any) -> str:
    """``model.base_quant`` of a run config (or ``base_quant`` of an engine config given one);
    "none" when the config has neither."""
    mode = getattr(config, "base_quant", None)
    if mode is None:
        mode = getattr(getattr(config, "model", None), "base_quant", "none")
    return str(mode)


def check_mode(mode: str, lora: bool) -> None:
    """A quantized base is frozen: only a LoRA run can train on it."""
    if mode not in ("none", *MODES):
        raise ValueError(f"model.base_quant must be none, nf4 or int8, got {mode!r}")
    if mode != "none" and not lora:
        raise ValueError(
            f"model.base_quant={mode} needs lora.enabled=true: a full fine-tune trains the "
            "base weights, which a quantized base cannot hold; set model.base_quant=none"
        )


def code_shape(mode: str, out_features: int, in_features: int) -> tuple[tuple, tuple]:
    """(shape of the codes, shape of the scales) of a ``out_features x in_features`` weight."""
    if mode == "int8":
        return (out_features, in_features), (out_features, 1)
    blocks = math.ceil(in_features / NF4_BLOCK)
    return (out_features, blocks * NF4_BLOCK // 2), (out_features, blocks)


def quantize(weight: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, fp32 scales) of a 2-D ``weight``, row by row (rows are independent: a shard of
    rows quantizes as the whole does). int8: round(w 127 / absmax of the row), the scale is
    the absmax. NF4: blocks of 64 along the row (the last one zero-padded), each scaled by its
    absmax and rounded to the nearest code, two codes a byte (the first in the high nibble)."""
    w = weight.detach().float()
    if mode == "int8":
        absmax = w.abs().amax(dim=1, keepdim=True)
        codes = torch.round(w * (127.0 / absmax.clamp(min=1e-38))).to(torch.int8)
        return codes, absmax
    if mode != "nf4":
        raise ValueError(f"unknown quantization {mode!r}")
    rows, cols = w.shape
    blocks = math.ceil(cols / NF4_BLOCK)
    w = F.pad(w, (0, blocks * NF4_BLOCK - cols)).reshape(rows, blocks, NF4_BLOCK)
    absmax = w.abs().amax(dim=-1)
    scaled = torch.clamp(w * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(-1), -1, 1)
    q = torch.bucketize(scaled, _nf4_tables(w.device)[1], out_int32=True).to(torch.uint8)
    q = q.reshape(rows, blocks * NF4_BLOCK)
    return (q[:, ::2] << 4) | q[:, 1::2], absmax


def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, mode: str, in_features: int, dtype: torch.dtype
) -> torch.Tensor:
    """The weight ``quantize`` coded, in ``dtype`` (computed in fp32, then cast)."""
    if mode == "int8":
        return (codes.float() * (scale.float() / 127.0)).to(dtype)
    rows, blocks = codes.shape[0], scale.shape[1]
    pairs = _nf4_tables(codes.device)[2]  # one lookup a byte: its two codes' values
    w = pairs[codes.int()].reshape(rows, blocks, NF4_BLOCK) * scale.float().unsqueeze(-1)
    return w.reshape(rows, blocks * NF4_BLOCK)[:, :in_features].to(dtype)


class _LinearQ(torch.autograd.Function):
    """``F.linear`` on the dequantized weight that saves the codes, not the weight: the
    backward dequantizes again (under FSDP2 the codes are all-gathered again for it), so no
    dequantized weight outlives its layer's forward. The base is frozen: no weight grad."""

    @staticmethod
    def forward(ctx, x, codes, scale, bias, mode, in_features):  # noqa: ANN001, ANN205
        ctx.save_for_backward(codes, scale)
        ctx.mode, ctx.in_features = mode, in_features
        return F.linear(x, dequantize(codes, scale, mode, in_features, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        codes, scale = ctx.saved_tensors
        weight = dequantize(codes, scale, ctx.mode, ctx.in_features, grad.dtype)
        return grad.matmul(weight), None, None, None, None, None


class QuantLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is stored quantized (``weight_q``: integer codes,
    ``weight_scale``: fp32 scales, both frozen parameters with one row per output feature)
    and dequantized to the input's dtype in each forward. ``weight`` (the dequantized weight
    in the original dtype) serves code that reads ``linear.weight``; it costs a dequantize."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        mode: str,
        bias: nn.Parameter | None,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features, self.mode, self.orig_dtype = (
            in_features,
            out_features,
            mode,
            dtype,
        )
        cshape, sshape = code_shape(mode, out_features, in_features)
        cdtype = torch.int8 if mode == "int8" else torch.uint8
        self.weight_q = nn.Parameter(
            torch.empty(cshape, dtype=cdtype, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(sshape, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = bias if bias is None else bias.requires_grad_(False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str) -> QuantLinear:
        """The quantized ``linear`` (its bias kept as it is); a meta ``linear`` gives empty
        meta codes, filled when the shards load (``flowgrpo.engine.load.materialize``)."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, mode, linear.bias, w.dtype, w.device)
        if not w.is_meta:
            out.load_weight(w)
        return out

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` (whole, or the rows this module holds) into the codes."""
        codes, scale = quantize(weight, self.mode)
        self.weight_q.copy_(codes)
        self.weight_scale.copy_(scale)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``, from the (all-gathered) codes."""
        return dequantize(self.weight_q, self.weight_scale, self.mode, self.in_features, dtype)

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantized(self.orig_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return _LinearQ.apply(
            x, self.weight_q, self.weight_scale, bias, self.mode, self.in_features
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.mode}"


def quantize_frozen(model: nn.Module, mode: str) -> int:
    """Replace every frozen ``nn.Linear`` of ``model`` (all its parameters without grad; not
    in the model's ``_keep_in_fp32_modules``) by its ``QuantLinear``, in place. Returns how
    many were replaced. ``mode`` "none" changes nothing."""
    if mode == "none":
        return 0
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    todo = [
        (name, m)
        for name, m in model.named_modules()
        if type(m) is nn.Linear
        and not any(p.requires_grad for p in m.parameters())
        and not keep.intersection(name.split("."))
    ]
    for name, linear in todo:
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, linear_q(linear, mode))
    return len(todo)


def linear_q(linear: nn.Linear, mode: str) -> QuantLinear:
    """``QuantLinear.from_linear`` (a name short enough for a one-line call)."""
    return QuantLinear.from_linear(linear, mode)


def quantize_text_encoders(pipe: Any, mode: str) -> int:
    """``quantize_frozen`` on each frozen text encoder of ``pipe`` (components named
    ``text_encoder*``). Returns how many Linear layers were replaced."""
    count = 0
    for name, module in getattr(pipe, "components", {}).items():
        if name.startswith("text_encoder") and isinstance(module, nn.Module):
            module.requires_grad_(False)
            count += quantize_frozen(module, mode)
    return count


def dequantize_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state dict of ``model`` with each ``QuantLinear``'s codes replaced by its
    dequantized ``weight`` (original dtype): what ``save_pretrained`` can write."""
    out = dict(state)
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear) and f"{name}.weight_q" in out:
            codes, scale = out.pop(f"{name}.weight_q"), out.pop(f"{name}.weight_scale")
            out[f"{name}.weight"] = dequantize(codes, scale, m.mode, m.in_features, m.orig_dtype)
    return out


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes the quantized weights take, weights they code), summed over ``model``'s
    ``QuantLinear`` layers (their local shards)."""
    from flowgrpo.engine.ema import local

    nbytes = count = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            for p in (m.weight_q, m.weight_scale):
                t = local(p)
                nbytes += t.numel() * t.element_size()
            count += m.in_features * m.out_features
    return nbytes, count


__all__ = [
    "MODES",
    "NF4_BLOCK",
    "NF4_CODE",
    "QuantLinear",
    "base_quant",
    "check_mode",
    "code_shape",
    "dequantize",
    "dequantize_state",
    "quantize",
    "quantize_frozen",
    "quantize_text_encoders",
    "quantized_bytes",
]
