"""Reproducibility assertions for tests, and the pytest plugin that wraps them.

    from divergence.testing import assert_reproducible, assert_traces_equal

`assert_reproducible(model, prompts, ...)` runs the prompts under serial and
concurrent schedules and, when they differ, raises an AssertionError whose text
is the bisect report: the first divergent token with both candidates' logits,
the batch step that caused it, and whether replay confirmed it. The plugin
(divergence.testing.plugin, registered through the `pytest11` entry point) adds
the `divergence_check` fixture, the `reproducible` marker, `--divergence-artifacts`
and the `divergence_*` ini keys. Importing this package does not import MLX.
"""
from __future__ import annotations

from .assertions import ReproducibilityError, assert_reproducible, assert_traces_equal

__all__ = ["ReproducibilityError", "assert_reproducible", "assert_traces_equal"]
