"""The memory planner behind ``flowgrpo memory PRESET [key=value ...] --gpus N --gpu-gb G``.

Per-GPU bytes of a run, by part, from the model's config files alone: every component is built
from its ``config.json`` on the meta device (no weight is read, nothing is allocated) and its
parameters counted. The sharded state is what the engine holds per rank once the transformer
is sharded over a shard group of S = gpus / fsdp.replicate_degree ranks:

- trained weights: full fine-tune, the fp32 master of every parameter (4 B / S); LoRA, the
  frozen base in the weights' dtype plus the fp32 LoRA factors;
- grads (fp32, 4 B / S) and AdamW's two moments (8 B / S) of the trained parameters;
- reference: a full fine-tune whose algorithm has a KL term keeps the initial weights in the
  compute dtype (2 B / S in bf16); LoRA's reference is the adapter switched off (0);
- EMA (and DiffusionNFT's old policy): fp32 shadows of the trained parameters (4 B / S each);
- FSDP's gathered blocks: the two largest blocks unsharded in the compute dtype (the one
  running and the one prefetched);
- frozen components: the text encoders (0 once every prompt is in the embedding cache and
  ``model.text_encoder_offload`` is cpu/free) and the VAE, whole on every GPU;
- activations of one training micro-batch (both CFG branches: 2 rows per sample), from each
  block's Linear widths x its tokens (image tokens; text tokens for the text stream),
  calibrated on CPU measurements (``ACT_PER_WIDTH``); with activation checkpointing, each
  block's input plus one block's activations;
- rollout buffers: this rank's trajectories (fp32 latents of the trained steps, prompt
  embeddings; every rank of a sequence-parallel group holds its group's samples whole) and one
  rollout chunk's decoded images, and the rollout's no-grad forward of ``rollout_batch_size``.
  The decoded images of all this rank's samples wait for the rewards in host memory
  (``(host: decoded images)``, not in the GPU total).

The totals are predictions: measured on CPUs (tests/config/test_memory_planner.py), not yet on
a GPU.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from flowgrpo.engine.config import parallel_layout
from flowgrpo.settings import resolve_dtype

GB = 1e9
#: activation bytes saved for backward per token, per unit of a block's Linear width (sum of
#: in + out features over the block's Linear layers, each at the tokens it sees), per byte of
#: the compute dtype: full fine-tune, and LoRA (a frozen Linear keeps no input for its weight's
#: grad). Fitted to the 1-rank CPU (fp32) measurements of a small SD3 (4 blocks of width 256,
#: 64 px, micro-batch 2 with CFG) in tests/config/test_memory_planner.py; the 2-rank runs of the
#: same test check them (within 4%).
ACT_PER_WIDTH = {"full": 1.06, "lora": 0.61}
#: the rollout's no-grad forward keeps about this many of the largest activations alive
ROLLOUT_ACT_FACTOR = 4.0
#: share of a GPU's memory the plan may use: the rest is the CUDA context, NCCL buffers and
#: the caching allocator's fragmentation
USABLE = 0.9
#: host memory per node of the decoded images above which the plan says so (GB)
HOST_NOTE_GB = 256
#: a plan that fits within this share of the usable memory gets a warning: the planner's error
MARGIN = 0.1
KNOWN_PREFIX = "known:"
_TEXT_MARKERS = ("add_", "context", "txt", "attn2.to_k", "attn2.to_v", "text")
_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")
#: components counted on the meta device, by (kind, library, class, config, ...): the advice
#: plans many variants of one run, and building a 20B transformer on meta takes ~0.5 s
_MEMO: dict[tuple, Any] = {}


# -- the model's config files --------------------------------------------------------------------
def known_models() -> list[str]:
    """Names of the shipped config sets (``model.path=known:NAME``)."""
    root = resources.files("flowgrpo") / "assets" / "model_configs"
    return sorted(p.name[: -len(".json")] for p in root.iterdir() if p.name.endswith(".json"))


def read_model_configs(path: str) -> dict[str, Any]:
    """{"model_index": ..., component: config} from a local diffusers directory (its
    model_index.json and each component's config.json) or a shipped set (``known:NAME``)."""
    if path.startswith(KNOWN_PREFIX):
        name = path[len(KNOWN_PREFIX) :]
        if name not in known_models():
            raise ValueError(
                f"model.path {path!r}: no shipped config set {name!r}; known: "
                + ", ".join(KNOWN_PREFIX + n for n in known_models())
            )
        text = (
            resources.files("flowgrpo") / "assets" / "model_configs" / f"{name}.json"
        ).read_text()
        return json.loads(text)
    from flowgrpo.models.registry import read_model_index, resolve_model_path

    index = read_model_index(path)
    root = resolve_model_path(path)
    out: dict[str, Any] = {"model_index": index}
    for comp, spec in index.items():
        if not (
            isinstance(spec, list) and len(spec) == 2 and spec[0] in ("diffusers", "transformers")
        ):
            continue
        cfg = root / comp / "config.json"
        if cfg.is_file():
            out[comp] = json.loads(cfg.read_text())
    if "transformer" not in out:
        raise ValueError(f"model.path '{path}': no transformer/config.json to plan from")
    return out


def preset_model(preset: str | None) -> list[str] | None:
    """The settings that plan shipped preset ``preset`` on its own model: ``model.path`` of
    its first config set (``PRESET_MODELS``) and what that row adds; None for other presets."""
    from flowgrpo.models.registry import PRESET_MODELS

    for name, model, extra in PRESET_MODELS:
        if name == preset:
            return [f"model.path={KNOWN_PREFIX}{model}", *extra]
    return None


def build_on_meta(library: str, class_name: str, config: dict[str, Any]) -> Any:
    """The component instantiated from ``config`` on the meta device (no memory, no weights)."""
    import torch

    with torch.device("meta"):
        if library == "diffusers":
            import diffusers

            return getattr(diffusers, class_name).from_config(config)
        import transformers

        klass = getattr(transformers, class_name)
        return klass(klass.config_class.from_dict(config))


def _numel(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


# -- the transformer's shape ---------------------------------------------------------------------
@dataclass
class TransformerShape:
    """What the planner needs of one trained transformer (all counts in elements)."""

    params: int
    buffers: int
    lora_params: int
    blocks: list[tuple[str, int, int, int]]  # (block list, params, image width, text width)
    hidden: int


def _blocks(model: Any) -> list[tuple[str, Any]]:
    out = []
    for name in _BLOCK_LISTS:
        blocks = getattr(model, name, None)
        if blocks is not None and hasattr(blocks, "__iter__"):
            out += [(name, b) for b in blocks]
    return out


def _lora_targeted(name: str, targets: list[str] | str) -> bool:
    if targets == "all-linear":
        return True
    return any(name == t or name.endswith("." + t) for t in targets)


def transformer_shape(model: Any, lora_targets: list[str] | str, rank: int) -> TransformerShape:
    """Parameter counts, LoRA parameter count (rank r on every targeted Linear: r (in + out))
    and, per block, its Linear width on image and on text tokens."""
    import torch

    lora = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and _lora_targeted(name, lora_targets):
            lora += rank * (mod.in_features + mod.out_features)
    blocks = []
    for kind, block in _blocks(model):
        img = txt = 0
        for name, mod in block.named_modules():
            if isinstance(mod, torch.nn.Linear):
                width = mod.in_features + mod.out_features
                if any(m in name for m in _TEXT_MARKERS) and kind != "single_transformer_blocks":
                    txt += width
                else:
                    img += width
        blocks.append((kind, _numel(block), img, txt))
    cfg = model.config
    if "num_attention_heads" in cfg and "attention_head_dim" in cfg:
        hidden = int(cfg["num_attention_heads"]) * int(cfg["attention_head_dim"])
    else:  # transformers configured by model width (``dim``) rather than heads x head width
        hidden = int(cfg.get("dim", cfg.get("hidden_size", 1)))
    buffers = sum(b.numel() for b in model.buffers())
    return TransformerShape(_numel(model), buffers, lora, blocks, hidden)


# -- the plan --------------------------------------------------------------------------------------
@dataclass
class Plan:
    """Per-GPU bytes by part, and what they were computed for."""

    parts: dict[str, float]
    gpus: int
    gpu_gb: float
    notes: list[str] = field(default_factory=list)
    params: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """The listed parts (names in parentheses are alternatives, not added), the rollout's
        forward counted only where it exceeds the training activations (never both at once)."""
        fixed = sum(v for k, v in self.parts.items() if not k.startswith("("))
        return fixed + max(
            0.0, self.parts.get("(rollout forward)", 0.0) - self.parts["activations"]
        )

    @property
    def fits(self) -> bool:
        return self.total <= USABLE * self.gpu_gb * GB

    @property
    def tight(self) -> bool:
        """Fits, but within ``MARGIN`` of the usable memory."""
        return self.fits and self.total > (1 - MARGIN) * USABLE * self.gpu_gb * GB


def _dtype_bytes(name: str, device: str) -> int:
    return resolve_dtype(name, device).itemsize


def _guidance(cfg: Any) -> float:
    algo = getattr(cfg, cfg.algorithm, None)
    g = getattr(algo, "guidance_scale", None)
    return cfg.sample.guidance_scale if g is None else g


def plan_memory(cfg: Any, gpus: int, gpu_gb: float, *, device: str = "cuda") -> Plan:
    """The per-GPU plan of run config ``cfg`` on ``gpus`` GPUs of ``gpu_gb`` GB each."""
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
    from flowgrpo.models.registry import SUPPORTED_PIPELINES, family_options, import_adapter

    if pipeline not in SUPPORTED_PIPELINES:
        raise ValueError(
            f"model.path '{cfg.model.path}' holds an unsupported pipeline {pipeline!r}; "
            f"supported: {', '.join(SUPPORTED_PIPELINES)}"
        )
    fs, m = cfg.fsdp, cfg.model
    from flowgrpo.config.checks import check_model_run

    # what the trainer refuses, from the same config files (flowgrpo.config.checks)
    check_model_run(cfg, configs, world_size=gpus, label="--gpus")
    layout = parallel_layout(gpus, fs.replicate_degree, fs.sp_degree)
    shard, dp = layout.shard_group, layout.dp
    wbytes = _dtype_bytes(m.dtype, device)  # the loaded weights (frozen parts, LoRA base)
    cbytes = wbytes if fs.param_dtype == "auto" else _dtype_bytes(fs.param_dtype, device)

    adapter_cls = import_adapter(SUPPORTED_PIPELINES[pipeline])
    if getattr(adapter_cls, "edits", False) and m.embed_cache_dir:  # as the trainer refuses it
        raise ValueError(
            "model.embed_cache_dir: an editing model's prompt embeddings depend on each "
            "sample's source images, so they are not cached; unset model.embed_cache_dir"
        )
    options = {k: getattr(m, k) for k in family_options()}  # the family's model.* options
    trained = [c for c in adapter_cls.trained_components(index) if c in configs and c in index]
    shapes = []
    for comp in trained:
        lib, cls = index[comp]
        targets = cfg.lora.target_modules
        if targets is None:
            targets = list(adapter_cls.lora_target_modules)
        key = ("shape", lib, cls, json.dumps(configs[comp], sort_keys=True), str(targets))
        key += (cfg.lora.rank,)
        if key not in _MEMO:
            model = build_on_meta(lib, cls, configs[comp])
            _MEMO[key] = transformer_shape(model, targets, cfg.lora.rank)
        shapes.append(_MEMO[key])
    n_params = sum(s.params for s in shapes)
    n_buffers = sum(s.buffers for s in shapes)  # whole on every rank (FSDP shards parameters)
    n_lora = sum(s.lora_params for s in shapes)
    frozen_parts: dict[str, int] = {}
    for comp, spec in index.items():
        if comp in trained or comp not in configs or not isinstance(spec, list):
            continue
        key = ("numel", spec[0], spec[1], json.dumps(configs[comp], sort_keys=True))
        if key not in _MEMO:
            _MEMO[key] = _numel(build_on_meta(spec[0], spec[1], configs[comp]))
        frozen_parts[comp] = _MEMO[key]

    algo = getattr(cfg, cfg.algorithm, None)
    from flowgrpo.algorithms import algorithm_class

    reference = algorithm_class(cfg.algorithm).needs_reference(algo)
    lora = cfg.lora.enabled
    n_train = n_lora if lora else n_params
    offload = fs.cpu_offload
    parts: dict[str, float] = {}
    state = 1.0 if not offload else 0.0  # CPU offload keeps the sharded state in host memory
    if lora:
        parts["trained weights"] = state * (n_params * wbytes + n_lora * 4) / shard
    else:
        parts["trained weights"] = state * n_params * 4 / shard
    parts["trained weights"] += n_buffers * wbytes
    parts["grads"] = state * n_train * 4 / shard
    parts["optimizer"] = state * n_train * 8 / shard
    parts["reference"] = state * (n_params * cbytes / shard if reference and not lora else 0)
    shadows = int(cfg.ema.enabled) + len(algorithm_class(cfg.algorithm).shadows)
    parts["EMA"] = state * shadows * n_train * 4 / shard
    # unsharded while a block runs: its params and the next one's (prefetch) in the compute
    # dtype, and in backward a block's unsharded fp32 grads before the reduce-scatter
    biggest = sorted((b[1] for s in shapes for b in s.blocks), reverse=True)
    gathered = sum(biggest[:2]) * cbytes + (0 if lora else biggest[0] * 4)
    parts["gathered blocks"] = gathered if shard > 1 or offload else 0.0
    released = m.embed_cache_dir and m.text_encoder_offload != "keep"
    text = sum(v for k, v in frozen_parts.items() if k.startswith("text_encoder"))
    other = sum(v for k, v in frozen_parts.items() if not k.startswith("text_encoder"))
    parts["frozen text encoders"] = 0.0 if released else text * wbytes
    parts["frozen VAE etc."] = other * wbytes

    tokens = adapter_cls.token_counts(configs, m.height, m.width, options)
    img, txt, latent = tokens.image, tokens.text, tokens.latent
    rows = 2 if adapter_cls.plans_cfg(_guidance(cfg), options) else 1
    sp = fs.sp_degree
    coef = ACT_PER_WIDTH["lora" if lora else "full"]
    per_block = [
        coef * cbytes * (iw * (img + (txt if k == "single_transformer_blocks" else 0)) + tw * txt)
        for s in shapes
        for (k, _, iw, tw) in s.blocks
    ]
    per_block = [b / sp for b in per_block]
    mb = cfg.update.micro_batch_size * rows
    hidden = max(s.hidden for s in shapes)
    act_full = mb * sum(per_block)
    act_ckpt = mb * (len(per_block) * (img + txt) * hidden * cbytes / sp + max(per_block))
    use_ckpt = fs.activation_checkpointing
    parts["activations"] = act_ckpt if use_ckpt else act_full
    parts["(activations without checkpointing)"] = act_full
    parts["(activations with checkpointing)"] = act_ckpt

    samples = cfg.sample.prompts_per_step * cfg.sample.group_size
    local = math.ceil(samples / dp)
    s = cfg.sample
    if s.window_size > 0:
        k = s.window_size
    else:
        k = max(1, math.ceil(s.stochastic_steps() * s.timestep_fraction))
    text_len, text_dim = tokens.prompt
    frames = tokens.frames
    per_sample = (
        (k + 2) * latent * 4  # latents of the trained steps + the final latents, fp32
        + rows * text_len * text_dim * wbytes  # prompt (and negative) embeddings
    )
    rollout_act = (
        ROLLOUT_ACT_FACTOR * s.rollout_batch_size * rows * (img + txt) * hidden * cbytes / sp
    )
    # every rank of an SP group samples its group's samples alike (the whole trajectories);
    # the decoded images / videos go to the host (the adapters' decode returns them on CPU,
    # the rewards take them there): host memory, not GPU memory, so not in the total
    image = 3 * frames * m.height * m.width * 4  # one decoded image / video, fp32
    if device == "cpu":  # the host is the device: the decoded images count
        parts["rollout buffers"] = local * (per_sample + image)
    else:
        decode_chunk = min(local, max(1, s.rollout_batch_size))
        parts["rollout buffers"] = local * per_sample + decode_chunk * image
        parts["(host: decoded images)"] = local * image
    parts["(rollout forward)"] = rollout_act
    plan = Plan(parts, gpus, gpu_gb)
    host = parts.get("(host: decoded images)", 0.0) * min(gpus, 8)
    if host > HOST_NOTE_GB * GB:
        plan.notes.append(
            f"note: the decoded images of a step wait for the rewards in host memory: "
            f"{host / GB:.0f} GB per node of {min(gpus, 8)} GPUs (fewer prompts per step or "
            "more GPUs shrink it)"
        )
    native = getattr(adapter_cls, "native_size", None)
    size = native(lambda c: configs.get(c) or {}) if native is not None else None
    if size is not None and (m.height, m.width, m.num_frames or size[2]) != size:
        frames = f" x {m.num_frames} frames" if m.num_frames else ""
        plan.notes.append(
            f"note: {cfg.model.path} generates {size[0]}x{size[1]} x {size[2]} frames by default; "
            f"this plan is for {m.height}x{m.width}{frames} (model.height/width/num_frames as "
            f"set): to plan its own size add model.height={size[0]} model.width={size[1]} "
            f"model.num_frames={size[2]}"
        )
    plan.params = {"trained": n_params, "lora": n_lora, **frozen_parts}
    return plan


def format_plan(plan: Plan, title: str) -> str:
    """The plan as a table of GB per GPU, then the verdict."""
    lines = [f"{title}: per-GPU memory on {plan.gpus} GPU(s) of {plan.gpu_gb:g} GB"]
    for name, value in plan.parts.items():
        lines.append(f"  {name:<38} {value / GB:9.2f} GB")
    lines.append(f"  {'total':<38} {plan.total / GB:9.2f} GB")
    budget = USABLE * plan.gpu_gb
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(
        f"{verdict}: {plan.total / GB:.1f} GB of the {budget:.1f} GB usable "
        f"({USABLE:.0%} of {plan.gpu_gb:g} GB; the rest: CUDA context, NCCL, fragmentation). "
        "Predicted by the planner, not measured on a GPU."
    )
    lines += plan.notes
    if plan.tight:
        lines.append(
            f"warning: tight: within {MARGIN:.0%} of the usable memory, inside the planner's "
            "error (its totals are within 15% of measured CPU peaks): leave room, e.g. with "
            "the settings below"
        )
    return "\n".join(lines)


def planned_line(cfg: Any, ranks: int, device: str, device_gb: float) -> str | None:
    """The startup banner's line: the planner's total per rank against ``device_gb`` (the
    device's memory), or None when the run's model cannot be planned (the built-in toy, a
    folder without per-component config files)."""
    try:
        plan = plan_memory(cfg, ranks, device_gb, device=device)
    except Exception:  # noqa: BLE001 - advisory: a model the planner cannot read never stops a run
        return None
    verdict = "fits" if plan.fits else "may NOT fit: flowgrpo memory PRESET ... says what to turn"
    return (
        f"  memory     planned {plan.total / GB:.1f} GB per rank of {device_gb:.0f} GB "
        f"({verdict}; predicted by the planner)"
    )


__all__ = [
    "ACT_PER_WIDTH",
    "Plan",
    "build_on_meta",
    "format_plan",
    "planned_line",
    "known_models",
    "plan_memory",
    "preset_model",
    "read_model_configs",
]
