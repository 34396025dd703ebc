"""The batched inference engine. Importing it loads the optimized BLAS (where
present) before MLX, so every engine module sees the same BLAS."""
from .kernels import blas as _blas  # noqa: F401  (must precede any mlx import)
