"""What the browser shows, computed from one or two traces. Never imports textual.

Everything is numpy over the reader's lazy tables: a screen asks for one
request's tokens, one page of steps, one request's KV grid, and nothing is
read before it is needed. `BrowseData.analyse()` (diff + bisect) is the slow
part; the app runs it in a worker thread.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..analysis.bisect import BisectReport, RootCause, bisect_traces
from ..analysis.diff import DIVERGED, DiffReport, RequestDiff, check_comparable
from ..analysis.report import KIND_TEXT, request_lines
from ..trace.reader import TokenRecords, Trace
from ..trace.schema import KERNELS as KERNEL_NAMES

A, B = 0, 1
OP_CLASSES = (("attn", ("q_proj", "k_proj", "v_proj", "o_proj")), ("mlp", ("gate_proj", "up_proj", "down_proj")),
              ("head", ("lm_head",)))
_CONTROL = {"\n": "⏎", "\t": "⇥", "\r": "␍"}


def show_piece(piece: str | None) -> str:
    """A token's text made visible on one line: newlines, tabs and a leading space shown."""
    if piece is None:
        return ""
    out = []
    for ch in piece:
        if ch in _CONTROL:
            out.append(_CONTROL[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    s = "".join(out)
    return "␣" + s[1:] if s.startswith(" ") else s


def fmt_logit(x) -> str:
    """A float32 logit to full precision: the shortest text that reads back to the same bits."""
    x = np.float32(x)
    return "nan" if np.isnan(x) else str(x)


def fmt_delta(x) -> str:
    return "" if x is None or np.isnan(x) else ("0" if x == 0 else f"{x:+.3e}")


def _name(path) -> str | None:
    """A model directory by its last part: ".../fixtures/target" -> "target"."""
    return None if not path else str(path).rstrip("/").rsplit("/", 1)[-1]


def span_text(positions) -> str:
    p = list(positions)
    if not p:
        return "-"
    if p == list(range(p[0], p[-1] + 1)):
        return f"{p[0]}-{p[-1]}" if len(p) > 1 else str(p[0])
    return ", ".join(map(str, p[:6])) + (" ..." if len(p) > 6 else "")


# -- request list --------------------------------------------------------------------------

@dataclass
class RequestRow:
    id: str
    prompt_len: int
    len_a: int | None  # None until the tokens are counted (count_tokens)
    len_b: int | None
    status: str  # identical | diverged | missing | "" (one trace) | "..." (not analysed yet)
    diff: RequestDiff | None = None
    cause: RootCause | None = None

    @property
    def diverged(self) -> bool:
        return self.status == DIVERGED

    def status_text(self) -> str:
        d = self.diff
        if d is None:
            return self.status
        if d.status == DIVERGED:
            t = d.first_divergent_token
            return f"diverged at {t.position} (#{t.generated_index})" if t else "diverged (length)"
        if d.first_numeric_divergence is not None:
            return f"{d.status}, logits differ"
        return d.status

    def numeric_text(self) -> str:
        n = self.diff.first_numeric_divergence if self.diff else None
        return "" if n is None else str(n.position)

    def cause_text(self) -> str:
        c = self.cause
        if c is None:
            return ""
        kind = KIND_TEXT.get(c.kind, c.kind)
        layer = f" L{c.layer}" if c.layer is not None else ""
        return f"{kind}{layer} @ step {c.b.step}"


# -- tokens --------------------------------------------------------------------------------

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
        ia, ib = self.topk_ids[0, i], self.topk_ids[1, i]
        match = (ia[:, None] == ib[None, :]) & (ia[:, None] >= 0)
        if not match.any():
            return 0.0
        la, lb = self.topk_logits[0, i].astype(np.float64), self.topk_logits[1, i].astype(np.float64)
        return float(np.abs(la[:, None] - lb[None, :])[match].max())

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


# -- steps ---------------------------------------------------------------------------------

@dataclass
class StepRow:
    step: int
    model: str
    rows: int
    duration_ms: float
    composition: str
    requests: list[str]
    kernels: dict[str, str] | None  # op class -> labels; None until the kernel index is read


@dataclass
class KernelRow:
    op: str
    layers: str
    rows: int
    kernel: str
    m: int
    n: int
    k: int


@dataclass(frozen=True)
class StepMark:
    """Why a step matters to one request."""

    request_id: str
    kind: str  # ROOT_CAUSE_MARK | DIVERGENT_TOKEN_MARK
    text: str

    @property
    def root(self) -> bool:
        return self.kind == ROOT_CAUSE_MARK


ROOT_CAUSE_MARK, DIVERGENT_TOKEN_MARK = "root cause", "divergent token"


@dataclass
class StepDetail:
    side: int
    step: int
    model: str
    rows: int
    duration_ms: float
    slices: list[dict]
    kernels: list[KernelRow]
    marks: list[StepMark]


# -- KV ------------------------------------------------------------------------------------

@dataclass
class KvGrid:
    """Live KV writes of one request, layer x position, as read at the given steps."""

    request_id: str
    prompt_len: int
    layers: np.ndarray  # layer numbers [L]
    positions: np.ndarray  # position numbers [P] (0..max)
    at_steps: tuple  # (A step, B step): None = the end of the run
    step: np.ndarray  # int64 [2, L, P]: step that wrote the live value (-1: none)
    k_hash: np.ndarray  # uint64 [2, L, P]
    v_hash: np.ndarray  # uint64 [2, L, P]
    differs: np.ndarray  # bool [L, P]: written on both sides, hashes differ
    one_sided: np.ndarray  # bool [L, P]: written on one side only
    earliest: tuple[int, int] | None  # (layer row, position) of the earliest differing cell
    two: bool

    @property
    def num_differ(self) -> int:
        return int(self.differs.sum())


class _Lru(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, key, make):
        if key in self:
            self.move_to_end(key)
            return self[key]
        v = self[key] = make()
        if len(self) > self.size:
            self.popitem(last=False)
        return v


def _compact(labels) -> str:
    """"gemm/2", "gemm/4", "gemv" -> "gemm/2,4 gemv": every kernel once, split-K counts merged."""
    kinds: dict[str, list[str]] = {}
    for lab in labels:
        kind, _, splits = lab.partition("/")
        kinds.setdefault(kind, [])
        if splits:
            kinds[kind].append(splits)
    return " ".join(k + ("/" + ",".join(v) if v else "") for k, v in kinds.items())


class StepIndex:
    """One trace's steps, for a timeline of any length: columns read once, rows built on demand."""

    def __init__(self, trace: Trace):
        self.trace = trace
        st = trace.steps
        self.index = np.asarray(st["index"])
        self.model = np.asarray(st["model"])
        self.rows = np.asarray(st["rows"])
        self.duration = np.asarray(st["duration"])
        self._plans = _Lru(4096)
        self._kernels: dict | None = None
        self._bounds: tuple | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    def row_of_step(self, step: int) -> int | None:
        i = np.flatnonzero(self.index == step)
        return int(i[0]) if i.size else None

    def steps_of(self, request_id: str) -> np.ndarray:
        """Sorted step indexes whose batch held the request (from its KV writes and tokens)."""
        t = self.trace
        w = t.kv_writes()
        mine = np.asarray(w["step"])[np.asarray(w["request"]) == t.request_index(request_id)]
        return np.union1d(mine, t.tokens(request_id).steps)

    def plan(self, step: int):
        return self._plans.get_or(step, lambda: self.trace.step_plan(step))

    @property
    def kernels_ready(self) -> bool:
        return self._kernels is not None

    def load_kernels(self) -> None:
        """Read the kernel table (large: one record per op, layer and step). Thread-safe; call once."""
        with self._lock:
            if self._kernels is not None:
                return
            k = self.trace.kernels()
            order = None if np.all(np.diff(k["step"]) >= 0) else np.argsort(k["step"], kind="stable")
            if order is not None:
                k = {n: v[order] for n, v in k.items()}
            # a label per record ("gemm/4", "gemv"), built over unique (kernel, splits) pairs: 1e6 records are common
            kernel = k["kernel"]
            kinds = list(KERNEL_NAMES)
            kinv = np.full(len(kernel), -1, np.int64)
            for j, name in enumerate(kinds):
                kinv[kernel == name] = j
            rest = kinv < 0
            if rest.any():  # kernels this version does not know by name
                extra, extra_inv = np.unique(kernel[rest], return_inverse=True)
                kinv[rest] = len(kinds) + extra_inv
                kinds += [str(x) for x in extra]
            code, inv = np.unique(kinv * 65536 + k["splits"], return_inverse=True)
            names = np.array([f"{kinds[c // 65536]}/{c % 65536}" if kinds[c // 65536] == "gemm" else kinds[c // 65536]
                              for c in code.tolist()])
            k["label"] = names[inv]
            self._bounds = (np.searchsorted(k["step"], self.index, "left"),
                            np.searchsorted(k["step"], self.index, "right"))
            self._kernels = k

    def _kernel_slice(self, row: int) -> dict | None:
        if self._kernels is None:
            return None
        lo, hi = int(self._bounds[0][row]), int(self._bounds[1][row])
        return {n: v[lo:hi] for n, v in self._kernels.items()}

    def kernel_summary(self, row: int) -> dict[str, str] | None:
        k = self._kernel_slice(row)
        if k is None:
            return None
        out = {}
        for name, ops in OP_CLASSES:
            labels = k["label"][np.isin(k["op"], ops)]
            out[name] = _compact(dict.fromkeys(labels.tolist())) if labels.size else ""
        return out

    def kernel_rows(self, row: int) -> list[KernelRow] | None:
        k = self._kernel_slice(row)
        if k is None:
            return None
        out: list[KernelRow] = []
        groups: dict[tuple, list[int]] = {}
        for i in range(len(k["op"])):
            key = (str(k["op"][i]), int(k["rows"][i]), str(k["label"][i]), int(k["m"][i]), int(k["n"][i]),
                   int(k["k"][i]))
            groups.setdefault(key, []).append(int(k["layer"][i]))
        for (op, rows, label, m, n, kk), layers in groups.items():
            out.append(KernelRow(op, span_text(sorted(set(layers))), rows, label, m, n, kk))
        return out

    def row(self, row: int) -> StepRow:
        step = int(self.index[row])
        plan = self.plan(step)
        comp = " + ".join(f"{s.request_id} {s.phase}[{s.start}:{s.start + s.count}]" for s in plan.slices)
        return StepRow(step, plan.model, int(self.rows[row]), float(self.duration[row]) * 1e3, comp,
                       list(dict.fromkeys(plan.request_ids)), self.kernel_summary(row))


# -- the whole browse session -----------------------------------------------------------------

class BrowseData:
    """One trace, or a pair (A, B) of the same run's requests under two schedules."""

    def __init__(self, a: Trace, b: Trace | None = None):
        self.traces = [a] if b is None else [a, b]
        self.diff: DiffReport | None = None
        self.bisect: BisectReport | None = None
        self.analysis_error: str | None = None
        self._steps: dict[int, StepIndex] = {}
        self._tokens: dict[str, TokenAlignment] = {}
        self._counts: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path_a, path_b=None) -> "BrowseData":
        """Open and check the traces; DivergenceInputError (TraceError, TraceMismatchError) if they're bad."""
        a = Trace.open(path_a)
        b = None
        try:
            if path_b is not None:
                b = Trace.open(path_b)
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
                self.bisect = bisect_traces(a, b)
                self.diff = self.bisect.diff
            except Exception as e:  # a damaged trace: show what we can, say why
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
        lines = request_lines(d, self.diff.label_a, self.diff.label_b, self.vocab, self.cause(request_id))
        n = d.first_numeric_divergence
        if d.status != DIVERGED and n is not None:
            lines.append(f"    same tokens, but the stored logits first differ at position {n.position} "
                         f"({self.diff.label_a} step {n.step_a}, {self.diff.label_b} step {n.step_b})")
        return lines

    # -- metadata --
    def meta_rows(self) -> list[tuple[str, list[str]]]:
        """(name, [value of A, value of B]) for the run metadata shown side by side."""
        rows = []

        def add(name, get):
            vals = []
            for t in self.traces:
                try:
                    v = get(t.meta)
                except (KeyError, TypeError, AttributeError):
                    v = None
                vals.append("-" if v is None or v == "" else str(v))
            rows.append((name, vals))

        env = lambda m: m["environment"]  # noqa: E731
        add("schedule", lambda m: m["schedule"])
        add("policy", lambda m: m["policy"])
        add("model", lambda m: f"{_name(m['model'].get('path'))} · {str(m['model'].get('weights_hash'))[:8]} · "
                               f"{m['model'].get('dtype')}")
        add("draft", lambda m: _name((m["draft"] or {}).get("path")))
        add("settings", lambda m: f"spec k {m['settings'].get('spec_k')}, budget "
                                  f"{m['settings'].get('token_budget')}, top-k {m.get('top_k')}")
        add("versions", lambda m: f"mlx {env(m).get('mlx', '?')} · mlx-lm {env(m).get('mlx_lm', '?')}")
        add("device", lambda m: env(m).get("device"))
        add("BLAS", lambda m: env(m).get("blas"))
        add("created", lambda m: str(m.get("created", ""))[:19].replace("T", " "))
        add("completed", lambda m: "yes" if m.get("completed") else "NO (killed or still running)")
        return rows

    def totals(self) -> list[tuple[str, list[str]]]:
        rows = []
        counts = [self._counts.get(id(t)) for t in self.traces]
        rows.append(("requests", [str(len(t.requests)) for t in self.traces]))
        rows.append(("tokens", ["…" if c is None else str(int(c.sum())) for c in counts]))
        rows.append(("steps", [str(t.num_steps) for t in self.traces]))
        rows.append(("max rows", [str(int(t.steps["rows"].max())) if t.num_steps else "0" for t in self.traces]))
        rows.append(("time", [f"{float(t.steps['duration'].sum()):.2f} s" for t in self.traces]))
        return rows

    # -- tokens --
    def tokens(self, request_id: str) -> TokenAlignment:
        if request_id not in self._tokens:
            self._tokens[request_id] = self._align(request_id)
        return self._tokens[request_id]

    def _align(self, request_id: str) -> TokenAlignment:
        recs = [self._records(t, request_id) for t in self.traces]
        pa = np.asarray(recs[0].positions, np.int64)
        if not self.two or np.array_equal(pa, recs[1].positions):
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
        if not self.two:
            z = np.zeros(n, bool)
            return TokenAlignment(request_id, len(self.prompt(request_id)), positions, present, tokens, steps,
                                  margins, logits[:, :, 0], ids, logits, z, z, None, None, False)
        both = present[0] & present[1]
        differs = (tokens[0] != tokens[1]) | ~both
        bits = logits.view(np.uint32)
        numeric = both & ((bits[0] != bits[1]).any(axis=1) | (ids[0] != ids[1]).any(axis=1))
        fd = np.flatnonzero(differs & both)
        if not fd.size:
            fd = np.flatnonzero(differs)
        fn = np.flatnonzero(numeric)
        return TokenAlignment(request_id, len(self.prompt(request_id)), positions, present, tokens, steps, margins,
                              logits[:, :, 0], ids, logits, differs, numeric, int(fd[0]) if fd.size else None,
                              int(fn[0]) if fn.size else None, True)

    @staticmethod
    def _records(trace: Trace, request_id: str):
        try:
            return trace.tokens(request_id)
        except KeyError:  # the request is not in this trace: no tokens
            z = np.zeros(0, np.int64)
            return TokenRecords(z, z, z, z, np.zeros((0, 0), np.int32), np.zeros((0, 0), np.float32))

    def topk(self, request_id: str, row: int) -> TopK:
        al = self.tokens(request_id)
        position = int(al.positions[row])
        raw = []
        for s, t in enumerate(self.traces):
            if not al.present[s, row]:
                raw.append(None)
                continue
            rec = self._records(t, request_id)
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
            other = raw[1 - s] if self.two else None
            omap = dict(zip(other[2], other[3])) if other else {}
            deltas = [(v - omap[i]) if i in omap else None for i, v in zip(ids, vals)]
            sides.append(TopKSide(self.label(s), step, token, ids, vals, [self.text(i) for i in ids], deltas))
        return TopK(request_id, position, position - al.prompt_len, sides)

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

    def kv_grid(self, request_id: str, at_steps: tuple = (None, None)) -> KvGrid:
        lives = []
        for s, t in enumerate(self.traces):
            try:
                lives.append(t.live_kv(request_id, model="target", at_step=at_steps[s]))
            except KeyError:  # the request is not in this trace
                lives.append({k: np.zeros(0, np.int64) for k in ("layer", "position", "step", "k_hash", "v_hash")})
        layers = np.unique(np.concatenate([np.asarray(lv["layer"], np.int64) for lv in lives]))
        top = max((int(np.max(lv["position"])) for lv in lives if len(lv["position"])), default=-1)
        positions = np.arange(top + 1)
        L, P, S = len(layers), len(positions), 2
        step = np.full((S, L, P), -1, np.int64)
        kh = np.zeros((S, L, P), np.uint64)
        vh = np.zeros((S, L, P), np.uint64)
        for s, lv in enumerate(lives):
            li = np.searchsorted(layers, np.asarray(lv["layer"], np.int64))
            p = np.asarray(lv["position"], np.int64)
            step[s, li, p] = lv["step"]
            kh[s, li, p] = lv["k_hash"]
            vh[s, li, p] = lv["v_hash"]
        if self.two:
            w0, w1 = step[0] >= 0, step[1] >= 0
            differs = w0 & w1 & ((kh[0] != kh[1]) | (vh[0] != vh[1]))
            one_sided = w0 ^ w1
        else:
            differs = one_sided = np.zeros((L, P), bool)
        earliest = None
        if differs.any():
            pos_any = np.flatnonzero(differs.any(axis=0))[0]
            earliest = (int(np.flatnonzero(differs[:, pos_any])[0]), int(pos_any))
        return KvGrid(request_id, len(self.prompt(request_id)), layers, positions, tuple(at_steps[:2]), step, kh, vh,
                      differs, one_sided, earliest, self.two)
