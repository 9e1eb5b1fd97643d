"""``DiffusersFSDPEngine``: Flow-GRPO training of a diffusers transformer with FSDP2 + peft LoRA.

The engine wraps ``adapter.transformer`` in place (LoRA, then ``fully_shard`` per block and on
the root), so the sampler and the trainer keep using ``adapter.transformer``. It is given
trajectories and advantages, returns metrics, and knows nothing about rewards. See
docs/engine.md.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
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

from flowgrpo.algo.losses import flow_grpo_loss, kl_penalty_image
from flowgrpo.engine import dist as fdist
from flowgrpo.engine.config import EngineConfig
from flowgrpo.engine.ema import EMA, local
from flowgrpo.errors import TrainingDiverged
from flowgrpo.models.base import DiffusionAdapter
from flowgrpo.rollout.sampler import Trajectory, trajectory_log_prob
from flowgrpo.settings import check_section

_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")
#: what ``_loss`` returns, in order (the last four are ``flow_grpo_loss``'s metrics)
METRIC_KEYS = (
    "loss",
    "policy_loss",
    "kl",
    "approx_kl",
    "approx_kl_k2",
    "clipfrac",
    "ratio_mean",
)


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
    ``lora``, ``optim``, ``loss``, ``fsdp``, ``ema``, ``update`` and a ``seed`` (read as they
    are, never copied). Attributes: ``transformer`` (the wrapped module, same object as adapter.transformer),
    ``optimizer``, ``scheduler``, ``ema`` (or None), ``step`` (train_step calls),
    ``optimizer_steps`` (applied updates), ``generator`` (shuffling; identical on all ranks).
    """

    def __init__(
        self,
        adapter: DiffusionAdapter,
        config: EngineConfig | Any | None = None,
        dist: fdist.DistInfo | None = None,
    ):
        self.adapter = adapter
        self.config = cfg = config if config is not None else EngineConfig()
        check_section(cfg)
        self.dist = dist or fdist.init_distributed()
        model = adapter.transformer
        self.model_class = type(model)
        self.use_lora = cfg.lora.enabled
        device = self.dist.device
        self.param_dtype = resolve_dtype(cfg.fsdp.param_dtype, device)
        self.reduce_dtype = resolve_dtype(cfg.fsdp.reduce_dtype, device)

        self._ref_model: nn.Module | None = None
        if not self.use_lora and cfg.loss.kl_beta > 0:
            self._ref_model = copy.deepcopy(model).requires_grad_(False)
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

        self.mesh = fdist.build_mesh(
            self.dist.world_size, cfg.fsdp.replicate_degree, device_type=device.type
        )
        self._shard(model)
        if self._ref_model is not None:
            self._shard(self._ref_model)
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
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.step = 0
        self.optimizer_steps = 0
        self.consecutive_skips = 0

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
        kw = dict(mesh=self.mesh, reshard_after_forward=fs.reshard_after_forward)
        for block in transformer_blocks(model):
            fully_shard(block, mp_policy=block_mp, offload_policy=offload, **kw)
        fully_shard(model, mp_policy=root_mp, offload_policy=offload, **kw)

    # -- policies ------------------------------------------------------------------------------
    @property
    def transformer(self) -> nn.Module:
        return self.model

    @contextmanager
    def reference_transformer(self) -> Iterator[nn.Module]:
        """The KL reference policy: the same transformer with every LoRA layer disabled, or
        the frozen sharded copy of the initial weights (full fine-tune with kl_beta > 0)."""
        if self._ref_model is not None:
            yield self._ref_model
            return
        if not self.use_lora:
            raise RuntimeError("full fine-tuning keeps a reference copy only when kl_beta > 0")
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
        """EMA update for the last applied optimizer step (train_step calls it already)."""
        return False if self.ema is None else self.ema.update(self.optimizer_steps - 1)

    # -- training ------------------------------------------------------------------------------
    def train_step(self, trajectory: Trajectory, advantages: torch.Tensor) -> dict[str, float]:
        """``num_minibatches`` optimizer steps on this rank's samples (shuffled by the engine's
        generator), each accumulating grads over micro-batches x trained steps.

        advantages: [B] for the B = len(trajectory) local samples. With
        ``skip_zero_advantage`` samples whose advantage is exactly 0 (groups whose rewards are
        all equal) are dropped first, as flow_grpo does: they carry no policy gradient and
        would only dilute the mean and cost a forward and backward each. The loss is a mean
        over the kept samples of all ranks; every rank runs the same number of micro-batches
        (zero-weight padding where it kept fewer) so FSDP's collectives line up. Returns global
        means (over ranks and optimizer steps) of the loss terms, grad_norm, lr and skipped,
        and the global counts ``samples_trained`` and ``samples_dropped``.
        """
        cfg = self.config
        batch = len(trajectory)
        adv = torch.as_tensor(advantages, dtype=torch.float32).reshape(-1)
        if adv.numel() != batch:
            raise ValueError(f"got {adv.numel()} advantages for a trajectory of {batch} samples")
        if batch < cfg.update.num_minibatches:
            raise ValueError(
                f"{batch} samples cannot fill {cfg.update.num_minibatches} minibatches"
            )
        if cfg.loss.kl_beta > 0 and (trajectory.noise_level <= 0 or trajectory.sde_type == "ode"):
            raise ValueError("kl_beta > 0 needs a stochastic trajectory (noise_level > 0, sde/cps)")
        adv = adv.to(trajectory.latents.device)
        kept = torch.arange(batch)
        if cfg.loss.skip_zero_advantage:
            kept = (adv.cpu() != 0).nonzero().squeeze(1)
        perm = kept[torch.randperm(len(kept), generator=self.generator)]
        minibatches = torch.tensor_split(perm, cfg.update.num_minibatches)
        # kept samples per (rank, minibatch): the global loss normalisation and micro-batch count
        counts = torch.tensor([len(mb) for mb in minibatches], device=self.dist.device)
        counts = fdist.all_gather_tensor(counts[None]).cpu()  # [world, num_minibatches]
        rows = []
        for m, mb in enumerate(minibatches):
            global_kept = int(counts[:, m].sum())
            if global_kept == 0:  # nothing to learn from on any rank: no update at all
                continue
            n_micro = max(-(-int(c) // cfg.update.micro_batch_size) for c in counts[:, m])  # ceil
            rows.append(self._optimizer_step(trajectory, adv, mb, global_kept, n_micro))
        self.step += 1
        total = int(counts.sum())
        if rows:
            out = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
        else:  # every advantage was 0: no optimizer step ran
            lr = float(self.optimizer.param_groups[0]["lr"])
            out = {**dict.fromkeys(METRIC_KEYS, 0.0), "grad_norm": 0.0, "lr": lr, "skipped": 0.0}
        out["optimizer_steps"] = float(sum(1 - r["skipped"] for r in rows))
        out["samples_trained"] = float(total)
        out["samples_dropped"] = float(batch * self.dist.world_size - total)
        return out

    def _micro_batches(
        self, index: torch.Tensor, n_micro: int
    ) -> Iterator[tuple[torch.Tensor, float]]:
        """(rows, weight of each row's loss) for ``n_micro`` micro-batches: this rank's rows in
        chunks of ``micro_batch_size``, then zero-weight padding (one local sample) so every
        rank runs ``n_micro`` forward/backward passes."""
        chunks = [c for c in index.split(self.config.update.micro_batch_size) if len(c)]
        for rows in chunks:
            yield rows, 1.0
        for _ in range(n_micro - len(chunks)):
            yield torch.zeros(1, dtype=torch.long), 0.0

    def _optimizer_step(
        self,
        traj: Trajectory,
        adv: torch.Tensor,
        index: torch.Tensor,
        global_kept: int,
        n_micro: int,
    ) -> dict[str, float]:
        """One optimizer step over this rank's rows ``index`` of a minibatch that holds
        ``global_kept`` samples on all ranks: each sample's loss (averaged over the trained
        steps) weighs world / global_kept, so FSDP's gradient average over ranks gives the
        mean over the minibatch's samples."""
        cfg, model = self.config, self.model
        num_steps = traj.num_train_steps
        sample_weight = self.dist.world_size / (global_kept * num_steps)
        sums = torch.zeros(len(METRIC_KEYS), dtype=torch.float64, device=self.dist.device)
        self.optimizer.zero_grad(set_to_none=True)
        n_tasks, done = n_micro * num_steps, 0
        for rows, scale in self._micro_batches(index, n_micro):
            sub = traj.select(rows)
            sub_adv = adv[rows.to(adv.device)] * scale
            weight = len(rows) * sample_weight * scale
            for k in range(num_steps):
                done += 1
                if isinstance(model, FSDPModule):  # reduce-scatter only after the last backward
                    model.set_requires_gradient_sync(done == n_tasks)
                terms = self._loss(sub, sub_adv, k)
                (terms[0] * weight).backward()
                sums += weight * torch.stack([t.detach().double().to(sums.device) for t in terms])
        stats = fdist.all_reduce_mean(sums).cpu()  # one host sync per optimizer step
        loss_finite = bool(torch.isfinite(stats).all())
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
        out = {k: float(v) for k, v in zip(METRIC_KEYS, stats, strict=True)}
        out.update(grad_norm=grad_norm, lr=lr, skipped=float(skipped))
        return out

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

    def _loss(self, sub: Trajectory, adv: torch.Tensor, k: int) -> list[torch.Tensor]:
        """[loss, policy_loss, kl, approx_kl, approx_kl_k2, clipfrac, ratio_mean] for trained
        step k; the gradient flows through both guidance branches unless ``cfg_grad`` says
        "cond_only"."""
        lc = self.config.loss
        ref_mean = None
        if lc.kl_beta > 0:
            with torch.no_grad(), self.reference_transformer() as ref:
                ref_mean = trajectory_log_prob(self.adapter, ref, sub, k).prev_sample_mean
        out = trajectory_log_prob(
            self.adapter, self.model, sub, k, cfg_grad=self.config.loss.cfg_grad
        )
        policy_loss, m = flow_grpo_loss(
            out.log_prob,
            sub.log_probs[:, k],
            adv,
            clip_range=lc.clip_range,
            adv_clip_max=lc.adv_clip_max,
        )
        loss = policy_loss
        if ref_mean is not None:
            kl = kl_penalty_image(out.prev_sample_mean, ref_mean, out.std_dev_t).mean()
            loss = loss + lc.kl_beta * kl
        else:
            kl = torch.zeros((), device=policy_loss.device)
        return [loss, policy_loss, kl, *(m[key] for key in METRIC_KEYS[3:])]

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
        directory, or a file name ending in .safetensors. Collective. Returns the file."""
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
            pipe_cls.save_lora_weights(
                folder,
                transformer_lora_layers=lora,
                transformer_lora_adapter_metadata=meta,
                weight_name=name,
            )
        fdist.barrier()
        return folder / name

    def save_full(self, path: str | Path) -> Path:
        """``save_pretrained`` of the full transformer (LoRA merged into the base weights), so
        ``TransformerClass.from_pretrained(path)`` loads it. Collective. Returns ``path``."""
        path = Path(path)
        state = self.full_state_dict()
        if self.dist.is_main:
            if self.use_lora:
                state = merge_lora(state, self.model.peft_config["default"])
            with torch.device("meta"):
                fresh = self.model_class.from_config(self.model.config)
            fresh.load_state_dict(state, strict=True, assign=True)
            fresh.save_pretrained(path)
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


__all__ = ["DiffusersFSDPEngine", "LRLambda", "merge_lora", "resolve_dtype", "transformer_blocks"]
