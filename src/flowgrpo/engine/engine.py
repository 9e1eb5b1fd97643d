"""``DiffusersFSDPEngine``: a diffusers transformer under training, with FSDP2 + peft LoRA.

The engine wraps ``adapter.transformer`` in place (``flowgrpo.engine.parallelize``: LoRA, then
``fully_shard`` per block and on the root), so the sampler and the trainer keep using
``adapter.transformer``. This module holds its training machinery: the reference policy, the
EMA and other parameter shadows, the micro-batch plan balanced over ranks, backward with
FSDP's gradient sync, the optimizer step (global clipping, non-finite handling), and
``state_dict`` / ``load_state_dict`` (what a checkpoint persists, ``flowgrpo.engine.checkpoint``);
the exports are ``flowgrpo.engine.export``. It knows no loss and no reward: an algorithm
(``flowgrpo.algorithms``) writes the update loop with these. See docs/engine.md.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from flowgrpo.engine import dist as fdist
from flowgrpo.engine import export
from flowgrpo.engine.config import EngineConfig
from flowgrpo.engine.ema import EMA, ParamShadow, local
from flowgrpo.engine.parallelize import parallelize
from flowgrpo.engine.quant import base_quant
from flowgrpo.errors import TrainingDiverged
from flowgrpo.models.base import DiffusionAdapter
from flowgrpo.models.parallel import EngineDeclarations
from flowgrpo.settings import check_section


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
    reference's too: no rank holds it whole. ``declared``: what the family declares to the
    engine (``EngineDeclarations``: LoRA targets, SP spec, FSDP blocks), as the trainer passes
    it; None: ``adapter.engine_declarations()``. The engine imports no adapter and looks
    nothing up by class. Attributes: ``transformer`` (the wrapped module, same object as
    adapter.transformer), ``declared``, ``optimizer``, ``scheduler``, ``ema`` (or None), ``step`` (updates finished),
    ``optimizer_steps`` (applied updates), ``generator`` (shuffling; identical on all ranks).
    A checkpoint persists them through ``state_dict()`` / ``load_state_dict()``.
    """

    def __init__(
        self,
        adapter: DiffusionAdapter,
        config: EngineConfig | Any | None = None,
        dist: fdist.DistInfo | None = None,
        *,
        reference: bool = False,
        declared: EngineDeclarations | None = None,
    ):
        self.adapter = adapter
        self.config = cfg = config if config is not None else EngineConfig()
        check_section(cfg)
        self.dist = dist or fdist.init_distributed()
        model = adapter.transformer
        self.model_class = type(model)
        self.component_classes = export.component_classes(model)  # before sharding renames
        self.use_lora = cfg.lora.enabled
        device = self.dist.device
        if declared is None:
            declared = adapter.engine_declarations()
        self.declared = declared
        par = parallelize(model, cfg, self.dist, declared, reference=reference)
        self.param_dtype, self.reduce_dtype = par.param_dtype, par.reduce_dtype
        self.parallel = par.parallel  # the SP meshes when fsdp.sp_degree > 1
        self.mesh = par.mesh
        self._ref_model = par.reference
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
        self.optim_changes: dict[str, tuple[Any, Any]] = {}  # by load_state_dict: old, new

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

    @property
    def sp_size(self) -> int:
        """Ranks of one sequence-parallel group (fsdp.sp_degree; 1 without SP)."""
        return 1 if self.parallel is None else self.parallel.sp_size

    def dp_rows(self, gathered: torch.Tensor) -> torch.Tensor:
        """Of a tensor all-gathered over every rank ([world * n, ...], equal n), the rows of one
        rank per SP group (its copies on the other ranks of the group dropped): [dp * n, ...]."""
        sp = self.sp_size
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
        ``num_minibatches`` optimizer steps of micro-batches; the split is global, so each
        optimizer step trains on the same samples whatever the number of ranks.

        The data-parallel ranks' rows are all-gathered once (an SP group's ranks hold the same
        samples: counted once), in rank order: the global batch in the trainer's sample order
        (rank r holds the r-th contiguous share). One permutation of the global batch, drawn
        with the engine's generator (advanced identically on every rank, checkpointed), orders
        the samples within each minibatch and assigns them: each run of ``num_minibatches``
        consecutive samples gives one to every minibatch, so a rank's samples are spread evenly
        over the minibatches (the trainer's draw has already shuffled the samples over ranks).
        FSDP averages gradients over the data-parallel ranks, so a sample weighing dp_size /
        (the minibatch's samples on all of them) makes the update the mean over all of them.
        Every rank runs as many micro-batches as the rank with the most (zero-weight padding on
        one local sample) so FSDP's collectives line up, and an empty minibatch is dropped.
        ``MiniBatch.total``: its samples on all ranks, for the caller's weights.
        """
        rows = torch.as_tensor(rows, dtype=torch.long).reshape(-1)
        tagged = torch.stack(
            [torch.full_like(rows.cpu(), self.dp_rank), torch.full_like(rows.cpu(), self.sp_rank)]
        ).T
        every = fdist.all_gather_tensor(tagged.to(self.dist.device)).cpu()  # [N_all, 2]
        owner = every[every[:, 1] == 0, 0].sort(stable=True).values  # dp rank, global order
        n, m_count = len(owner), int(num_minibatches)
        key = torch.randperm(n, generator=self.generator)  # the global permutation
        chunk = torch.arange(n) // m_count
        order = torch.argsort(chunk * n + key)  # by run of num_minibatches, then by key
        minibatch = torch.empty(n, dtype=torch.long)
        minibatch[order] = torch.arange(n) - chunk[order] * m_count
        local = torch.zeros(n, dtype=torch.long)  # each global sample's place on its rank
        for r in owner.unique():
            mask = owner == r
            local[mask] = torch.arange(int(mask.sum()))
        by_key = torch.argsort(key)  # the global samples in the permutation's order
        plan = []
        for m in range(m_count):
            members = by_key[minibatch[by_key] == m]
            if len(members) == 0:  # nothing to learn from on any rank: no update at all
                continue
            counts = torch.bincount(owner[members], minlength=self.dp_size)
            mine = rows[local[members[owner[members] == self.dp_rank]].to(rows.device)]
            n_micro = max(-(-int(c) // micro_batch_size) for c in counts)  # ceil
            micro = [MicroBatch(c, 1.0) for c in mine.split(micro_batch_size) if len(c)]
            micro += [MicroBatch(torch.zeros(1, dtype=torch.long), 0.0)] * (n_micro - len(micro))
            plan.append(MiniBatch(micro, len(members)))
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

    # -- state (what a checkpoint persists: flowgrpo.engine.checkpoint) -----------------------
    def _dcp_options(self) -> StateDictOptions:
        return StateDictOptions(ignore_frozen_params=self.use_lora, strict=not self.use_lora)

    def state_dict(self) -> dict[str, Any]:
        """Everything a checkpoint needs to resume this engine exactly, by section:

        - ``model``, ``optim``: DCP's state dicts of the model (its trainable params only under
          LoRA) and of AdamW (keyed by param name), sharded;
        - ``ema`` (when on) and ``shadow.<name>`` (the algorithms' copies): sharded, by param name;
        - ``engine``: plain host data, the same on every rank: the update counters, the LR
          scheduler's state and the shuffle generator's.

        The sharded sections hold the live tensors: ``dcp.load`` fills them in place, then
        ``load_state_dict`` applies the result. Call on every rank."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._dcp_options())
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if self.ema is not None:
            state["ema"] = self.ema.state_dict(self.param_names)
        for name, shadow in self.shadows.items():  # the algorithms' (an old policy)
            state[f"shadow.{name}"] = shadow.state_dict(self.param_names)
        state["engine"] = {
            "step": self.step,
            "optimizer_steps": self.optimizer_steps,
            "consecutive_skips": self.consecutive_skips,
            "scheduler": self.scheduler.state_dict(),
            "generator": self.generator.get_state(),
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` (its sharded sections filled by ``dcp.load``). Without
        ``ema`` the EMA starts from the loaded weights, without ``shadow.<name>`` that copy does
        too. The LR schedule's shape and AdamW's lr / weight_decay / betas / eps are the
        configured ones, not the state's (``apply_configured_optim``; what changed is left in
        ``optim_changes``). Collective."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._dcp_options(),
        )
        for name, shadow in self.shadows.items():
            if f"shadow.{name}" in state:
                shadow.load_state_dict(state[f"shadow.{name}"], self.param_names)
            else:
                shadow.reset_()
        if self.ema is not None:
            if "ema" in state:
                self.ema.load_state_dict(state["ema"], self.param_names)
            else:  # a state without EMA: start the EMA from the loaded weights
                self.ema = EMA(self.params, self.ema.decay, self.ema.update_every)
        es = state["engine"]
        self.step = es["step"]
        self.optimizer_steps = es["optimizer_steps"]
        self.consecutive_skips = es["consecutive_skips"]
        self.scheduler.load_state_dict(es["scheduler"])
        o = self.config.optim  # LambdaLR restores its lambda's fields: the current config wins
        self.scheduler.lr_lambdas[0] = LRLambda(o.lr_schedule, o.warmup_steps, o.total_steps)
        self.optim_changes = self.apply_configured_optim()
        self.generator.set_state(es["generator"])

    def apply_configured_optim(self) -> dict[str, tuple[Any, Any]]:
        """Make the configured ``optim.lr`` / ``weight_decay`` / ``betas`` / ``eps`` the ones the
        next step uses: a restored optimizer and LR scheduler carry the checkpoint's (the LR
        schedule continues from its step with the configured base LR). Returns {setting:
        (checkpoint's value, configured value)} for those that differ (empty when none)."""
        o, sched = self.config.optim, self.scheduler
        groups = self.optimizer.param_groups
        want = {
            "lr": float(o.lr),
            "weight_decay": float(o.weight_decay),
            "betas": tuple(float(b) for b in o.betas),
            "eps": float(o.eps),
        }
        had = {
            "lr": float(sched.base_lrs[0]),
            "weight_decay": float(groups[0]["weight_decay"]),
            "betas": tuple(float(b) for b in groups[0]["betas"]),
            "eps": float(groups[0]["eps"]),
        }
        sched.base_lrs = [want["lr"]] * len(groups)
        for group, factor in zip(groups, sched.lr_lambdas, strict=True):
            group.update(initial_lr=want["lr"], weight_decay=want["weight_decay"], eps=want["eps"])
            group.update(betas=want["betas"], lr=want["lr"] * factor(sched.last_epoch))
        return {k: (had[k], want[k]) for k in want if had[k] != want[k]}

    # -- exports (flowgrpo.engine.export) ----------------------------------------------------
    def full_state_dict(self, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Unsharded CPU state dict on rank 0 ({} elsewhere). Collective: call on every rank."""
        return export.full_state_dict(self.model, trainable_only)

    def export_lora(self, path: str | Path) -> Path:
        """Write the LoRA as diffusers' ``pytorch_lora_weights.safetensors`` (with the peft
        config as adapter metadata) that ``pipe.load_lora_weights(dir)`` loads. ``path`` is a
        directory, or a file name ending in .safetensors. Collective. Returns the file.
        A module of several components (two experts) writes each one's file beside it, named
        by the module (``lora_file_name``)."""
        if not self.use_lora:
            raise ValueError("export_lora needs lora.enabled; use save_full for a full fine-tune")
        quant = base_quant(self.config)
        note = None if quant == "none" else {"flowgrpo_trained_on_base_quant": quant}
        return export.export_lora(self.model, type(self.adapter.pipe), self.dist, path, note)

    def save_full(self, path: str | Path) -> Path:
        """``save_pretrained`` of the full transformer (LoRA merged into the base weights), so
        ``TransformerClass.from_pretrained(path)`` loads it (a module of several components:
        ``path/<component>`` for each). Collective. Returns ``path``."""
        return export.save_full(
            self.model, self.model_class, self.component_classes, self.dist, path, self.use_lora
        )


__all__ = ["DiffusersFSDPEngine", "LRLambda", "MicroBatch", "MiniBatch"]
