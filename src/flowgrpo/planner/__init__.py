"""The memory planner (``flowgrpo memory``): per-GPU bytes of a run by part and by phase from
the model's config files alone (``plan``), the config files and reward models it reads
(``models``), what to turn when a run does not fit (``advice``) and the published figures it
is checked against (``published``). It asks the algorithm for the trained steps and the
rollout's guidance and runs the trainer's own checks (``flowgrpo.config.checks``)."""

from flowgrpo.planner.models import (
    KNOWN_PREFIX,
    build_on_meta,
    known_models,
    preset_model,
    read_model_configs,
    reward_models,
)
from flowgrpo.planner.plan import (
    ACT_PER_WIDTH,
    GB,
    GIB,
    Plan,
    format_plan,
    plan_memory,
    planned_line,
)

__all__ = [
    "ACT_PER_WIDTH",
    "GB",
    "GIB",
    "KNOWN_PREFIX",
    "Plan",
    "build_on_meta",
    "format_plan",
    "known_models",
    "plan_memory",
    "planned_line",
    "preset_model",
    "read_model_configs",
    "reward_models",
]
