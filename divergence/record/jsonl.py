"""JSON Lines -> trace: how an engine in any language gets its runs diffed and bisected.

A directory holds one file per record kind (run.jsonl, requests.jsonl, steps.jsonl,
kernels.jsonl, kv_writes.jsonl, tokens.jsonl, finishes.jsonl), or any *.jsonl files
whose lines carry a `kind` field (both may be mixed). Every file ends with an end
record, {"kind": "end", "records": N} (N: the records before it), so a file cut
short, even at a line boundary, is refused (contract 1 files have none: declared
with "contract": 1 in the run record, they import without that check). Every line
is checked by the same Recorder a Python engine uses; the first bad one stops the
import with its file and line number, before anything is written.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..core.jsonl import read_lines
from ..core.names import RECORD_KINDS
from ..errors import RecordError
from .contract import CONTRACT_VERSION, END, check
from .recorder import Recorder

# file stem -> kind (plural as in the docs; the singular works too)
FILE_KINDS = {**{k: k for k in RECORD_KINDS}, "requests": "request", "steps": "step", "kernels": "kernel",
              "kv_writes": "kv_write", "tokens": "token", "finishes": "finish", "runs": "run"}
STEP_RECORDS = ("kernel", "kv_write", "token", "finish")  # records that belong to a step


class _Line:
    __slots__ = ("kind", "fields", "where")

    def __init__(self, kind: str, fields: dict, where: str):
        self.kind, self.fields, self.where = kind, fields, where


class _File:
    """One file's bookkeeping: its records, its end record, the number of its last line."""
    __slots__ = ("path", "records", "end", "last_line")

    def __init__(self, path: Path):
        self.path, self.records, self.end, self.last_line = path, 0, None, 0


def read_records(src) -> list[_Line]:
    """Every record of a directory (or one .jsonl file), in file then line order."""
    return _read(src)[0]


def _read(src) -> tuple[list[_Line], list[_File]]:
    src = Path(src)
    if not src.exists():
        raise RecordError(f"no such directory or file: {src}")
    files = sorted(src.glob("*.jsonl")) if src.is_dir() else [src]
    if not files:
        raise RecordError(f"{src} holds no .jsonl files")
    out, info = [], []
    for f in files:
        file_kind = FILE_KINDS.get(f.stem)
        fi = _File(f)
        info.append(fi)
        for n, where, rec in read_lines(f, RecordError, "record file"):
            fi.last_line = n
            if not isinstance(rec, dict):
                raise RecordError(f"{where}: expected a JSON object, got {type(rec).__name__}")
            if fi.end is not None:
                raise RecordError(f"{where}: a record after the end record ({fi.end.where}): the end "
                                  f"record is the file's last line")
            kind = rec.pop("kind", None)
            if kind == END:
                fi.end = _Line(END, _at(where, lambda: check(END, rec)), where)
                continue
            if kind is None:
                kind = file_kind
                if kind is None:
                    raise RecordError(f"{where}: no 'kind' field (lines of {f.name} need one: "
                                      f"{', '.join(RECORD_KINDS)})")
            elif kind not in RECORD_KINDS:
                raise RecordError(f"{where}: unknown kind {kind!r} (kinds: {', '.join(RECORD_KINDS)}, "
                                  f"and {END} to close a file)")
            elif file_kind is not None and kind != file_kind:
                raise RecordError(f"{where}: a {kind!r} record in {f.name}, which holds {file_kind!r}")
            fi.records += 1
            out.append(_Line(kind, rec, where))
    return out, info


def _check_ends(files: list[_File], contract: int) -> None:
    """Each file's end record counts its records: a file cut short (even at a line boundary) is refused."""
    for fi in files:
        if fi.end is None:
            if contract < 2:
                continue
            what = "is empty" if not fi.records else \
                f"ends after {fi.records} record" + ("" if fi.records == 1 else "s")
            raise RecordError(f"{fi.path}:{fi.last_line + 1}: end: missing: the file {what} without its end "
                              f'record {{"kind": "end", "records": {fi.records}}}: cut short? (a run of '
                              f'recording contract 1 says "contract": 1 in its run record)')
        elif fi.end.fields["records"] != fi.records:
            raise RecordError(f"{fi.end.where}: end.records: {fi.end.fields['records']}, but the file holds "
                              f"{fi.records} records before it: lines lost?")


def import_records(src, out) -> dict:
    """Check every record of `src`, then write the trace `out` (nothing is written when a
    record is bad). Returns counts of what was imported."""
    lines, files = _read(src)
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
    _check_ends(files, fields["contract"])
    del fields["contract"]
    first_kv = next((ln for ln in lines if ln.kind == "kv_write"), None)
    if first_kv is not None and not fields["kv_hash"]:
        raise RecordError(f"{run.where}: run.kv_hash: kv_write records need the hash named (kv_hash, e.g. "
                          f"xxh3_64): {first_kv.where} is one")
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
    # every step first, so that a step out of order is refused at its own line, not at
    # a record of another step that its records were then checked against
    prev = None
    for st in steps:
        idx = st.fields.get("index")
        if prev is not None and isinstance(idx, int) and not isinstance(idx, bool) and idx <= prev.fields["index"]:
            raise RecordError(f"{st.where}: step.index: {idx} does not follow step {prev.fields['index']} "
                              f"({prev.where}): steps must be strictly increasing")
        _at(st.where, lambda: rec.add("step", st.fields, json_hashes=True))
        prev = st
    orphans = [ln for i, group in by_step.items() if i not in rec._step_index for ln in group]
    if orphans:
        order = {id(ln): i for i, ln in enumerate(lines)}
        first = min(orphans, key=lambda ln: order[id(ln)])
        raise RecordError(f"{first.where}: {first.kind}.step: step {first.fields['step']} has no step record")
    for st in steps:
        # a step's records in the order the engine emits them: kernels, KV writes, tokens, finishes
        for ln in sorted(by_step.pop(st.fields["index"], ()), key=lambda x: STEP_RECORDS.index(x.kind)):
            _at(ln.where, lambda: rec.add(ln.kind, ln.fields, json_hashes=True))
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
