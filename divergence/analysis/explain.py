"""`divergence explain`: which live trace holds the requests a user names, and the analysis of
their serial re-run against it. Engine-free (the re-run itself is serve/rerun.py's).

The id is the one a `divergence serve` response carried (`id`, X-Divergence-Request-Id):
the request's id in the trace. A server rotates its trace (`--rotate-mb`, `--rotate-minutes`),
so the file named may not be the one that holds the request: explain looks in it first,
then in the other live traces of its directory (its rotation siblings), and a directory
names them all. A request in two files of one directory (two servers' counters both start
at 1) is ambiguous: the response's X-Divergence-Trace header names the right file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import DivergenceInputError, TraceError
from ..trace.reader import Trace
from .cause import BisectReport
from .pipeline import AnalysisOptions, analyze_pair

LIVE_KEY = "serve"  # a live trace's settings name the server that wrote it (serve/live.py, serve/mlxlm.py)


@dataclass
class Found:
    """The live trace that holds the requests, and how it was found."""

    path: Path
    ids: list[str]
    searched: int  # live traces looked in
    sibling: bool  # not the file named: a rotation sibling (or the file named was a directory)


def is_live(trace) -> bool:
    return LIVE_KEY in (trace.meta.get("settings") or {})


def _request_ids(path: Path) -> set[str] | None:
    """The ids of a live trace's requests; None when `path` is not a live trace."""
    try:
        with Trace.open(path) as t:
            return {r.id for r in t.requests} if is_live(t) else None
    except TraceError:
        return None


def _siblings(directory: Path, named: Path | None) -> list[Path]:
    """The directory's other traces, newest name first (a server names its segments by time)."""
    return sorted((p for p in directory.glob("*.h5") if p.is_file() and p != named), reverse=True)


def locate(path, request_ids) -> Found:
    """The one live trace that holds every id: the file named, else its siblings. Bad input
    (not a live trace, an id nowhere, ids in several files) is one DivergenceInputError."""
    p = Path(path)
    ids = list(dict.fromkeys(str(i) for i in request_ids))
    if not ids:
        raise DivergenceInputError("name at least one request id (the `id` a divergence serve response carried)")
    if not p.exists():
        raise TraceError(f"no such trace: {p}")
    if p.is_dir():
        named, candidates = None, _siblings(p, None)
        if not candidates:
            raise TraceError(f"{p} holds no trace (*.h5)")
    else:
        with Trace.open(p) as t:  # not a trace at all: Trace.open's one line
            if not is_live(t):
                raise DivergenceInputError(
                    f"{p} is not a live trace (divergence serve writes those; this one is a "
                    f"{t.meta.get('schedule', '?')} run): explain a run's request with divergence bisect A.h5 B.h5 "
                    f"--confirm --requests ID")
            held = {r.id for r in t.requests}
        if all(i in held for i in ids):
            return Found(p, ids, 1, False)
        named, candidates = p, _siblings(p.parent, p)
    where: dict[str, list[Path]] = {}
    searched = 0
    for c in ([named] if named is not None else []) + candidates:
        got = _request_ids(c)
        if got is None:
            continue
        searched += 1
        for i in ids:
            if i in got:
                where.setdefault(i, []).append(c)
    missing = [i for i in ids if i not in where]
    if missing:
        if named is None:
            what = f"the {searched} live traces of {p}"
        else:
            what = f"{named} nor its {searched - 1} rotation siblings" if searched > 1 else \
                f"{named} (no other live trace beside it)"
        raise DivergenceInputError(f"no request {missing[0]!r} in {what} (the id is the `id` a divergence serve "
                                   f"response carried)")
    twice = [i for i in ids if len(where[i]) > 1]
    if twice:
        files = ", ".join(str(x) for x in where[twice[0]][:3])
        raise DivergenceInputError(f"request {twice[0]!r} is in {len(where[twice[0]])} traces ({files}): name the "
                                   f"file its response's X-Divergence-Trace header named")
    files = {where[i][0] for i in ids}
    if len(files) > 1:
        by = ", ".join(f"{i} in {where[i][0].name}" for i in ids)
        raise DivergenceInputError(f"the requests are in different trace files ({by}): explain one file's requests "
                                   f"at a time")
    return Found(files.pop(), ids, searched, True)


def check_explainable(live, ids) -> None:
    """Every id generated a token live (a request cancelled before its first has nothing to explain)."""
    live.select(ids)  # (their rows only)
    for rid in ids:
        if not len(live.tokens(rid).tokens):
            raise DivergenceInputError(f"request {rid!r} got no token in {live.path} (cancelled before its first, "
                                       f"or not started yet): nothing to explain")


def analyze(a, b, ids, opts: AnalysisOptions) -> BisectReport:
    """The bisect --confirm report of (re-run a, live b), restricted to `ids`."""
    a.select(ids)
    b.select(ids)
    return analyze_pair(a, b, opts)
