"""Quiet by default: what a run prints is what a user needs to read.

* Loading bars (diffusers' "Loading pipeline components", transformers' "Loading checkpoint
  shards") are shown by rank 0 only: eight ranks drew eight bars.
* Two warnings that are known to be harmless for flowgrpo are silenced, each by a filter that
  matches its exact text and nothing else (docs/training.md, "Quiet by default", says why):

  - FSDP2's "FSDP2-wrapped module (...) returned a view tensor": it warns that an in-place op
    on a block's output *would* skip the parameter all-gather. No flowgrpo code path does such
    an op; sharded training is tested equal to one-process training (tests/engine,
    tests/trainer), which a skipped all-gather would break.
  - diffusers' prompt truncation warning ("The following part of your input was truncated
    because ...") when the removed text is empty, as for the empty negative prompt: nothing of
    any prompt was cut. When real text is cut, the warning stays.
"""

from __future__ import annotations

import logging
import re
import warnings

FSDP_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor\. An in-place op"
TRUNCATION_WARNING = "The following part of your input was truncated because"


def truncation_loggers() -> tuple[str, ...]:
    """The loggers of the pipelines whose prompt encoders log TRUNCATION_WARNING, as each
    registered family declares them (``DiffusionAdapter.truncation_loggers``)."""
    from flowgrpo.models.registry import adapter_classes

    names = (n for cls in adapter_classes() for n in getattr(cls, "truncation_loggers", ()))
    return tuple(dict.fromkeys(names))


def __getattr__(name: str) -> tuple[str, ...]:
    if name == "TRUNCATION_LOGGERS":  # computed on first use: it imports the adapters
        return truncation_loggers()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_BLANK_REMOVED = re.compile(r"tokens: \[(\s*'\s*'\s*,?)*\s*\]\s*$")  # e.g. "tokens: ['', '']"


class BlankTruncationFilter(logging.Filter):
    """Drops diffusers' truncation warning when the text it says was removed is blank."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(TRUNCATION_WARNING):
            return True
        return _BLANK_REMOVED.search(message) is None


_FILTER = BlankTruncationFilter()


def quiet_known_noise(is_main: bool) -> None:
    """Rank 0 keeps the loading bars, other ranks lose them; every rank drops the two
    known-harmless warnings (module docstring). Idempotent."""
    warnings.filterwarnings("ignore", message=FSDP_VIEW_WARNING, category=UserWarning)
    for name in truncation_loggers():
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
    if is_main:
        return
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


__all__ = ["BlankTruncationFilter", "quiet_known_noise"]
