"""The trace format in one place: every table, column, dtype, code table and the version.

See docs/trace-format.md for the prose. Readers refuse a newer SCHEMA_VERSION.

To add a table or a column, declare it in TABLES (nothing else): the writer creates
it at run start, `TraceWriter.append(table, **columns)` (or an event whose fields
are named like the columns) fills it, and `Trace.table(name)` reads it back, with
each column's default where an older trace lacks it. Append, never reorder: a
code column stores an index into its name table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core import names
from ..core.hashing import HASH_NAME  # noqa: F401  (the hash the kv tables hold)

FORMAT = "divergence-trace"
SCHEMA_VERSION = 2  # 2: one compound dataset per table; 1: a group of 1-D datasets per table

# Code tables, stored in each file's attrs under these keys (readers decode with the file's own).
MODELS = names.MODELS
PHASES = names.PHASES
KERNELS = names.KERNELS
OPS = names.OPS
REQUEST_EVENTS = names.REQUEST_EVENTS
TP_BACKENDS = names.TP_BACKENDS
CODE_TABLES: dict[str, tuple[str, ...]] = {
    "models": names.MODELS, "phases": names.PHASES, "kernels": names.KERNELS, "ops": names.OPS,
    "kinds": names.REQUEST_EVENTS, "draw_purposes": names.DRAW_PURPOSES, "tp_backends": names.TP_BACKENDS,
}
REQUEST = "requests"  # a column with codes=REQUEST holds an index into /requests (writers take the id)

STATUS = "status"  # int8 [1]: 0 running (or killed), 1 completed
REQUESTS = "requests"  # fixed-size group written at run start
VOCAB = "vocab"  # bytes + offsets of each token id decoded alone
META = "meta"  # attrs: JSON strings settings, model, draft, environment
TAILS = "tails"  # per table: [2, chunk rows] uncompressed rows after the body (a run still writing)
COMMIT = "commit"  # int64 [1 + tables, 3]: (sequence, 0, 0), then (body rows, tail rows, tail slot)


@dataclass(frozen=True)
class Column:
    dtype: type
    description: str
    width: int | str | None = None  # 2-D [n, width]; a str names a run setting, resolved at run start
    default: object = 0  # what writers store where a record omits it and readers give where a trace lacks it
    codes: str | None = None  # key into CODE_TABLES (or REQUEST): writers accept names, store the index


@dataclass(frozen=True)
class Table:
    description: str
    columns: dict[str, Column]
    v1: str | None = None  # schema 1's group path (one 1-D dataset per column); None: not in schema 1
    by_step: bool = True  # has a `step` column: readers drop records of steps /steps does not hold yet
    derived: dict[str, str] = field(default_factory=dict)  # column -> column it equals (not stored)


def _step(desc="step index"):
    return Column(np.int64, desc)


def _model():
    return Column(np.int8, "code into attrs['models']", codes="models")


def _request():
    return Column(np.int32, "index into /requests", codes=REQUEST)


TABLES: dict[str, Table] = {
    "steps": Table("one record per forward pass (target or draft), written last in each flush", {
        "index": Column(np.int64, "engine step index (target and draft forward passes share one counter)"),
        "model": Column(np.int8, "code into attrs['models']: which model ran this forward pass", codes="models"),
        "duration": Column(np.float64, "wall-clock seconds of the forward pass (s)"),
        "rows": Column(np.int32, "rows of the packed [T, hidden] input: tokens in this step"),
        "slice_offset": Column(np.int64, "first row of this step in /slices"),
        "slice_count": Column(np.int32, "number of sequence slices in this step"),
    }, v1="steps", by_step=False),
    "slices": Table("one record per sequence slice of a step (the StepPlan replay re-executes)", {
        "step": _step(),
        "request": _request(),
        "phase": Column(np.int8, "code into attrs['phases']", codes="phases"),
        "start": Column(np.int32, "sequence position of the slice's first token"),
        "count": Column(np.int32, "number of tokens (rows)"),
        "row_offset": Column(np.int32, "first row of the slice in the step's packed input"),
        "token_offset": Column(np.int64, "offset of the slice's input token ids in /slice_tokens"),
        "logit_offset": Column(np.int64, "offset of the slice's logit rows in /slice_logit_rows"),
        "logit_count": Column(np.int32, "number of rows (relative to the slice) whose logits were computed"),
    }, v1="slices"),
    "slice_tokens": Table("input token ids of every slice, concatenated", {
        "value": Column(np.int32, "input token id"),
    }, v1="slices/input_tokens", by_step=False),
    "slice_logit_rows": Table("slice-relative rows whose logits were computed, concatenated", {
        "value": Column(np.int32, "slice-relative row"),
    }, v1="slices/logit_rows", by_step=False),
    "kernels": Table("one record per dispatched op of a step and layer: the kernel that ran", {
        "step": _step(),
        "model": _model(),
        "layer": Column(np.int16, "transformer layer; num_layers for lm_head"),
        "op": Column(np.int8, "code into attrs['ops']", codes="ops"),
        "kernel": Column(np.int8, "code into attrs['kernels']", codes="kernels"),
        "m": Column(np.int32, "M of the (M, N, K) product: rows the op saw (attention: query rows)"),
        "n": Column(np.int32, "N: output features (attention: sequences in the call)"),
        "k": Column(np.int32, "K: input features, the reduction length (attention: the longest KV length)"),
        "splits": Column(np.int16, "split-K partitions (gemm); 1 otherwise", default=1),
        "native_class": Column(np.uint64, "native kernel class at this row count: probe signature, equal = same "
                                          "class; 0 for the engine's own kernels"),
        "expert": Column(np.int16, "`experts` op: the expert of the layer these rows went to; -1 for every other op",
                         default=-1),
        "kv_min": Column(np.int32, "attention: the shortest KV length of the call (m = query rows, n = sequences, "
                                   "k = the longest KV length); 0 for other ops"),
    }, v1="kernels", derived={"rows": "m"}),  # schema 1 stored rows (always equal to m)
    "kv_writes": Table("one record per (slice, layer) write of K/V into the cache", {
        "step": _step("step that wrote (for prefix-cache hits: the step that wrote the shared block)"),
        "model": _model(),
        "request": _request(),
        "layer": Column(np.int16, "transformer layer"),
        "start": Column(np.int32, "first sequence position written"),
        "count": Column(np.int32, "positions written"),
        "hash_offset": Column(np.int64, "row of the first position's hashes in /kv_hashes"),
    }, v1="kv/writes"),
    "kv_hashes": Table("one record per position written, in /kv_writes order", {
        "k_hash": Column(np.uint64, "xxh3_64 of one position's K bytes (all kv heads, cache dtype, little-endian)"),
        "v_hash": Column(np.uint64, "xxh3_64 of one position's V bytes"),
    }, v1="kv/hashes", by_step=False),
    "tokens": Table("one record per token committed to a request's output", {
        "step": _step("step whose logits produced the token"),
        "request": _request(),
        "position": Column(np.int32, "sequence position of the token (prompt length + generated index)"),
        "token": Column(np.int32, "token id"),
        "spec": Column(np.int8, "0 plain, 1 accepted draft proposal, 2 target token after a rejection / bonus"),
        "topk_ids": Column(np.int32, "top-k token ids, best first (ties by lower id); -1 pads", width="top_k",
                           default=-1),
        "topk_logits": Column(np.float32, "top-k logits as float32, exactly as the model produced them; NaN pads",
                              width="top_k", default=np.nan),
        "logit": Column(np.float32, "the chosen token's own logit (NaN where not recorded)", default=np.nan),
        "prob": Column(np.float32, "the chosen token's probability under the sampler (NaN where not recorded)",
                       default=np.nan),
    }, v1="tokens"),
    "request_events": Table("arrivals, finishes and errors of requests", {
        "step": _step("step at which it happened"),
        "request": _request(),
        "kind": Column(np.int8, "code into attrs['kinds']", codes="kinds"),
    }, v1="request_events"),
    "draws": Table("the sampler's uniform draws", {
        "step": _step("step whose logits the draw sampled from"),
        "request": _request(),
        "position": Column(np.int32, "sequence position the draw decides"),
        "purpose": Column(np.int8, "code into attrs['draw_purposes']", codes="draw_purposes"),
        "value": Column(np.float64, "the uniform in [0, 1)"),
        "token": Column(np.int32, "the token drawn, or the proposal an accept test judged", default=-1),
        "lo": Column(np.float64, "the outcome's range of u is [lo, hi): the token's slice of the CDF (token-id "
                                 "order), or [0, a) for an accepted proposal", default=np.nan),
        "hi": Column(np.float64, "end of that range", default=np.nan),
        "prev_token": Column(np.int32, "the token just below in the CDF (nonzero probability); -1: none",
                             default=-1),
        "prev_lo": Column(np.float64, "its slice is [prev_lo, lo)", default=np.nan),
        "next_token": Column(np.int32, "the token just above; -1: none", default=-1),
        "next_hi": Column(np.float64, "its slice is [hi, next_hi)", default=np.nan),
        "p": Column(np.float64, "accept: the target's p(token); else the drawn token's probability",
                    default=np.nan),
        "q": Column(np.float64, "accept: the draft's q(token)", default=np.nan),
    }),
    "routing": Table("MoE routing: one record per (MoE layer, sequence position, step that computed it)", {
        "step": _step("step whose forward pass routed this row"),
        "model": _model(),
        "request": _request(),
        "layer": Column(np.int16, "transformer layer (MoE layers only)"),
        "position": Column(np.int32, "sequence position of the row"),
        "choice_offset": Column(np.int64, "row of the first chosen expert in /routing_choices"),
        "k": Column(np.int8, "experts chosen (top-k)"),
        "runner_up": Column(np.int16, "best expert not chosen (-1 when every expert was)", default=-1),
        "runner_up_score": Column(np.float32, "its gate value, exact (NaN when none)", default=np.nan),
        "input_hash": Column(np.uint64, "xxh3_64 of the router's input row (model dtype, little-endian): equal in "
                                        "two traces = the router saw the same input"),
    }, v1="routing"),
    "routing_choices": Table("the chosen experts of each routing record (its k rows from choice_offset) and their gate values", {
        "expert": Column(np.int16, "chosen expert, in the order the block used them"),
        "score": Column(np.float32, "its gate value as top-k ranked it (qwen3_moe: router probability; mixtral: "
                                    "router logit), exactly (float32 holds the model dtype's value)"),
    }, v1="routing/choices", by_step=False),
    "allreduce": Table("tensor parallelism: one record per all-reduce (rank 0's view; every rank does the same)", {
        "step": _step(),
        "model": _model(),
        "layer": Column(np.int16, "transformer layer"),
        "op": Column(np.int8, "code into attrs['ops']: the op whose partial sums were reduced", codes="ops"),
        "ranks": Column(np.int16, "ranks in the group"),
        "bytes": Column(np.int64, "bytes reduced per rank (rows x N x dtype size)"),
        "backend": Column(np.int8, "code into attrs['tp_backends']", codes="tp_backends"),
    }, v1="allreduce"),
    # A live server's requests arrive while it records: /requests (fixed at run start) holds none of
    # them, these tables do, appended and committed with the steps that name them (readers list
    # /requests first, then these rows: a request's index counts on from /requests).
    "live_requests": Table("requests that joined the run while it ran (a live server's), in arrival order", {
        "id": Column(np.dtype("S64"), "request id, ASCII", default=b""),
        "prompt_offset": Column(np.int64, "row of its first prompt token in /live_prompt_tokens"),
        "prompt_count": Column(np.int32, "prompt tokens"),
        "arrival": Column(np.int32, "target step at which it came in"),
        "max_tokens": Column(np.int32, "tokens to generate at most"),
        "temperature": Column(np.float64, "0 = greedy"),
        "top_p": Column(np.float64, "nucleus sampling mass", default=1.0),
        "seed": Column(np.int64, "sampling seed"),
    }, by_step=False),
    "live_prompt_tokens": Table("prompt token ids of /live_requests, concatenated", {
        "value": Column(np.int32, "prompt token id"),
    }, by_step=False),
}
# Names schema 1 readers used for tables: Trace.table accepts both.
ALIASES = {t.v1: name for name, t in TABLES.items() if t.v1 and t.v1 != name}
# Widths of 2-D columns where a run gives none (the table then stays empty).
DEFAULT_WIDTHS = {"top_k": 8}

CHUNK_BYTES = 1 << 13  # chunk size of each table's body (and of its tail slots: the fixed cost of a table)
COMPRESSION = dict(compression="gzip", compression_opts=1, shuffle=True)  # the bodies
# bodies stored without it: 64-bit hashes are random bits, which gzip cannot shrink, and /kv_hashes
# is the largest table, so compressing it would be most of a trace's compression time for nothing
UNCOMPRESSED = frozenset({"kv_hashes"})


def code(table: tuple, name: str) -> int:
    return table.index(name)


def record_dtype(table: Table, widths: dict) -> np.dtype:
    """The compound dtype of a table's records (schema 2)."""
    fields = []
    for name, c in table.columns.items():
        w = column_width(c, widths)
        fields.append((name, c.dtype, (w,)) if w is not None else (name, c.dtype))
    return np.dtype(fields)


def column_width(c: Column, widths: dict) -> int | None:
    if c.width is None:
        return None
    if isinstance(c.width, int):
        return c.width
    return int(widths.get(c.width) or DEFAULT_WIDTHS.get(c.width, 1))


def default_array(c: Column, n: int, width: int | None) -> np.ndarray:
    shape = (n,) if width is None else (n, width)
    return np.full(shape, c.default, c.dtype)
