"""The trace format in one place: every path, dtype, code table and the version.

See docs/trace-format.md for the prose. Readers refuse a newer SCHEMA_VERSION.
"""
from __future__ import annotations

import numpy as np

from ..core import names
from ..core.hashing import HASH_NAME  # noqa: F401  (the hash the kv tables hold)

FORMAT = "divergence-trace"
SCHEMA_VERSION = 1

# Code tables, stored in each file's attrs (readers decode with the file's own tables).
MODELS = names.MODELS
PHASES = names.PHASES
KERNELS = names.KERNELS
OPS = names.OPS
REQUEST_EVENTS = names.REQUEST_EVENTS
TP_BACKENDS = names.TP_BACKENDS

STATUS = "status"  # int8 [1]: 0 running (or killed), 1 completed

# table path -> {column: (dtype, description)}; every column is a 1-D resizable dataset
TABLES: dict[str, dict[str, tuple]] = {
    "steps": {
        "index": (np.int64, "engine step index (target and draft forward passes share one counter)"),
        "model": (np.int8, "code into attrs['models']: which model ran this forward pass"),
        "duration": (np.float64, "wall-clock seconds of the forward pass (s)"),
        "rows": (np.int32, "rows of the packed [T, hidden] input: tokens in this step"),
        "slice_offset": (np.int64, "first row of this step in /slices"),
        "slice_count": (np.int32, "number of sequence slices in this step"),
    },
    "slices": {
        "step": (np.int64, "step index"),
        "request": (np.int32, "index into /requests"),
        "phase": (np.int8, "code into attrs['phases']"),
        "start": (np.int32, "sequence position of the slice's first token"),
        "count": (np.int32, "number of tokens (rows)"),
        "row_offset": (np.int32, "first row of the slice in the step's packed input"),
        "token_offset": (np.int64, "offset of the slice's input token ids in /slices/input_tokens"),
        "logit_offset": (np.int64, "offset of the slice's logit rows in /slices/logit_rows"),
        "logit_count": (np.int32, "number of rows (relative to the slice) whose logits were computed"),
    },
    "slices/input_tokens": {"value": (np.int32, "input token ids of every slice, concatenated")},
    "slices/logit_rows": {"value": (np.int32, "slice-relative rows whose logits were computed, concatenated")},
    "kernels": {
        "step": (np.int64, "step index"),
        "model": (np.int8, "code into attrs['models']"),
        "layer": (np.int16, "transformer layer; num_layers for lm_head"),
        "op": (np.int8, "code into attrs['ops']"),
        "rows": (np.int32, "rows the op saw (M)"),
        "kernel": (np.int8, "code into attrs['kernels']"),
        "m": (np.int32, "M of the (M, N, K) product"),
        "n": (np.int32, "N: output features"),
        "k": (np.int32, "K: input features (reduction length)"),
        "splits": (np.int16, "split-K partitions (gemm); 1 otherwise"),
        "native_class": (np.uint64, "native kernel class at this row count: probe signature, equal = same "
                                    "class; 0 for the engine's own kernels (added later: readers give 0 where a trace lacks the column)"),
        "expert": (np.int16, "`experts` op: the expert of the layer these rows went to; -1 for every other op "
                             "(added later: readers give -1 where a trace lacks the column)"),
    },
    "kv/writes": {
        "step": (np.int64, "step that wrote (for prefix-cache hits: the step that wrote the shared block)"),
        "model": (np.int8, "code into attrs['models']"),
        "request": (np.int32, "index into /requests"),
        "layer": (np.int16, "transformer layer"),
        "start": (np.int32, "first sequence position written"),
        "count": (np.int32, "positions written"),
        "hash_offset": (np.int64, "row of the first position's hashes in /kv/hashes"),
    },
    "kv/hashes": {
        "k_hash": (np.uint64, "xxh3_64 of one position's K bytes (all kv heads, cache dtype, little-endian)"),
        "v_hash": (np.uint64, "xxh3_64 of one position's V bytes"),
    },
    "tokens": {
        "step": (np.int64, "step whose logits produced the token"),
        "request": (np.int32, "index into /requests"),
        "position": (np.int32, "sequence position of the token (prompt length + generated index)"),
        "token": (np.int32, "token id"),
        "spec": (np.int8, "0 plain, 1 accepted draft proposal, 2 target token after a rejection / bonus"),
    },
    "allreduce": {  # tensor parallelism: one record per all-reduce (rank 0's view; every rank does the same)
        "step": (np.int64, "step index"),
        "model": (np.int8, "code into attrs['models']"),
        "layer": (np.int16, "transformer layer"),
        "op": (np.int8, "code into attrs['ops']: the op whose partial sums were reduced"),
        "ranks": (np.int16, "ranks in the group"),
        "bytes": (np.int64, "bytes reduced per rank"),
        "backend": (np.int8, "code into attrs['tp_backends']"),
    },
    "request_events": {
        "step": (np.int64, "step at which it happened"),
        "request": (np.int32, "index into /requests"),
        "kind": (np.int8, "code into attrs['kinds']"),
    },
}
# Mixture-of-experts routing: one row per (MoE layer, sequence position, step that computed it).
TABLES["routing"] = {
    "step": (np.int64, "step whose forward pass routed this row"),
    "model": (np.int8, "code into attrs['models']"),
    "request": (np.int32, "index into /requests"),
    "layer": (np.int16, "transformer layer (MoE layers only)"),
    "position": (np.int32, "sequence position of the row"),
    "choice_offset": (np.int64, "row of the first chosen expert in /routing/choices"),
    "k": (np.int8, "experts chosen (top-k)"),
    "runner_up": (np.int16, "best expert not chosen (-1 when every expert was)"),
    "runner_up_score": (np.float32, "its gate value, exact (NaN when none)"),
    "input_hash": (np.uint64, "xxh3_64 of the router's input row (model dtype, little-endian): equal in two "
                              "traces = the router saw the same input"),
}
TABLES["routing/choices"] = {
    "expert": (np.int16, "chosen expert, in the order the block used them"),
    "score": (np.float32, "its gate value as top-k ranked it (qwen3_moe: router probability; mixtral: router "
                          "logit), exactly (float32 holds the model dtype's value)"),
}
# Columns added after traces were written: what readers give where a trace lacks one (else 0).
DEFAULTS = {("kernels", "expert"): -1}
OPTIONAL_TABLES = ("routing", "routing/choices")  # traces of dense models (or older ones) lack them

TOPK_IDS = "tokens/topk_ids"  # int32 [n, K], best first
TOPK_LOGITS = "tokens/topk_logits"  # float32 [n, K], exact values the model produced
REQUESTS = "requests"  # fixed-size group written at run start
VOCAB = "vocab"  # vlen str [vocab]: each token id decoded alone
META = "meta"  # attrs: JSON strings settings, model, draft, environment
CHUNK = 4096
COMPRESSION = "lzf"


def code(table: tuple, name: str) -> int:
    return table.index(name)
