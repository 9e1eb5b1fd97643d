"""``DiffusersFSDPEngine``: a diffusers transformer under training, with FSDP2 + peft LoRA.

The engine wraps ``adapter.transformer`` in place (LoRA, then ``fully_shard`` per block and on
the root), so the sampler and the trainer keep using ``adapter.transformer``. It owns the model
and its training machinery: the reference policy, the EMA and other parameter shadows, the
micro-batch plan balanced over ranks, backward with FSDP's gradient sync, the optimizer step
(global clipping, non-finite handling), checkpoints and exports. It knows no loss and no
reward: an algorithm (``flowgrpo.algorithms``) writes the update loop with these. See
docs/engine.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from flowgrpo.engine import dist as fdist
from flowgrpo.engine.config import EngineConfig
from flowgrpo.engine.ema import EMA, ParamShadow, local
from flowgrpo.engine.load import adapters_beside_meta, is_empty, materialize
from flowgrpo.errors import TrainingDiverged
from flowgrpo.models.base import DiffusionAdapter
from flowgrpo.settings import check_section

_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")


@dataclass
class MicroBatch:
    """rows: local sample indices of one forward/backward; scale: 1, or 0 for a padding
    micro-batch (run only so that every rank makes as many forwards and backwards)."""

    rows: torch.Tensor
    scale: float


@dataclass
class MiniBatch:
    """The micro-batches of one optimizer step (as many on every rank) and the number of
    samples it trains on over all ranks."""

    micro: list[MicroBatch]
    total: int


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """ "auto" = bf16 on CUDA, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPE[name]


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: modules whose class is in the model's
    ``_no_split_modules``, else the members of its block lists (transformer_blocks, ...)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    if blocks:
        return blocks
    for attr in _BLOCK_LISTS:
        ml = getattr(model, attr, None)
        if isinstance(ml, nn.ModuleList):
            blocks.extend(ml)
    return blocks


class LRLambda:
    """LR multiplier at optimizer step s (0-based): linear warm-up (s + 1) / W for s < W, then
    1 ("constant") or 0.5 (1 + cos(pi * progress)) ("cosine" over total_steps - W steps)."""

    def __init__(self, schedule: str, warmup_steps: int, total_steps: int):
        self.schedule, self.warmup, self.total = schedule, warmup_steps, total_steps

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if self.schedule == "constant" or self.total <= 0:
            return 1.0
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.5 * (1.0 + math.cos(math.pi * progress))


class DiffusersFSDPEngine:
    """Trainable policy = ``adapter.transformer`` (LoRA or full), sharded with FSDP2.

    ``config``: an ``EngineConfig``, or the run config itself: anything with the sections
    ``lora``, ``optim``, ``fsdp``, ``ema`` and a ``seed`` (read as they are, never copied).
    ``reference``: keep a frozen copy of the initial weights as the reference policy (a full
    fine-tune with a KL term; under LoRA the reference is the adapter switched off). A transformer
    built on the meta device (``load_pipeline(..., empty_trained=True)``) is wrapped and sharded
    there, then each rank's shards are read from its files (``flowgrpo.engine.load``), the
    reference's too: no rank holds it whole. Attributes: ``transformer`` (the wrapped module, same object as adapter.transformer),
    ``optimizer``, ``scheduler``, ``ema`` (or None), ``step`` (updates finished),
    ``optimizer_steps`` (applied updates), ``generator`` (shuffling; identical on all ranks).
    """

    def __init__(
        self,
        adapter: DiffusionAdapter,
        config: EngineConfig | Any | None = None,
        dist: fdist.DistInfo | None = None,
        *,
        reference: bool = False,
    ):
        self.adapter = adapter
        self.config = cfg = config if config is not None else EngineConfig()
        check_section(cfg)
        self.dist = dist or fdist.init_distributed()
        model = adapter.transformer
        self.model_class = type(model)
        self.component_classes = {  # Wan2.2's experts, before sharding renames their classes
            c: type(getattr(model, c))
            for c in ("transformer", "transformer_2")
            if hasattr(model, "split_state_dict")
        }
        self.use_lora = cfg.lora.enabled
        device = self.dist.device
        self.param_dtype = resolve_dtype(cfg.fsdp.param_dtype, device)
        self.reduce_dtype = resolve_dtype(cfg.fsdp.reduce_dtype, device)

        # built on the meta device (flowgrpo.engine.load): shards are allocated and read from
        # the model's files after sharding, so no rank ever holds the whole model
        empty = is_empty(model)
        self._ref_model: nn.Module | None = None
        if not self.use_lora and reference:  # LoRA's reference is the adapter switched off
            self._ref_model = copy.deepcopy(model).requires_grad_(False)  # meta: no memory
        if self.use_lora:
            model.requires_grad_(False)
            self._add_lora(model)
        else:
            model.requires_grad_(True)
        with torch.no_grad():  # fp32 master weights for everything that trains
            for p in model.parameters():
                if p.requires_grad and p.dtype != torch.float32:
                    p.data = p.data.float()
        if cfg.fsdp.activation_checkpointing:
            if not getattr(model, "_supports_gradient_checkpointing", False):
                raise ValueError(f"{self.model_class.__name__} does not support checkpointing")
            model.enable_gradient_checkpointing()

        fs = cfg.fsdp
        self.parallel = None  # the SP meshes when fsdp.sp_degree > 1
        if fs.sp_degree > 1:
            from flowgrpo.engine.sp import build_parallel_mesh

            self.parallel = build_parallel_mesh(
                self.dist.world_size, fs.replicate_degree, fs.sp_degree, device.type
            )
            self.mesh = self.parallel.fsdp
        else:
            self.mesh = fdist.build_mesh(
                self.dist.world_size, fs.replicate_degree, device_type=device.type
            )
        self._shard(model)
        if self._ref_model is not None:
            self._shard(self._ref_model)
        if empty:
            init_device = "cpu" if fs.cpu_offload else device
            for m in (model, self._ref_model):
                if m is not None:
                    materialize(m, init_device)
        self.model = model

        self.param_names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the engine found no trainable parameters (check lora targets)")
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=o.lr,
            betas=tuple(o.betas),
            weight_decay=o.weight_decay,
            eps=o.eps,
            fused=device.type == "cuda" and not cfg.fsdp.cpu_offload,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, LRLambda(o.lr_schedule, o.warmup_steps, o.total_steps)
        )
        self.ema = (
            EMA(self.params, cfg.ema.decay, cfg.ema.update_every) if cfg.ema.enabled else None
        )
        self.shadows: dict[str, ParamShadow] = {}  # the algorithms' named copies (checkpointed)
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.optimizer_steps = 0
        self.consecutive_skips = 0
        self.optim_changes: dict[str, tuple[Any, Any]] = {}  # by load_checkpoint: old, new

    # -- construction ------------------------------------------------------------------------
    def _add_lora(self, model: nn.Module) -> None:
        from peft import LoraConfig as PeftLoraConfig

        lc = self.config.lora
        targets = lc.target_modules
        if targets is None:
            targets = list(self.adapter.lora_target_modules)
        if not targets:
            raise ValueError("lora.target_modules is empty and the adapter has no defaults")
        init = {"default": True, "true": True, "false": False}.get(str(lc.init).lower(), lc.init)
        peft_cfg = PeftLoraConfig(
            r=lc.rank,
            lora_alpha=lc.alpha,
            init_lora_weights=init,
            target_modules=targets,
            lora_dropout=lc.dropout,
        )
        devices = [self.dist.device] if self.dist.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):  # identical init on every rank
            torch.manual_seed(self.config.seed)
            if self.dist.device.type == "cuda":
                torch.cuda.manual_seed(self.config.seed)
            with adapters_beside_meta():  # a meta base keeps its new LoRA on the host
                model.add_adapter(peft_cfg)
        for name, p in model.named_parameters():
            p.requires_grad_("lora_" in name)

    def _shard(self, model: nn.Module) -> None:
        fs = self.config.fsdp
        block_mp = MixedPrecisionPolicy(
            param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype
        )
        root_mp = MixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            output_dtype=torch.float32,
        )
        offload = (
            CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if fs.cpu_offload
            else OffloadPolicy()
        )
        if self.parallel is not None:  # after LoRA and checkpointing, before sharding
            from flowgrpo.engine.sp import enable_sequence_parallel

            enable_sequence_parallel(model, self.parallel, fs.sp_degree)
        kw = dict(mesh=self.mesh, reshard_after_forward=fs.reshard_after_forward)
        for block in transformer_blocks(model):
            fully_shard(block, mp_policy=block_mp, offload_policy=offload, **kw)
        fully_shard(model, mp_policy=root_mp, offload_policy=offload, **kw)
        if self.parallel is not None:  # SUM over an SP group, MEAN over data-parallel ranks
            from flowgrpo.engine.sp import set_sp_gradient_scale

            set_sp_gradient_scale(model, self.parallel)

    # -- data parallelism ----------------------------------------------------------------------
    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel rank: the ranks of a sequence-parallel group share one
        (they hold the same samples)."""
        return self.dist.rank if self.parallel is None else self.parallel.dp_rank

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (world / fsdp.sp_degree)."""
        return self.dist.world_size if self.parallel is None else self.parallel.dp_size

    @property
    def sp_rank(self) -> int:
        return 0 if self.parallel is None else self.parallel.sp_rank

    def dp_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """Of a tensor all-gathered over every rank ([world * n, ...], equal n), the rows of one
        rank per SP group (its copies on the other ranks of the group dropped): [dp * n, ...]."""
        sp = self.dist.world_size // self.dp_size
        if sp == 1:
            return gathered
        parts = gathered.reshape(self.dist.world_size, -1, *gathered.shape[1:])
        return parts[::sp].reshape(-1, *gathered.shape[1:])

    # -- policies ------------------------------------------------------------------------------
    @property
    def transformer(self) -> nn.Module:
        return self.model

    @contextmanager
    def reference_transformer(self) -> Iterator[nn.Module]:
        """The KL reference policy: the same transformer with every LoRA layer disabled, or
        the frozen sharded copy of the initial weights (full fine-tune built with
        ``reference=True``)."""
        if self._ref_model is not None:
            yield self._ref_model
            return
        if not self.use_lora:
            raise RuntimeError("a full fine-tune keeps a reference copy only with reference=True")
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in self.model.modules() if isinstance(m, BaseTunerLayer)]
        before = [m._disable_adapters for m in layers]
        for m in layers:  # flip the flag only: enable/disable_adapters would touch requires_grad
            m._disable_adapters = True
        try:
            yield self.model
        finally:
            for m, b in zip(layers, before, strict=True):
                m._disable_adapters = b

    @contextmanager
    def ema_weights(self) -> Iterator[nn.Module]:
        """Inside the block the trainable params hold their EMA (no-op when EMA is off)."""
        if self.ema is None:
            yield self.model
            return
        with self.ema.swapped():
            yield self.model

    def ema_update(self) -> bool:
        """EMA update for the last applied optimizer step (optimizer_step calls it already)."""
        return False if self.ema is None else self.ema.update(self.optimizer_steps - 1)

    def shadow(self, name: str) -> ParamShadow:
        """A named copy of the trainable params (created from their current values at first
        use): an algorithm's old policy. Saved and restored with checkpoints."""
        if name not in self.shadows:
            self.shadows[name] = ParamShadow(self.params)
        return self.shadows[name]

    # -- training primitives (the algorithms write the loop and the loss) --------------------
    def plan(
        self, rows: torch.Tensor, num_minibatches: int, micro_batch_size: int
    ) -> list[MiniBatch]:
        """Split this rank's samples ``rows`` (local indices to train on) into
        ``num_minibatches`` optimizer steps of micro-batches, balanced over ranks.

        The rows are shuffled with the engine's generator (advanced identically on every rank,
        checkpointed), split evenly, and the counts of every rank all-gathered once (an SP
        group's ranks hold the same samples: counted once). FSDP averages gradients over the
        data-parallel ranks, so a sample weighing dp_size / (the minibatch's samples on all of
        them) makes the update the mean over all of them. Every rank
        runs as many micro-batches as the rank with the most (zero-weight padding on one local
        sample) so FSDP's collectives line up, and a minibatch empty on every rank is dropped.
        ``MiniBatch.total``: its samples on all ranks, for the caller's weights.
        """
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        perm = rows[torch.randperm(len(rows), generator=self.generator)]
        parts = torch.tensor_split(perm, num_minibatches)
        counts = torch.tensor([len(mb) for mb in parts], device=self.dist.device)
        counts = self.dp_rows(fdist.all_gather_tensor(counts[None])).cpu()  # [dp, minibatches]
        plan = []
        for m, mb in enumerate(parts):
            total = int(counts[:, m].sum())
            if total == 0:  # nothing to learn from on any rank: no update at all
                continue
            n_micro = max(-(-int(c) // micro_batch_size) for c in counts[:, m])  # ceil
            micro = [MicroBatch(c, 1.0) for c in mb.split(micro_batch_size) if len(c)]
            micro += [MicroBatch(torch.zeros(1, dtype=torch.long), 0.0)] * (n_micro - len(micro))
            plan.append(MiniBatch(micro, total))
        return plan

    def backward(self, loss: torch.Tensor, *, last: bool) -> None:
        """``loss.backward()``; FSDP reduce-scatters the gradients only after the ``last``
        backward of an optimizer step."""
        if isinstance(self.model, FSDPModule):
            self.model.set_requires_gradient_sync(last)
        loss.backward()

    def optimizer_step(self, loss_finite: bool = True) -> dict[str, float]:
        """Clip (global norm), then AdamW, the LR schedule and the EMA, unless the loss
        (``loss_finite``, agreed by the caller over ranks) or the gradient is not finite or
        the update would make a weight non-finite: then the step is skipped (weights, optimizer,
        LR schedule and EMA unchanged). Gradients are cleared either way. After
        ``optim.max_consecutive_skips`` skips in a row: ``TrainingDiverged``.
        Returns {grad_norm, lr, skipped}."""
        cfg = self.config
        max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        # a non-finite loss or gradient, or an update that would make a weight non-finite, is
        # never applied: weights, optimizer state, LR schedule and EMA stay as they were
        skipped = not (loss_finite and math.isfinite(grad_norm) and self._update_is_finite())
        if skipped:
            self.consecutive_skips += 1
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
            self.consecutive_skips = 0
            self.ema_update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.consecutive_skips >= cfg.optim.max_consecutive_skips:
            raise TrainingDiverged(
                f"training diverged: {self.consecutive_skips} consecutive non-finite updates "
                f"(loss, gradient or weights); lower optim.lr (now {lr:g})"
            )
        return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}

    def mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Mean over ranks on the host (one sync): what metrics report."""
        return fdist.all_reduce_mean(values.to(self.dist.device)).cpu()

    def finish_update(self) -> None:
        """Count one update (the ``step`` counter checkpoints and resumes)."""
        self.step += 1

    @torch.no_grad()
    def _update_is_finite(self) -> bool:
        """Would this AdamW step keep every trainable weight and moment finite?

        AdamW's update, computed in fp64 on this rank's shards one parameter at a time (extra
        memory: a few copies of the largest shard) without touching the optimizer, must fit
        each tensor's dtype; agreed over ranks. With finite, clipped gradients only an
        overflow fails it (an lr near fp32's max, a huge unclipped gradient squared).
        """
        group = self.optimizer.param_groups[0]
        lr, (b1, b2) = group["lr"], group["betas"]
        eps, wd = group["eps"], group["weight_decay"]
        ok = torch.ones((), dtype=torch.bool, device=self.dist.device)
        for p in self.params:
            if p.grad is None:
                continue
            g, x = local(p.grad).double(), local(p).double()
            state = self.optimizer.state.get(p) or {}
            if "step" in state:
                step = float(state["step"]) + 1
                m = local(state["exp_avg"]).double() * b1 + g * (1 - b1)
                v = local(state["exp_avg_sq"]).double() * b2 + g * g * (1 - b2)
            else:
                step, m, v = 1.0, g * (1 - b1), g * g * (1 - b2)
            denom = v.sqrt() / math.sqrt(1 - b2**step) + eps
            new = x * (1 - lr * wd) - (lr / (1 - b1**step)) * m / denom
            top = torch.finfo(p.dtype).max
            ok &= (new.abs() <= top).all() & (v <= top).all() & (m.abs() <= top).all()
        return bool(fdist.all_reduce_min(ok.to(torch.float32)).item() > 0)

    @torch.no_grad()
    def weights_are_finite(self) -> bool:
        """True when every trainable weight (and EMA shadow) is finite on every rank
        (collective). Checkpoints are never written otherwise."""
        ok = torch.ones((), dtype=torch.bool, device=self.dist.device)
        tensors = list(self.params) + (list(self.ema.shadow) if self.ema is not None else [])
        for t in tensors:
            ok &= torch.isfinite(local(t)).all()
        return bool(fdist.all_reduce_min(ok.to(torch.float32)).item() > 0)

    # -- exports ---------------------------------------------------------------------------------
    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded CPU state dict on rank 0 ({} elsewhere). Collective: call on every rank."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        opts = StateDictOptions(
            full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only
        )
        return get_model_state_dict(self.model, options=opts)

    def export_lora(self, path: str | Path) -> Path:
        """Write the LoRA as diffusers' ``pytorch_lora_weights.safetensors`` (with the peft
        config as adapter metadata) that ``pipe.load_lora_weights(dir)`` loads. ``path`` is a
        directory, or a file name ending in .safetensors. Collective. Returns the file.
        Wan2.2's second expert goes to ``expert_file(name, "transformer_2")`` beside it
        (``pipe.load_lora_weights(dir, weight_name=..., load_into_transformer_2=True)``)."""
        if not self.use_lora:
            raise ValueError("export_lora needs lora.enabled; use save_full for a full fine-tune")
        path = Path(path)
        folder, name = (
            (path.parent, path.name)
            if path.suffix == ".safetensors"
            else (path, "pytorch_lora_weights.safetensors")
        )
        pipe_cls = type(self.adapter.pipe)
        if not hasattr(pipe_cls, "save_lora_weights"):
            raise TypeError(f"{pipe_cls.__name__} has no save_lora_weights: cannot export LoRA")
        state = self.full_state_dict(trainable_only=True)
        if self.dist.is_main:
            from peft.utils import get_peft_model_state_dict

            lora = get_peft_model_state_dict(self.model, state_dict=state)
            meta = self.model.peft_config["default"].to_dict()
            folder.mkdir(parents=True, exist_ok=True)
            split = getattr(self.model, "split_state_dict", None)  # Wan2.2's two experts
            parts = {"transformer": lora} if split is None else split(lora)
            for component, layers in parts.items():
                pipe_cls.save_lora_weights(
                    folder,
                    transformer_lora_layers=layers,
                    transformer_lora_adapter_metadata=meta,
                    weight_name=expert_file(name, component),
                )
        fdist.barrier()
        return folder / name

    def save_full(self, path: str | Path) -> Path:
        """``save_pretrained`` of the full transformer (LoRA merged into the base weights), so
        ``TransformerClass.from_pretrained(path)`` loads it (Wan2.2: ``path/transformer`` and
        ``path/transformer_2``, one per expert). Collective. Returns ``path``."""
        path = Path(path)
        state = self.full_state_dict()
        if self.dist.is_main:
            if self.use_lora:
                state = merge_lora(state, self.model.peft_config["default"])
            split = getattr(self.model, "split_state_dict", None)  # Wan2.2's two experts
            parts = {"": state} if split is None else split(state)
            for component, part in parts.items():
                cls = self.component_classes[component] if component else self.model_class
                expert = getattr(self.model, component) if component else self.model
                with torch.device("meta"):
                    fresh = cls.from_config(expert.config)
                fresh.load_state_dict(part, strict=True, assign=True)
                fresh.save_pretrained(path / component if component else path)
        fdist.barrier()
        return path


def merge_lora(state: dict[str, torch.Tensor], peft_config) -> dict[str, torch.Tensor]:
    """Fold peft LoRA Linear layers into their base weights: W + s B A with s = alpha / r
    (alpha / sqrt(r) with rslora), and drop the peft key infixes."""
    r, alpha = peft_config.r, peft_config.lora_alpha
    scale = alpha / math.sqrt(r) if getattr(peft_config, "use_rslora", False) else alpha / r
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if ".base_layer." in key:
            prefix, leaf = key.split(".base_layer.")
            a_key = f"{prefix}.lora_A.default.weight"
            if leaf == "weight" and a_key in state:
                a, b = state[a_key].float(), state[f"{prefix}.lora_B.default.weight"].float()
                if value.ndim != 2:
                    raise ValueError(f"cannot merge a LoRA into non-Linear weight {key}")
                value = (value.float() + scale * (b @ a)).to(value.dtype)
            key = f"{prefix}.{leaf}"
        out[key] = value
    return out


__all__ = [
    "DiffusersFSDPEngine",
    "LRLambda",
    "expert_file",
    "merge_lora",
    "resolve_dtype",
    "transformer_blocks",
]


def expert_file(name: str, component: str) -> str:
    """The LoRA file of a pipeline component: ``name`` for the transformer, ``<stem>_2.<ext>``
    for Wan2.2's ``transformer_2``."""
    if component == "transformer":
        return name
    stem, dot, ext = name.rpartition(".")
    return f"{stem}_2{dot}{ext}" if dot else f"{name}_2"
