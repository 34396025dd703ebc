"""JSON Lines -> trace: how an engine in any language gets its runs diffed and bisected.

A directory holds one file per record kind (run.jsonl, requests.jsonl, steps.jsonl,
kernels.jsonl, kv_writes.jsonl, tokens.jsonl, finishes.jsonl), or any *.jsonl files
whose lines carry a `kind` field (both may be mixed). Every line is checked by the
same Recorder a Python engine uses; the first bad one stops the import with its
file and line number, before anything is written.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from ..core.names import RECORD_KINDS
from ..errors import RecordError
from .contract import CONTRACT_VERSION, check
from .recorder import Recorder

# file stem -> kind (plural as in the docs; the singular works too)
FILE_KINDS = {**{k: k for k in RECORD_KINDS}, "requests": "request", "steps": "step", "kernels": "kernel",
              "kv_writes": "kv_write", "tokens": "token", "finishes": "finish", "runs": "run"}
STEP_RECORDS = ("kernel", "kv_write", "token", "finish")  # records that belong to a step


class _Line:
    __slots__ = ("kind", "fields", "where")

    def __init__(self, kind: str, fields: dict, where: str):
        self.kind, self.fields, self.where = kind, fields, where


def read_records(src) -> list[_Line]:
    """Every record of a directory (or one .jsonl file), in file then line order."""
    src = Path(src)
    if not src.exists():
        raise RecordError(f"no such directory or file: {src}")
    files = sorted(src.glob("*.jsonl")) if src.is_dir() else [src]
    if not files:
        raise RecordError(f"{src} holds no .jsonl files")
    out = []
    for f in files:
        file_kind = FILE_KINDS.get(f.stem)
        with open(f, encoding="utf-8", errors="strict") as fh:
            try:
                for n, line in enumerate(fh, 1):
                    where = f"{f}:{n}"
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise RecordError(f"{where}: not a JSON object ({e.msg} at column {e.colno})") from None
                    if not isinstance(rec, dict):
                        raise RecordError(f"{where}: expected a JSON object, got {type(rec).__name__}")
                    kind = rec.pop("kind", None)
                    if kind is None:
                        kind = file_kind
                        if kind is None:
                            raise RecordError(f"{where}: no 'kind' field (lines of {f.name} need one: "
                                              f"{', '.join(RECORD_KINDS)})")
                    elif kind not in RECORD_KINDS:
                        raise RecordError(f"{where}: unknown kind {kind!r} (kinds: {', '.join(RECORD_KINDS)})")
                    elif file_kind is not None and kind != file_kind:
                        raise RecordError(f"{where}: a {kind!r} record in {f.name}, which holds {file_kind!r}")
                    out.append(_Line(kind, rec, where))
            except UnicodeDecodeError as e:
                raise RecordError(f"{f}: not UTF-8 text ({e.reason})") from None
    return out


def import_records(src, out) -> dict:
    """Check every record of `src`, then write the trace `out` (nothing is written when a
    record is bad). Returns counts of what was imported."""
    lines = read_records(src)
    runs = [ln for ln in lines if ln.kind == "run"]
    if not runs:
        raise RecordError(f"{src}: no run record (engine, schedule, ...): see docs/recording.md")
    if len(runs) > 1:
        raise RecordError(f"{runs[1].where}: a second run record (one run per directory)")
    run = runs[0]
    fields = _at(run.where, lambda: check("run", run.fields))
    if fields["contract"] > CONTRACT_VERSION:
        raise RecordError(f"{run.where}: recording contract {fields['contract']} is newer than this "
                          f"divergence reads ({CONTRACT_VERSION}); upgrade divergence")
    del fields["contract"]
    rec = _at(run.where, lambda: Recorder(out, **fields))
    by_step: dict[int, list[_Line]] = defaultdict(list)
    steps = []
    for ln in lines:
        if ln.kind == "request":
            _at(ln.where, lambda: rec.add("request", ln.fields, json_hashes=True))
        elif ln.kind == "step":
            steps.append(ln)
        elif ln.kind in STEP_RECORDS:
            step = ln.fields.get("step")
            if step is None:
                raise RecordError(f"{ln.where}: {ln.kind}: missing field 'step'")
            if isinstance(step, bool) or not isinstance(step, int):
                raise RecordError(f"{ln.where}: {ln.kind}.step: expected an integer, got {step!r}")
            by_step[step].append(ln)
    for st in steps:
        idx = _at(st.where, lambda: rec.add("step", st.fields, json_hashes=True))
        # a step's records in the order the engine emits them: kernels, KV writes, tokens, finishes
        for ln in sorted(by_step.pop(idx, ()), key=lambda x: STEP_RECORDS.index(x.kind)):
            _at(ln.where, lambda: rec.add(ln.kind, ln.fields, json_hashes=True))
    if by_step:
        order = {id(ln): i for i, ln in enumerate(lines)}
        first = min((ln for group in by_step.values() for ln in group), key=lambda ln: order[id(ln)])
        raise RecordError(f"{first.where}: {first.kind}: step {first.fields['step']} has no step record")
    counts = {"requests": len(rec._requests), "steps": len(rec._steps),
              "tokens": sum(len(v) for v in rec._generated.values())}
    _at(str(src), lambda: rec.close(completed=True))
    return counts


def _at(where: str, fn):
    """Run fn; a RecordError gets the file and line it came from."""
    try:
        return fn()
    except RecordError as e:
        raise RecordError(f"{where}: {e}") from None
