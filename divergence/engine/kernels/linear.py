"""The linear-layer kernels the dispatcher chooses between.

`native` is the backend exactly as it is (the module's own matmul or
quantized_matmul). `gemv` runs the same native op one row at a time, so every
row sees the M=1 kernel. `gemm` is a tiled kernel whose split-K comes from the
(M, N, K) shape, as BLAS heuristics do, with partial sums rounded to the compute
dtype: it really reorders the sum. `batch-invariant` pads rows to a fixed tile
and calls the native op on that one shape only, so a row's bits never depend on
how many other rows share the step, whatever the backend does per shape.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from . import splits as cpu_split
from ...core.names import TP_SHARDING


GEMM_TILE = 64  # output tile edge used by the split-K heuristic
GEMM_TARGET_TILES = 32  # split K until about this many (tile x split) work items
GEMM_MIN_CHUNK = 32  # never split K below this many columns
INVARIANT_TILE = 8  # rows per call of the batch-invariant kernel
GEMV, BATCH_INVARIANT = "gemv", "batch-invariant"  # the kernels that may run as one native call where proved


@dataclass
class LinearOp:
    """One linear layer's weights, seen the same way whatever the module type."""

    name: str
    module: nn.Module  # nn.Linear / nn.QuantizedLinear / nn.Embedding (tied head)
    n: int  # output features
    k: int  # input features
    tied_embedding: bool = False
    # How tensor parallelism shards it (mlx-lm's shard_linear modes): the input-side
    # projections split their outputs (all-to-sharded), o_proj / down_proj split their
    # inputs and need an all-reduce after (sharded-to-all); None = replicated (lm_head).
    shard: str | None = None
    # Asked for every op of every step: looked up once (a module attribute probe goes
    # through mlx.nn.Module.__getattr__, a dict probe each, dozens per step).
    quantized: bool = field(init=False)
    weight_dtype: object = field(init=False, repr=False)
    splittable: bool = field(init=False, repr=False)

    def __post_init__(self):
        self.quantized = "scales" in self.module
        self.weight_dtype = self.module.weight.dtype
        # mlx.nn's modules split by columns (cpu_split); another module says whether it can
        self.splittable = getattr(self.module, "splittable", True)
        # the module's own product, bound once (mlx.nn's Module.__call__ -> Linear.__call__)
        self._product = self.module.as_linear if self.tied_embedding else self.module.__call__
        # gemm's K-slices of the weights, per chunk: {chunk: (weight they were cut from, slices)}.
        # On the op, so they go when the model does.
        self._k_slices: dict = {}
        self._proved: dict = {}  # (kernel, m, dtype) -> does that kernel give native's bits here

    def proved(self, kernel: str, m: int, dtype) -> bool:
        """Whether `kernel` (gemv, batch-invariant) at m rows of `dtype` has the bits of one
        native m-row call here (backend_proofs.same_as_native: probed once per backend)."""
        key = (kernel, m, dtype)
        got = self._proved.get(key)
        if got is None:
            from .backend_proofs import same_as_native

            got = self._proved[key] = same_as_native(self, kernel, m, dtype)
        return got

    def k_slices(self, chunk: int) -> list[tuple[int, int, tuple]]:
        """(k0, k1, operands) of each K-chunk of the weights, evaluated once (slicing the
        weights on every call made a strided view that each product copied again): the
        arrays, layout included, that the product made of each slice, so the same bits."""
        w = self.module.weight
        got = self._k_slices.get(chunk)
        if got is None or got[0] is not w:
            got = self._k_slices[chunk] = (w, _cut_k(self, chunk))
        return got[1]

    @property
    def precision(self) -> str:
        """How its weights are stored: "q4g64" (bits, group size) or their dtype; part of the
        keys a probe's results are cached under (native_classes, backend_proofs)."""
        m = self.module
        return f"q{m.bits}g{m.group_size}" if self.quantized else str(self.weight_dtype)

    def native(self, x: mx.array) -> mx.array:
        split = _spread(x.size // x.shape[-1], self, x.dtype)
        if split is not None:
            return cpu_split.linear(x, self.module, self.tied_embedding, split)  # same bits, more cores
        return self._product(x)

    @classmethod
    def from_module(cls, name: str, module: nn.Module, *, tied_embedding: bool = False,
                    shard: str | None = None) -> "LinearOp":
        # Linear and Embedding weights are both [out, in] (the tied head reads the table as W).
        n = module.weight.shape[0]
        return cls(name=name, module=module, n=n, k=_input_features(module), tied_embedding=tied_embedding,
                   shard=shard if shard is not None else SHARD_OF.get(name))


SHARD_OF = TP_SHARDING  # the tensor-parallel mode of each op, as mlx-lm shards them


def _input_features(module: nn.Module) -> int:
    w = module.weight
    if hasattr(module, "scales"):
        # Packed: each uint32 holds 32 / bits values.
        return w.shape[1] * 32 // module.bits
    return w.shape[1]


def gemm_splits(m: int, n: int, k: int, *, group: int = 1) -> int:
    """Split-K partitions for an (M, N, K) product, chosen from the shape.

    Like BLAS heuristics: few output tiles (small M or N) leave the machine idle,
    so K is split to make more work items; never fewer than 2, so gemm always
    reorders the sum relative to a plain dot product.
    """
    tiles = math.ceil(m / GEMM_TILE) * math.ceil(n / GEMM_TILE)
    unit = max(GEMM_MIN_CHUNK, group)
    max_splits = max(1, k // unit)
    splits = 2
    while splits * 2 <= max_splits and tiles * splits < GEMM_TARGET_TILES:
        splits *= 2
    return min(splits, max_splits)


def run_native(x: mx.array, op: LinearOp) -> mx.array:
    return op.native(x)


OWN_NATIVE = run_native  # as defined here (see attention.OWN_KERNELS)


def run_gemv(x: mx.array, op: LinearOp) -> mx.array:
    m = x.shape[0]
    if m == 1 or op.proved(GEMV, m, x.dtype):
        return op.native(x)  # proved: every row of the m-row call has the bits of the row alone
    return gemv_rows(x, op)


def gemv_rows(x: mx.array, op: LinearOp) -> mx.array:
    """gemv as defined: each row its own M=1 call of the native op."""
    m = x.shape[0]
    split = _spread(m, op, x.dtype)
    if split is None:
        return mx.concatenate([op.native(x[i : i + 1]) for i in range(m)], axis=0)
    # Row i alone on part i's CPU stream (rows in contiguous groups, one group a part):
    # each row is still its own M=1 call, wherever it runs, so the bits are the same.
    groups = []
    edges = [m * p // split.parts for p in range(split.parts + 1)]
    for p, (r0, r1) in enumerate(zip(edges, edges[1:])):
        if r1 <= r0:
            continue
        with mx.stream(mx.default_stream(mx.default_device()) if p == 0 else split.streams[p - 1]):
            rows = [op.native(x[i : i + 1]) for i in range(r0, r1)]
            groups.append(rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0))
    return mx.concatenate(groups, axis=0)


def run_batch_invariant(x: mx.array, op: LinearOp) -> mx.array:
    if op.proved(BATCH_INVARIANT, x.shape[0], x.dtype):
        return op.native(x)  # proved: the m-row call has the bits of the padded tiles' rows
    return tiled(x, op)


def tiled(x: mx.array, op: LinearOp) -> mx.array:
    """batch-invariant as defined: rows padded to INVARIANT_TILE, the native op on tiles of
    that many rows only."""
    m = x.shape[0]
    pad = (-m) % INVARIANT_TILE
    if pad:
        x = mx.concatenate([x, mx.zeros((pad, x.shape[1]), dtype=x.dtype)], axis=0)
    tiles = [op.native(x[i : i + INVARIANT_TILE]) for i in range(0, x.shape[0], INVARIANT_TILE)]
    out = tiles[0] if len(tiles) == 1 else mx.concatenate(tiles, axis=0)
    return out[:m] if pad else out


def gemm_chunk(op: LinearOp, splits: int) -> int:
    """Columns of K per partial product of `splits` (the last one may be shorter)."""
    group = op.module.group_size if op.quantized else 1
    unit = max(GEMM_MIN_CHUNK, group)
    return math.ceil(op.k / splits / unit) * unit


def run_gemm(x: mx.array, op: LinearOp, splits: int) -> mx.array:
    """Split-K product: partial products over K chunks, summed in the compute dtype, in
    K order. Where the product is big enough that `native` would split it across CPU
    streams (splits.py), the partials are shared out over those streams (partial i on
    part i mod P): each is the same call on the same data wherever it runs, and the sum
    stays on the caller's stream in K order, so the bits do not change."""
    mod = op.module
    split = _spread(x.shape[0], op, x.dtype)
    acc = None
    for i, (k0, k1, operands) in enumerate(op.k_slices(gemm_chunk(op, splits))):
        p = i % split.parts if split is not None else 0
        part = _partial(x[:, k0:k1], op, operands, None if p == 0 else split.streams[p - 1])
        acc = part if acc is None else acc + part
    if not op.tied_embedding and "bias" in mod:
        acc = acc + mod.bias
    return acc


def _spread(m: int, op: LinearOp, dtype) -> cpu_split.ColumnSplit | None:
    """The CPU split of this (m, N, K) product, or None: the one decision `native` takes and
    gemm / gemv share their work out by."""
    if not (cpu_split.MAY_SPLIT and op.splittable):
        return None
    return cpu_split.split_for(m, op.n, op.k, dtype, op.quantized or dtype == op.weight_dtype, op.quantized)


def split_parts(m: int, op: LinearOp, dtype) -> int:
    """Column parts of an m-row native call of op (1: unsplit): a key of the proofs about it."""
    split = _spread(m, op, dtype)
    return 1 if split is None else split.parts


def _cut_k(op: LinearOp, chunk: int) -> list[tuple[int, int, tuple]]:
    """The weights' K-chunks as run_gemm multiplies them: (W[:, k0:k1].T,) for a dense op,
    (packed W, scales, biases) columns for a quantized one; contiguous and evaluated."""
    mod = op.module
    out = []
    for k0 in range(0, op.k, chunk):
        k1 = min(op.k, k0 + chunk)
        if not op.quantized:
            # as the product reads W[:, k0:k1].T: a strided view, which MLX's CPU matmul copies
            # to a row-contiguous [chunk, N] first (untransposed B), or W.T itself when the
            # chunk is all of K (transposed B, no copy). BLAS kernels differ by that flag: at
            # M = 1 OpenBLAS's SkylakeX core gives other fp32 bits for a transposed [N, chunk]
            wt = mod.weight.T if k1 - k0 == op.k else mx.contiguous(mod.weight[:, k0:k1].T)
            operands = (wt,)
        else:
            per_word, g = 32 // mod.bits, mod.group_size
            operands = (mx.contiguous(mod.weight[:, k0 // per_word : k1 // per_word]),
                        mx.contiguous(mod.scales[:, k0 // g : k1 // g]),
                        mx.contiguous(mod.biases[:, k0 // g : k1 // g]) if "biases" in mod else None)
        out.append((k0, k1, operands))
    mx.eval([a for _, _, ops in out for a in ops if a is not None])
    return out


def _partial(xs: mx.array, op: LinearOp, operands: tuple, stream) -> mx.array:
    if not op.quantized:
        return mx.matmul(xs, operands[0], stream=stream)
    mod = op.module
    w, scales, biases = operands
    return mx.quantized_matmul(xs, w, scales=scales, biases=biases, transpose=True, group_size=mod.group_size,
                               bits=mod.bits, mode=getattr(mod, "mode", "affine"), stream=stream)
