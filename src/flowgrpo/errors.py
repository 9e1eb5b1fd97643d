"""Errors a run reports as one line (``flowgrpo: error: ...``, exit status 1).

Configuration and input errors are ``flowgrpo.config.ConfigError`` (exit status 2). These
are failures while a run goes: they name the culprit (a reward, a file and line, a folder, the
cause of a divergence) in their message, and the command line prints the message alone
unless ``run.debug=true`` or ``FLOWGRPO_TRACEBACK=1`` asks for the traceback.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A run-time failure with a one-line message that names its culprit."""


class TrainingDiverged(RunError):
    """Training produced non-finite numbers it cannot recover from (weights, updates or
    rollout latents): the run stops and keeps its last good checkpoint."""


__all__ = ["RunError", "TrainingDiverged"]
