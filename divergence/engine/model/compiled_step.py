"""A decode step's graph traced once per batch size and replayed (`mx.compile`), with the
bits of the eager step.

Building a decode step's graph from Python is host work repeated every token: ~20 MLX
calls per layer, each a Python call into MLX and a node. Between a layer's attention and
the next layer's attention nothing depends on the step's KV length: the output
projection, the residual adds, the norms, the MLP and the next layer's q/k/v projections
and RoPE see [T, ...] rows whatever the context. Each such stretch is one compiled
*segment*: traced on first use at a row count, then replayed by MLX's C++ runtime. What
does depend on the context stays eager between segments: the cache write (an in-place
slice update / scatter into the pool) and attention (its K/V reads and SDPA, whose
shapes grow with the context):

    seg 0:  embed, layer 0 up to attention           -> h, q, k, v
    (eager) cache write 0, attention 0               -> a
    seg i:  layer i-1 after attention, layer i up to -> h, q, k, v
    ...
    seg L:  layer L-1 after attention, final norm, lm_head -> logits

The segments run the forward's own code (PackedForward.pre_attention / post_attention),
each linear op its module's native call, so they are the eager step's ops; `mx.compile`
only fuses chains of elementwise ops between them and never touches a matmul. The kernel
records the dispatcher makes for each linear op are taken while a segment is traced and
emitted again, in the same order, at every replay: a trace holds the same rows as an
eager step's. Whether fusion keeps each op's bits is proved, not assumed:
tests/engine/test_compiled_step.py compares every segment's outputs and every tap point
with the eager step's, and whole runs' tokens and top-k logits with generate_step's.

Only where the step is a plain native decode: every linear op native with nothing forced
this step (replay's forced steps run eager), one query row per sequence, every row's
logits, dense MLPs, no taps, RoPE that takes per-row positions as an array (a Python
number would be traced as a constant), one device. Anything else runs eager.

RoPE: on the CPU the step's cos / sin table (rotary.StepRotation) is built eagerly, once
per step, and handed to the segments as inputs; the rotation's multiply-adds then fuse.
Elsewhere `mx.fast.rope` takes the positions array; at one row as a 0-d offset, which is
what MLX makes of the Python number the eager step passes.

DIVERGENCE_COMPILED_STEP=0 turns it off, =1 on; by default it is on where it was proved: the
CPU (tests/engine/test_compiled_step.py) and MLX CUDA (the same file and tests/test_cuda.py's
0.5B-shape comparison, on an H200: bench/results/cuda/issue47_pytest.txt). Not on Metal:
unproved there (mlx #4461: its JIT once rounded mx.sigmoid otherwise than the eager kernel).
"""
from __future__ import annotations

import os

import mlx.core as mx

from ..kernels import linear as kernels

ENV = "DIVERGENCE_COMPILED_STEP"


def default_on(*, cuda: bool = True) -> bool:
    """Whether a forward compiles its decode steps unless told: DIVERGENCE_COMPILED_STEP, else
    on the backends where the compiled step was proved bit for bit against the eager one.
    cuda=False: for a graph proved on the CPU only (the sampler's: sampling.compiled_sampler)."""
    v = os.environ.get(ENV, "").strip().lower()
    if v in ("0", "off", "no", "false"):
        return False
    if v in ("1", "on", "yes", "true"):
        return True
    if mx.default_device() == mx.cpu:
        return True
    backend = getattr(mx, "cuda", None)  # (Metal is not proved: its JIT once rounded mx.sigmoid otherwise)
    return cuda and backend is not None and backend.is_available()


class _Tracer:
    """Stands in for the dispatcher inside a segment's trace: each linear op its native call,
    and what the dispatcher would have recorded for it, (op, layer, rows, dtype), kept."""

    def __init__(self):
        self.calls: list[tuple] = []

    def __call__(self, x: mx.array, op, layer: int) -> mx.array:
        self.calls.append((op, layer, x.shape[0], x.dtype))
        return kernels.run_native(x, op)


class CompiledDecode:
    """The compiled segments of one PackedForward (see the module docstring).

    tapped: each segment also returns every tap point its ops pass (forward.py's TAP_POINTS),
    and `run` hands them to the step's tap in the eager step's order: how the tests compare
    a compiled step with the eager one op by op. (A tap point a segment returns is still
    computed inside its fused kernels, whose values are the ones compared.)"""

    def __init__(self, fwd, *, tapped: bool = False):
        self.fwd = fwd
        self.tapped = tapped
        self.supported = all(m is None for m in fwd.moe)  # (a router's choices go to the trace: eager)
        self._segments = [mx.compile(self._segment_fn(i)) for i in range(fwd.num_layers + 1)]
        # (segment, rows, inputs) -> (the linear ops it runs, as the dispatcher records them;
        # the (layer, point) of each tap output)
        self._traced: dict[tuple, tuple[list[tuple], list[tuple]]] = {}

    def usable(self, prep, dispatch, *, tap, keep_routing: bool) -> bool:
        """May this step run compiled? (See the module docstring.)"""
        return (self.supported and (tap is None or self.tapped) and not keep_routing and dispatch.all_native
                and kernels.run_native is kernels.OWN_NATIVE and prep.real_rows is None
                and prep.logit_index is None and prep.logit_rows == prep.rows == len(prep.plan.slices)
                and prep.decode_queries == 1 and self.fwd.vector_rope)

    def run(self, prep, cache, dispatch, rotation, *, keep_kv: bool, tap=None):
        """The step's logits (and K/V written when keep_kv), as PackedForward.execute gives them."""
        fwd = self.fwd
        rope_in = (prep.positions,) if rotation is None else (prep.positions, rotation.cos, rotation.sin)
        k_layers, v_layers = [], []
        h, q, k, v = self._call(0, dispatch, tap, prep.tokens, *rope_in)
        for li in range(fwd.num_layers):
            cache.write(li, prep.write_slots, k, v, start=prep.write_start)
            if keep_kv:
                k_layers.append(k)
                v_layers.append(v)
            a = dispatch.attend(prep, li, q, cache, fwd.scale)
            if li + 1 < fwd.num_layers:
                h, q, k, v = self._call(li + 1, dispatch, tap, a, h, *rope_in)
            else:
                (logits,) = self._call(li + 1, dispatch, tap, a, h)
        if not keep_kv:
            return logits, None, None
        T, L, KV, hd = prep.rows, fwd.num_layers, fwd.n_kv_heads, fwd.head_dim
        return logits, mx.stack(k_layers).reshape(L, T, KV, hd), mx.stack(v_layers).reshape(L, T, KV, hd)

    def _call(self, i: int, dispatch, tap, *args: mx.array) -> tuple:
        out = self._segments[i](*args)
        calls, points = self._traced[_key(i, args)]
        if dispatch.recording:
            for op, layer, m, dtype in calls:
                dispatch.record_native(op, layer, m, dtype)
        if points:
            n = len(out) - len(points)
            if tap is not None:
                for (layer, point), x in zip(points, out[n:]):
                    tap(layer, point, x)
            out = out[:n]
        return out

    def _segment_fn(self, i: int):
        fwd, L = self.fwd, self.fwd.num_layers

        def segment(*args):
            tracer = _Tracer()
            seen: list[tuple] = []
            tap = (lambda layer, point, x: seen.append(((layer, point), x))) if self.tapped else None
            if i == 0:
                tokens, *rope_in = args
                h = fwd.embed(tokens)
            else:
                a, h, *rope_in = args
                h = fwd.post_attention(i - 1, a, h, tracer, tap=tap)
            if i == L:
                xn = fwd.final_norm(h)
                out = (tracer(xn, fwd.head, L),)
                if tap is not None:
                    tap(L, "norm", xn)
                    tap(L, "lm_head", out[0])
            else:
                out = (h, *fwd.pre_attention(i, h, tracer, _rope_of(fwd, rope_in), tap))
            self._traced[_key(i, args)] = (tracer.calls, [p for p, _ in seen])
            return out + tuple(x for _, x in seen)

        return segment


def _key(i: int, args) -> tuple:
    """What a segment's trace depends on besides the forward: its rows and its inputs (how many;
    their dtypes are the model's, fixed per forward). mx.compile keys its traces by every
    input's shape and dtype; this only finds the records of the trace it used."""
    return i, args[0].shape[0], len(args)


def _rope_of(fwd, rope_in):
    """rope(module, x) inside a segment, as PackedForward._rope decides it, from the segment's
    RoPE inputs: (positions,) or (positions, cos, sin) (the step's StepRotation table)."""
    positions, *table = rope_in
    rotation = None
    if table:
        from .rotary import StepRotation

        rotation = StepRotation.of_table(fwd.shared_rope, fwd.head_dim, *table)

    def rope(module, x):
        if rotation is not None and x.dtype == fwd.dtype:
            return rotation.rotate(x)
        # one row: a 0-d offset, as MLX makes the eager step's Python number (mlx-lm's own call)
        return module(x, offset=positions.reshape(()) if x.shape[0] == 1 else positions)
    return rope
