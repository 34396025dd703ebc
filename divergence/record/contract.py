"""The recording contract as code: every record kind's fields, types and defaults.

One table serves the `Recorder` (Python engines), `divergence import` (JSON Lines
from any language) and docs/recording.md. `check(kind, fields)` returns the
record with defaults filled in and values normalised (numpy arrays for lists),
or raises RecordError naming the field. Checks that need more than one record
(steps in order, known requests, a token's row) live in the Recorder.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.names import MODELS, PHASES, RECORD_KINDS, SPEC_CORRECTED, TARGET
from ..errors import RecordError

CONTRACT_VERSION = 2  # 2: every JSON Lines file ends with an `end` record (1: no end records)
END = "end"  # the last line of every JSON Lines file: {"kind": "end", "records": N}
REQUIRED = object()
_HEX64 = re.compile(r"[0-9a-fA-F]{16}")


@dataclass(frozen=True)
class Field:
    type: str  # int, str, float, dict, ints, strs, hashes, logits, logit, slices
    default: Any = REQUIRED
    min: int | None = None  # smallest allowed value (ints)
    choices: tuple = ()  # allowed values (str)
    doc: str = ""


# kind -> field -> spec; the doc's tables are these
FIELDS: dict[str, dict[str, Field]] = {
    "run": {
        "engine": Field("str", doc="name and version of the engine, e.g. \"mini-vllm-rs 0.3\": marks the "
                                   "trace as foreign (divergence's replay refuses it)"),
        "schedule": Field("str", doc="what this run was, e.g. serial / concurrent (the label reports use)"),
        "kv_hash": Field("str", None, doc="name of the 64-bit hash of the KV bytes, e.g. xxh3_64 or "
                                          "blake2b_64 (needed when there are kv_write records; both traces "
                                          "of a pair must use the same)"),
        "top_k": Field("int", None, min=1, doc="K of the top-k lists (default: the longest given)"),
        "policy": Field("str", "native", doc="the engine's kernel policy, as it names it"),
        "model": Field("dict", {}, doc="path / name, weights_hash, dtype: pairs with different weights_hash "
                                       "or dtype are refused"),
        "settings": Field("dict", {}, doc="anything else about the run (token budget, block size, ...)"),
        "environment": Field("dict", {}, doc="versions, device, backend"),
        "vocab": Field("strs", None, doc="text of each token id decoded alone (lets reports show text)"),
        "contract": Field("int", CONTRACT_VERSION, min=1, doc="version of this contract the records follow "
                          "(2: every JSON Lines file ends with an end record; 1: files without end records, "
                          "imported without the check that none was cut short)"),
    },
    "request": {
        "id": Field("str", doc="request id, unique in the run"),
        "prompt": Field("ints", min=0, doc="prompt token ids"),
        "max_tokens": Field("int", None, min=1, doc="tokens it may generate (default: as many as recorded)"),
        "arrival": Field("int", 0, min=0, doc="step at which it arrived"),
        "temperature": Field("float", 0.0, doc="0 = greedy"),
        "top_p": Field("float", 1.0),
        "seed": Field("int", 0),
    },
    "step": {
        "index": Field("int", min=0, doc="step index: strictly increasing"),
        "slices": Field("slices", doc="the step's composition, one slice per sequence (see below)"),
        "model": Field("str", TARGET, choices=MODELS, doc="which model ran the forward pass"),
        "duration": Field("float", 0.0, doc="seconds the forward pass took"),
    },
    "slice": {
        "request": Field("str", doc="request id"),
        "phase": Field("str", choices=PHASES, doc="what these rows were"),
        "start": Field("int", min=0, doc="sequence position of the slice's first row"),
        "count": Field("int", min=1, doc="rows (tokens) of this sequence in the step"),
        "row_offset": Field("int", None, min=0, doc="first row in the step's packed input (default: after "
                                                    "the previous slice)"),
        "tokens": Field("ints", None, min=0, doc="input token ids of the rows (default: from the prompt and "
                                                 "the tokens recorded; -1 where unknown)"),
    },
    "kernel": {
        "step": Field("int", min=0),
        "layer": Field("int", min=0, doc="layer index (the engine's numbering; lm_head after the last layer)"),
        "op": Field("str", doc="the op, as the engine names it (q_proj, qkv, attention, lm_head, ...)"),
        "rows": Field("int", min=1, doc="rows the op saw (M)"),
        "kernel": Field("str", doc="the kernel, as the engine names it (mv, mm_t, gemm/4, ...)"),
        "model": Field("str", None, choices=MODELS, doc="default: the step's model"),
        "m": Field("int", None, min=0, doc="M of the product (default: rows)"),
        "n": Field("int", 0, min=0, doc="N: output features"),
        "k": Field("int", 0, min=0, doc="K: reduction length"),
    },
    "kv_write": {
        "step": Field("int", min=0),
        "request": Field("str"),
        "layer": Field("int", min=0),
        "start": Field("int", min=0, doc="first position written"),
        "k_hashes": Field("hashes", doc="one 64-bit hash per position of the exact K bytes written "
                                        "(16 hex digits each in JSON)"),
        "v_hashes": Field("hashes", doc="the same for V"),
        "model": Field("str", None, choices=MODELS, doc="default: the step's model"),
    },
    "token": {
        "step": Field("int", min=0, doc="the step whose logits produced the token"),
        "request": Field("str"),
        "position": Field("int", min=0, doc="sequence position of the token (prompt length + generated index)"),
        "token": Field("int", min=0, doc="token id"),
        "topk_ids": Field("ints", min=0, doc="top-k token ids, best first"),
        "topk_logits": Field("logits", doc="their logits as float32 values, best first"),
        "logit": Field("logit", None, doc="the chosen token's logit (checked against the top-k when it is "
                                          "there)"),
        "spec": Field("int", 0, min=0, doc="0 plain, 1 accepted draft proposal, 2 target token after a "
                                           "rejection"),
    },
    "finish": {
        "step": Field("int", min=0),
        "request": Field("str"),
        "reason": Field("str", "", doc="stop, length, ... (length: it generated max_tokens tokens, all "
                                       "recorded)"),
    },
    END: {
        "records": Field("int", min=0, doc="records in the file before this line (JSON Lines only: the last "
                                           "line of every file, so a file cut short is refused)"),
    },
}
assert set(RECORD_KINDS) <= set(FIELDS)


def check(kind: str, rec: dict, *, json_hashes: bool = False) -> dict:
    """The record with defaults filled in, or RecordError naming the first bad field.
    json_hashes: hashes must be 16-hex-digit strings (JSON numbers lose bits above 2**53)."""
    spec = FIELDS[kind]
    unknown = [k for k in rec if k not in spec]
    if unknown:
        raise RecordError(f"{kind}: unknown field {unknown[0]!r} (fields: {', '.join(spec)})")
    out = {}
    for name, f in spec.items():
        if name not in rec or rec[name] is None:
            if f.default is REQUIRED:
                raise RecordError(f"{kind}: missing field {name!r}")
            out[name] = f.default
            continue
        out[name] = _value(kind, name, f, rec[name], json_hashes)
    if kind == "step" and out["slices"] is not None:
        out["slices"] = [check("slice", s, json_hashes=json_hashes) for s in out["slices"]]
    if kind == "token":
        if out["spec"] > SPEC_CORRECTED:
            raise RecordError(f"token.spec: must be 0, 1 or 2, got {out['spec']}")
        _check_topk(out)
    if kind == "kv_write" and len(out["k_hashes"]) != len(out["v_hashes"]):
        raise RecordError(f"kv_write: {len(out['k_hashes'])} k_hashes but {len(out['v_hashes'])} v_hashes")
    return out


def _value(kind: str, name: str, f: Field, v, json_hashes: bool):
    where = f"{kind}.{name}"
    t = f.type
    if t == "int":
        v = _int(where, v)
        if f.min is not None and v < f.min:
            raise RecordError(f"{where}: must be >= {f.min}, got {v}")
        return v
    if t == "str":
        if not isinstance(v, str) or not v and f.default is REQUIRED:
            raise RecordError(f"{where}: expected a non-empty string, got {_show(v)}")
        if f.choices and v not in f.choices:
            raise RecordError(f"{where}: {v!r} is not one of {', '.join(f.choices)}")
        return v
    if t == "float":
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v):
            raise RecordError(f"{where}: expected a finite number, got {_show(v)}")
        return float(v)
    if t == "dict":
        if not isinstance(v, dict):
            raise RecordError(f"{where}: expected an object, got {_show(v)}")
        return v
    if t == "strs":
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise RecordError(f"{where}: expected a list of strings")
        return list(v)
    if t == "ints":
        a = _ints(where, v)
        if f.min is not None and a.size and int(a.min()) < f.min:
            raise RecordError(f"{where}: values must be >= {f.min}, got {int(a.min())}")
        return a
    if t == "hashes":
        return _hashes(where, v, json_hashes)
    if t == "logits":
        return _logits(where, v)
    if t == "logit":
        return _logits(where, [v])[0]
    if t == "slices":
        if not isinstance(v, (list, tuple)) or not v:
            raise RecordError(f"{where}: expected a non-empty list of slices")
        return [_slice(where, i, s) for i, s in enumerate(v)]
    raise AssertionError(t)  # pragma: no cover


def _int(where: str, v) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise RecordError(f"{where}: expected an integer, got {_show(v)}")
    return int(v)


def _ints(where: str, v) -> np.ndarray:
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or not (np.issubdtype(v.dtype, np.integer) or v.size == 0):
            raise RecordError(f"{where}: expected a 1-D integer array, got {v.dtype} {list(v.shape)}")
        return v.astype(np.int64)
    if not isinstance(v, (list, tuple)):
        raise RecordError(f"{where}: expected a list of integers, got {_show(v)}")
    for i, x in enumerate(v):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
            raise RecordError(f"{where}[{i}]: expected an integer, got {_show(x)}")
    return np.array(v, dtype=np.int64)


def _hashes(where: str, v, json_hashes: bool) -> np.ndarray:
    if isinstance(v, np.ndarray) and not json_hashes:
        if v.ndim != 1 or v.dtype not in (np.uint64, np.int64) or not v.size:
            raise RecordError(f"{where}: expected a non-empty 1-D uint64 array, got {v.dtype} {list(v.shape)}")
        return v.astype(np.uint64) if v.dtype == np.uint64 else v.view(np.uint64)
    if not isinstance(v, (list, tuple)) or not v:
        raise RecordError(f"{where}: expected a non-empty list of 64-bit hashes, got {_show(v)}")
    out = np.empty(len(v), np.uint64)
    for i, x in enumerate(v):
        if isinstance(x, str):
            h = x[2:] if x[:2].lower() == "0x" else x
            if not _HEX64.fullmatch(h):
                raise RecordError(f"{where}[{i}]: {x!r} is not a 64-bit hash: expected 16 hex digits")
            out[i] = int(h, 16)
        elif not json_hashes and isinstance(x, (int, np.integer)) and not isinstance(x, bool) \
                and 0 <= int(x) < 2**64:
            out[i] = int(x)
        else:
            raise RecordError(f"{where}[{i}]: expected a 64-bit hash as 16 hex digits, got {_show(x)}")
    return out


def _logits(where: str, v) -> np.ndarray:
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or not np.issubdtype(v.dtype, np.floating):
            raise RecordError(f"{where}: expected a 1-D float array, got {v.dtype} {list(v.shape)}")
        vals = v
    else:
        if not isinstance(v, (list, tuple)):
            raise RecordError(f"{where}: expected a list of numbers, got {_show(v)}")
        for i, x in enumerate(v):
            if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
                raise RecordError(f"{where}[{i}]: expected a number, got {_show(x)}")
        vals = np.array(v, dtype=np.float64)
    if np.isnan(vals).any():
        raise RecordError(f"{where}: NaN is not a logit (give fewer entries instead of padding)")
    f32 = vals.astype(np.float32)
    if vals.dtype != np.float32 and vals.dtype.itemsize <= 4:  # float16 / bfloat16 widen exactly
        return f32
    inexact = np.flatnonzero(f32.astype(np.float64) != np.asarray(vals, np.float64))
    # a float32 printed with up to 9 significant digits (its shortest decimal, or %.9g)
    # parses to a nearby double: that is the float32; more digits mean a float64 value.
    # A float64 array has no decimal text and must hold float32 values exactly.
    text = not isinstance(v, np.ndarray)
    for i in inexact:
        x, f = float(vals[i]), float(f32[i])
        if not text or not any(float(f"{f:.{d}g}") == x for d in range(1, 10)):
            raise RecordError(f"{where}[{i}]: {float(vals[i])!r} is not a float32 value; give logits as "
                              f"float32 (exact, or their shortest decimal), not float64")
    return f32


def _slice(where: str, i: int, s) -> dict:
    if isinstance(s, dict):
        return dict(s)
    if isinstance(s, (list, tuple)) and len(s) in (4, 5):  # (request, phase, start, count[, row_offset])
        return dict(zip(("request", "phase", "start", "count", "row_offset"), s))
    if hasattr(s, "request_id"):  # a core SeqSlice
        return {"request": s.request_id, "phase": s.phase, "start": s.start, "count": s.count,
                "row_offset": s.row_offset, "tokens": list(s.tokens) or None}
    raise RecordError(f"{where}[{i}]: expected an object with request, phase, start, count, got {_show(s)}")


def _check_topk(t: dict) -> None:
    ids, vals = t["topk_ids"], t["topk_logits"]
    if len(ids) != len(vals):
        raise RecordError(f"token: {len(ids)} topk_ids but {len(vals)} topk_logits")
    if not len(ids):
        raise RecordError("token: topk_ids is empty (give at least the chosen token and its logit)")
    if len(set(ids.tolist())) != len(ids):
        raise RecordError("token: topk_ids repeats an id")
    if (np.diff(vals.astype(np.float64)) > 0).any():
        raise RecordError("token: topk_logits are not best first (descending)")
    hit = np.flatnonzero(ids == t["token"])
    if t["logit"] is not None and hit.size and vals[hit[0]].view(np.uint32) != np.float32(t["logit"]).view(np.uint32):
        raise RecordError(f"token: logit {float(t['logit'])!r} differs from the top-k's logit of token "
                          f"{t['token']} ({float(vals[hit[0]])!r})")


def _show(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."
