"""Model adapters (one file per family) and the registry. The tiny offline pipelines of the
tests are test doubles: ``flowgrpo.testing.tiny``."""

from flowgrpo.models.base import DiffusionAdapter, PromptEmbeds, Schedule
from flowgrpo.models.registry import build_adapter, load_pipeline

__all__ = [
    "DiffusionAdapter",
    "PromptEmbeds",
    "Schedule",
    "build_adapter",
    "load_pipeline",
]
