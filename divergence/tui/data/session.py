"""A browse session: one trace or a pair, their analysis, and each screen's view of them, cached."""
from __future__ import annotations

import threading
from functools import cached_property

import numpy as np

from ...analysis.cause import BisectReport, RootCause
from ...analysis.pipeline import AnalysisOptions, analyze_pair
from ...analysis.diff import DIVERGED, DiffReport, RequestDiff, check_comparable
from ...analysis.report import KIND_TEXT, request_lines
from ...errors import TraceError
from ...trace.reader import Trace
from .kv import KvGrid, kv_grid
from .routing import PositionRouting, position_routing, request_routing
from .overview import RequestRow, meta_rows, totals
from .steps import DIVERGENT_TOKEN_MARK, ROOT_CAUSE_MARK, StepDetail, StepIndex, StepMark
from .text import show_piece
from .tokens import TokenAlignment, TopK, align_tokens, token_records, top_k

A, B = 0, 1


class BrowseData:
    """One trace, or a pair (A, B) of the same run's requests under two schedules."""

    def __init__(self, a: Trace, b: Trace | None = None):
        self.traces = [a] if b is None else [a, b]
        self.diff: DiffReport | None = None
        self.bisect: BisectReport | None = None
        self.analysis_error: str | None = None
        self._steps: dict[int, StepIndex] = {}
        self._tokens: dict[str, TokenAlignment] = {}
        self._routing: dict[str, list | None] = {}
        self._counts: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path_a, path_b=None) -> "BrowseData":
        """Open and check the traces; DivergenceInputError (TraceError, TraceMismatchError) if they're bad."""
        a = Trace.open(path_a)
        b = None
        try:
            a.check()  # a damaged trace: one TraceError here, not a crash in a screen's worker
            if path_b is not None:
                b = Trace.open(path_b)
                b.check()
                check_comparable(a, b)
        except BaseException:
            a.close()
            if b is not None:
                b.close()
            raise
        return cls(a, b)

    def close(self) -> None:
        for t in self.traces:
            t.close()

    # -- basics --
    @property
    def two(self) -> bool:
        return len(self.traces) == 2

    @property
    def sides(self) -> range:
        return range(len(self.traces))

    def trace(self, side: int) -> Trace:
        return self.traces[side]

    def label(self, side: int) -> str:
        return f"{'AB'[side]} {self.traces[side].meta.get('schedule', '?')}"

    @cached_property
    def vocab(self) -> list[str] | None:
        for t in self.traces:
            if t.vocab is not None:
                return t.vocab
        return None

    def piece(self, token: int | None) -> str | None:
        v = self.vocab
        if token is None or v is None or not 0 <= token < len(v):
            return None
        return v[token]

    def text(self, token: int | None) -> str:
        return show_piece(self.piece(token))

    @cached_property
    def request_ids(self) -> list[str]:
        return [r.id for r in self.traces[0].requests]

    def prompt(self, request_id: str) -> tuple:
        return self.traces[0].requests[self.traces[0].request_index(request_id)].prompt_tokens

    def prompt_text(self, request_id: str) -> str:
        if self.vocab is None:
            return " ".join(map(str, self.prompt(request_id)))
        return "".join(self.piece(t) or "" for t in self.prompt(request_id))

    # -- analysis (slow: run it in a worker) --
    def analyse(self) -> None:
        """Count the tokens, then diff and bisect the pair; results land in .diff / .bisect
        (or .analysis_error)."""
        self.count_tokens()
        if not self.two:
            return
        with self._lock:
            if self.diff is not None or self.analysis_error is not None:
                return
            a, b = self.traces
            try:
                # the leads every front end gets (analysis.pipeline), without replays: browse runs no model
                self.bisect = analyze_pair(a, b, AnalysisOptions(replay=False))
                self.diff = self.bisect.diff
            except TraceError as e:  # a damaged trace: its one line
                self.analysis_error = str(e)
            except Exception as e:  # show what we can, say why
                self.analysis_error = f"{type(e).__name__}: {e}"

    @property
    def analysed(self) -> bool:
        return not self.two or self.diff is not None or self.analysis_error is not None

    def request_diff(self, request_id: str) -> RequestDiff | None:
        if self.diff is None:
            return None
        return next((r for r in self.diff.requests if r.id == request_id), None)

    def cause(self, request_id: str) -> RootCause | None:
        return self.bisect.causes.get(request_id) if self.bisect else None

    def request_rows(self) -> list[RequestRow]:
        """One row per request, from what has been read so far: nothing but the request list
        until `count_tokens`, no status until `analyse`."""
        counts = [self._counts.get(id(t)) for t in self.traces]
        rows = []
        for i, req in enumerate(self.traces[0].requests):
            d = self.request_diff(req.id)
            status = d.status if d else ("..." if self.two and not self.analysed else
                                         "only in A" if self.two and self.diff is not None else "")
            n = [None if c is None or i >= len(c) else int(c[i]) for c in counts]
            rows.append(RequestRow(req.id, len(req.prompt_tokens), n[0], n[1] if self.two else None, status, d,
                                   self.cause(req.id)))
        return rows

    @property
    def counted(self) -> bool:
        return all(id(t) in self._counts for t in self.traces)

    def count_tokens(self) -> None:
        """Generated tokens per request (reads every token record: run it in a worker)."""
        for t in self.traces:
            if id(t) not in self._counts:
                self._counts[id(t)] = np.array([len(t.tokens(r.id).tokens) for r in t.requests], np.int64)

    def report_lines(self, request_id: str) -> list[str]:
        """The bisect report's text for one request (the CLI's words)."""
        d = self.request_diff(request_id)
        if d is None:
            return []
        lines = request_lines(d, self.diff.label_a, self.diff.label_b, self.vocab,
                              self.bisect.finding(request_id) if self.bisect else None)
        n = d.first_numeric_divergence
        if d.status != DIVERGED and n is not None:
            lines.append(f"    same tokens, but the stored logits first differ at position {n.position} "
                         f"({self.diff.label_a} step {n.step_a}, {self.diff.label_b} step {n.step_b})")
        return lines

    # -- metadata --
    def meta_rows(self) -> list[tuple[str, list[str]]]:
        """(name, [value of A, value of B]) for the run metadata shown side by side."""
        return meta_rows(self.traces)

    def totals(self) -> list[tuple[str, list[str]]]:
        return totals(self.traces, [self._counts.get(id(t)) for t in self.traces])

    # -- tokens --
    def tokens(self, request_id: str) -> TokenAlignment:
        if request_id not in self._tokens:
            recs = [token_records(t, request_id) for t in self.traces]
            self._tokens[request_id] = align_tokens(request_id, len(self.prompt(request_id)), recs)
        return self._tokens[request_id]

    def topk(self, request_id: str, row: int) -> TopK:
        return top_k(self.traces, self.tokens(request_id), row, self.label, self.text)

    def routing(self, request_id: str, position: int) -> PositionRouting | None:
        """MoE routing of one position per layer, both sides (None for dense models)."""
        if request_id not in self._routing:
            self._routing[request_id] = request_routing(self.traces, request_id)
        rows = self._routing[request_id]
        return None if rows is None else position_routing(rows, request_id, position)

    def decoded(self, request_id: str, side: int, lo: int, hi: int) -> str:
        al = self.tokens(request_id)
        toks = al.tokens[side, lo:hi][al.present[side, lo:hi]]
        if self.vocab is None:
            return " ".join(map(str, toks.tolist()))
        return "".join(self.piece(int(t)) or "" for t in toks)

    # -- steps --
    def steps(self, side: int) -> StepIndex:
        if side not in self._steps:
            self._steps[side] = StepIndex(self.traces[side])
        return self._steps[side]

    def step_marks(self, side: int) -> dict[int, list[StepMark]]:
        """step -> why it matters: the root-cause step (on each side) and the divergent token's step."""
        marks: dict[int, list[StepMark]] = {}
        if self.bisect is None:
            return marks
        for rid, c in self.bisect.causes.items():
            view = c.b if side == B else c.a
            marks.setdefault(view.step, []).append(
                StepMark(rid, ROOT_CAUSE_MARK, f"root cause of {rid} ({KIND_TEXT.get(c.kind, c.kind)})"))
        for d in self.diff.requests:
            t = d.first_divergent_token
            if t is not None:
                marks.setdefault(t.step_b if side == B else t.step_a, []).append(
                    StepMark(d.id, DIVERGENT_TOKEN_MARK, f"produced {d.id}'s first divergent token (position {t.position})"))
        return marks

    def step_detail(self, side: int, row: int) -> StepDetail:
        idx = self.steps(side)
        r = idx.row(row)
        plan = idx.plan(r.step)
        slices = [{"request_id": s.request_id, "phase": s.phase, "start": s.start, "count": s.count,
                   "row_offset": s.row_offset} for s in plan.slices]
        return StepDetail(side, r.step, r.model, r.rows, r.duration_ms, slices, idx.kernel_rows(row) or [],
                          self.step_marks(side).get(r.step, []))

    # -- KV --
    def kv_default_steps(self, request_id: str) -> tuple:
        """The steps whose reads bisect compares: those that computed the first divergent token
        (or, with no flip, the first differing logits); (None, None) = the end of the run."""
        d = self.request_diff(request_id)
        if d is None:
            return (None, None)
        t, n = d.first_divergent_token, d.first_numeric_divergence
        if t is not None:
            return (t.step_a, t.step_b)
        return (n.step_a, n.step_b) if n is not None else (None, None)

    def kv_read_position(self, request_id: str) -> int | None:
        """The position computed by the steps of kv_default_steps (the cache it read: positions < it)."""
        d = self.request_diff(request_id)
        if d is None:
            return None
        t = d.first_divergent_token or d.first_numeric_divergence
        return None if t is None else int(t.position)

    def kv_grid(self, request_id: str, at_steps: tuple = (None, None)) -> KvGrid:
        read_before = None
        if self.two and at_steps != (None, None) and at_steps == self.kv_default_steps(request_id):
            read_before = self.kv_read_position(request_id)
        return kv_grid(self.traces, request_id, len(self.prompt(request_id)), at_steps, read_before)
