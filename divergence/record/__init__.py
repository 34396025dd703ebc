"""Traces from any engine: the recording contract (docs/recording.md) for Python engines.

    from divergence.record import Recorder, hash_kv

numpy only: a PyTorch, JAX or plain-numpy engine records without MLX. Engines in
other languages write JSON Lines and run `divergence import` (divergence.record.jsonl).
"""
from __future__ import annotations

import numpy as np

from ..core.hashing import HASH_NAME, hash_rows
from ..errors import RecordError
from .contract import CONTRACT_VERSION, FIELDS
from .recorder import Recorder

__all__ = ["Recorder", "hash_kv", "HASH_NAME", "RecordError", "CONTRACT_VERSION", "FIELDS"]


def hash_kv(rows) -> np.ndarray:
    """uint64 [positions]: the xxh3_64 of each position's exact bytes. `rows` is a numpy
    array with positions first ([positions, kv_heads, head_dim], in the cache's dtype):
    hash what you store, not a converted copy."""
    a = np.asarray(rows)
    if a.ndim < 1 or a.shape[0] == 0:
        raise RecordError(f"hash_kv: expected an array with positions first, got shape {list(a.shape)}")
    return hash_rows(a)
