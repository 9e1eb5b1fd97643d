"""The run configuration: one dataclass per section, each setting declared once.

Every field is a ``flowgrpo.settings.setting``: its default, its one-line help (the docs table
and ``flowgrpo config show`` print it) and its range check live together; rules that tie
fields together are the section's ``check()``. The engine's sections (``lora``, ``optim``,
``fsdp``, ``ema``) are declared in ``flowgrpo.engine.config`` and read by the engine from this
config directly; the algorithms' (``update``, and one section per registered algorithm, named
as it, added by ``_with_algorithm_sections``) in ``flowgrpo.algorithms``; a model family's
own settings (one section per family that declares them, named as it: ``flux``, ``wan``, ...,
added by ``_with_family_sections``) in its adapter file. Parsing is
``loader.py``; checks that need the disk are ``validate.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowgrpo.algorithms import (
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    algorithm_class,
    algorithm_settings,
)
from flowgrpo.algorithms.base import UpdateConfig
from flowgrpo.engine.config import DTYPES, EMAConfig, FSDPConfig, LoraConfig, OptimConfig
from flowgrpo.functional.sde import ROLLOUT_SDE_TYPES
from flowgrpo.functional.tree import ESTIMATORS, FUSIONS, WIDTH_PRUNING, BranchSpec
from flowgrpo.models.prompt_cache import TEXT_ENCODER_OFFLOAD
from flowgrpo.models.registry import family_settings
from flowgrpo.rewards.spec import RewardSpec, check_labels
from flowgrpo.settings import (
    DEFAULT_PRESET,
    ConfigError,
    between,
    ge,
    gt,
    need,
    one_of,
    optional,
    setting,
)

REWARD_MODES = ("weighted_sum", "advantage")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class ModelConfig:
    """Which pipeline to load, in which dtype, at which size: the settings every family reads
    (a family's own are its section, ``_with_family_sections``)."""

    path: str | None = setting(
        None,
        "Local diffusers pipeline directory of the base model, or a built-in one "
        "(`builtin:toy-digits`). Required.",
    )
    dtype: str = setting(
        "auto",
        "Weights dtype: `auto` (bf16 on CUDA, fp32 on CPU), `fp32`, `bf16`, `fp16`.",
        check=one_of(*DTYPES),
    )
    base_quant: str = setting(
        "none",
        "LoRA runs: keep the frozen base transformer's weights quantized, `nf4` or `int8` "
        "(weight-only), or `none`; rollout and training use the same quantized weights.",
        check=one_of("none", "nf4", "int8"),
    )
    height: int = setting(512, "Image height in pixels (8 for the toy).", check=ge(1))
    width: int = setting(512, "Image width in pixels.", check=ge(1))
    max_sequence_length: int | None = setting(
        None,
        "Text tokens per prompt (T5 / Qwen / UMT5); null = the pipeline's default (SD3 256, "
        "FLUX 512, Qwen-Image 512, Wan 512).",
        check=optional(ge(1)),
    )
    num_frames: int | None = setting(
        None,
        "Video models (Wan): frames per video, 4k + 1 (5, 9, 33, 81); null = the adapter's "
        "default (Wan: 81). Image models refuse it.",
        check=optional(ge(1)),
    )
    embed_cache_dir: str | None = setting(
        None,
        "Folder of the prompt-embedding cache: each prompt is encoded once (alone) and read back "
        "bit-identically; keyed by the text encoders' weights, the tokenizers, the max length "
        "and the prompt; safe to share between runs. null = off.",
    )
    text_encoder_offload: str = setting(
        "keep",
        "Once every train/eval/negative prompt is in `embed_cache_dir`: `keep` the text "
        "encoders on the GPU, move them to `cpu`, or `free` them (Qwen-Image: 16 GB, Wan: 11 GB "
        "per GPU).",
        check=one_of(*TEXT_ENCODER_OFFLOAD),
    )
    vae_slicing: bool = setting(
        True,
        "Decode one sample at a time (the VAE's peak memory of one sample, not the batch); "
        "pixels equal the batched decode to ~1e-6.",
    )
    vae_tiling: bool = setting(
        False,
        "Decode in overlapping spatial tiles (diffusers `enable_tiling`; bounds the peak at any "
        "size; blended tile seams change pixels slightly).",
    )

    def check(self) -> None:
        if self.text_encoder_offload != "keep":
            need(
                self.embed_cache_dir is not None,
                "model.text_encoder_offload",
                "'keep' unless model.embed_cache_dir is set (the encoders leave once prompts are "
                "cached)",
                self.text_encoder_offload,
            )


@dataclass
class BranchingConfig:
    """Branching rollouts (BranchGRPO, TreeGRPO): each group is one tree that splits into
    children at chosen trained SDE steps, so its samples share their prefix; off while
    ``split_steps`` is empty. docs/algorithms.md says when to use it."""

    split_steps: list[int] = setting(
        help="Trained SDE steps where every node splits, as offsets from the first trained step "
        "(the window's start with sample.window_size); [] = no branching.",
        default_factory=list,
    )
    factors: list[int] = setting(
        help="Children per node at each split step; their product must equal sample.group_size.",
        default_factory=list,
    )
    estimator: str = setting(
        "depth",
        "Tree advantage: `depth` (BranchGRPO: fused node values standardized per depth) or "
        "`backup` (TreeGRPO: the leaves' group advantages fused up the tree, as they are).",
        check=one_of(*ESTIMATORS),
    )
    fusion: str = setting(
        "mean",
        "How a node's value fuses its children's: `mean`, or `logprob` (weights = softmax of "
        "the child edges' rollout log-probs: BranchGRPO's --tree_prob_weighted, TreeGRPO's).",
        check=one_of(*FUSIONS),
    )
    prune_steps: list[int] = setting(
        help="Depth pruning: trained step offsets whose edges are not trained (sampled and "
        "rewarded all the same).",
        default_factory=list,
    )
    width_pruning: str = setting(
        "none",
        "Width pruning of the edges after the last split: `none`, `branch` (each leaf's best "
        "`width_ratio`) or `extremes` (each tree's best and worst `width_ratio` / 2).",
        check=one_of(*WIDTH_PRUNING),
    )
    width_ratio: float = setting(
        0.5,
        "Fraction of the edges after the last split that width pruning keeps.",
        check=between(0, 1, lo_open=True),
    )

    @property
    def enabled(self) -> bool:
        return bool(self.split_steps)

    def spec(self) -> BranchSpec | None:
        """The tree (None when off)."""
        return BranchSpec(tuple(self.split_steps), tuple(self.factors)) if self.enabled else None

    def check(self) -> None:
        s, f = self.split_steps, self.factors
        key = "sample.branching."
        need(len(f) == len(s), key + "factors", f"one factor per split step ({len(s)})", f)
        need(all(v >= 2 for v in f), key + "factors", "all >= 2 (children per split)", f)
        need(
            all(v >= 0 for v in s) and all(b > a for a, b in zip(s, s[1:])),
            key + "split_steps",
            "increasing offsets >= 0",
            s,
        )
        unused = {  # settings a run without a tree (or without width pruning) would ignore
            "prune_steps": (self.prune_steps, [], not s),
            "estimator": (self.estimator, "depth", not s),
            "fusion": (self.fusion, "mean", not s),
            "width_pruning": (self.width_pruning, "none", not s),
            "width_ratio": (self.width_ratio, 0.5, self.width_pruning == "none"),
        }
        for name, (value, default, idle) in unused.items():
            why = "without split_steps" if not s else "with width_pruning 'none'"
            need(not idle or value == default, key + name, f"{default!r} {why}", value)

    def check_steps(self, trained: int, where: str, group_size: int) -> None:
        """Refuse a tree whose leaves are not ``group_size`` or whose split (or pruned) steps
        fall outside the ``trained`` SDE steps (``where`` says which they are)."""
        if not self.enabled:
            return
        key = "sample.branching."
        leaves = BranchSpec(tuple(self.split_steps), tuple(self.factors)).leaves
        need(
            leaves == group_size,
            key + "factors",
            f"a tree of sample.group_size={group_size} leaves (their product is {leaves})",
            self.factors,
        )
        for name, steps in (("split_steps", self.split_steps), ("prune_steps", self.prune_steps)):
            need(
                all(0 <= v < trained for v in steps),
                key + name,
                f"offsets inside the {trained} trained SDE steps ({where}): in [0, {trained - 1}]",
                steps,
            )


@dataclass
class SampleConfig:
    """Rollout (SDE, training) and eval (ODE) sampling, and the group structure: each step draws
    ``prompts_per_step`` prompts (m, global) and samples each ``group_size`` times (K)."""

    num_steps: int = setting(10, "Denoising steps of a training rollout.", check=ge(1))
    eval_num_steps: int = setting(
        40, "Denoising steps of eval and `flowgrpo sample` (ODE sampler).", check=ge(1)
    )
    guidance_scale: float = setting(
        4.5,
        "CFG scale of rollouts (1 = no CFG; FLUX.1-dev: the distilled guidance embedding; "
        "Qwen-Image: true CFG).",
        check=ge(0, " (1 = no CFG)"),
    )
    eval_guidance_scale: float | None = setting(
        None,
        "CFG scale of eval; null = `guidance_scale`, or the algorithm's own (DiffusionNFT: "
        "its section's `guidance_scale`, the guidance-free policy it trains).",
        check=optional(ge(0)),
    )
    noise_level: float = setting(
        0.7,
        "SDE noise level *a* (0 = deterministic Euler; `cps`: in [0, 1]).",
        check=ge(0),
    )
    sde_type: str = setting(
        "sde",
        "Stochastic sampler of rollouts: `sde` (Flow-GRPO) or `cps` (coefficients-preserving).",
        check=one_of(*ROLLOUT_SDE_TYPES),
    )
    window_size: int = setting(
        0,
        "Flow-GRPO-Fast SDE window: SDE (trained) on this many consecutive steps, ODE "
        "elsewhere; 0 = no window.",
        check=ge(0, " (0 = no window)"),
    )
    window_lo: int = setting(0, "First step the window may start at.", check=ge(0))
    window_hi: int | None = setting(
        None, "Window end bound (exclusive); null = the last stochastic step + 1."
    )
    window_draw: str = setting(
        "sample",
        "How the window's start is drawn: `sample` (each sample its own: every step trains "
        "all window positions) or `step` (one start per training step for every sample and "
        "rank, drawn from seed and step: Flow-Factory's draw per epoch, Flow-GRPO's per "
        "rollout batch).",
        check=one_of("sample", "step"),
    )
    timestep_fraction: float = setting(
        1.0,
        "Without a window: train the first fraction of the stochastic steps.",
        check=between(0, 1, lo_open=True),
    )
    deterministic_last_step: bool = setting(
        True, "Keep the last step (sigma_next = 0) deterministic and untrained."
    )
    prompts_per_step: int = setting(8, "m: prompts drawn per step, over all ranks.", check=ge(1))
    group_size: int = setting(
        16,
        "K: samples per prompt (a group); advantages compare within groups.",
        check=ge(2, " (a group compares samples)"),
    )
    rollout_batch_size: int = setting(
        8, "Samples per rollout forward chunk, per rank.", check=ge(1)
    )
    negative_prompt: str = setting("", 'Negative prompt for CFG (Qwen-Image uses " ").')
    use_ema_for_rollout: bool = setting(
        False, "Sample rollouts with the EMA weights (needs `ema.enabled`)."
    )
    same_latent: bool = setting(
        False,
        "Every sample of a group starts training rollouts from the same initial noise (drawn "
        "from the group's seed): the group shares its ODE path up to its first SDE step, so "
        "its reward differences come from the SDE noise alone (MixGRPO's --init_same_noise, "
        "Flow-GRPO's sample.same_latent).",
    )
    refill_rounds: int = setting(
        0,
        "Rounds per step that replace constant groups (all rewards equal: no advantage) by "
        "freshly sampled ones, DAPO's dynamic sampling (docs/algorithms.md); 0 = off.",
        check=ge(0, " (0 = off)"),
    )
    refill_max_groups: int | None = setting(
        None,
        "Extra groups a step may sample for refill, over all its rounds; null = "
        "`prompts_per_step` (a step samples at most twice its groups).",
        check=optional(ge(1)),
    )
    time_shift: float | None = setting(
        None,
        "Training rollouts on the fixed grid sigma = s t / (1 + (s - 1) t), t = linspace(1, 0, "
        "N + 1) with this s (MixGRPO's sd3_time_shift, 3); null = the pipeline's own schedule "
        "(FLUX / Qwen-Image: a resolution-dependent shift). Eval keeps the pipeline's.",
        check=optional(gt(0)),
    )
    branching: BranchingConfig = field(default_factory=BranchingConfig)

    def stochastic_steps(self) -> int:
        """Steps that can be SDE (trained) steps: num_steps, minus the deterministic last one."""
        return self.num_steps - (1 if self.deterministic_last_step else 0)

    def trained_steps(self) -> tuple[int, str]:
        """How many SDE steps a training rollout records, and what they are (for messages)."""
        if self.window_size > 0:
            return self.window_size, f"sample.window_size={self.window_size}"
        k = max(1, int(self.stochastic_steps() * self.timestep_fraction))
        return k, f"the first {k} of {self.stochastic_steps()} stochastic steps"

    def check(self) -> None:
        if self.deterministic_last_step:
            need(self.num_steps >= 2, "sample.num_steps", ">= 2 with deterministic_last_step", 1)
        elif self.sde_type == "sde" and self.noise_level > 0:  # one step starts at sigma = 1
            # with no second sigma to stand in: the 'sde' noise scale sigma / (1 - sigma) is inf
            n = self.num_steps
            need(n >= 2, "sample.num_steps", ">= 2 with sde_type 'sde'", n)
        if self.sde_type == "cps":
            need(
                self.noise_level <= 1,
                "sample.noise_level",
                "in [0, 1] for sde_type 'cps'",
                self.noise_level,
            )
        if self.window_draw != "sample":
            need(
                self.window_size > 0,
                "sample.window_draw",
                "'sample' without a window (sample.window_size 0)",
                self.window_draw,
            )
        if self.window_size > 0:
            avail = self.stochastic_steps()
            hi = avail if self.window_hi is None else self.window_hi
            last = " - 1 with deterministic_last_step" if self.deterministic_last_step else ""
            need(hi <= avail, "sample.window_hi", f"<= {avail} (num_steps{last}) or null", hi)
            need(
                self.window_lo + self.window_size <= hi,
                "sample.window_size",
                f"<= {hi - self.window_lo} (window_hi {hi} - window_lo {self.window_lo}: the "
                f"window must fit in the {avail} stochastic steps)",
                self.window_size,
            )
        if self.branching.enabled:
            b = self.branching
            if self.window_size > 0:  # every sample of a tree needs the same window
                need(
                    self.window_draw == "step",
                    "sample.window_draw",
                    "'step' with sample.branching (a tree's samples share their SDE window)",
                    self.window_draw,
                )
            need(
                self.noise_level > 0,
                "sample.noise_level",
                "> 0 with sample.branching (a split needs stochastic steps)",
                self.noise_level,
            )
            need(
                self.rollout_batch_size % b.spec().leaves == 0,
                "sample.rollout_batch_size",
                f"a multiple of the tree's {b.spec().leaves} leaves with sample.branching",
                self.rollout_batch_size,
            )
            trained, where = self.trained_steps()
            b.check_steps(trained, where, self.group_size)


@dataclass
class DataConfig:
    """Prompt files (.txt / .jsonl / .parquet, or a built-in set) and the eval split."""

    train_prompts: str | None = setting(
        None,
        "Training prompts: .txt (a prompt a line), .jsonl (`prompt` + metadata), .parquet, or "
        "a built-in set (`builtin:digits`). Required.",
    )
    eval_prompts: str | None = setting(
        None,
        "Eval prompts file; null = hold out `eval_fraction` of the train prompts, or eval on them.",
    )
    eval_fraction: float = setting(
        0.0,
        "Fraction of the train prompts held out for eval when `eval_prompts` is null (0 = eval "
        "on the train prompts).",
        check=between(0, 1, hi_open=True),
    )
    eval_num_prompts: int = setting(
        0, "Use only the first N eval prompts (0 = all).", check=ge(0, " (0 = all)")
    )
    eval_samples_per_prompt: int = setting(
        1, "Eval images per eval prompt (fixed noise).", check=ge(1)
    )
    shuffle: bool = setting(True, "Shuffle the prompt order each epoch (seeded).")


@dataclass
class AdvantageConfig:
    """How rewards become advantages."""

    mode: str = setting(
        "weighted_sum",
        "`weighted_sum` (sum rewards, then normalise per group) or `advantage` (normalise "
        "each reward, then sum).",
        check=one_of(*REWARD_MODES),
    )
    global_std: bool = setting(
        True, "Divide by the std of the whole global batch (true) or of the group (false)."
    )
    async_reward: bool = setting(
        False, "Score rewards in a background thread, overlapping the next rollout chunk."
    )


@dataclass
class TrainerConfig:
    """Loop length, eval/checkpoint cadence and resume."""

    max_steps: int = setting(1000, "Training steps (one rollout + update each).", check=ge(1))
    eval_every: int = setting(
        50,
        "Evaluate every N steps (and at step 0 and the last step; 0 = only those).",
        check=ge(0, " (0 = the last step only)"),
    )
    save_every: int = setting(
        50,
        "Checkpoint every N steps (and at the last step; 0 = only the last).",
        check=ge(0, " (0 = the last step only)"),
    )
    keep_last: int = setting(2, "Checkpoints kept on disk.", check=ge(1))
    resume: str | None = setting(
        None,
        "`auto` = newest complete checkpoint in `run.output_dir`, a path = that checkpoint, "
        "null = fresh run. Also settable as `resume=...`.",
    )
    allow_config_change: bool = setting(
        False,
        "Resume even though run-defining settings (reward, algorithm and its section, model, "
        "sampling, LoRA, ...: docs/training.md) differ from the checkpoint's `config.yaml`.",
    )
    off_policy_steps: int = setting(
        0,
        "One-step-off-policy rollout: 1 = step t+1's rollout is sampled by the weights before "
        "update t (the behaviour policy), its log-probs recorded, so that it can overlap update "
        "t; 0 = on-policy. Staleness is bounded to 1 (docs/algorithms.md).",
        check=one_of(0, 1),
    )
    off_policy_overlap: bool = setting(
        False,
        "With off_policy_steps=1: sample the next step in a thread, on a second copy of the "
        "model, while this step trains (one process only; the same math as the sequential "
        "schedule; measured in docs/algorithms.md).",
    )
    log_every: int = setting(
        1,
        "Without the progress bar, print a line every N steps; tensorboard / wandb get the "
        "scalars every N steps (metrics.jsonl gets every step).",
        check=ge(1),
    )


#: sections a rollback may not change (``guard.on_rollback``): they define what the
#: checkpoint holds, where the run lives, or the guard itself
ROLLBACK_FIXED = (
    "seed",
    "preset",
    "algorithm",
    "model",
    "data",
    "lora",
    "fsdp",
    "run",
    "trainer",
    "guard",
    "eval",
    "reward",
    "eval_reward",
    *family_settings(),  # the model's own settings, as ``model``
)


@dataclass
class EvalConfig:
    """What evals watch besides the training reward: gold rewards, never trained on."""

    gold_reward: list[RewardSpec] = setting(
        help="Gold rewards: scored at every eval on the eval prompts (same forms as `reward`), "
        "never trained on; logged as `eval/gold/<name>`, their weighted sum as "
        "`eval/gold_score` (what the guard and `--checkpoint best` rank by), and "
        "`eval/hacking_gap`: the training reward's relative gain since the base eval minus "
        "the gold score's (docs/reward_hacking.md).",
        default_factory=list,
    )


@dataclass
class GuardConfig:
    """Reward-hacking guard: act when the gold score falls while the training reward rises."""

    max_gold_drop: float | None = setting(
        None,
        "Trigger when `eval/gold_score` is this far below its best eval while "
        "`eval/reward_mean` is above its value at that eval (null = no guard; needs "
        "`eval.gold_reward`).",
        check=optional(gt(0)),
    )
    action: str = setting(
        "stop",
        "`stop`: end the run with one line naming the eval, the figures and the best-gold "
        "checkpoint; `rollback`: resume from that checkpoint with `on_rollback` applied.",
        check=one_of("stop", "rollback"),
    )
    on_rollback: dict[str, Any] = setting(
        help="Settings a rollback changes, dotted keys: `{optim.lr: 1.0e-4, "
        "<algorithm>.kl_beta: 0.1}`; applied again at each rollback (not model, data, reward, "
        "run, trainer).",
        default_factory=dict,
    )
    max_rollbacks: int = setting(
        2, "Rollbacks at most; the next trigger stops the run.", check=ge(1)
    )
    patience: int = setting(
        1,
        "Act only when the rule holds at this many evals in a row (2: one noisy eval, a drop "
        "within the gold reward's sampling noise, does not trip the guard).",
        check=ge(1),
    )


@dataclass
class RunConfig:
    """Where and how to log."""

    output_dir: str = setting(
        "runs/{preset}",
        "Run folder: metrics.jsonl, checkpoints/, grids, reward_curve.png (`{preset}` becomes "
        "the preset's name).",
        check=("a directory path", bool),
    )
    name: str | None = setting(None, "Run name for tensorboard / wandb (null = the folder name).")
    tensorboard: bool = setting(True, "Write tensorboard scalars and image grids.")
    wandb: bool = setting(False, "Log to Weights & Biases.")
    wandb_project: str = setting("flowgrpo", "wandb project.")
    wandb_mode: str = setting(
        "offline",
        "`offline` (no network), `online` or `disabled`.",
        check=one_of(*WANDB_MODES),
    )
    progress_bar: bool = setting(
        True,
        "Show a progress bar with step, reward and ETA (on a terminal); false, or output to a "
        "pipe or file: a line every `trainer.log_every` steps (and at least every 60 s).",
    )
    num_threads: int = setting(
        0,
        "CPU threads per process for torch (0 = torch's default). Tiny models run faster on 1 "
        "thread than on 2: thread start-up costs more than the work.",
        check=ge(0, " (0 = torch's default)"),
    )
    overwrite: bool = setting(
        False,
        "Start a fresh run in a folder that holds another run's checkpoints or metrics, "
        "deleting those outputs first (without it, such a folder is refused).",
    )
    debug: bool = setting(
        False, "Print the full traceback with an error (also FLOWGRPO_TRACEBACK=1)."
    )


def flat_keys(mapping: Any, prefix: str = "") -> dict[str, Any]:
    """``{optim: {lr: 1}}`` or ``{"optim.lr": 1}`` -> ``{"optim.lr": 1}``."""
    out: dict[str, Any] = {}
    for k, v in (mapping or {}).items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _default_rewards() -> list[RewardSpec]:
    return [RewardSpec()]


_ALGORITHM_NAMES = ", ".join(f"`{n}`" for n in list(ALGORITHMS)[:-1]) + (
    f" or `{list(ALGORITHMS)[-1]}`"
)


def _with_sections(cls: type, after: str, sections: dict[str, type]) -> type:
    """Give ``cls`` one section per entry of ``sections`` (name -> settings class), right after
    its field ``after``, each defaulting to its settings class's defaults."""
    annotations: dict[str, object] = {}
    for key, hint in cls.__annotations__.items():
        annotations[key] = hint
        if key == after:
            for name, settings in sections.items():
                annotations[name] = settings
                setattr(cls, name, field(default_factory=settings))
    cls.__annotations__ = annotations
    return cls


def _with_algorithm_sections(cls: type) -> type:
    """One section per registered algorithm, named as it, holding its settings class
    (``flowgrpo.algorithms.algorithm_settings``), right after the ``update`` section: the
    schema names no algorithm, and a new one gets its section from its registry line."""
    return _with_sections(cls, "update", algorithm_settings())


def _with_family_sections(cls: type) -> type:
    """One section per family that declares settings, named as the family, holding its
    settings class (``flowgrpo.models.registry.family_settings``, declared in the family's
    adapter file), right after the ``model`` section: the schema names no family, and a new
    one gets its section from its registry line."""
    return _with_sections(cls, "model", family_settings())


@dataclass
@_with_family_sections
@_with_algorithm_sections
class Config:
    """The whole run."""

    seed: int = setting(
        0,
        "Seed of everything: prompt order, rollout noise (per sample), eval noise, init.",
        check=between(0, 2**64 - 1),  # torch.manual_seed takes 64 bits
    )
    preset: str | None = setting(
        None, "Where the config came from (set by load_config; informational)."
    )
    algorithm: str = setting(
        DEFAULT_ALGORITHM,
        f"The RL algorithm: {_ALGORITHM_NAMES}; its settings are the section of the same name "
        "(docs/algorithms.md).",
        check=one_of(*ALGORITHMS),
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    # here, one section per family that declares settings (``_with_family_sections``)
    sample: SampleConfig = field(default_factory=SampleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: list[RewardSpec] = setting(
        help="The rewards: `reward=ocr`, `reward=ocr:1.0,jpeg_compressibility:0.1`, or a YAML "
        "list of {name, weight, options}.",
        default_factory=_default_rewards,
    )
    eval_reward: list[RewardSpec] = setting(
        help="Scores computed at eval only, on the whole eval set at once (e.g. the toy's "
        "`digits_eval`: accuracy, judge accuracy, diversity); each entry is logged as "
        "`eval/<entry>`, outside `eval/reward_mean`.",
        default_factory=list,
    )
    eval: EvalConfig = field(default_factory=EvalConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    # here, one section per registered algorithm (``_with_algorithm_sections``)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def check(self) -> None:
        """Rules across sections."""
        need(len(self.reward) >= 1, "reward", "a non-empty list", self.reward)
        check_labels(self.reward, "reward")
        check_labels(self.eval_reward, "eval_reward")
        check_labels(self.eval.gold_reward, "eval.gold_reward")
        trained = {r.name for r in self.reward} | {r.label for r in self.reward}
        for gold in self.eval.gold_reward:
            need(
                gold.name not in trained,
                f"eval.gold_reward.{gold.label}",
                "a reward the run does not train on (it is also in `reward`: a gold reward "
                "must be independent of what is optimised)",
                gold.name,
            )
        if self.guard.max_gold_drop is not None:
            need(
                bool(self.eval.gold_reward),
                "guard.max_gold_drop",
                "null without eval.gold_reward (the guard watches the gold rewards)",
                self.guard.max_gold_drop,
            )
            need(
                self.trainer.eval_every > 0,
                "trainer.eval_every",
                "> 0 with guard.max_gold_drop (the guard acts at evals)",
                self.trainer.eval_every,
            )
            if self.guard.action == "rollback":
                need(
                    self.trainer.save_every > 0,
                    "trainer.save_every",
                    "> 0 with guard.action=rollback (a rollback resumes from a checkpoint)",
                    self.trainer.save_every,
                )
        for key in flat_keys(self.guard.on_rollback):
            need(
                key.split(".")[0] not in ROLLBACK_FIXED,
                f"guard.on_rollback.{key}",
                "a setting a rollback may change (optim, the algorithm's section, update, "
                "sample, advantage, ema)",
                key,
            )
        if self.sample.use_ema_for_rollout:
            e = self.ema.enabled
            need(e, "ema.enabled", "true with sample.use_ema_for_rollout=true", e)
        if self.model.base_quant != "none" and not self.lora.enabled:
            raise ConfigError(
                f"config key 'model.base_quant' is {self.model.base_quant} but lora.enabled="
                "false: a quantized base is frozen, so only a LoRA run trains on it; set "
                "lora.enabled=true or model.base_quant=none"
            )
        if self.sample.branching.enabled:
            algo = algorithm_class(self.algorithm)
            names = ", ".join(n for n in ALGORITHMS if algorithm_class(n).supports_branching)
            need(
                algo.supports_branching,
                "sample.branching.split_steps",
                f"[] with algorithm={self.algorithm} (branching needs an SDE-rollout algorithm: "
                f"{names})",
                self.sample.branching.split_steps,
            )
        if self.trainer.off_policy_steps:  # what an off-policy rollout cannot serve
            refusal = algorithm_class(self.algorithm).off_policy_refusal
            need(
                refusal is None,
                "trainer.off_policy_steps",
                f"0 with algorithm={self.algorithm} ({refusal})",
                self.trainer.off_policy_steps,
            )
            overlap = self.trainer.off_policy_overlap
            refusal = algorithm_class(self.algorithm).overlap_refusal(self) if overlap else None
            need(
                refusal is None,
                "trainer.off_policy_overlap",
                f"false with algorithm={self.algorithm} ({refusal})",
                overlap,
            )
            need(
                self.sample.refill_rounds == 0,
                "trainer.off_policy_steps",
                "0 with sample.refill_rounds > 0 (refill's extra rollouts would come from the "
                "live weights, the step's from the behaviour policy: one batch, two policies)",
                self.trainer.off_policy_steps,
            )
        else:
            need(
                not self.trainer.off_policy_overlap,
                "trainer.off_policy_overlap",
                "false with trainer.off_policy_steps=0 (nothing to overlap)",
                self.trainer.off_policy_overlap,
            )
        algorithm_class(self.algorithm).check_config(self)  # what the algorithm cannot honour


__all__ = [
    "AdvantageConfig",
    "BranchingConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DEFAULT_PRESET",
    "EvalConfig",
    "GuardConfig",
    "ModelConfig",
    "RunConfig",
    "SampleConfig",
    "TrainerConfig",
    "flat_keys",
]
