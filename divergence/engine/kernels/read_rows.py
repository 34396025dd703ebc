"""How many rows a GPU attention call's K/V buffer may have: MLX CUDA picks the one-row
SDPA's kernel by them (and by the allocator), so the reads are sized here, for the
batched call (batched_blocks) and for mlx-lm's layout (KV_STEP). Plain integers: the
model's step preparation and the attention kernels both take them.
"""
from __future__ import annotations

KV_STEP = 256  # mlx-lm's KVCache grows its buffer by this many positions


# MLX CUDA runs a one-row, unmasked SDPA over >= 256 keys through cuDNN only when the K/V
# buffer's rows are a multiple of this, and then only when the allocator's buffer is exactly
# that size, which follows the process's allocation history: the same step ran cuDNN in one
# run and MLX's vector kernel in the next, other bits each time (tests/test_cuda.py checks
# that a batch repeats; docs/architecture.md)
CUDNN_ROWS = 256


def batched_blocks(length: int, block_size: int) -> int:
    """Blocks a batched call's K/V are gathered into: enough for `length` positions, and one
    more where their rows would be a multiple of CUDNN_ROWS, so that every such call runs
    the vector kernel and a step's bits are a function of its inputs, run after run. (mlx-lm
    has no batched-call bits to keep; a one-sequence call reads mlx-lm's own layout,
    attention.mlxlm_reads, except under the policies whose promise is one sequence's bits
    whatever the batch: attention.stable_reads.) The CPU's SDPA reads any number of rows alike."""
    nb = -(-length // block_size)
    return nb + 1 if (nb * block_size) % CUDNN_ROWS == 0 else nb
