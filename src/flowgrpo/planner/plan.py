"""The memory planner behind ``flowgrpo memory PRESET [key=value ...] --gpus N --gpu-gb G``.

Per-GPU bytes of a run, by part and by phase, from the model's config files alone (every
component built on the meta device: ``flowgrpo.planner.models``). The sharded state is what
the engine holds per rank once the transformer is sharded over a shard group of S = gpus /
fsdp.replicate_degree ranks:

- trained weights: full fine-tune, the fp32 master of every parameter (4 B / S); LoRA, the
  frozen base in the weights' dtype (``model.base_quant``: its Linear weights NF4, 4 bits and
  an fp32 absmax per block of 64, or int8 with an fp32 scale per output row) plus the
  fp32 LoRA factors;
- grads (fp32, 4 B / S) and AdamW's two moments (8 B / S) of the trained parameters;
- reference: a full fine-tune whose algorithm has a KL term keeps the initial weights in the
  compute dtype; LoRA's reference is the adapter switched off (0);
- EMA (and DiffusionNFT's old policy, the off-policy behaviour policy): fp32 shadows of the
  trained parameters (4 B / S each);
- FSDP's gathered blocks: the two largest blocks unsharded (the one running, the one
  prefetched);
- frozen components: the text encoders (0 once every prompt is in the embedding cache and
  ``model.text_encoder_offload`` is cpu/free; quantized with the base), the VAE, and the
  reward models on the run's device (``planner.models.reward_models``: the trained rewards',
  ``eval_reward``'s and ``eval.gold_reward``'s, each resident from the start), whole on every
  GPU;
- the CUDA context, cuBLAS workspace and NCCL buffers (``CUDA_OVERHEAD_MIB``, measured);
- activations of one training micro-batch from each block's Linear widths x the tokens each
  Linear sees (AdaLN modulation on one vector; cross-attended text at the prompt's tokens;
  a trimmed prompt at ``TYPICAL_PROMPT_TOKENS``; no N^2 for a masked attention: torch's SDPA
  keeps none with the families' [B, 1, 1, S] masks), calibrated on CPU measurements
  (``ACT_PER_WIDTH``), plus ``FRAGMENTATION`` of them on a GPU;
- the rollout: this rank's trajectories (fp32 latents of the trained steps, which the
  algorithm says: ``Algorithm.trained_steps``), the no-grad forward of ``rollout_batch_size``,
  the VAE decode of one chunk (``vae_decode_peak``) and its decoded images; twice the
  trajectories with ``trainer.off_policy_steps=1`` (the next step's is held while one trains),
  and with ``trainer.off_policy_overlap`` a second pipeline (the copy that samples beside).

The phases' peaks: ``prompt encoding`` (with the embedding cache: the weights and the text
encoders, before the optimizer exists), ``rollout`` and ``training``; the total is the
largest. Printed in GiB (2^30 bytes); ``--gpu-gb`` is the card's memory in GiB.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from flowgrpo.engine.config import parallel_layout
from flowgrpo.planner.models import (
    KNOWN_PREFIX,
    MEMO,
    build_on_meta,
    component_counts,
    known_models,
    linear_weights,
    numel,
    read_model_configs,
    reward_models,
)
from flowgrpo.settings import resolve_dtype

GIB = 2**30
GB = GIB  # the unit printed (GiB); kept under its old name for callers
#: activation bytes saved for backward per token, per unit of a block's Linear width (sum of
#: in + out features over the block's Linear layers, each at the tokens it sees), per byte of
#: the compute dtype: full fine-tune, and LoRA (a frozen Linear keeps no input for its weight's
#: grad). Fitted to the 1-rank CPU (fp32) measurements of a small SD3 (4 blocks of width 256,
#: 64 px, micro-batch 2 with CFG) in tests/config/test_memory_planner.py, with the AdaLN
#: modulation Linears counted on their one vector: least squares over the 1- and 2-rank runs
#: (measured 132.2 / 124.4 MiB LoRA, 326.2 / 271.8 MiB full with KL; planned within 9%).
ACT_PER_WIDTH = {"full": 1.37, "lora": 0.74}
#: the rollout's no-grad forward keeps about this many of the largest activations alive
ROLLOUT_ACT_FACTOR = 4.0
#: MiB a CUDA process holds outside the caching allocator: the context with cuBLAS' workspace
#: and SDPA's kernels (701 MiB), and with more than one GPU NCCL's buffers after the first
#: all-reduce (+558 MiB). Measured on an H200 (torch 2.11, CUDA 13): bench/results_cuda.json
#: ``cuda_overheads``, commit 8ea7fde (bench/gpu_check.py).
CUDA_OVERHEAD_MIB = {"context": 700.8, "nccl": 558.0}
#: the caching allocator's fragmentation, as a share of the activations on a GPU: an
#: allowance (assumed, not measured), not fitted to any figure
FRAGMENTATION = 0.10
#: prompt tokens planned for a family that trims the prompt embeddings to the batch's longest
#: prompt (``prompt_trimmed``): an assumption (a long prompt), capped at max_sequence_length
TYPICAL_PROMPT_TOKENS = 128
#: host memory per node of the decoded images above which the plan says so (GiB)
HOST_NOTE_GB = 256
#: a plan that fits within this share of the card gets a warning: the planner's error
MARGIN = 0.1
#: bytes per quantized Linear weight element (``model.base_quant``) as ``engine.quant`` stores
#: it (bitsandbytes' formats): NF4 4 bits plus an fp32 absmax per block of 64 (no double
#: quantization); int8 1 byte (+ an fp32 scale per output row, counted apart)
QUANT_BYTES = {"nf4": 0.5 + 4 / 64, "int8": 1.0}
_TEXT_MARKERS = ("add_", "context", "txt", "text")
#: a second attention's keys and values: cross-attention to the text where the family has no
#: joint text (Wan), else a second self-attention over the image tokens (SD3.5's dual blocks)
_SECOND_KV = ("attn2.to_k", "attn2.to_v")


# -- the transformer's shape ---------------------------------------------------------------------
@dataclass
class TransformerShape:
    """What the planner needs of one trained transformer (all counts in elements)."""

    params: int
    buffers: int
    lora_params: int
    #: (block list, params, image width, text width, modulation width, attention heads,
    #: second attention's key/value width)
    blocks: list[tuple[str, int, int, int, int, int, int]]
    hidden: int
    linear: tuple[int, int] = (0, 0)  # Linear weight elements, output rows


def _blocks(model: Any) -> list[tuple[str, Any]]:
    """The model's transformer blocks: every ModuleList of the model's top level whose modules
    are alike (one class), as FSDP wraps them."""
    import torch

    out = []
    for name, child in model.named_children():
        if (
            isinstance(child, torch.nn.ModuleList)
            and len(child)
            and len({type(b) for b in child}) == 1
        ):
            out += [(name, b) for b in child]
    return out


def _lora_targeted(name: str, targets: list[str] | str) -> bool:
    if targets == "all-linear":
        return True
    return any(name == t or name.endswith("." + t) for t in targets)


def _is_modulation(name: str) -> bool:
    """An AdaLN modulation Linear (``norm1.linear``, ``img_mod.1``, ``adaLN_modulation.0``):
    it maps the conditioning vector, one token per sample, not the sequence."""
    parts = name.split(".")
    return (len(parts) >= 2 and parts[-1] == "linear" and parts[-2].startswith("norm")) or any(
        p.endswith("_mod") or p == "adaLN_modulation" or p == "modulation" for p in parts
    )


def transformer_shape(model: Any, lora_targets: list[str] | str, rank: int) -> TransformerShape:
    """Parameter counts, LoRA parameter count (rank r on every targeted Linear: r (in + out))
    and, per block, its Linear width on image tokens, on text tokens and on the modulation
    vector, and its attention heads."""
    import torch

    lora = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and _lora_targeted(name, lora_targets):
            lora += rank * (mod.in_features + mod.out_features)
    blocks = []
    for kind, block in _blocks(model):
        img = txt = modw = heads = kv2 = 0
        for name, mod in block.named_modules():
            if isinstance(mod, torch.nn.Linear):
                width = mod.in_features + mod.out_features
                if _is_modulation(name):
                    modw += width
                elif any(m in name for m in _SECOND_KV):
                    kv2 += width
                elif any(m in name for m in _TEXT_MARKERS) and kind != "single_transformer_blocks":
                    txt += width
                else:
                    img += width
            h = getattr(mod, "heads", None)
            if isinstance(h, int) and not heads:
                heads = h
        blocks.append((kind, numel(block), img, txt, modw, heads, kv2))
    cfg = model.config
    if "num_attention_heads" in cfg and "attention_head_dim" in cfg:
        hidden = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    else:  # transformers configured by model width (``dim``) rather than heads x head width
        hidden = int(cfg.get("dim", cfg.get("hidden_size", 1)))
    buffers = sum(b.numel() for b in model.buffers())
    return TransformerShape(numel(model), buffers, lora, blocks, hidden, linear_weights(model))


# -- the plan --------------------------------------------------------------------------------------
@dataclass
class Plan:
    """Per-GPU bytes by part and each phase's peak, and what they were computed for. Parts
    in parentheses are alternatives or host memory, not added to a phase."""

    parts: dict[str, float]
    gpus: int
    gpu_gb: float
    notes: list[str] = field(default_factory=list)
    params: dict[str, int] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """The largest phase peak (bytes per GPU)."""
        return max(self.phases.values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_gb * GIB

    @property
    def tight(self) -> bool:
        """Fits, but within ``MARGIN`` of the card."""
        return self.fits and self.total > (1 - MARGIN) * self.gpu_gb * GIB


def _dtype_bytes(name: str, device: str) -> int:
    return resolve_dtype(name, device).itemsize


def _weight_bytes(n: int, linear: tuple[int, int], wbytes: int, quant: str) -> float:
    """Bytes of ``n`` parameters in the weights' dtype, their Linear weights (``linear``:
    elements, output rows) quantized as ``quant`` says."""
    if quant == "none":
        return n * wbytes
    elems, rows = linear
    scales = rows * 4.0 if quant == "int8" else 0.0  # fp32; NF4's are in QUANT_BYTES
    return (n - elems) * wbytes + elems * QUANT_BYTES[quant] + scales


def vae_decode_peak(
    vae: dict[str, Any], height: int, width: int, frames: int, nbytes: int, *, tiling: bool
) -> float:
    """Bytes live while the VAE decodes one sample: the decoder's last level at full size
    (the upsampled input of the widest full-size block and its output: the first two of
    ``block_out_channels``, or a video VAE's ``base_dim`` x ``dim_mult``), per frame of a
    causal chunk (4 frames), and the decoded sample (3 x frames x H x W). With tiling, the
    level is held one 512-px tile at a time."""
    chans = vae.get("block_out_channels")
    if chans:
        c0, c1 = chans[0], chans[min(1, len(chans) - 1)]
    else:
        base = int(vae.get("base_dim", 128))
        mult = vae.get("dim_mult", [1, 2])
        c0, c1 = base * mult[0], base * mult[min(1, len(mult) - 1)]
    pixels = min(height * width, 512 * 512) if tiling else height * width
    chunk = min(frames, 4)
    return (c0 + c1) * pixels * chunk * nbytes + 3 * frames * height * width * nbytes


def plan_memory(cfg: Any, gpus: int, gpu_gb: float, *, device: str = "cuda") -> Plan:
    """The per-GPU plan of run config ``cfg`` on ``gpus`` GPUs of ``gpu_gb`` GiB each."""
    if gpus <= 0:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if not (gpu_gb > 0 and math.isfinite(gpu_gb)):
        raise ValueError(f"--gpu-gb must be a finite number > 0, got {gpu_gb}")
    if not cfg.model.path:
        raise ValueError(
            "model.path is required: a local diffusers directory (only its config files are "
            "read) or a shipped config set: " + ", ".join(KNOWN_PREFIX + n for n in known_models())
        )
    configs = read_model_configs(str(cfg.model.path))
    index = configs["model_index"]
    pipeline = str(index.get("_class_name", ""))
    from flowgrpo.models.registry import SUPPORTED_PIPELINES, import_adapter

    if pipeline not in SUPPORTED_PIPELINES:
        raise ValueError(
            f"model.path '{cfg.model.path}' holds an unsupported pipeline {pipeline!r}; "
            f"supported: {', '.join(SUPPORTED_PIPELINES)}"
        )
    fs, m = cfg.fsdp, cfg.model
    from flowgrpo.config.checks import check_model_run, planner_options

    # what the trainer refuses, from the same config files (flowgrpo.config.checks; the
    # editing model + prompt cache refusal among them: check_prompt_cache)
    check_model_run(cfg, configs, world_size=gpus, label="--gpus")
    layout = parallel_layout(gpus, fs.replicate_degree, fs.sp_degree)
    shard, dp = layout.shard_group, layout.dp
    wbytes = _dtype_bytes(m.dtype, device)  # the loaded weights (frozen parts, LoRA base)
    cbytes = wbytes if fs.param_dtype == "auto" else _dtype_bytes(fs.param_dtype, device)
    lora = cfg.lora.enabled
    quant = getattr(m, "base_quant", "none") or "none"
    if quant != "none" and not lora:
        raise ValueError(
            f"model.base_quant={quant} quantizes the frozen base of a LoRA run: set "
            "lora.enabled=true or model.base_quant=none"
        )

    adapter_cls = import_adapter(SUPPORTED_PIPELINES[pipeline])
    options = planner_options(cfg)  # every adapter option, from its section
    trained = [c for c in adapter_cls.trained_components(index) if c in configs and c in index]
    shapes = []
    for comp in trained:
        lib, cls = index[comp]
        targets = cfg.lora.target_modules
        if targets is None:
            targets = list(adapter_cls.lora_target_modules)
        key = ("shape", lib, cls, json.dumps(configs[comp], sort_keys=True), str(targets))
        key += (cfg.lora.rank,)
        if key not in MEMO:
            model = build_on_meta(lib, cls, configs[comp])
            MEMO[key] = transformer_shape(model, targets, cfg.lora.rank)
        shapes.append(MEMO[key])
    n_params = sum(s.params for s in shapes)
    n_buffers = sum(s.buffers for s in shapes)  # whole on every rank (FSDP shards parameters)
    n_lora = sum(s.lora_params for s in shapes)
    lin = (sum(s.linear[0] for s in shapes), sum(s.linear[1] for s in shapes))
    frozen: dict[str, tuple[int, int, int]] = {}
    for comp, spec in index.items():
        if comp in trained or comp not in configs or not isinstance(spec, list):
            continue
        frozen[comp] = component_counts(spec[0], spec[1], configs[comp])

    from flowgrpo.algorithms import algorithm_class

    algo_cls = algorithm_class(cfg.algorithm)
    algo = getattr(cfg, cfg.algorithm, None)
    reference = algo_cls.needs_reference(algo)
    n_train = n_lora if lora else n_params
    offload = fs.cpu_offload
    parts: dict[str, float] = {}
    state = 1.0 if not offload else 0.0  # CPU offload keeps the sharded state in host memory
    if lora:
        base = _weight_bytes(n_params, lin, wbytes, quant)
        parts["trained weights"] = state * (base + n_lora * 4) / shard
    else:
        parts["trained weights"] = state * n_params * 4 / shard
    parts["trained weights"] += n_buffers * wbytes
    parts["grads"] = state * n_train * 4 / shard
    parts["optimizer"] = state * n_train * 8 / shard
    parts["reference"] = state * (n_params * cbytes / shard if reference and not lora else 0)
    # trainer.off_policy_steps=1 keeps the behaviour policy's params (trainer/off_policy.py)
    off_policy = int(cfg.trainer.off_policy_steps > 0)
    shadows = int(cfg.ema.enabled) + len(algo_cls.shadows) + off_policy
    parts["EMA"] = state * shadows * n_train * 4 / shard
    # unsharded while a block runs: its params and the next one's (prefetch) in the compute
    # dtype (a quantized base gathers its quantized bytes), and in backward a block's
    # unsharded fp32 grads before the reduce-scatter
    biggest = sorted((b[1] for s in shapes for b in s.blocks), reverse=True)
    per_param = cbytes if quant == "none" else QUANT_BYTES[quant]
    gathered = sum(biggest[:2]) * per_param + (0 if lora else biggest[0] * 4)
    parts["gathered blocks"] = gathered if shard > 1 or offload else 0.0
    cached = bool(m.embed_cache_dir)
    released = cached and m.text_encoder_offload != "keep"
    text = sum(
        _weight_bytes(n, (e, r), wbytes, quant)
        for k, (n, e, r) in frozen.items()
        if k.startswith("text_encoder")
    )
    other = sum(n for k, (n, _, _) in frozen.items() if not k.startswith("text_encoder"))
    parts["frozen text encoders"] = 0.0 if released else text
    parts["frozen VAE etc."] = other * wbytes
    # every reward the run builds holds its model from the start (trainer/run.py): the trained
    # ones, the eval-only ones and the gold ones
    rewards = [
        *reward_models(list(cfg.reward), device),
        *reward_models(list(cfg.eval_reward), device, "eval_reward"),
        *reward_models(list(cfg.eval.gold_reward), device, "eval.gold_reward"),
    ]
    on_device = [r for r in rewards if r[3] != "cpu" or device == "cpu"]
    parts["reward models"] = float(sum(n * b for _, n, b, _, _ in on_device))
    if device == "cuda":
        mib = CUDA_OVERHEAD_MIB["context"] + (CUDA_OVERHEAD_MIB["nccl"] if gpus > 1 else 0.0)
        parts["CUDA context, cuBLAS, NCCL"] = mib * 2**20
    else:
        parts["CUDA context, cuBLAS, NCCL"] = 0.0
    if off_policy and cfg.trainer.off_policy_overlap:  # a second pipeline samples beside
        copied = ("trained weights", "frozen text encoders", "frozen VAE etc.")
        parts["off-policy model copy"] = sum(parts[k] for k in copied)
    persistent = sum(parts.values())

    tokens = adapter_cls.token_counts(configs, m.height, m.width, options)
    img, txt, latent = tokens.image, tokens.text, tokens.latent
    text_len, text_dim = tokens.prompt
    notes: list[str] = []
    if adapter_cls.prompt_trimmed and txt >= text_len:
        trimmed = min(TYPICAL_PROMPT_TOKENS, text_len)
        txt, text_len = txt - tokens.prompt[0] + trimmed, trimmed
        notes.append(
            f"note: {pipeline} trims the prompt embeddings to the batch's longest prompt: "
            f"planned at {trimmed} tokens (flowgrpo.planner.plan.TYPICAL_PROMPT_TOKENS)"
        )
    cross = tokens.prompt[0] if txt == 0 else 0  # cross-attended text: the prompt's tokens
    if cross and adapter_cls.prompt_trimmed:
        cross = text_len
    guidance = algo_cls.rollout_guidance_scale(cfg)
    rows = 2 if adapter_cls.plans_cfg(guidance, options) else 1
    sp = fs.sp_degree
    coef = ACT_PER_WIDTH["lora" if lora else "full"]
    seq = img + txt
    # a trimmed prompt is padded within its batch and masked: Qwen-Image's joint mask is
    # [B, 1, 1, S], with which torch's SDPA keeps no N^2 tensor (on the CPU the saved tensors
    # of a masked and an unmasked call are the same bytes; CUDA's memory-efficient kernel
    # takes it): no N^2 term while no family's attention falls back to the math path
    per_block = []
    for s in shapes:
        for k, _, iw, tw, mw, _heads, kv2 in s.blocks:
            single = k.startswith("single")
            tok_img = img + (txt if single else 0)
            tok_txt = txt if not single else 0
            width = iw * tok_img + tw * (tok_txt or cross) + mw + kv2 * (cross or img)
            per_block.append(coef * cbytes * width / sp)
    mb = cfg.update.micro_batch_size * rows
    hidden = max(s.hidden for s in shapes)
    act_full = mb * sum(per_block)
    act_ckpt = mb * (len(per_block) * seq * hidden * cbytes / sp + max(per_block))
    frag = 1.0 + (FRAGMENTATION if device == "cuda" else 0.0)
    use_ckpt = fs.activation_checkpointing
    parts["activations"] = frag * (act_ckpt if use_ckpt else act_full)
    parts["(activations without checkpointing)"] = frag * act_full
    parts["(activations with checkpointing)"] = frag * act_ckpt

    samples = cfg.sample.prompts_per_step * cfg.sample.group_size
    local = math.ceil(samples / dp)
    s = cfg.sample
    k = algo_cls.trained_steps(cfg)
    frames = tokens.frames
    per_sample = (
        (k + 2) * latent * 4  # latents of the trained steps + the final latents, fp32
        + rows * text_len * text_dim * wbytes  # prompt (and negative) embeddings
    )
    rollout_act = frag * (
        ROLLOUT_ACT_FACTOR * s.rollout_batch_size * rows * seq * hidden * cbytes / sp
    )
    # every rank of an SP group samples its group's samples alike (the whole trajectories);
    # the decoded images / videos go to the host (the adapters' decode returns them on CPU,
    # the rewards take them there): host memory, not GPU memory, except the chunk decoding
    image = 3 * frames * m.height * m.width * 4  # one decoded image / video, fp32 on the host
    vbytes = wbytes
    decode_chunk = 1 if m.vae_slicing else min(local, max(1, s.rollout_batch_size))
    decode = decode_chunk * vae_decode_peak(
        configs.get("vae", {}), m.height, m.width, frames, vbytes, tiling=m.vae_tiling
    )
    # off-policy: the next step's rollout is held while this one trains (two rollouts alive)
    parts["trajectories"] = local * per_sample * (1 + off_policy)
    if device == "cpu":  # the host is the device: the decoded images count
        parts["trajectories"] += local * image * (1 + off_policy)
    else:
        parts["(host: decoded images)"] = local * image
    parts["(rollout forward)"] = rollout_act
    parts["(VAE decode)"] = decode
    train_state = persistent
    phases = {
        "rollout": persistent
        + parts["trajectories"]
        + max(rollout_act, decode)
        + (parts["gathered blocks"] if shard > 1 else 0.0),
        "training": train_state
        + parts["trajectories"]
        + parts["gathered blocks"]
        + parts["activations"],
    }
    if cached:  # the cache is filled before the first step: no grads or moments yet
        phases["prompt encoding"] = (
            persistent - parts["grads"] - parts["optimizer"] - parts["frozen text encoders"] + text
        )
    plan = Plan(parts, gpus, gpu_gb, notes=notes, phases=phases)
    for label, n, _, dev, assumed in rewards:
        if "assumed" in assumed or "unknown" in assumed:
            plan.notes.append(f"note: reward {assumed}")
        elif dev == "cpu" and device != "cpu" and n:
            plan.notes.append(f"note: reward {label} runs on the CPU (not counted)")
    host = parts.get("(host: decoded images)", 0.0) * min(gpus, 8)
    if host > HOST_NOTE_GB * GIB:
        plan.notes.append(
            f"note: the decoded images of a step wait for the rewards in host memory: "
            f"{host / GIB:.0f} GiB per node of {min(gpus, 8)} GPUs (fewer prompts per step or "
            "more GPUs shrink it)"
        )
    native = getattr(adapter_cls, "native_size", None)
    size = native(lambda c: configs.get(c) or {}) if native is not None else None
    if size is not None and (m.height, m.width, m.num_frames or size[2]) != size:
        nf = f" x {m.num_frames} frames" if m.num_frames else ""
        plan.notes.append(
            f"note: {cfg.model.path} generates {size[0]}x{size[1]} x {size[2]} frames by default; "
            f"this plan is for {m.height}x{m.width}{nf} (model.height/width/num_frames as "
            f"set): to plan its own size add model.height={size[0]} model.width={size[1]} "
            f"model.num_frames={size[2]}"
        )
    plan.params = {"trained": n_params, "lora": n_lora, **{k: v[0] for k, v in frozen.items()}}
    plan.params.update({f"reward:{label}": n for label, n, _, _, _ in rewards})
    return plan


def format_plan(plan: Plan, title: str) -> str:
    """The plan as a table of GiB per GPU, each phase's peak, then the verdict."""
    lines = [f"{title}: per-GPU memory on {plan.gpus} GPU(s) of {plan.gpu_gb:g} GiB (GiB = 2^30 B)"]
    for name, value in plan.parts.items():
        lines.append(f"  {name:<38} {value / GIB:9.2f} GiB")
    for name, value in plan.phases.items():
        lines.append(f"  {'peak: ' + name:<38} {value / GIB:9.2f} GiB")
    lines.append(f"  {'total (the largest peak)':<38} {plan.total / GIB:9.2f} GiB")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"{verdict}: {plan.total / GIB:.1f} GiB of {plan.gpu_gb:g} GiB at its peak "
        f"({plan.peak_phase}; the CUDA context, cuBLAS and NCCL included). Predicted by the "
        "planner, not measured on a GPU."
    )
    lines += plan.notes
    if plan.tight:
        lines.append(
            f"warning: tight: within {MARGIN:.0%} of the card, inside the planner's error "
            "(its totals are within 15% of measured CPU peaks): leave room, e.g. with the "
            "settings below"
        )
    return "\n".join(lines)


def planned_line(cfg: Any, ranks: int, device: str, device_gb: float) -> str | None:
    """The startup banner's line: the planner's total per rank against ``device_gb`` (the
    device's memory in 10^9 bytes, as the trainer reads it), or None when the run's model
    cannot be planned (the built-in toy, a folder without per-component config files)."""
    gib = device_gb * 1e9 / GIB
    try:
        plan = plan_memory(cfg, ranks, gib, device=device)
    except Exception:  # noqa: BLE001 - advisory: a model the planner cannot read never stops a run
        return None
    verdict = "fits" if plan.fits else "may NOT fit: flowgrpo memory PRESET ... says what to turn"
    return (
        f"  memory     planned {plan.total / GIB:.1f} GiB per rank of {gib:.0f} GiB "
        f"({verdict}; predicted by the planner)"
    )


__all__ = [
    "ACT_PER_WIDTH",
    "CUDA_OVERHEAD_MIB",
    "FRAGMENTATION",
    "GIB",
    "Plan",
    "QUANT_BYTES",
    "format_plan",
    "plan_memory",
    "planned_line",
    "transformer_shape",
    "vae_decode_peak",
]
