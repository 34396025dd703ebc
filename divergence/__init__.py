"""divergence: find out why an LLM inference engine's output changes when requests are batched.

Importing this package does not import MLX; the engine loads it (after the
optimized BLAS, see divergence.blas) when first used.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["Trace", "__version__"]


def __getattr__(name):
    if name == "Trace":
        from .trace.reader import Trace

        return Trace
    raise AttributeError(name)
