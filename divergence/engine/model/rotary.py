"""RoPE on the CPU stream, with a step's cos / sin made once for all its layers.

On the CPU stream `mx.fast.rope` has no kernel: each call builds MLX's fallback graph,
about 30 ops. Two thirds of them (positions, inverse frequencies, theta, cos, sin and
their casts) depend only on the rows' positions, which every q and k of every layer of
a step share: a decode step of a 4-layer model built that part 8 times, a sixth of the
step's graph on the fixture. Each op is a dispatch on the CPU stream, and at small
shapes the dispatches are the step's time.

`StepRotation` builds the cos / sin rows once per step, by running the layer's own RoPE
module on a unit vector (first half ones, second half zeros): the rotation of
(1, 0) is (cos, sin), with one exact multiply by 1 and an exact add of a zero, so the
table holds the fallback's own cos / sin in the model dtype, whatever its frequency
scheme. `rotate` then runs the rest of the fallback: its own elementwise ops where the
rotary dims are part of the head, and where they are the whole head one equivalent
product pair (see StepRotation), so the result is the fallback's bit for bit
(test_rotary.py; the reference tests compare whole forwards with mlx-lm's).

Only where the fallback is what would run (the CPU stream) and only for RoPE modules
that are a plain `mx.fast.rope` call, non-traditional, configured alike in every layer;
anywhere else `shared_rope` answers None and the forward calls the module per layer.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import rope_utils

# modules whose __call__ is exactly mx.fast.rope(x, dims, traditional, base / freqs, scale, offset):
# no scaling of x before or after (YarnRoPE's mscale, SuScaledRoPE's), no position-dependent base
_PLAIN_ROPE = tuple(c for c in (nn.RoPE, getattr(rope_utils, "Llama3RoPE", None)) if c is not None)


def _config(rope) -> tuple | None:
    if type(rope) not in _PLAIN_ROPE or getattr(rope, "traditional", True):
        return None
    freqs = getattr(rope, "_freqs", None)
    return (type(rope), rope.dims, getattr(rope, "base", None), getattr(rope, "scale", None),
            None if freqs is None else tuple(freqs.tolist()))


def shared_rope(ropes: list) -> nn.Module | None:
    """The one RoPE configuration every layer uses, if StepRotation can stand in for it."""
    configs = {_config(r) for r in ropes}
    if len(configs) != 1 or None in configs:
        return None
    return ropes[0]


def fallback_in_use() -> bool:
    """Whether mx.fast.rope builds its op-by-op fallback here: on the CPU stream."""
    return mx.default_device() == mx.cpu


class StepRotation:
    """The cos / sin of one step's rows ([T, 1, 1, dims / 2] each) and the rotation that uses them."""

    def __init__(self, rope: nn.Module, positions: mx.array, dtype: mx.Dtype, head_dim: int):
        self.dims = rope.dims
        half = self.dims // 2
        T = positions.shape[0]
        unit = mx.concatenate([mx.ones((half,), dtype), mx.zeros((self.dims - half,), dtype)])
        cos_sin = rope(mx.broadcast_to(unit, (T, 1, 1, self.dims)), offset=positions)
        cos, sin = cos_sin[..., :half], cos_sin[..., half:]
        self.whole_head = self.dims == head_dim
        if self.whole_head:
            # one product pair over the full width:
            #   x * [cos, cos] + roll(x) * [-sin, sin],  roll(x) = [x2, x1]
            # is the fallback's (x1 cos - x2 sin, x1 sin + x2 cos) bit for bit: a - b is
            # a + (-b) in IEEE arithmetic, x2 * (-sin) is -(x2 * sin) (signed zeros too), and
            # the second half's sum only swaps its operands. 4 calls instead of 9.
            cos, sin = mx.concatenate([cos, cos], axis=-1), mx.concatenate([-sin, sin], axis=-1)
        self.cos, self.sin = cos, sin
        # broadcast once per shape (q's, k's): the fallback broadcasts them in each of
        # its four products, in every call (the same values either way)
        self._wide: dict[tuple, tuple[mx.array, mx.array]] = {}

    @classmethod
    def of_table(cls, rope: nn.Module, head_dim: int, cos: mx.array, sin: mx.array) -> "StepRotation":
        """The rotation of a table made before (its cos / sin as this class holds them): a
        compiled step takes them as inputs (compiled_step.py)."""
        self = cls.__new__(cls)
        self.dims, self.whole_head = rope.dims, rope.dims == head_dim
        self.cos, self.sin, self._wide = cos, sin, {}
        return self

    def _broadcast(self, shape: tuple) -> tuple[mx.array, mx.array]:
        wide = self._wide.get(shape)
        if wide is None:
            wide = self._wide[shape] = (mx.broadcast_to(self.cos, shape), mx.broadcast_to(self.sin, shape))
        return wide

    def rotate(self, x: mx.array) -> mx.array:
        """x [T, heads, 1, head_dim] -> rotated, as mx.fast.rope's fallback computes it."""
        half, dims = self.dims // 2, self.dims
        if self.whole_head:
            cos, sin = self._broadcast(x.shape)
            return x * cos + mx.roll(x, half, axis=-1) * sin
        x1, x2 = x[..., :half], x[..., half:dims]  # partial rotary: the fallback's own form
        cos, sin = self._broadcast(x1.shape)
        parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., dims:]]
        return mx.concatenate(parts, axis=-1)
