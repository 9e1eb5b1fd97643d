"""Moved to ``flowgrpo.planner``: this name stays for the trainer's banner
(``trainer/setup.py``: ``planned_line``) until it imports the planner itself."""

from flowgrpo.planner import GB, GIB, Plan, format_plan, plan_memory, planned_line

__all__ = ["GB", "GIB", "Plan", "format_plan", "plan_memory", "planned_line"]
