"""divergence: find out why an LLM inference engine's output changes when requests are batched.

Importing this package imports neither MLX nor a BLAS. The public names are
loaded on first use: `Trace` (reading traces: numpy and h5py only), and
`load_model`, `Engine`, `Request` (the engine, which loads the optimized BLAS
before MLX, see divergence.engine.kernels.blas).
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it (imported lazily, PEP 562)
_LAZY = {
    "Trace": "divergence.trace.reader",
    "Request": "divergence.core.request",
    "Sampling": "divergence.core.request",
    "load_model": "divergence.engine.model.loading",
    "Engine": "divergence.engine.engine",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'divergence' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
