"""Where a run happened: versions, backend, device and BLAS (they change numerics)."""
from __future__ import annotations

import platform

import mlx.core as mx


def environment() -> dict:
    import mlx

    from .. import __version__
    from ..blas import blas_in_use

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
        "blas": blas_in_use(),
    }
