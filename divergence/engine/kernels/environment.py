"""Where a run happened: versions, backend, device and BLAS (they change numerics)."""
from __future__ import annotations

import platform

import mlx.core as mx


def environment() -> dict:
    import mlx

    from ... import __version__
    from .blas import blas_config, blas_core, blas_in_use, blas_threads

    try:
        import mlx_lm

        mlx_lm_version = mlx_lm.__version__
    except Exception:  # pragma: no cover
        mlx_lm_version = "unknown"
    return {
        "divergence": __version__,
        "mlx": getattr(mlx.core, "__version__", "unknown"),
        "mlx_lm": mlx_lm_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backend": "gpu" if mx.default_device() == mx.gpu else "cpu",
        "device": str(mx.default_device()),
        "device_name": _device_name(),
        # the CPU BLAS MLX's CPU ops use (on a GPU backend: only CPU-side ops use it)
        "blas": blas_in_use(),
        "blas_threads": blas_threads(),  # OpenBLAS's thread count changes fp32 bits (engine/kernels/blas.py)
        # the kernels OpenBLAS picked for this CPU (or OPENBLAS_CORETYPE): they change fp32 bits too
        "blas_core": blas_core(),
        "blas_config": blas_config(),
    }


def _device_name() -> str:
    """The chip behind the default device ('NVIDIA H200', 'Apple M3 Max', a CPU's name):
    kernel choices, so bits, differ between chips of one backend."""
    try:
        return str(mx.device_info().get("device_name", "unknown"))
    except Exception:  # pragma: no cover - older MLX
        return "unknown"
