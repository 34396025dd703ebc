"""Compare two traces token by token and bit by bit. Pure numpy; never runs a model.

For every request: identical, or the first divergent token (both sides' token,
logit, runner-up and margin, from the stored top-k and the chosen token's own
logit), and the first numeric divergence: the first position whose stored logits
differ in any bit, often hundreds of tokens before the text flips. With
`bitwise`, a request whose tokens match but whose logits differ is diverged too.

The row-wise comparisons (`numeric_rows`, `abs_delta_rows`) are the one
implementation the TUI uses as well.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import math

import numpy as np

from ..core.request import WARMUP_PREFIX
from ..errors import DivergenceInputError, TraceMismatchError
from .environment import environment_differs

IDENTICAL = "identical"
DIVERGED = "diverged"
MISSING = "missing"


@dataclass
class Candidate:
    """One side's view of a divergent position."""

    token: int
    logit: float | None  # None: outside the stored top-k and the trace lacks the token's own logit
    runner_up: int | None
    runner_up_logit: float | None

    @property
    def margin(self) -> float | None:
        if self.logit is None or self.runner_up_logit is None:
            return None
        return self.logit - self.runner_up_logit

    def to_json(self) -> dict:
        return {"token": self.token, "logit": self.logit, "runner_up": self.runner_up,
                "runner_up_logit": self.runner_up_logit, "margin": self.margin}


@dataclass
class TokenDivergence:
    position: int
    generated_index: int
    step_a: int
    step_b: int
    a: Candidate
    b: Candidate

    def to_json(self) -> dict:
        return {"position": self.position, "generated_index": self.generated_index,
                "step_a": self.step_a, "step_b": self.step_b, "a": self.a.to_json(), "b": self.b.to_json()}


@dataclass
class NumericDivergence:
    position: int
    step_a: int
    step_b: int
    tokens_before_flip: int | None  # how far it precedes the token flip (negative: it follows it)
    max_abs_delta_before_flip: float  # largest |Δlogit| of shared top-k ids before the flip

    def to_json(self) -> dict:
        return {"position": self.position, "step_a": self.step_a, "step_b": self.step_b,
                "tokens_before_flip": self.tokens_before_flip,
                "max_abs_delta_before_flip": self.max_abs_delta_before_flip}


@dataclass
class RequestDiff:
    id: str
    status: str
    prompt_len: int
    compared: int  # generated tokens compared (the shorter side)
    len_a: int
    len_b: int
    first_divergent_token: TokenDivergence | None = None
    first_numeric_divergence: NumericDivergence | None = None
    truncated: bool = False  # compared only up to where an incomplete trace ends

    @property
    def logits_only(self) -> bool:
        """Tokens equal (same length), logits not: diverged only under --bitwise."""
        return (self.first_divergent_token is None and self.first_numeric_divergence is not None
                and self.len_a == self.len_b)

    def to_json(self) -> dict:
        return {
            "id": self.id, "status": self.status, "prompt_len": self.prompt_len, "compared": self.compared,
            "len_a": self.len_a, "len_b": self.len_b, "truncated": self.truncated,
            "first_divergent_token": self.first_divergent_token.to_json() if self.first_divergent_token else None,
            "first_numeric_divergence": (self.first_numeric_divergence.to_json()
                                         if self.first_numeric_divergence else None),
        }


@dataclass
class DiffReport:
    path_a: str
    path_b: str
    label_a: str
    label_b: str
    requests: list[RequestDiff]
    incomplete: list[str] = field(default_factory=list)  # paths of traces that did not complete
    bitwise: bool = False  # logit-only differences count as divergences
    tp_degrees: tuple = (1, 1)  # tensor-parallel degree of each trace
    # environment keys whose values differ between the traces (key -> [a, b]): another
    # device, BLAS or thread count changes numerics on its own, whatever the schedules
    environment: dict = field(default_factory=dict)
    subset: list = field(default_factory=list)  # a partial rerun's pair: the ids compared (empty: every request)
    selected: list = field(default_factory=list)  # --requests: the ids chosen (empty: every request)

    @property
    def identical(self) -> bool:
        return all(r.status == IDENTICAL for r in self.requests)

    @property
    def diverged(self) -> list[RequestDiff]:
        return [r for r in self.requests if r.status != IDENTICAL]

    def to_json(self) -> dict:
        return {"identical": self.identical, "a": self.path_a, "b": self.path_b, "bitwise": self.bitwise,
                "tp_degrees": list(self.tp_degrees), "labels": [self.label_a, self.label_b], "incomplete": self.incomplete,
                "environment_differs": {k: list(v) for k, v in self.environment.items()},
                **({"compared_only": self.subset} if self.subset else {}),
                **({"selected": self.selected} if self.selected else {}),
                "requests": [r.to_json() for r in self.requests]}


def check_comparable(a, b) -> None:
    """Raise TraceMismatchError naming what differs, when two traces can't be compared."""
    ma, mb = a.meta, b.meta
    wa, wb = ma["model"].get("weights_hash"), mb["model"].get("weights_hash")
    if wa != wb:
        raise TraceMismatchError(
            f"traces are of different models: {ma['model'].get('path')} ({str(wa)[:12]}) vs "
            f"{mb['model'].get('path')} ({str(wb)[:12]})")
    ha, hb = getattr(a, "kv_hash", None), getattr(b, "kv_hash", None)
    if a.has_kv_hashes and b.has_kv_hashes and ha != hb:  # another engine may name its own hash
        raise TraceMismatchError(f"traces hash their KV writes differently ({ha} vs {hb}): every write would "
                                 f"differ")
    if ma["model"].get("dtype") != mb["model"].get("dtype"):
        raise TraceMismatchError(f"traces ran the model in different dtypes: "
                                 f"{ma['model'].get('dtype')} vs {mb['model'].get('dtype')}")
    ra = {r.id: r for r in compared_requests(a)}
    rb = {r.id: r for r in compared_requests(b)}
    if set(ra) != set(rb):
        only = sorted(set(ra) ^ set(rb))
        raise TraceMismatchError(f"traces hold different requests (only in one: {', '.join(only[:5])})")
    for rid, x in ra.items():
        y = rb[rid]
        if tuple(x.prompt_tokens) != tuple(y.prompt_tokens):
            raise TraceMismatchError(f"request {rid!r} has different prompts in the two traces")
        if x.sampling != y.sampling:
            raise TraceMismatchError(f"request {rid!r} has different sampling settings: {x.sampling} vs {y.sampling}")
        if x.max_tokens != y.max_tokens:
            raise TraceMismatchError(f"request {rid!r} has different max_tokens: {x.max_tokens} vs {y.max_tokens}")


def compared_requests(trace) -> list:
    """The user's requests: the warm schedule's warm-up requests are part of its schedule."""
    return [r for r in trace.requests if not r.id.startswith(WARMUP_PREFIX)]


def rerun_subset(a, b) -> set[str] | None:
    """The requests a partial `divergence rerun` re-ran, where one of the pair is one (its
    settings name them: rerun.requests); None: compare every request."""
    for t in (a, b):
        ids = ((t.meta.get("settings") or {}).get("rerun") or {}).get("requests")
        if ids:
            return set(ids)
    return None


def selected_requests(a, b) -> frozenset | None:
    """The requests `--requests` chose (Trace.select, on either trace); None: every request."""
    sa, sb = getattr(a, "selected", None), getattr(b, "selected", None)
    if sa is not None and sb is not None:
        return sa & sb
    return sa if sa is not None else sb


def _finite(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _candidate(topk_ids: np.ndarray, topk_logits: np.ndarray, token: int, own_logit=None) -> Candidate:
    """One side's token at a position: its logit from the top-k, else the token's own
    recorded logit (newer traces), else None; the runner-up is the best other top-k id."""
    ids, vals = topk_ids.tolist(), topk_logits.tolist()
    if token in ids:
        logit = _finite(vals[ids.index(token)])
    else:
        logit = _finite(own_logit) if own_logit is not None else None
    others = [(int(i), float(v)) for i, v in zip(ids, vals) if i != token and i >= 0 and math.isfinite(v)]
    ru, rl = others[0] if others else (None, None)
    return Candidate(int(token), logit, ru, rl)


def numeric_rows(ids_a, logits_a, ids_b, logits_b) -> np.ndarray:
    """bool [n]: row i's stored top-k logit bits differ, or its ids do. Ids tied with the
    row's k-th logit are exempt: which of several exactly equal logits makes the cut is
    a presentation choice (traces before the engine broke such ties by lower id kept an
    arbitrary one), not a numeric difference."""
    la = np.asarray(logits_a, dtype=np.float32)
    lb = np.asarray(logits_b, dtype=np.float32)
    ids_a, ids_b = np.asarray(ids_a), np.asarray(ids_b)
    if la.shape != lb.shape:  # traces with another top-k: compare the common width
        k = min(la.shape[-1], lb.shape[-1])
        la, lb, ids_a, ids_b = la[..., :k], lb[..., :k], ids_a[..., :k], ids_b[..., :k]
    bits = (la.view(np.uint32) != lb.view(np.uint32)).any(axis=-1)
    if la.size == 0:
        return bits
    with np.errstate(invalid="ignore"):
        cut = np.where(np.isfinite(la), la, np.inf).min(axis=-1, keepdims=True)
        strict = ~(la == cut)  # entries above the cut (and pads), whose ids must agree
    return bits | ((ids_a != ids_b) & strict).any(axis=-1)


def abs_delta_rows(ids_a, logits_a, ids_b, logits_b) -> np.ndarray:
    """float64 [n]: per row, the largest |Δlogit| over token ids in both sides' top-k
    (0.0 where they share none); padding ids (< 0) and non-finite values never count."""
    ids_a, ids_b = np.asarray(ids_a), np.asarray(ids_b)
    if len(ids_a) == 0:
        return np.zeros(0)
    la, lb = np.asarray(logits_a, np.float64), np.asarray(logits_b, np.float64)
    match = (ids_a[:, :, None] == ids_b[:, None, :]) & (ids_a[:, :, None] >= 0)  # [n, K, K]
    delta = np.abs(la[:, :, None] - lb[:, None, :])
    match &= np.isfinite(delta)
    return np.where(match, delta, 0.0).max(axis=(1, 2))


def _own_logit(rec, i: int):
    """The chosen token's own logit where the trace records it (None otherwise)."""
    own = getattr(rec, "logit", None)
    return None if own is None or len(own) <= i else own[i]


def diff_request(rid: str, prompt_len: int, ta, tb, *, truncated: bool = False, bitwise: bool = False) -> RequestDiff:
    """ta / tb: token records of one request (positions, tokens, steps, topk_ids, topk_logits)."""
    na, nb = len(ta.tokens), len(tb.tokens)
    if na == 0 or nb == 0:
        return RequestDiff(rid, MISSING if na != nb or truncated else IDENTICAL, prompt_len, 0, na, nb,
                           truncated=truncated)
    n = min(na, nb)
    tok_a, tok_b = np.asarray(ta.tokens[:n]), np.asarray(tb.tokens[:n])
    flip = np.flatnonzero(tok_a != tok_b)
    ids_a, ids_b = np.asarray(ta.topk_ids[:n]), np.asarray(tb.topk_ids[:n])
    numeric = np.flatnonzero(numeric_rows(ids_a, ta.topk_logits[:n], ids_b, tb.topk_logits[:n]))
    diff = RequestDiff(rid, IDENTICAL, prompt_len, n, na, nb, truncated=truncated)
    if flip.size:
        i = int(flip[0])
        diff.status = DIVERGED
        diff.first_divergent_token = TokenDivergence(
            position=int(ta.positions[i]), generated_index=int(ta.positions[i]) - prompt_len,
            step_a=int(ta.steps[i]), step_b=int(tb.steps[i]),
            a=_candidate(ids_a[i], ta.topk_logits[i], int(tok_a[i]), _own_logit(ta, i)),
            b=_candidate(ids_b[i], tb.topk_logits[i], int(tok_b[i]), _own_logit(tb, i)),
        )
    elif na != nb and not truncated:
        diff.status = DIVERGED  # same prefix, one side stopped (e.g. EOS) earlier
    if numeric.size:
        j = int(numeric[0])
        end = int(flip[0]) + 1 if flip.size else n
        end = max(end, j + 1)  # logits first differ after the flip (a sampler flip): that row's own delta
        diff.first_numeric_divergence = NumericDivergence(
            position=int(ta.positions[j]), step_a=int(ta.steps[j]), step_b=int(tb.steps[j]),
            tokens_before_flip=(int(flip[0]) - j) if flip.size else None,
            max_abs_delta_before_flip=float(abs_delta_rows(ids_a[j:end], ta.topk_logits[j:end],
                                                           ids_b[j:end], tb.topk_logits[j:end]).max()),
        )
        if bitwise:
            diff.status = DIVERGED  # the bitwise standard: equal tokens are not enough
    return diff


def diff_traces(a, b, *, bitwise: bool = False) -> DiffReport:
    """a, b: open `Trace`s (see divergence.trace.reader). bitwise: a request whose tokens
    match but whose logits differ counts as diverged (the standard of vLLM's determinism tests)."""
    check_comparable(a, b)
    incomplete = [t.path for t in (a, b) if not t.completed]
    out = []
    chosen = rerun_subset(a, b)
    selected = selected_requests(a, b)
    if selected is not None and chosen is not None and selected - chosen:
        rid = sorted(selected - chosen)[0]
        raise DivergenceInputError(f"--requests: {rid} was not re-run (the partial rerun re-ran "
                                   f"{', '.join(sorted(chosen)[:5])}{' ...' if len(chosen) > 5 else ''})")
    for req in compared_requests(a):
        if chosen is not None and req.id not in chosen:
            continue  # a partial rerun's pair: the requests it did not re-run are not compared
        if selected is not None and req.id not in selected:
            continue  # --requests: only those
        ta, tb = a.tokens(req.id), b.tokens(req.id)
        d = diff_request(req.id, len(req.prompt_tokens), ta, tb, truncated=bool(incomplete), bitwise=bitwise)
        out.append(d)
    return DiffReport(str(a.path), str(b.path), *pair_labels(a, b), out, [str(p) for p in incomplete],
                      bitwise=bitwise, tp_degrees=(a.tp_degree, b.tp_degree),
                      environment=environment_differs(a, b), subset=sorted(chosen or ()),
                      selected=sorted(selected or ()))


def _label(trace) -> str:
    tp = f" TP={trace.tp_degree}" if trace.tp_degree > 1 else ""
    return str(trace.meta.get("schedule", "?")) + tp


trace_label = _label


def pair_labels(a, b) -> tuple[str, str]:
    """The two traces' names in a report: their schedules, told apart as (A) and (B) where
    they are one schedule (two machines, two BLAS cores)."""
    la, lb = _label(a), _label(b)
    return (f"{la} (A)", f"{lb} (B)") if la == lb else (la, lb)
