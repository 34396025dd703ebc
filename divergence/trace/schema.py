"""The trace format in one place: every path, dtype, code table and the version.

docs/trace-format.md is the prose for this module. A table is one HDF5 dataset
of compound records (one field per column; the top-k columns are [top_k]
subarrays): one write per table per flush, since every HDF5 call costs ~0.1 ms.
Readers refuse a newer SCHEMA_VERSION; additive changes (a new table, or a new
field that old readers can ignore) bump SCHEMA_MINOR only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FORMAT = "divergence-trace"
SCHEMA_VERSION = 1  # major: readers refuse a file whose major is newer than theirs
SCHEMA_MINOR = 0  # additive changes

# Code tables: a stored code is the index of the name in its tuple. The names are
# also stored on every coded column (attribute "codes"), so a file explains itself.
MODELS = ("target", "draft")
PHASES = ("prefill", "decode", "verify", "draft")
KERNELS = ("native", "gemv", "gemm", "batch-invariant")
OPS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
REQUEST_EVENTS = ("arrived", "finished", "error")
SPEC = ("none", "accepted", "corrected")  # TokenEvent.spec: SPEC_NONE, SPEC_ACCEPTED, SPEC_CORRECTED

KV_HASH = "xxh3_64"
TOPK_PAD_ID = -1  # top-k slots past the vocabulary (K > vocab) hold id -1 ...
TOPK_PAD_LOGIT = float("-inf")  # ... and logit -inf


@dataclass(frozen=True)
class Column:
    name: str
    dtype: type
    description: str
    units: str = ""
    codes: tuple | None = None  # names of the codes stored in this column
    wide: bool = False  # [n, top_k] instead of [n]


@dataclass(frozen=True)
class Table:
    path: str
    description: str
    columns: tuple[Column, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def dtype(self, top_k: int) -> np.dtype:
        """The record type; wide columns are [top_k] subarrays."""
        return np.dtype([(c.name, c.dtype, (top_k,)) if c.wide else (c.name, c.dtype) for c in self.columns])


C = Column
STEP = "engine step index (target and draft forward passes share one counter)"

STEPS = Table("steps", "one row per forward pass, in execution order", (
    C("index", np.int64, STEP, units="step"),
    C("model", np.int8, "which model ran this forward pass", codes=MODELS),
    C("duration", np.float64, "wall-clock time of the forward pass", units="s"),
    C("rows", np.int32, "rows of the packed [T, hidden] input (tokens in the step)", units="rows"),
    C("slice_offset", np.int64, "row of this step's first slice in /slices"),
    C("slice_count", np.int32, "number of sequence slices in this step")))

SLICES = Table("slices", "one row per sequence slice of a step (StepPlan.slices), in plan order", (
    C("step", np.int64, STEP, units="step"),
    C("request", np.int32, "row in /requests"),
    C("phase", np.int8, "what the rows do", codes=PHASES),
    C("start", np.int32, "sequence position of the slice's first token", units="position"),
    C("count", np.int32, "rows (tokens) of the slice", units="rows"),
    C("row_offset", np.int32, "first row of the slice in the step's packed input", units="rows"),
    C("token_offset", np.int64, "row of the slice's first input token in /slice_tokens"),
    C("logit_offset", np.int64, "row of the slice's first logit row in /slice_logit_rows"),
    C("logit_count", np.int32, "number of rows whose logits were computed")))

SLICE_TOKENS = Table("slice_tokens", "input token ids of every slice, concatenated "
                     "(slice i: token[token_offset[i] : token_offset[i] + count[i]])", (
                         C("token", np.int32, "input token id"),))

SLICE_LOGIT_ROWS = Table("slice_logit_rows", "slice-relative rows whose logits were computed, concatenated "
                         "(slice i: row[logit_offset[i] : logit_offset[i] + logit_count[i]])", (
                             C("row", np.int32, "row relative to the slice's first row", units="rows"),))

KERNELS_T = Table("kernels", "one row per linear op per layer per step: what kernel dispatch chose", (
    C("step", np.int64, STEP, units="step"),
    C("model", np.int8, "model of the step", codes=MODELS),
    C("layer", np.int16, "transformer layer; num_layers for lm_head"),
    C("op", np.int8, "linear op", codes=OPS),
    C("rows", np.int32, "rows the op saw", units="rows"),
    C("kernel", np.int8, "kernel that ran", codes=KERNELS),
    C("m", np.int32, "M of the (M, N, K) product", units="rows"),
    C("n", np.int32, "N: output features"),
    C("k", np.int32, "K: input features (reduction length)"),
    C("splits", np.int16, "split-K partitions (gemm); 1 otherwise")))

KV_WRITES = Table("kv/writes", "one row per write of K/V rows of one request and layer into the cache", (
    C("step", np.int64, "step that wrote the bytes (a prefix-cache hit records the step that wrote the "
                        "shared block)", units="step"),
    C("model", np.int8, "whose cache", codes=MODELS),
    C("request", np.int32, "row in /requests"),
    C("layer", np.int16, "transformer layer"),
    C("start", np.int32, "first sequence position written", units="position"),
    C("count", np.int32, "positions written", units="positions"),
    C("hash_offset", np.int64, "row of the first position's hashes in /kv/hashes")))

KV_HASHES = Table("kv/hashes", f"one row per position written: {KV_HASH} of the exact bytes "
                  "(all kv heads, cache dtype, little-endian)", (
                      C("k_hash", np.uint64, f"{KV_HASH} of one position's K bytes"),
                      C("v_hash", np.uint64, f"{KV_HASH} of one position's V bytes")))

TOKENS = Table("tokens", "one row per token committed to a request's output, in commit order", (
    C("step", np.int64, "step whose logits produced the token", units="step"),
    C("request", np.int32, "row in /requests"),
    C("position", np.int32, "sequence position of the token (prompt length + generated index)", units="position"),
    C("token", np.int32, "token id"),
    C("spec", np.int8, "how the token came to be", codes=SPEC),
    C("topk_ids", np.int32, "top-k token ids, best first (-1: past the vocabulary)", wide=True),
    C("topk_logits", np.float32, "top-k raw logits as float32, bit-exact as the model produced them "
                                 "(-inf: past the vocabulary)", units="logit", wide=True)))

REQUEST_EVENTS_T = Table("request_events", "request lifecycle: arrived, finished (detail: reason), "
                         "error (detail: message)", (
                             C("step", np.int64, "step at which (arrived: before which) it happened", units="step"),
                             C("request", np.int32, "row in /requests"),
                             C("kind", np.int8, "what happened", codes=REQUEST_EVENTS),
                             C("detail_offset", np.int64, "first byte of the detail in /request_event_detail"),
                             C("detail_count", np.int32, "bytes of the detail (utf-8)", units="bytes")))

REQUEST_EVENT_DETAIL = Table("request_event_detail", "utf-8 bytes of every request event's detail, concatenated", (
    C("byte", np.uint8, "utf-8 byte"),))

# Streamed tables, in the order a batch writes them (/steps last).
TABLES: tuple[Table, ...] = (SLICES, SLICE_TOKENS, SLICE_LOGIT_ROWS, KERNELS_T, KV_WRITES, KV_HASHES, TOKENS,
                             REQUEST_EVENTS_T, REQUEST_EVENT_DETAIL, STEPS)
TABLE = {t.path: t for t in TABLES}

# /status: int64 [1 + len(TABLES)]; attrs["fields"] names the entries: "completed"
# (1 once the run completed), then the committed rows of each table. Rows past a
# table's committed count are not part of the trace (a batch being written, or cut
# by a kill).
STATUS = "status"
STATUS_FIELDS = ("completed",) + tuple(t.path for t in TABLES)

# Written once at run start (fixed size).
REQUESTS = "requests"  # id (str), prompt_offsets, prompt_tokens, arrival, max_tokens, temperature, top_p, seed
META = "meta"  # attrs: settings, model, draft, environment as JSON strings
VOCAB = "vocab"  # bytes (uint8), offsets (int64 [vocab+1]): token i's text decoded alone

# Attributes of a table dataset: description, fields (names, in order), and per
# field "field:<name>" (its description), "units:<name>", "codes:<name>".

# Streaming chunks hold about this many bytes, uncompressed; a completed trace is
# rewritten compressed with chunks fitted to the data.
STREAM_CHUNK_BYTES = 32 * 1024
FINAL_CHUNK_BYTES = 256 * 1024
COMPRESSION = "gzip"
COMPRESSION_OPTS = 1


def code(names: tuple, name: str, what: str) -> int:
    """The code of `name` in a code table; a clear error for a name the format lacks."""
    try:
        return names.index(name)
    except ValueError:
        raise ValueError(f"trace format: unknown {what} {name!r} (known: {', '.join(names)}); "
                         "add it to divergence.trace.schema") from None
