"""A decode batch's K/V kept whole from one step to the next (the GPU's batched decode).

The `batched` kernel reads a decode step's K/V by gathering every sequence's blocks out
of the paged pool into [B, kv_heads, rows, head_dim] (kv_reads.gather_blocks). On MLX
CUDA that gather is the one read that grows with the context: at B=8 and 4,096
positions it took 1.5 of a step's 2.0 ms of attention reads on the H200, where
BatchGenerator, whose cache is that array, reads nothing
(bench/results/cuda/kv_read_cost.txt). Between two decode steps of the same batch the
gathered array changes by one row per sequence, so `DecodeBatchKv` keeps it and writes
the new rows into it as the pool takes them: one small update per pool and layer in
place of the gather.

The kept array is the gathered one, laid out alike ([B, kv_heads, nb * block_size,
head_dim], row-contiguous, read as its first L positions), so SDPA reads the same values
in the same layout and gives the same bits as over a fresh gather: the buffer is a
cache of the gather, never another layout. It is rebuilt by a gather whenever it could
be stale or shaped otherwise: the batch's sequences or their blocks change, a length
does not grow by exactly the one row the step writes, the longest sequence needs
another block (the layout grows by a block; every block_size steps), or any step that
is not such a decode step ran on the cache in between (a prefill, a verify, a mixed
step: any of them may write rows the buffer holds).

Kept on the GPU only (`KEEP`): the CPU's gather costs little against its SDPA, and the
buffer doubles the batch's K/V memory while it lives.
"""
from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

# None: on the GPU only; True / False: always / never (tests keep it on the CPU too)
KEEP: bool | None = None


def keeping() -> bool:
    return KEEP if KEEP is not None else mx.default_device() == mx.gpu


class DecodeBatchKv:
    """Per layer the K and V one batched decode group last read, and what they hold."""

    def __init__(self, layers: int, block_size: int):
        self.block_size = block_size
        self.k: list[mx.array | None] = [None] * layers
        self.v: list[mx.array | None] = [None] * layers
        self.tables: tuple[Sequence[int], ...] | None = None  # per sequence, the block ids of its rows
        self.lengths: tuple[int, ...] = ()
        self.rows = 0  # the layout's positions (nb * block_size)
        self.extending = False  # this step writes its rows into the kept arrays (else: gathered anew)
        self._update: tuple | None = None  # this step's write: (position,) for all rows alike, or a scatter index
        self.steps = {"kept": 0, "gathered": 0}  # batched decode steps that read kept arrays / gathered anew

    def begin(self, tables: Sequence[Sequence[int]] | None, lengths: Sequence[int]) -> None:
        """A step starts on the cache. tables: per sequence of its batched decode group, its
        block ids (covering its length); None: no such group this step, and what is kept
        may go stale: dropped."""
        if tables is None:
            self.drop()
            return
        lengths = tuple(lengths)
        rows = -(-max(lengths) // self.block_size) * self.block_size
        old = self.tables
        self.extending = (
            old is not None and self.v[-1] is not None and len(old) == len(tables) and rows == self.rows
            and all(n == m + 1 for n, m in zip(lengths, self.lengths))
            and all(list(t[: len(o)]) == list(o) for t, o in zip(tables, old))
        )
        self.tables, self.lengths, self.rows = tuple(tables), lengths, rows
        self.steps["kept" if self.extending else "gathered"] += 1
        if not self.extending:
            self.k = [None] * len(self.k)
            self.v = [None] * len(self.v)
            self._update = None
            return
        pos = [n - 1 for n in lengths]  # each sequence's new row
        if all(p == pos[0] for p in pos):
            self._update = (pos[0],)
        else:
            B, kv = len(pos), self.v[-1].shape[1]
            b = mx.broadcast_to(mx.arange(B, dtype=mx.int32)[:, None], (B, kv))
            h = mx.broadcast_to(mx.arange(kv, dtype=mx.int32)[None, :], (B, kv))
            p = mx.broadcast_to(mx.array(pos, dtype=mx.int32)[:, None], (B, kv))
            self._update = (b, h, p)

    def drop(self) -> None:
        self.k = [None] * len(self.k)
        self.v = [None] * len(self.v)
        self.tables, self.lengths, self.rows, self.extending, self._update = None, (), 0, False, None

    def write(self, layer: int, k: mx.array, v: mx.array) -> None:
        """The step's new rows (k, v: [B, kv_heads, (1,) head_dim], the pool's write) into
        the kept arrays, when extending."""
        if not self.extending:
            return
        up = self._update
        for kept, x in ((self.k, k), (self.v, v)):
            B, kv, hd = x.shape[0], x.shape[1], x.shape[-1]
            if len(up) == 1:
                kept[layer][:, :, up[0] : up[0] + 1] = x.reshape(B, kv, 1, hd)
            else:
                kept[layer][up] = x.reshape(B, kv, hd)

    def read(self, layer: int, length: int) -> tuple[mx.array, mx.array] | None:
        """The kept K, V [B, kv_heads, length, head_dim] of this layer (None: gather them)."""
        if not self.extending or self.k[layer] is None:
            return None
        k, v = self.k[layer], self.v[layer]
        return (k, v) if k.shape[2] == length else (k[:, :, :length], v[:, :, :length])

    def keep(self, layer: int, k: mx.array, v: mx.array) -> None:
        """A fresh gather's whole arrays [B, kv_heads, rows, head_dim], kept for the next step."""
        if self.tables is not None and k.shape[2] == self.rows:
            self.k[layer], self.v[layer] = k, v

    def arrays(self) -> list[mx.array]:
        return [a for a in self.k + self.v if a is not None]
