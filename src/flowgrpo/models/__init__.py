"""Model adapters (one file per family), the registry, and tiny offline pipelines."""

from flowgrpo.models.base import DiffusionAdapter, PromptEmbeds, Schedule
from flowgrpo.models.registry import build_adapter, load_pipeline
from flowgrpo.models.tiny import tiny_pipeline

__all__ = [
    "DiffusionAdapter",
    "PromptEmbeds",
    "Schedule",
    "build_adapter",
    "load_pipeline",
    "tiny_pipeline",
]
