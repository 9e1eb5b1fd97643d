"""One line of help per config key, and the markdown table of docs/training.md.

``python -m flowgrpo.config.docs`` prints the table (keys, schema defaults, meaning); a test
checks that docs/training.md contains it verbatim, so the docs cannot drift from the schema.
"""

from __future__ import annotations

import json
from typing import Any

KEY_HELP: dict[str, str] = {
    "seed": "Seed of everything: prompt order, rollout noise (per sample), eval noise, init.",
    "preset": "Where the config came from (set by load_config; informational).",
    "model.path": "Local diffusers directory of the base model. Required except for the toy.",
    "model.kind": "`auto` (from the pipeline class), `toy`, `qwen_image`, `sd3` or `flux`.",
    "model.dtype": "Weights dtype: `auto` (bf16 on CUDA, fp32 on CPU), `fp32`, `bf16`, `fp16`.",
    "model.height": "Image height in pixels (8 for the toy).",
    "model.width": "Image width in pixels.",
    "model.true_cfg_scale": "FLUX only: true CFG with the negative prompt when > 1 (1 = off).",
    "model.max_sequence_length": "Text tokens per prompt (T5 / Qwen); null = the pipeline's "
    "default (SD3 256, FLUX 512, Qwen-Image 512).",
    "model.pretrained": "Toy only: start from the shipped pretrained weights (false = random).",
    "sample.num_steps": "Denoising steps of a training rollout.",
    "sample.eval_num_steps": "Denoising steps of eval and `flowgrpo sample` (ODE sampler).",
    "sample.guidance_scale": "CFG scale of rollouts (1 = no CFG; FLUX.1-dev: the distilled "
    "guidance embedding; Qwen-Image: true CFG).",
    "sample.eval_guidance_scale": "CFG scale of eval; null = `guidance_scale`.",
    "sample.noise_level": "SDE noise level *a* (0 = deterministic Euler; `cps`: in [0, 1]).",
    "sample.sde_type": "Stochastic sampler of rollouts: `sde` (Flow-GRPO) or `cps` "
    "(coefficients-preserving).",
    "sample.window_size": "Flow-GRPO-Fast SDE window: SDE (trained) on this many consecutive "
    "steps, ODE elsewhere; 0 = no window.",
    "sample.window_lo": "First step the window may start at.",
    "sample.window_hi": "Window end bound (exclusive); null = the last stochastic step + 1.",
    "sample.timestep_fraction": "Without a window: train the first fraction of the stochastic "
    "steps.",
    "sample.deterministic_last_step": "Keep the last step (sigma_next = 0) deterministic and "
    "untrained.",
    "sample.prompts_per_step": "m: prompts drawn per step, over all ranks.",
    "sample.group_size": "K: samples per prompt (a group); advantages compare within groups.",
    "sample.rollout_batch_size": "Samples per rollout forward chunk, per rank.",
    "sample.negative_prompt": 'Negative prompt for CFG (Qwen-Image uses " ").',
    "sample.use_ema_for_rollout": "Sample rollouts with the EMA weights (needs `ema.enabled`).",
    "data.train_prompts": "Training prompts: .txt (a prompt a line), .jsonl (`prompt` + "
    "metadata) or .parquet; null = the toy's digit prompts.",
    "data.eval_prompts": "Eval prompts file; null = hold out `eval_fraction` of the train "
    "prompts, or eval on them.",
    "data.eval_fraction": "Fraction of the train prompts held out for eval when "
    "`eval_prompts` is null (0 = eval on the train prompts).",
    "data.eval_num_prompts": "Use only the first N eval prompts (0 = all).",
    "data.eval_samples_per_prompt": "Eval images per eval prompt (fixed noise).",
    "data.shuffle": "Shuffle the prompt order each epoch (seeded).",
    "reward": "The rewards: `reward=ocr`, `reward=ocr:1.0,jpeg_compressibility:0.1`, or a "
    "YAML list of {name, weight, options}.",
    "reward.NAME.name": "Registry name (`ocr`, `jpeg_compressibility`, `digits`, "
    "`pickscore`, ...) or `package.module:function`.",
    "reward.NAME.weight": "Weight in the combined reward / advantage.",
    "reward.NAME.options": "Keyword options of the reward (e.g. `path` for pickscore).",
    "reward.NAME.key_weights": "Weights of the entries of a dict-returning reward (unlisted "
    "entries are only logged).",
    "reward.NAME.alias": "Name in logs (to use one reward twice).",
    "advantage.mode": "`weighted_sum` (sum rewards, then normalise per group) or `advantage` "
    "(normalise each reward, then sum).",
    "advantage.global_std": "Divide by the std of the whole global batch (true) or of the "
    "group (false).",
    "advantage.async_reward": "Score rewards in a background thread, overlapping the next "
    "rollout chunk.",
    "train.micro_batch_size": "Samples per forward/backward in the update.",
    "train.num_minibatches": "Optimizer steps per rollout (the global batch is split in this "
    "many parts).",
    "train.skip_zero_advantage": "Drop samples whose advantage is exactly 0 (groups with equal "
    "rewards) before the update, as flow_grpo does; the loss is the mean over the kept samples.",
    "train.cfg_grad": "How the guidance gradient flows: `both` branches (exact) or `cond_only` "
    "(unconditional branch under no_grad: cheaper, biased; the original paper's form).",
    "train.max_consecutive_skips": "Abort after this many optimizer steps in a row skipped "
    "for non-finite gradients.",
    "lora.enabled": "Train LoRA adapters (false = full fine-tune).",
    "lora.rank": "LoRA rank r.",
    "lora.alpha": "LoRA alpha (scale alpha / r).",
    "lora.init": "peft `init_lora_weights`: `gaussian`, `default`, `pissa`, ...",
    "lora.target_modules": "Module names to adapt; null = the model family's defaults; "
    "`all-linear` = every Linear.",
    "lora.dropout": "LoRA dropout.",
    "optim.lr": "AdamW learning rate.",
    "optim.betas": "AdamW betas.",
    "optim.weight_decay": "AdamW weight decay.",
    "optim.eps": "AdamW epsilon.",
    "optim.max_grad_norm": "Gradient clipping norm.",
    "optim.lr_schedule": "`constant` or `cosine`, both after a linear warm-up.",
    "optim.warmup_steps": "Linear warm-up length in optimizer steps.",
    "optim.total_steps": "Cosine length in optimizer steps; 0 = `trainer.max_steps` x "
    "`train.num_minibatches`.",
    "loss.clip_range": "PPO ratio clip epsilon (log-probs are per-dimension means, hence tiny).",
    "loss.adv_clip_max": "Advantages are clamped to +-this.",
    "loss.kl_beta": "Weight of KL(policy || reference) (reference = LoRA off / initial "
    "weights); 0 = no KL and no reference forward.",
    "fsdp.param_dtype": "FSDP2 compute dtype: `auto` (`model.dtype` if explicit, else bf16 on "
    "CUDA, fp32 on CPU), `fp32`, `bf16`, `fp16`.",
    "fsdp.reduce_dtype": "Gradient reduce dtype.",
    "fsdp.cpu_offload": "Offload parameters and optimizer state to CPU.",
    "fsdp.activation_checkpointing": "Recompute transformer blocks in backward (saves memory).",
    "fsdp.reshard_after_forward": "Free gathered parameters after each block's forward.",
    "fsdp.replicate_degree": "HSDP: shard within groups of world/replicate_degree ranks, "
    "replicate across them (1 = plain FSDP).",
    "ema.enabled": "Keep an EMA of the trainable parameters (used by eval and checkpoints).",
    "ema.decay": "EMA decay (warm-up min((1+s)/(10+s), decay)).",
    "ema.update_every": "Update the EMA every this many optimizer steps.",
    "trainer.max_steps": "Training steps (one rollout + update each).",
    "trainer.eval_every": "Evaluate every N steps (and at step 0 and the last step; 0 = only "
    "those).",
    "trainer.save_every": "Checkpoint every N steps (and at the last step; 0 = only the last).",
    "trainer.keep_last": "Checkpoints kept on disk.",
    "trainer.resume": "`auto` = newest complete checkpoint in `run.output_dir`, a path = that "
    "checkpoint, null = fresh run. Also settable as `resume=...`.",
    "trainer.log_every": "Print a progress line every N steps (metrics.jsonl gets every step).",
    "run.output_dir": "Run folder: metrics.jsonl, checkpoints/, grids, reward_curve.png.",
    "run.name": "Run name for tensorboard / wandb (null = the folder name).",
    "run.tensorboard": "Write tensorboard scalars and image grids.",
    "run.wandb": "Log to Weights & Biases.",
    "run.wandb_project": "wandb project.",
    "run.wandb_mode": "`offline` (no network), `online` or `disabled`.",
    "run.progress_bar": "Show a progress bar with step, reward and ETA.",
    "run.num_threads": "CPU threads per process for torch (0 = torch's default). Tiny models "
    "run faster on 1 thread than on 2: thread start-up costs more than the work.",
    "run.overwrite": "Start a fresh run in a folder that holds another run's checkpoints or "
    "metrics, deleting those outputs first (without it, such a folder is refused).",
    "run.debug": "Print the full traceback with an error (also FLOWGRPO_TRACEBACK=1).",
}


def _default(key: str, defaults: dict[str, Any]) -> str:
    node: Any = defaults
    for part in key.split("."):
        if part == "NAME":
            node = node[0]
            continue
        node = node[part]
    if key == "reward":
        return "`" + ",".join(f"{r['name']}:{r['weight']}" for r in node) + "`"
    return "`" + json.dumps(node) + "`"


def markdown_table() -> str:
    """| key | default | meaning | for every leaf key, in schema order."""
    from flowgrpo.config.loader import _hints, config_to_dict, valid_keys
    from flowgrpo.config.schema import Config

    defaults = config_to_dict(Config())
    rows = ["| key | default | meaning |", "|---|---|---|"]
    sections = {name for name, tp in _hints(Config).items() if hasattr(tp, "__dataclass_fields__")}
    for key in valid_keys():
        if key in sections:
            continue
        rows.append(f"| `{key}` | {_default(key, defaults)} | {KEY_HELP[key]} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
