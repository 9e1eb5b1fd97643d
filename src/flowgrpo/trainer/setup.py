"""Build what a run needs from a ``Config``: the adapter, the engine, the rewards, the prompt
streams and the prompt cache; and the figures the loop derives from the config (the global
batch, each rank's eval share, the eval grid's layout, the planned memory).

The seeds live in ``flowgrpo.trainer.seeds`` and the run folder in
``flowgrpo.trainer.run_folder``; their names imported from here before are kept importable.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from flowgrpo.engine.dist import DistInfo
from flowgrpo.trainer.run_folder import resolve_checkpoint as resolve_checkpoint
from flowgrpo.trainer.seeds import EVAL_SALT as EVAL_SALT
from flowgrpo.trainer.seeds import GROUP_SALT as GROUP_SALT
from flowgrpo.trainer.seeds import SAMPLE_SALT as SAMPLE_SALT
from flowgrpo.trainer.seeds import generators as generators
from flowgrpo.trainer.seeds import group_generators as group_generators
from flowgrpo.trainer.seeds import sample_seed as sample_seed


def build_adapter_for(cfg: Any, dist: DistInfo) -> Any:
    """The pipeline at ``model.path`` (a local diffusers directory or a built-in one) wrapped
    in its adapter, on this rank's device, in ``model.dtype`` ("auto": bf16 on CUDA, else fp32);
    the trained transformer(s) on the meta device, for ``build_engine`` to load sharded.
    The adapter options that differ from their defaults (its family's section, the shared
    ``model.*`` ones: ``config.checks.adapter_kwargs``) go to the adapter; one it does not take
    is a clear error."""
    from flowgrpo.config.checks import adapter_kwargs
    from flowgrpo.engine.load import move_components
    from flowgrpo.models.registry import build_adapter, load_pipeline
    from flowgrpo.settings import resolve_dtype

    m = cfg.model
    dtype = resolve_dtype(m.dtype, dist.device)
    if not m.path:
        raise ValueError("model.path is required: a local diffusers directory or builtin:NAME")
    # the trained transformer(s) stay on the meta device: the engine loads each rank's shards
    pipe = load_pipeline(m.path, torch_dtype=dtype, empty_trained=True)
    if m.base_quant != "none" and cfg.lora.enabled:  # the frozen text encoders, as the base
        from flowgrpo.engine.quant import quantize_text_encoders

        quantize_text_encoders(pipe, m.base_quant)
    if dist.device.type != "cpu":
        move_components(pipe, dist.device)
    options = adapter_kwargs(cfg, type(pipe))
    vae = getattr(pipe, "vae", None)
    for on, name in ((m.vae_slicing, "enable_slicing"), (m.vae_tiling, "enable_tiling")):
        if on and hasattr(vae, name):  # the VAE decodes a sample (a tile) at a time
            getattr(vae, name)()
    return build_adapter(pipe, **options)


def prepare_prompt_cache(
    cfg: Any, adapter: Any, dist: DistInfo, prompt_sets: list[list[str]]
) -> None:
    """``model.embed_cache_dir``: give the adapter a prompt-embedding cache, encode every
    prompt of ``prompt_sets`` and the negative prompts that is missing (each
    rank a share, then each rank what it still cannot read: the folder need not be shared),
    then apply ``model.text_encoder_offload``. Collective."""
    from flowgrpo.config.checks import check_prompt_cache
    from flowgrpo.engine.dist import barrier
    from flowgrpo.models.prompt_cache import PromptEmbedCache

    m = cfg.model
    if not m.embed_cache_dir:
        return
    check_prompt_cache(adapter.edits, m.embed_cache_dir)  # the planner asks it too
    cache = PromptEmbedCache(m.embed_cache_dir, adapter)
    prompts = [p for prompt_set in prompt_sets for p in prompt_set]
    prompts += [cfg.sample.negative_prompt, adapter.default_negative_prompt]
    todo = cache.missing(prompts)
    cache.prepare(todo[dist.rank :: dist.world_size])
    barrier()
    cache.prepare(todo)
    adapter.prompt_cache = cache
    cache.release_text_encoders(m.text_encoder_offload)


def build_engine(cfg: Any, adapter: Any, dist: DistInfo) -> tuple[Any, Any]:
    """(engine, algorithm): the engine reads its sections (lora, optim, fsdp, ema, seed) from
    the run config itself, gets what the family declares (LoRA targets, SP spec, FSDP blocks)
    from the adapter and keeps a reference copy when the algorithm needs one; the algorithm
    (``cfg.algorithm``) reads its own section."""
    from flowgrpo.algorithms import algorithm_class
    from flowgrpo.engine.engine import DiffusersFSDPEngine

    algo_cls = algorithm_class(cfg.algorithm)
    reference = algo_cls.needs_reference(getattr(cfg, cfg.algorithm))
    engine = DiffusersFSDPEngine(
        adapter, cfg, dist, reference=reference, declared=adapter.engine_declarations()
    )
    return engine, algo_cls(cfg, engine, adapter)


def build_rewards(specs: Any, device: torch.device | str | None = None) -> Any:
    """MultiReward from a list of RewardSpec (``cfg.reward`` or ``cfg.eval_reward``); None for
    an empty list. Reward models that take a ``device`` option run on ``device`` (the run's)
    unless their options say otherwise."""
    from flowgrpo.rewards import MultiReward

    return MultiReward(specs, device=device) if specs else None


def build_data(cfg: Any) -> tuple[Any, Any, Any]:
    """(train PromptDataset, KRepeatSampler, eval PromptDataset with each eval prompt repeated
    ``data.eval_samples_per_prompt`` times)."""
    from flowgrpo.data.prompts import KRepeatSampler, prompt_splits, repeat_for_eval

    train, ev = prompt_splits(cfg.data, cfg.seed)
    sampler = KRepeatSampler(
        len(train),
        cfg.sample.prompts_per_step,
        cfg.sample.group_size,
        seed=cfg.seed,
        shuffle=cfg.data.shuffle,
        whole_groups=cfg.sample.branching.enabled,  # one tree per group, on one rank
    )
    return train, sampler, repeat_for_eval(ev, cfg.data.eval_samples_per_prompt)


def build_eval_data(cfg: Any) -> Any:
    """The eval PromptDataset alone (``flowgrpo eval``): ``data.eval_prompts`` when given (no
    training prompts needed), else the split ``build_data`` makes; each prompt repeated
    ``data.eval_samples_per_prompt`` times."""
    from flowgrpo.data.prompts import load_prompts, prompt_splits, repeat_for_eval

    d = cfg.data
    if d.eval_prompts:
        ev = load_prompts(d.eval_prompts)
        if 0 < d.eval_num_prompts < len(ev):
            ev = ev.subset(range(d.eval_num_prompts))
    else:
        ev = prompt_splits(d, cfg.seed)[1]
    return repeat_for_eval(ev, d.eval_samples_per_prompt)


def planned_memory(cfg: Any, dist: DistInfo) -> str | None:
    """The banner's planned memory per rank (``flowgrpo.planner.planned_line``) against
    this device's memory (a GPU's, or the host's on a CPU); None where it cannot be planned."""
    from flowgrpo.planner import planned_line

    if dist.device.type == "cuda":
        total = torch.cuda.get_device_properties(dist.device).total_memory
    else:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return planned_line(cfg, dist.world_size, dist.device.type, total / 1e9)


def global_batch_size(cfg: Any) -> int:
    """The samples of one step over all ranks: m prompts x K samples each."""
    return cfg.sample.prompts_per_step * cfg.sample.group_size


def padded_shard(n: int, rank: int, size: int) -> tuple[list[int], int]:
    """Data-parallel rank ``rank``'s share of n items as (indices, number of real ones): padded
    by repeating an index to ceil(n / size) so every rank runs the same number of forwards
    (FSDP collectives must match); the padding's results are dropped."""
    per = -(-n // size)
    idx = list(range(rank * per, min(n, (rank + 1) * per)))
    real = len(idx)
    fill = idx[-1] if idx else n - 1
    return idx + [fill] * (per - real), real


def grid_layout(n: int, samples_per_prompt: int, cap: int = 64) -> tuple[set[int], int]:
    """Eval images for the grids when the eval set is each prompt ``samples_per_prompt`` times
    in a row: (their indices, columns). Few prompts: one row per prompt, one column per seed.
    Many prompts (or one sample each): the first seed of up to ``cap`` prompts, 8 columns."""
    per = max(1, samples_per_prompt)
    prompts = max(1, n // per)
    if per == 1 or 2 * prompts > cap:
        firsts = list(range(0, n, per))[:cap]
        return set(firsts), min(8, len(firsts))
    cols = min(per, cap // prompts)
    return {p * per + j for p in range(prompts) for j in range(cols)}, cols


def optim_changes_line(changes: dict[str, tuple[Any, Any]], step: int) -> str:
    """One line saying which optimizer settings a resume changed ({name: (old, new)})."""
    what = ", ".join(f"optim.{k} {_short(a)} -> {_short(b)}" for k, (a, b) in changes.items())
    return f"optimizer settings changed on resume, in effect from step {step}: {what}"


def _short(v: Any) -> str:
    return f"({', '.join(f'{x:g}' for x in v)})" if isinstance(v, tuple) else f"{v:g}"
