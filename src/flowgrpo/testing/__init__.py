"""The test kit: what flowgrpo's tests, its benchmarks and users testing their own model family
share.

- ``flowgrpo.testing.tiny``: tiny pipelines of every registered family (``tiny_pipeline``,
  ``tiny_size``, ``kinds``), built by the family's module in ``flowgrpo.testing.families``
  (its builder, its ``Family`` line and cost tier).
- ``flowgrpo.testing.models``: a transformer-only adapter for engine tests (``TinyAdapter``),
  a saved random toy (``random_toy_path``).
- ``flowgrpo.testing.ranks``: several gloo ranks on one machine (``free_port``, ``rank_env``,
  ``spawn``, ``start_cli_ranks``) and ``one_thread``.
- ``flowgrpo.testing.compare``: ``assert_tensors_equal`` / ``_close`` and
  ``assert_state_dicts_equal`` / ``_close`` with messages that name what differs.
- ``flowgrpo.testing.conformance``: the checks every model family passes (``Family``);
  ``flowgrpo.testing.families.params``: the per-family pytest parameters (cost tiers).
- ``flowgrpo.testing.fixtures``: pytest fixtures (``one_thread``, ``dist1``).

The package sits above everything it tests (it may import any layer); nothing in flowgrpo
imports it.
"""

from flowgrpo.testing.compare import (
    assert_state_dicts_close,
    assert_state_dicts_equal,
    assert_tensors_close,
    assert_tensors_equal,
    full_trainable,
    max_abs_diff,
)
from flowgrpo.testing.ranks import (
    free_port,
    one_thread,
    rank_env,
    rank_variables,
    spawn,
    start_cli_ranks,
)
from flowgrpo.testing.tiny import tiny_pipeline, tiny_size

__all__ = [
    "assert_state_dicts_close",
    "assert_state_dicts_equal",
    "assert_tensors_close",
    "assert_tensors_equal",
    "free_port",
    "full_trainable",
    "max_abs_diff",
    "one_thread",
    "rank_env",
    "rank_variables",
    "spawn",
    "start_cli_ranks",
    "tiny_pipeline",
    "tiny_size",
]
