"""What the engine tells the world: plans of each step and what happened in them.

Data flows one way: scheduler -> StepPlan -> forward -> sampler -> these events
-> observers (the trace writer, progress bars). Numpy only (the core), so the
trace and analysis layers use these types without the engine.
"""
from __future__ import annotations

import collections.abc
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .names import (  # noqa: F401  (re-exported: the event vocabulary)
    DECODE, DRAFT, DRAFT_MODEL, LINEAR_OPS, PREFILL, SPEC_ACCEPTED, SPEC_CORRECTED, SPEC_NONE, TARGET, VERIFY,
)


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's contiguous run of rows inside a packed step."""

    request_id: str
    phase: str
    start: int  # position of the first token in the sequence
    count: int  # number of rows (tokens)
    row_offset: int  # first row of this slice in the step's [T, hidden] input
    tokens: tuple[int, ...]  # input token ids for these rows
    # Rows (relative to the slice) whose logits are needed (sampling/verify).
    logit_rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """Everything needed to execute one forward pass exactly; replay re-runs these."""

    index: int
    model: str  # TARGET or DRAFT_MODEL
    slices: tuple[SeqSlice, ...]

    @property
    def rows(self) -> int:
        return sum(s.count for s in self.slices)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(s.request_id for s in self.slices)


@dataclass(frozen=True)
class KernelChoice:
    """Which kernel ran one linear op of one step (layer == num_layers for lm_head), or
    one layer's attention (op "attention": m = query rows, n = sequences, k = the
    longest KV length, kv_min = the shortest)."""

    step: int
    model: str
    layer: int
    op: str
    rows: int
    kernel: str  # "native" | "gemv" | "gemm" | "batch-invariant" (+ detail below)
    m: int
    n: int
    k: int
    splits: int = 1  # split-K partitions used (gemm); 1 for others
    # native only: the backend's kernel class at this row count, as a probe signature
    # (see native_classes); equal signatures = same class; 0 for the engine's own kernels
    native_class: int = 0
    # `experts` only: which expert of the layer these rows went to (-1 for every other op)
    expert: int = -1
    kv_min: int = 0  # attention only: the shortest KV length of the step (0 for linear ops)


# A KernelChoice's fields but `step`, in order: one row of StepKernels
KERNEL_ROW = ("model", "layer", "op", "rows", "kernel", "m", "n", "k", "splits", "native_class", "expert", "kv_min")


def kernel_choice(step: int, row: tuple) -> KernelChoice:
    """The KernelChoice of a StepKernels row (set through its __dict__, as a frozen dataclass's
    __init__ would: equal, hashed and printed as one made by it, at a third of the cost)."""
    ev = object.__new__(KernelChoice)
    d = ev.__dict__
    d["step"] = step
    d.update(zip(KERNEL_ROW, row))
    return ev


class _LazyEvents(collections.abc.Sequence):
    """A step's events kept as columns or rows, read as a sequence of event objects that
    `events()` makes once (the subclasses say how, and how many)."""

    __slots__ = ()

    def __getitem__(self, i):
        return self.events()[i]

    def __iter__(self):
        return iter(self.events())

    def events(self) -> list:
        raise NotImplementedError


class StepKernels(_LazyEvents):
    """One step's kernel choices as the engine emits them in one on_kernels call: a sequence of
    KernelChoice events, made when first read, and the same choices as rows for an observer
    that stores them whole (the trace writer: no event objects made).

    `rows`: one tuple per choice, in emission order, of its fields but step (KERNEL_ROW); the
    dispatcher shares one tuple among every step whose op has the same fields."""

    __slots__ = ("step", "rows", "_events")

    def __init__(self, step: int, rows: list):
        self.step, self.rows = step, rows
        self._events: list[KernelChoice] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"StepKernels(step={self.step}, choices={len(self)})"

    def events(self) -> list[KernelChoice]:
        """The choices as KernelChoice events (made once)."""
        if self._events is None:
            step = self.step
            self._events = [kernel_choice(step, r) for r in self.rows]
        return self._events


@dataclass(frozen=True)
class AllReduce:
    """One all-reduce of a sharded-to-all op under tensor parallelism (its partial sums
    added across the ranks); layer == num_layers never occurs (lm_head is not sharded)."""

    step: int
    model: str
    layer: int
    op: str  # "o_proj" | "down_proj"
    ranks: int  # group size
    bytes: int  # message size per rank
    backend: str  # one of names.TP_BACKENDS


@dataclass
class KvWrite:
    """One write of K/V rows of one request and layer into the paged cache."""

    step: int
    model: str
    request_id: str
    layer: int
    start: int
    count: int
    # One 64-bit xxh3 hash per position of the exact bytes written (all kv heads).
    k_hashes: np.ndarray  # uint64 [count]
    v_hashes: np.ndarray  # uint64 [count]


class StepKvWrites(_LazyEvents):
    """One step's KV writes (one per slice and layer, slice by slice, layers in order) as the
    engine emits them in one on_kv_writes call: a sequence of KvWrite events, made when first
    read, and the same writes as columns for an observer that stores them whole (the trace
    writer: no event objects made, its records made from the columns at once).

    `k`, `v`: uint64 hashes of every write's positions in write order (a write's are the next
    `count`); write i is of slice i // layers, layer i % layers."""

    __slots__ = ("step", "model", "slices", "layers", "k", "v", "_events")

    def __init__(self, step: int, model: str, slices: tuple, layers: int, k: np.ndarray, v: np.ndarray):
        self.step, self.model, self.slices, self.layers, self.k, self.v = step, model, slices, layers, k, v
        self._events: list[KvWrite] | None = None

    def __len__(self) -> int:
        return len(self.slices) * self.layers

    def __repr__(self) -> str:
        return f"StepKvWrites(step={self.step}, model={self.model!r}, writes={len(self)})"

    def events(self) -> list[KvWrite]:
        """The writes as KvWrite events (made once), their hashes views of k and v."""
        if self._events is None:
            step, model, layers, k, v = self.step, self.model, self.layers, self.k, self.v
            if all(s.count == 1 for s in self.slices):  # decode: a [1] view each, made by iterating
                ks, vs = iter(k.reshape(-1, 1)), iter(v.reshape(-1, 1))
                self._events = [KvWrite(step, model, s.request_id, layer, s.start, 1, next(ks), next(vs))
                                for s in self.slices for layer in range(layers)]
            else:
                out, i = [], 0
                for s in self.slices:
                    n = s.count
                    for layer in range(layers):
                        out.append(KvWrite(step, model, s.request_id, layer, s.start, n, k[i:i + n], v[i:i + n]))
                        i += n
                self._events = out
        return self._events


@dataclass
class Routing:
    """Which experts one MoE layer chose for each row of one slice, with the gate values
    top-k ranked (router probabilities for qwen3_moe, router logits for mixtral), exact."""

    step: int
    model: str
    request_id: str
    layer: int
    start: int  # sequence position of the first row
    count: int
    experts: np.ndarray  # int32 [count, k], in the order the block used them
    scores: np.ndarray  # float32 [count, k], the ranked gate value of each chosen expert
    runner_up: np.ndarray  # int32 [count]: the best expert not chosen (-1 when every expert is)
    runner_up_score: np.ndarray  # float32 [count]
    input_hash: np.ndarray  # uint64 [count]: xxh3_64 of the router's input row (exact bytes)


@dataclass
class TokenEvent:
    """A token the engine committed to a request's output."""

    step: int
    request_id: str
    position: int  # position of this token in the sequence (prompt_len + generated index)
    token: int
    spec: int  # SPEC_NONE | SPEC_ACCEPTED | SPEC_CORRECTED
    topk_ids: np.ndarray  # int32 [k], best first
    topk_logits: np.ndarray  # float32 [k], raw logits as the model produced them
    logit: float = float("nan")  # the token's own logit (also when outside the top-k)
    prob: float = float("nan")  # its probability under the request's sampler (greedy: the softmax)


@dataclass
class StepEvent:
    """A finished forward pass: its plan and how long it took."""

    plan: StepPlan
    duration_s: float


@dataclass
class RequestEvent:
    """Lifecycle of a request: 'arrived', 'finished' (with reason) or 'error'."""

    step: int
    request_id: str
    kind: str
    detail: str = ""


@dataclass
class RunInfo:
    """Facts about a run, known before its first step."""

    schedule: str
    policy: str
    settings: dict = field(default_factory=dict)  # token budget, spec_k, top_k, dtype, ...
    requests: Sequence = ()  # engine Request objects (id, prompt_tokens, arrival, max_tokens, sampling)
    model: dict = field(default_factory=dict)  # path, config, weights hash, tokenizer hash
    draft: dict | None = None
    environment: dict = field(default_factory=dict)  # versions, backend, device, BLAS
    # Text of each token id decoded alone, so readers can show text without a tokenizer.
    vocab: Sequence[str] = ()


class Observer:
    """Receives engine events. Subclasses override what they need.

    `wants_kv_hashes` / `wants_kernels` / `wants_routing` / `wants_records`: the engine
    skips that work when no observer asks, so an unobserved run pays nothing for tracing.

    `on_record(table, **columns)` carries records of any trace table
    (trace/schema.py TABLES: draws, ...): arrays of one length
    or scalars. An observer may keep an event (and its arrays) past the call: the
    engine never mutates what it emitted.

    Order within one step: on_kernel* and on_allreduce* (during the forward), on_kv_write*
    (or on_kv_writes), on_routing*,
    on_token*, on_request* (arrivals are sent before the step that first
    schedules them; finishes after its tokens), then on_step, which closes the
    step: a writer flushes there.
    """

    wants_kv_hashes: bool = False
    wants_kernels: bool = False
    wants_routing: bool = False
    wants_records: bool = False

    def on_run_start(self, info: RunInfo) -> None: ...
    def on_step(self, event: StepEvent) -> None: ...
    def on_kernel(self, choice: KernelChoice) -> None: ...

    def on_kernels(self, choices: list[KernelChoice]) -> None:
        """A step's kernel choices in one call (the engine's, once a step: a StepKernels);
        on_kernel each unless overridden (the trace writer takes the rows whole)."""
        for c in choices:
            self.on_kernel(c)

    def on_allreduce(self, event: AllReduce) -> None: ...
    def on_kv_write(self, write: KvWrite) -> None: ...

    def on_kv_writes(self, writes: list[KvWrite]) -> None:
        """A step's KV writes in one call; on_kv_write each unless overridden (the trace
        writer takes the list whole)."""
        for w in writes:
            self.on_kv_write(w)

    def on_routing(self, routing: Routing) -> None: ...
    def on_token(self, event: TokenEvent) -> None: ...
    def on_request(self, event: RequestEvent) -> None: ...
    def on_request_added(self, request) -> None:
        """A request that joined a run after on_run_start (a live server's), before any event names it."""
    def on_record(self, table: str, **columns) -> None: ...
    def on_run_end(self, completed: bool) -> None: ...
