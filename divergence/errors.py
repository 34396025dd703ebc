"""Typed errors. Everything a user can get wrong is a `DivergenceInputError`:
the CLI prints its message on one line and exits 2."""
from __future__ import annotations


class DivergenceError(Exception):
    """Base of every error this package raises on purpose."""


class DivergenceInputError(DivergenceError):
    """Bad input from the user: the CLI exits 2 with this message."""


class ModelLoadError(DivergenceInputError):
    """A model directory is missing, unreadable or incomplete."""


class UnsupportedModelError(ModelLoadError):
    """The model's model_type is not one the packed forward implements."""


class PromptError(DivergenceInputError):
    """A prompt file or request is malformed, empty, or longer than the context."""


class PolicyError(DivergenceInputError):
    """A kernel policy or a forced kernel is not understood."""


class TraceError(DivergenceInputError):
    """A file is not a readable divergence trace (corrupt, foreign, newer schema)."""


class TraceMismatchError(DivergenceInputError):
    """Two traces cannot be compared: different models, prompts or settings."""


class ReplayError(DivergenceInputError):
    """A trace cannot be replayed (e.g. the model's weights changed)."""


class EnvironmentMismatchError(ReplayError):
    """A trace was recorded under a numeric environment (BLAS library, OpenBLAS core) that
    this process does not run under, or that this machine cannot provide at all."""


class RanksNeededError(ReplayError):
    """A tensor-parallel trace replays only inside a group of its degree, and this process
    is in none (the CLI starts the ranks itself; an in-process caller replays in a child)."""


class RecordError(DivergenceInputError):
    """A record another engine gave (divergence.record, `divergence import`) breaks the
    recording contract (docs/recording.md): missing field, wrong type, unknown request..."""


class TensorParallelError(DivergenceInputError):
    """A model cannot be sharded N ways (--tp), or the launched group is not the one asked for."""
