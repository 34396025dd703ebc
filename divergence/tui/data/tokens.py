"""One request's generated tokens of A and B aligned by position, and their stored top-k.

Which rows differ numerically, and by how much, is analysis.diff's rule (one
implementation for the reports and the browser)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...analysis.diff import abs_delta_rows, numeric_rows
from ...trace.reader import Trace
from ...trace.views import TokenRecords


@dataclass
class TokenAlignment:
    """One request's generated tokens of A and B, aligned by position (row i = position positions[i])."""

    request_id: str
    prompt_len: int
    positions: np.ndarray  # int [n]
    present: np.ndarray  # bool [2, n]
    tokens: np.ndarray  # int [2, n] (-1 where absent)
    steps: np.ndarray  # int [2, n] (-1 where absent)
    margins: np.ndarray  # float64 [2, n]: top-1 minus top-2 logit (nan where absent / K < 2)
    top1: np.ndarray  # float32 [2, n]: the top-1 logit
    topk_ids: np.ndarray  # int32 [2, n, K] (-1 where absent)
    topk_logits: np.ndarray  # float32 [2, n, K]
    differs: np.ndarray  # bool [n]: tokens differ (or one side lacks the position)
    numeric: np.ndarray  # bool [n]: stored top-k ids or logit bits differ
    first_divergent: int | None  # row
    first_numeric: int | None  # row
    two: bool

    def __len__(self) -> int:
        return len(self.positions)

    def max_delta(self, i: int) -> float:
        """Largest |Δlogit| at row i over token ids in both sides' top-k (0.0 with one trace)."""
        if not self.two or not self.present[:, i].all():
            return 0.0
        return float(abs_delta_rows(self.topk_ids[0, i : i + 1], self.topk_logits[0, i : i + 1],
                                    self.topk_ids[1, i : i + 1], self.topk_logits[1, i : i + 1])[0])

    def row_of_position(self, position: int) -> int | None:
        i = int(np.searchsorted(self.positions, position))
        return i if i < len(self.positions) and self.positions[i] == position else None


@dataclass
class TopKSide:
    label: str
    step: int
    token: int
    ids: list[int]
    logits: list[float]  # float32 values as Python floats (exact)
    texts: list[str]
    deltas: list[float | None]  # this side's logit minus the other side's, for the same id


@dataclass
class TopK:
    request_id: str
    position: int
    generated_index: int
    sides: list[TopKSide | None]  # [A, B]; None where the side has no token at this position


def token_records(trace: Trace, request_id: str) -> TokenRecords:
    """The request's token records in one trace; empty where the trace lacks the request."""
    try:
        return trace.tokens(request_id)
    except KeyError:  # the request is not in this trace: no tokens
        z = np.zeros(0, np.int64)
        return TokenRecords(z, z, z, z, np.zeros((0, 0), np.int32), np.zeros((0, 0), np.float32))


def align_tokens(request_id: str, prompt_len: int, recs: list[TokenRecords]) -> TokenAlignment:
    """The token records of one trace, or of a pair, aligned by position."""
    two = len(recs) == 2
    pa = np.asarray(recs[0].positions, np.int64)
    if not two or np.array_equal(pa, recs[1].positions):
        positions = pa
    else:
        positions = np.unique(np.concatenate([pa, np.asarray(recs[1].positions, np.int64)]))
    n, S = len(positions), 2
    present = np.zeros((S, n), bool)
    tokens = np.full((S, n), -1, np.int64)
    steps = np.full((S, n), -1, np.int64)
    margins = np.full((S, n), np.nan)
    K = max(1, max(r.topk_ids.shape[1] if r.topk_ids.ndim == 2 else 0 for r in recs))
    ids = np.full((S, n, K), -1, np.int32)
    logits = np.full((S, n, K), np.nan, np.float32)
    for s, r in enumerate(recs):
        rows = np.searchsorted(positions, r.positions)
        present[s, rows] = True
        tokens[s, rows] = r.tokens
        steps[s, rows] = r.steps
        if r.topk_ids.ndim == 2 and r.topk_ids.shape[1]:
            k = r.topk_ids.shape[1]
            ids[s, rows, :k] = r.topk_ids
            logits[s, rows, :k] = r.topk_logits
            if k >= 2:
                margins[s, rows] = r.topk_logits[:, 0].astype(np.float64) - r.topk_logits[:, 1]
    if not two:
        z = np.zeros(n, bool)
        return TokenAlignment(request_id, prompt_len, positions, present, tokens, steps,
                              margins, logits[:, :, 0], ids, logits, z, z, None, None, False)
    both = present[0] & present[1]
    differs = (tokens[0] != tokens[1]) | ~both
    numeric = both & numeric_rows(ids[0], logits[0], ids[1], logits[1])
    fd = np.flatnonzero(differs & both)
    if not fd.size:
        fd = np.flatnonzero(differs)
    fn = np.flatnonzero(numeric)
    return TokenAlignment(request_id, prompt_len, positions, present, tokens, steps, margins,
                          logits[:, :, 0], ids, logits, differs, numeric, int(fd[0]) if fd.size else None,
                          int(fn[0]) if fn.size else None, True)


def top_k(traces: list[Trace], al: TokenAlignment, row: int, label: Callable[[int], str],
          text: Callable[[int], str]) -> TopK:
    """Each side's stored top-k at one row of the alignment, with the logit deltas between the sides.
    label(side) names a side; text(token id) shows a token."""
    position = int(al.positions[row])
    raw = []
    for s, t in enumerate(traces):
        if not al.present[s, row]:
            raw.append(None)
            continue
        rec = token_records(t, al.request_id)
        i = int(np.searchsorted(rec.positions, position))
        ids = [int(x) for x in rec.topk_ids[i]]
        vals = [float(x) for x in rec.topk_logits[i]]
        keep = [j for j, x in enumerate(ids) if x >= 0]
        raw.append((int(rec.steps[i]), int(rec.tokens[i]), [ids[j] for j in keep], [vals[j] for j in keep]))
    sides: list[TopKSide | None] = []
    for s, r in enumerate(raw):
        if r is None:
            sides.append(None)
            continue
        step, token, ids, vals = r
        other = raw[1 - s] if al.two else None
        omap = dict(zip(other[2], other[3])) if other else {}
        deltas = [(v - omap[i]) if i in omap else None for i, v in zip(ids, vals)]
        sides.append(TopKSide(label(s), step, token, ids, vals, [text(i) for i in ids], deltas))
    return TopK(al.request_id, position, position - al.prompt_len, sides)
