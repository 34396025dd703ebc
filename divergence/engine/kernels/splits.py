"""Linear products split by output columns across CPU streams, bits unchanged.

MLX's CPU backend runs each stream's ops on one thread. Its bf16 / fp16 matmul
(`simd_gemm`) and its quantized matmul are single-threaded loops, so on an
n-core machine a bf16 model's decode step leaves n - 1 cores idle (the fp32
matmul goes to the BLAS, which threads itself). Each output element of those
kernels is one sum over K in a fixed order that does not depend on N, so
computing W's rows (the output columns) in P parts, each on its own CPU
stream, and concatenating gives the same bits as the single call: the engine's
`native` stays mlx-lm's, bit for bit (tests/engine/test_cpu_split.py checks
every kind of product against the unsplit call).

Part 0 runs on the caller's stream and parts 1.. on their own, so each product
costs one cross-thread wait, paid back from about 2^18
multiply-adds. Products below that, fp32 under an optimized BLAS, and every
non-CPU device run unsplit.

DIVERGENCE_CPU_SPLIT=1 turns it off; =P asks for P parts (default: the
usable cores, at most 8).
"""
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import mlx.core as mx

from ...core.host import CPU_SPLIT_ENV as ENV, usable_cores

MAX_PARTS = 8
MIN_MACS = 1 << 18  # below this the cross-stream wait costs more than the second core gains
ALIGN = 16  # part edges on simd_gemm's 16-column blocks


@dataclass
class ColumnSplit:
    parts: int
    streams: tuple  # parts - 1 CPU streams (part 0 runs on the caller's stream)
    dtypes: frozenset  # float dtypes whose unquantized matmul is split (quantized ones always are)

    def wants(self, m: int, n: int, k: int, dtype, quantized: bool) -> bool:
        if self.parts < 2 or m * n * k < MIN_MACS or n < self.parts * ALIGN:
            return False
        return quantized or dtype in self.dtypes

    def edges(self, n: int) -> list[int]:
        step = -(-n // self.parts)
        step = -(-step // ALIGN) * ALIGN
        return [min(n, i * step) for i in range(self.parts)] + [n]


def linear(x: mx.array, module, tied_embedding: bool, split: ColumnSplit) -> mx.array:
    """The module's own product (nn.Linear, QuantizedLinear, a tied (Quantized)Embedding
    as the head), computed in column parts on the split's streams."""
    edges = split.edges(module.weight.shape[0])
    outs = []
    for i, (n0, n1) in enumerate(zip(edges, edges[1:])):
        if n1 <= n0:
            continue
        stream = None if i == 0 else split.streams[i - 1]
        outs.append(_part(x, module, tied_embedding, n0, n1, stream))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)


def _part(x: mx.array, module, tied_embedding: bool, n0: int, n1: int, stream) -> mx.array:
    # The same calls as mlx.nn's modules make, on rows n0:n1 of every per-output tensor;
    # a module that is not mlx.nn's (an MoE expert) computes its own part.
    if hasattr(module, "part"):
        return module.part(x, n0, n1, stream)
    bias = None if tied_embedding or "bias" not in module else module["bias"][n0:n1]
    w = module["weight"][n0:n1]
    if "scales" in module:
        biases = module.get("biases")
        out = mx.quantized_matmul(x, w, scales=module["scales"][n0:n1],
                                  biases=biases[n0:n1] if biases is not None else None, transpose=True,
                                  group_size=module.group_size, bits=module.bits,
                                  mode=getattr(module, "mode", "affine"), stream=stream)
        return out if bias is None else mx.add(out, bias, stream=stream)
    if bias is not None:
        return mx.addmm(bias, x, w.T, stream=stream)
    return mx.matmul(x, w.T, stream=stream)


_state: dict = {}
_decisions: dict = {}  # split_for's arguments -> the split or None: asked for every op of every step
# False once this process is known to split nothing (a GPU, one core, DIVERGENCE_CPU_SPLIT=1):
# LinearOp.native then skips split_for (asked ~170 times a step on a 24-layer model). Set
# only by _set and forget, so it never disagrees with _state.
MAY_SPLIT = True


def _set(split: ColumnSplit | None) -> None:
    global MAY_SPLIT
    _state["split"] = split
    MAY_SPLIT = split is not None


def process_split() -> ColumnSplit | None:
    """This process's split (None: off), decided once: the device, the cores, the BLAS."""
    if "split" not in _state:
        _set(_decide())
    return _state["split"]


def split_for(m: int, n: int, k: int, dtype, same_dtype: bool, quantized: bool) -> ColumnSplit | None:
    """The split an (m, n, k) product of `dtype` takes, or None. same_dtype: the input has
    the weight's dtype (else MLX promotes and the product is another kernel's)."""
    key = (m, n, k, dtype, same_dtype, quantized)
    got = _decisions.get(key, False)
    if got is False:
        split = process_split()
        got = _decisions[key] = split if split is not None and same_dtype and \
            split.wants(m, n, k, dtype, quantized) else None
    return got


def configure(split: ColumnSplit | None = None, *, min_macs: int | None = None) -> None:
    """Set this process's split (and threshold) by hand: tests and benchmarks. Forgets
    every earlier decision."""
    global MIN_MACS
    _set(split)
    if min_macs is not None:
        MIN_MACS = min_macs
    _decisions.clear()


def forget() -> None:
    """Back to undecided: the next product decides the process's split again (tests)."""
    global MAY_SPLIT
    _state.pop("split", None)
    _decisions.clear()
    MAY_SPLIT = True


def _decide() -> ColumnSplit | None:
    if mx.default_device() != mx.cpu:
        return None
    choice = os.environ.get(ENV, "").strip()
    try:
        parts = int(choice) if choice else min(MAX_PARTS, usable_cores())
    except ValueError:
        parts = min(MAX_PARTS, usable_cores())
        warnings.warn(f"{ENV}={choice!r} is not a number of parts; splitting in {parts} (1 turns it off)",
                      stacklevel=2)
    if parts < 2:
        return None
    from .blas import blas_in_use

    dtypes = {mx.bfloat16, mx.float16}
    if blas_in_use().startswith("reference"):  # the bundled reference BLAS is single-threaded too
        dtypes.add(mx.float32)
    return ColumnSplit(parts, tuple(mx.new_stream(mx.cpu) for _ in range(parts - 1)), frozenset(dtypes))
