"""What ``flowgrpo memory`` advises when a plan does not fit (or fits tightly): each knob
tried alone with its total, the cheapest combination of knobs that fits (``KNOB_COST``), and
the settings docs/memory.md's table adds (``settings_that_fit``, ``docs_table``). Every
variant is planned by ``flowgrpo.planner.plan.plan_memory``, so a setting the trainer would
refuse is never offered."""

from __future__ import annotations

import math
from typing import Any

from flowgrpo.planner.models import KNOWN_PREFIX
from flowgrpo.planner.plan import GIB, Plan, plan_memory

GB = GIB

# -- what to turn ----------------------------------------------------------------------------------
#: settings that shrink a plan, mildest first (what each costs: none, recompute, more steps,
#: more communication, host memory traffic)
SUGGESTIONS: list[tuple[str, list[str]]] = [
    (
        "cache prompt embeddings and free the text encoders",
        ["model.embed_cache_dir=prompt-cache", "model.text_encoder_offload=free"],
    ),
    ("train LoRA instead of the whole transformer", ["lora.enabled=true"]),
    ("keep the frozen base (and text encoders) in int8", ["model.base_quant=int8"]),
    ("recompute blocks in backward", ["fsdp.activation_checkpointing=true"]),
    ("one sample per micro-batch", ["update.micro_batch_size=1"]),
    ("split each sample's tokens over 2 GPUs", ["fsdp.sp_degree=2"]),
    ("keep the sharded state in host memory", ["fsdp.cpu_offload=true"]),
]


#: the relative cost of each knob's step, for the cheapest combination (``cheapest_fit``):
#: free first (the cache), then recompute, a quantized frozen base (int8, then NF4: slower
#: matmuls, and the policy trains on the quantized weights), more steps, communication, host
#: traffic, more GPUs, then what changes the training itself (fewer samples per step, smaller
#: groups, LoRA)
KNOB_COST = {
    "cache": 1,
    "ckpt": 2,
    "quant": 2.5,
    "micro": 3,
    "sp": 4,
    "offload": 6,
    "gpus": 7,
    "prompts": 8,
    "group": 10,
    "lora": 12,
}


def _knobs(cfg: Any, gpus: int) -> list[list[tuple[list[str], float, str]]]:
    """Per knob, its levels (settings, cost, why); level 0 is the run as given. GPU counts are
    levels too, as the setting ``--gpus N``."""
    s, fs = cfg.sample, cfg.fsdp
    knobs: list[list[tuple[list[str], float, str]]] = []
    for name, extra in SUGGESTIONS:
        if extra[0].startswith("fsdp.sp_degree"):
            levels = [
                (
                    [f"fsdp.sp_degree={n}"],
                    KNOB_COST["sp"] * math.log2(n / fs.sp_degree),
                    f"split each sample's tokens over {n} GPUs",
                )
                for n in (2, 4, 8)
                if n > fs.sp_degree
            ]
        elif extra[0].startswith("model.base_quant"):
            if cfg.model.base_quant != "none":
                continue
            levels = [
                (["model.base_quant=int8"], KNOB_COST["quant"], "keep the frozen base in int8"),
                (["model.base_quant=nf4"], 2 * KNOB_COST["quant"], "keep the frozen base in NF4"),
            ]
        else:
            kind = {
                "model.embed_cache_dir=prompt-cache": "cache",
                "lora.enabled=true": "lora",
                "fsdp.activation_checkpointing=true": "ckpt",
                "update.micro_batch_size=1": "micro",
                "fsdp.cpu_offload=true": "offload",
            }[extra[0]]
            levels = [(extra, KNOB_COST[kind], name)]
        knobs.append(levels)
    p, k = s.prompts_per_step, s.group_size
    knobs.append(
        [
            (
                [f"sample.prompts_per_step={p // d}"],
                KNOB_COST["prompts"] * math.log2(d),
                f"fewer prompts per step ({p // d} x {k} samples; a different training)",
            )
            for d in (2, 4, 8)
            if p % d == 0
        ]
    )
    if k % 2 == 0 and k // 2 >= 2:
        knobs.append(
            [
                (
                    [f"sample.group_size={k // 2}"],
                    KNOB_COST["group"],
                    "smaller groups (noisier advantages; a different training)",
                )
            ]
        )
    knobs.append(
        [
            ([f"--gpus {gpus * d}"], KNOB_COST["gpus"] * math.log2(d), "shard the state wider")
            for d in (2, 4, 8)
        ]
    )
    return [[([], 0.0, ""), *levels] for levels in knobs if levels]


def _plan_with(
    preset: str | None,
    overrides: list[str],
    extra: list[str],
    gpus: int,
    gpu_gb: float,
    device: str,
) -> Plan | None:
    """The plan with ``extra`` settings (``--gpus N`` among them sets the GPU count); None when
    they do not apply (the trainer would refuse the run)."""
    from flowgrpo.config import load_config

    settings = [e for e in extra if not e.startswith("--gpus ")]
    for e in extra:
        if e.startswith("--gpus "):
            gpus = int(e.split()[1])
    try:
        cfg = load_config(preset, [*overrides, *settings], check_paths=False)
        return plan_memory(cfg, gpus, gpu_gb, device=device)
    except Exception:  # noqa: BLE001 - a setting that does not apply is simply not offered
        return None


def suggestions(preset: str | None, overrides: list[str], plan: Plan, *, device: str) -> list[str]:
    """Settings that would shrink the plan, each tried alone (every knob's first step; the
    smallest GPU count that fits), best first, with the total each gives; a line ends in
    "fits" when that setting alone makes the run fit."""
    from flowgrpo.config import load_config

    cfg = load_config(preset, overrides, check_paths=False)
    out = []
    for levels in _knobs(cfg, plan.gpus):
        options = levels[1:2]
        if levels[1][0][0].startswith(("--gpus", "model.base_quant")):
            options = levels[1:]  # the smallest count that fits (else the largest tried)
        found = None
        for extra, _, why in options:
            other = _plan_with(preset, overrides, extra, plan.gpus, plan.gpu_gb, device)
            if other is not None and (other.fits or other.total < plan.total * 0.97):
                found = (other, extra, why)
                if other.fits:
                    break
        if found is not None:
            other, extra, why = found
            verdict = ", fits" if other.fits else ""
            line = f"{' '.join(extra)}  ({why}): {other.total / GB:.1f} GiB{verdict}"
            out.append((other.total, line))
    out.sort()
    return [text for _, text in out]


def cheapest_fit(
    preset: str | None, overrides: list[str], plan: Plan, *, device: str, limit: int = 400
) -> tuple[list[str], Plan] | None:
    """The cheapest combination of the knobs (``KNOB_COST``, summed) that fits: (settings,
    plan), or None when none of the ``limit`` cheapest combinations fits."""
    import itertools

    from flowgrpo.config import load_config

    cfg = load_config(preset, overrides, check_paths=False)
    combos = []
    for pick in itertools.product(*_knobs(cfg, plan.gpus)):
        extra = [x for settings, _, _ in pick for x in settings]
        if extra:
            combos.append((sum(c for _, c, _ in pick), len(extra), extra))
    combos.sort(key=lambda c: (c[0], c[1]))
    for _, _, extra in combos[:limit]:
        other = _plan_with(preset, overrides, extra, plan.gpus, plan.gpu_gb, device)
        if other is not None and other.fits:
            return extra, other
    return None


def settings_that_fit(
    preset: str | None, overrides: list[str], gpus: int, gpu_gb: float
) -> tuple[list[str], Plan]:
    """Add the settings of ``SUGGESTIONS`` in order (mildest first; LoRA is left to the user),
    each one that shrinks the plan, until it fits; returns (settings added, final plan)."""
    from flowgrpo.config import load_config

    added: list[str] = []
    plan = plan_memory(load_config(preset, overrides, check_paths=False), gpus, gpu_gb)
    for _, extra in SUGGESTIONS:
        if plan.fits:
            break
        if extra == ["lora.enabled=true"]:  # a different training, not a memory setting
            continue
        if extra[0].startswith("model.base_quant"):  # the policy trains on other weights
            continue
        try:
            cfg = load_config(preset, [*overrides, *added, *extra], check_paths=False)
            other = plan_memory(cfg, gpus, gpu_gb)
        except Exception:  # noqa: BLE001 - a setting that does not apply
            continue
        if other.total < plan.total * 0.99:
            added += extra
            plan = other
    return added, plan


#: GPU memory sizes (GiB) the fit tables try, smallest first: RTX 4080, RTX 4090, RTX 5090,
#: A100 40GB, L40S / RTX 6000 Ada, A100 / H100 80GB, H20, H200, B200
CARDS = (16, 24, 32, 40, 48, 80, 96, 141, 180)
#: the knob sets of the "smallest GPU" table, mildest first
FIT_KNOBS: list[tuple[str, list[str]]] = [
    ("as is", []),
    ("prompt cache", ["model.embed_cache_dir=prompt-cache", "model.text_encoder_offload=free"]),
    ("int8 base", ["model.base_quant=int8"]),
    ("NF4 base", ["model.base_quant=nf4"]),
    (
        "cache + NF4 + checkpointing",
        [
            "model.embed_cache_dir=prompt-cache",
            "model.text_encoder_offload=free",
            "model.base_quant=nf4",
            "fsdp.activation_checkpointing=true",
        ],
    ),
]


def smallest_card(preset: str | None, overrides: list[str], gpus: int) -> tuple[float, Plan] | None:
    """The smallest of ``CARDS`` the run fits on ``gpus`` of (GiB, its plan); None: none."""
    from flowgrpo.config import load_config

    try:
        cfg = load_config(preset, overrides, check_paths=False)
        plan = plan_memory(cfg, gpus, CARDS[-1])
    except Exception:  # noqa: BLE001 - a setting that does not apply to this run
        return None
    for card in CARDS:
        if plan.total <= card * GIB:
            return card, plan
    return None


def fits_line(preset: str | None, overrides: list[str], gpus: int) -> str:
    """``flowgrpo memory``'s line saying the smallest card the run fits, as given and with
    each of ``FIT_KNOBS``."""
    cells = []
    for label, extra in FIT_KNOBS:
        found = smallest_card(preset, [*overrides, *extra], gpus)
        if found is not None:
            cells.append(f"{label}: {found[0]:g} GiB")
        elif label == "as is":
            cells.append(f"{label}: none up to {CARDS[-1]} GiB")
    return f"smallest card ({gpus} GPU(s)) it fits: " + "; ".join(cells)


def smallest_gpu_table(gpus: int = 8) -> str:
    """docs/memory.md's table: per preset's real model, the smallest card of ``CARDS`` it
    trains on (``gpus`` of them) as shipped and with each knob set of ``FIT_KNOBS``."""
    from flowgrpo.config.shipped import preset_models

    head = "| preset, model | " + " | ".join(label for label, _ in FIT_KNOBS) + " |"
    lines = [head, "|" + "---|" * (1 + len(FIT_KNOBS))]
    for preset, model, extra in preset_models():
        over = [f"model.path={KNOWN_PREFIX}{model}", *extra]
        cells = []
        for _, knobs in FIT_KNOBS:
            found = smallest_card(preset, [*over, *knobs], gpus)
            cells.append("—" if found is None else f"{found[0]:g} GiB ({found[1].total / GIB:.1f})")
        lines.append(f"| {preset}, {model} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    """Print docs/memory.md's generated tables (python -m flowgrpo.planner.advice)."""
    from flowgrpo.planner.published import docs_rows

    print("<!-- published figures vs the planner -->")
    print("\n".join(docs_rows()))
    print()
    print("<!-- smallest GPU (8 of them) each preset's model trains on -->")
    print(smallest_gpu_table())
    print()
    print("<!-- 8x80 / 8x141 GiB: what to add -->")
    print(docs_table())


def docs_table(gpu_sizes: tuple[float, ...] = (80, 141), gpus: int = 8) -> str:
    """The markdown table of docs/memory.md: every preset's real model, LoRA (the preset) and
    a full fine-tune, on ``gpus`` GPUs of each size: GB per GPU and the settings that fit."""
    head = "| preset, model | training | " + " | ".join(
        f"{gpus}x{g:g} GiB: GiB/GPU, settings added" for g in gpu_sizes
    )
    from flowgrpo.config.shipped import preset_models

    lines = [head + " |", "|" + "---|" * (2 + len(gpu_sizes))]
    for preset, model, extra in preset_models():
        for label, more in (
            ("LoRA (preset)", []),
            ("full, KL as preset", ["lora.enabled=false", "lora.target_modules=null"]),
        ):
            over = [f"model.path={KNOWN_PREFIX}{model}", *extra, *more]
            cells = []
            for g in gpu_sizes:
                added, plan = settings_that_fit(preset, over, gpus, g)
                verdict = "" if plan.fits else " **does not fit**"
                what = ", ".join(f"`{a}`" for a in added) or "as is"
                cells.append(f"{plan.total / GB:.1f}{verdict}; {what}")
            lines.append(f"| {preset}, {model} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m flowgrpo.planner.advice: docs/memory.md's tables
    main()


__all__ = [
    "CARDS",
    "FIT_KNOBS",
    "KNOB_COST",
    "SUGGESTIONS",
    "cheapest_fit",
    "docs_table",
    "fits_line",
    "main",
    "smallest_card",
    "smallest_gpu_table",
    "settings_that_fit",
    "suggestions",
]
