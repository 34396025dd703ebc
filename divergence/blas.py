"""Load an optimized BLAS into the process before MLX, where one is installed.

MLX's Linux CPU wheel links the reference BLAS (~2 GFLOP/s fp32). Loading
OpenBLAS with RTLD_GLOBAL before `import mlx` makes MLX resolve its BLAS
symbols there (107-179 GFLOP/s measured). It also changes numerics (fp32
matmul at M >= 16 rows no longer equals M = 1), so which BLAS ran is recorded
with every run. Turn it off with DIVERGENCE_BLAS=reference (or the CLI's
--reference-blas).
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

ENV = "DIVERGENCE_BLAS"  # "reference" to keep MLX's bundled BLAS; or a path to a libblas
CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)

_state = {"blas": None}


def _load() -> str:
    if platform.system() != "Linux":
        return "platform default (Accelerate on macOS)" if platform.system() == "Darwin" else "platform default"
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() in ("reference", "off", "0", "none"):
        return "reference BLAS bundled with MLX (optimized BLAS turned off)"
    if "mlx.core" in sys.modules:
        return "reference BLAS bundled with MLX (mlx was imported before divergence)"
    paths = (choice,) if choice else CANDIDATES
    for path in paths:
        if os.path.exists(path):
            try:
                ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
            except OSError:
                continue
            return f"OpenBLAS ({os.path.realpath(path)})"
    return "reference BLAS bundled with MLX (no optimized BLAS found)"


def blas_in_use() -> str:
    """Which BLAS MLX's CPU backend uses in this process (loads it on first call)."""
    if _state["blas"] is None:
        _state["blas"] = _load()
    return _state["blas"]


blas_in_use()
