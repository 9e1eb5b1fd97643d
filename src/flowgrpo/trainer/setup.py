"""Build what the loop needs from a ``Config``: the adapter, the engine, the rewards, the prompt
streams, and the per-sample random generators that make every step a pure function of
(seed, step, restored state).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import torch

from flowgrpo.engine.dist import DistInfo

EVAL_SALT = 0x5EED_E7A1  # stream of the fixed eval noise (independent of the step)
SAMPLE_SALT = 0x5A4D_91E0  # stream of `flowgrpo sample`
GROUP_SALT = 0x6E0_0000_0000  # per-group streams (sample.same_latent), apart from sample indices


def sample_seed(seed: int, step: int, index: int) -> int:
    """A 63-bit seed for sample ``index`` of ``step`` (splitmix64-style mixing, no collisions
    between neighbouring (step, index) pairs in practice)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(step) * 0xBF58476D1CE4E5B9 + int(index)) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return (x ^ (x >> 31)) % 2**63


def generators(
    seed: int, step: int, indices: list[int], device: torch.device | str
) -> list[torch.Generator]:
    """One generator per sample, seeded from (seed, step, global sample index): a sample's
    noise is the same whatever the batch, the rank or a resume."""
    out = []
    for i in indices:
        g = torch.Generator(device=device)
        g.manual_seed(sample_seed(seed, step, i))
        out.append(g)
    return out


def group_generators(
    seed: int, step: int, groups: list[int], device: torch.device | str
) -> list[torch.Generator]:
    """One generator per sample, seeded from (seed, step, the sample's group): every sample of a
    group draws the same initial noise, whatever the batch, the rank or a resume."""
    return generators(seed, step, [GROUP_SALT + int(g) for g in groups], device)


def build_adapter_for(cfg: Any, dist: DistInfo) -> Any:
    """The pipeline at ``model.path`` (a local diffusers directory or a built-in one) wrapped
    in its adapter, on this rank's device, in ``model.dtype`` ("auto": bf16 on CUDA, else fp32);
    the trained transformer(s) on the meta device, for ``build_engine`` to load sharded.
    The family options (``model.*`` settings some adapter takes, ``registry.family_options``)
    that differ from their defaults go to the adapter; one it does not take is a clear error."""
    from flowgrpo.engine.load import move_components
    from flowgrpo.models.registry import (
        adapter_options,
        build_adapter,
        family_options,
        load_pipeline,
    )
    from flowgrpo.settings import resolve_dtype

    m = cfg.model
    dtype = resolve_dtype(m.dtype, dist.device)
    if not m.path:
        raise ValueError("model.path is required: a local diffusers directory or builtin:NAME")
    # the trained transformer(s) stay on the meta device: the engine loads each rank's shards
    pipe = load_pipeline(m.path, torch_dtype=dtype, empty_trained=True)
    if dist.device.type != "cpu":
        move_components(pipe, dist.device)
    family, defaults = family_options(), type(m)()
    options = {
        f.name: getattr(m, f.name)
        for f in dataclasses.fields(m)
        if f.name in family and getattr(m, f.name) != getattr(defaults, f.name)
    }
    takes = adapter_options(type(pipe))
    for key in options:
        if key not in takes:
            raise ValueError(f"model.{key} does not apply to {type(pipe).__name__}")
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
    from flowgrpo.engine.dist import barrier
    from flowgrpo.models.prompt_cache import PromptEmbedCache

    m = cfg.model
    if not m.embed_cache_dir:
        return
    if adapter.edits:
        raise ValueError(
            "model.embed_cache_dir: an editing model's prompt embeddings depend on each "
            "sample's source images, so they are not cached; unset model.embed_cache_dir"
        )
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
    the run config itself and keeps a reference copy when the algorithm needs one; the
    algorithm (``cfg.algorithm``) reads its own section."""
    from flowgrpo.algorithms import algorithm_class
    from flowgrpo.engine.engine import DiffusersFSDPEngine

    algo_cls = algorithm_class(cfg.algorithm)
    reference = algo_cls.needs_reference(getattr(cfg, cfg.algorithm))
    engine = DiffusersFSDPEngine(adapter, cfg, dist, reference=reference)
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
    """The banner's planned memory per rank (``flowgrpo.config.memory.planned_line``) against
    this device's memory (a GPU's, or the host's on a CPU); None where it cannot be planned."""
    from flowgrpo.config.memory import planned_line

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


#: inside the folders a run writes to, the names it writes (run.overwrite deletes these only)
RUN_WRITES = {
    "checkpoints": re.compile(r"step_\d+(\.tmp)?"),  # abandoned_after_step_*: never deleted
    "tensorboard": re.compile(r"events\.out\.tfevents\..+"),
    "wandb": re.compile(r"(offline-)?run-.+|latest-run|debug(-internal)?\.log|wandb-resume\.json"),
}
LOCK_FILE = ".flowgrpo.lock"
_held_locks: list[Any] = []  # this process's open, locked lock files


def prepare_output_dir(cfg: Any, dist: DistInfo, *, fresh: bool) -> Path:
    """``run.output_dir``, created, checked writable and locked for this run
    (``lock_output_dir``; RunError naming it otherwise). A fresh run with ``run.overwrite``
    first deletes what an earlier run wrote there (``remove_run_outputs``). Collective."""
    from flowgrpo.engine.dist import barrier
    from flowgrpo.errors import RunError

    out = Path(cfg.run.output_dir)
    if dist.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
            lock_output_dir(out)
            if fresh and cfg.run.overwrite:
                remove_run_outputs(out)
            probe = out / ".flowgrpo-write-test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as e:
            raise RunError(
                f"cannot write to run.output_dir {out}: {e.strerror or e}; choose a writable "
                "folder (run.output_dir=...)"
            ) from None
    barrier()
    return out


def remove_run_outputs(out: Path) -> None:
    """Delete what a run writes in ``out``: the files of ``RUN_OUTPUTS`` and, inside its
    folders (checkpoints/, tensorboard/, wandb/), the names of ``RUN_WRITES`` only; a folder
    left empty goes too. Anything else (a user's checkpoints/my_model.safetensors or
    step_best.tmp/) stays, and so does a checkpoint another run wrote (not one of the run ids
    recorded in ``.flowgrpo-run-ids``: ``run_files.removable_checkpoint``), said in one line."""
    import warnings

    from flowgrpo.config.validate import RUN_OUTPUTS
    from flowgrpo.trainer.run_files import recorded_run_ids, removable_checkpoint

    kept = []
    for name in RUN_OUTPUTS:
        target = out / name
        pattern = RUN_WRITES.get(name)
        if pattern is not None and target.is_dir() and not target.is_symlink():
            ids = recorded_run_ids(out) if name == "checkpoints" else None
            for entry in sorted(target.iterdir()):
                if not pattern.fullmatch(entry.name):
                    continue
                if name == "checkpoints" and entry.name.startswith("step_"):
                    if not entry.is_dir() or not removable_checkpoint(entry, ids):
                        kept.append(entry.name)
                        continue
                _remove(entry)
            if not any(target.iterdir()):
                target.rmdir()
        elif target.exists() or target.is_symlink():
            _remove(target)
    if kept:
        warnings.warn(
            f"run.overwrite kept {', '.join(kept)} in {out / 'checkpoints'}: not written by the "
            "run it overwrites (another run's, or not a checkpoint); move it away yourself "
            "if it should go",
            stacklevel=2,
        )


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


def lock_output_dir(out: Path) -> None:
    """Hold ``out/.flowgrpo.lock`` (an exclusive ``flock``) until ``release_output_dir``: a
    second run into a folder that a live run holds is refused with a RunError naming the
    holder. The system drops the lock when its process ends, so a killed run's lock never
    blocks a resume. Rank 0 takes it for the whole run."""
    import fcntl
    import os
    import socket
    import warnings

    from flowgrpo.errors import RunError

    path = out / LOCK_FILE
    while True:
        f = open(path, "a+")  # noqa: SIM115 - held open for the run
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = " ".join(f.read().split()) or "another process"
            f.close()
            raise RunError(
                f"run.output_dir {out} is in use by a running training run ({holder}): wait "
                "for it to end or stop it, or choose another run.output_dir"
            ) from None
        except OSError as e:  # a file system without flock (some network mounts)
            f.close()
            warnings.warn(
                f"cannot lock run.output_dir {out} ({e.strerror or e}): the run goes on "
                "unlocked; do not start a second run into this folder meanwhile",
                stacklevel=2,
            )
            return
        try:  # a release may have removed the file between open and flock: lock the new one
            same = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        f.close()
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    _held_locks.append((path, f))


def release_output_dir() -> None:
    """Remove and unlock the run-folder locks this process holds (the end of a run)."""
    while _held_locks:
        path, f = _held_locks.pop()
        path.unlink(missing_ok=True)  # still locked: no other run can hold it meanwhile
        f.close()


def new_run_id() -> str:
    """A random id shared by every rank: checkpoints carry it so that pruning only ever
    removes this run's own checkpoints. Collective."""
    import uuid

    from flowgrpo.engine.dist import all_gather_object

    return all_gather_object(uuid.uuid4().hex)[0]


def optim_changes_line(changes: dict[str, tuple[Any, Any]], step: int) -> str:
    """One line saying which optimizer settings a resume changed ({name: (old, new)})."""
    what = ", ".join(f"optim.{k} {_short(a)} -> {_short(b)}" for k, (a, b) in changes.items())
    return f"optimizer settings changed on resume, in effect from step {step}: {what}"


def _short(v: Any) -> str:
    return f"({', '.join(f'{x:g}' for x in v)})" if isinstance(v, tuple) else f"{v:g}"


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or a run / checkpoints directory -> its newest complete one."""
    from flowgrpo.engine.checkpoint import latest_checkpoint

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint '{path}' does not exist")
    for root in (p / "checkpoints", p):
        found = latest_checkpoint(root) if root.is_dir() else None
        if found is not None and Path(found) != p and Path(found).parent == root:
            return Path(found)
    return p


def resolve_resume(resume: Any, ckpt_root: Path) -> Path | None:
    """trainer.resume: None/""/false -> fresh run; "auto" -> newest complete checkpoint under
    ``ckpt_root`` (fresh run if none); anything else -> that checkpoint path (must exist)."""
    from flowgrpo.engine.checkpoint import latest_checkpoint

    if resume in (None, "", False, "none", "false", "never"):
        return None
    if resume == "auto":
        found = latest_checkpoint(ckpt_root) if ckpt_root.is_dir() else None
        return Path(found) if found is not None else None
    return resolve_checkpoint(resume)
