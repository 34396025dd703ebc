"""Load an optimized BLAS into the process before MLX, where one is installed.

MLX's Linux CPU wheel links the reference BLAS, an unblocked, single-threaded loop. Loading
OpenBLAS with RTLD_GLOBAL before `import mlx` makes MLX resolve its BLAS
symbols there (blocked, vectorised and threaded: fp32 matmul is then tens of times
faster). It also changes numerics (fp32
matmul at M >= 16 rows no longer equals M = 1), so which BLAS ran is recorded
with every run. Turn it off with DIVERGENCE_BLAS=reference (or the CLI's
--reference-blas).
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys
from contextlib import contextmanager

# "reference" to keep MLX's bundled BLAS, or a path to a libblas; OPENBLAS_CORETYPE picks the
# core, whose kernels change fp32 bits (DESIGN.md: small-matrix kernels on SkylakeX / Cooperlake)
from ...core.host import BLAS_ENV as ENV, REFERENCE_WORDS

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib64/libopenblas.so.0",
)

_state = {"blas": None, "lib": None, "problem": None}


def blas_problem() -> str | None:
    """What is wrong with DIVERGENCE_BLAS, on one line (None: nothing). Importing this module
    never raises: `divergence run` checks this and refuses the value (exit 2)."""
    blas_in_use()
    return _state["problem"]


def _load() -> str:
    if platform.system() != "Linux":
        return "platform default (Accelerate on macOS)" if platform.system() == "Darwin" else "platform default"
    choice = os.environ.get(ENV, "").strip()
    if choice.lower() in REFERENCE_WORDS:
        return "reference BLAS bundled with MLX (optimized BLAS turned off)"
    if choice and not os.path.isfile(choice):
        _state["problem"] = (f"{ENV}={choice!r} is neither {' / '.join(REFERENCE_WORDS)} nor the path of a BLAS "
                             f"library (no such file)")
    if "mlx.core" in sys.modules:
        return "reference BLAS bundled with MLX (mlx was imported before divergence)"
    paths = (choice,) if choice else CANDIDATES
    for path in paths:
        if os.path.exists(path):
            try:
                lib = ctypes.CDLL(path, mode=os.RTLD_GLOBAL)
            except OSError as e:
                if choice:
                    _state["problem"] = f"{ENV}={choice!r} cannot be loaded: {' '.join(str(e).split())}"
                continue
            if hasattr(lib, "openblas_get_num_threads") and hasattr(lib, "openblas_set_num_threads"):
                _state["lib"] = lib
                for name in ("openblas_get_corename", "openblas_get_config"):
                    if hasattr(lib, name):
                        getattr(lib, name).restype = ctypes.c_char_p
            return f"OpenBLAS ({os.path.realpath(path)})"
    return "reference BLAS bundled with MLX (no optimized BLAS found)"


def blas_in_use() -> str:
    """Which BLAS MLX's CPU backend uses in this process (loads it on first call)."""
    if _state["blas"] is None:
        _state["blas"] = _load()
    return _state["blas"]


blas_in_use()


# OpenBLAS splits an fp32 matmul of 8 or more rows between its threads in a way that
# changes the bits (measured, OpenBLAS 0.3.21: [8, 256] x [256, 704] and every larger shape
# tried; one row is the same at any count). A trace records the count, and a replay runs
# under it: else a replay on a machine with other cores is not the recording.
def blas_threads() -> int | None:
    """OpenBLAS's thread count in this process; None where another BLAS is in use."""
    blas_in_use()
    lib = _state["lib"]
    return int(lib.openblas_get_num_threads()) if lib is not None else None


@contextmanager
def using_blas_threads(n: int | None):
    """Run a block with OpenBLAS on n threads (None, or no OpenBLAS: as it is), then put
    the count back."""
    old = blas_threads()
    if not n or old is None or int(n) == old:
        yield
        return
    _state["lib"].openblas_set_num_threads(int(n))
    try:
        yield
    finally:
        _state["lib"].openblas_set_num_threads(old)


def blas_core() -> str | None:
    """The core whose kernels OpenBLAS runs in this process ('Haswell', 'SkylakeX', ...);
    None where another BLAS is in use."""
    blas_in_use()
    lib = _state["lib"]
    if lib is None or not hasattr(lib, "openblas_get_corename"):
        return None
    return lib.openblas_get_corename().decode(errors="replace")


def blas_config() -> str | None:
    """OpenBLAS's build string ('OpenBLAS 0.3.21 DYNAMIC_ARCH ... Cooperlake MAX_THREADS=64')."""
    blas_in_use()
    lib = _state["lib"]
    if lib is None or not hasattr(lib, "openblas_get_config"):
        return None
    return lib.openblas_get_config().decode(errors="replace").strip()
