"""Where a sampled token's uniform draw fell, in each trace: the sampler's side of a divergence.

At a divergent position each trace recorded the draws that decided it (the draft's
proposal, the accept test, the residual draw after a rejection, or the plain
sample), each with the range of u that gives its outcome. The first draw whose
outcome differs is the story: "u = 0.41237 fell in token X's interval [0.4110,
0.4126) in A and in Y's in B; X's probability moved by -2.1e-4". Pure numpy.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core.names import DRAW_PURPOSES

SAMPLE, ACCEPT, RESIDUAL, DRAFT = DRAW_PURPOSES
ORDER = (DRAFT, ACCEPT, RESIDUAL, SAMPLE)  # the order a position's draws happen in


@dataclass
class DrawView:
    """One recorded draw (a row of a trace's draws table)."""

    step: int
    purpose: str
    u: float
    token: int
    lo: float
    hi: float
    prev_token: int
    prev_lo: float
    next_token: int
    next_hi: float
    p: float
    q: float

    @property
    def threshold(self) -> float:
        """An accept test's a = min(1, p/q): u < a accepts."""
        return min(1.0, self.p / max(self.q, 1e-30))

    @property
    def accepted(self) -> bool:
        return self.purpose == ACCEPT and self.u < self.threshold

    @property
    def outcome(self) -> tuple:
        return (self.token, self.accepted) if self.purpose == ACCEPT else (self.token,)

    def interval_of(self, token: int) -> tuple[float, float] | None:
        """The CDF slice of `token` in this draw's distribution, where this record knows it."""
        if token == self.token:
            return self.lo, self.hi
        if token == self.prev_token and _finite(self.prev_lo):
            return self.prev_lo, self.lo
        if token == self.next_token and _finite(self.next_hi):
            return self.hi, self.next_hi
        return None

    def to_json(self) -> dict:
        return {"step": self.step, "purpose": self.purpose, "u": self.u, "token": self.token,
                "interval": [self.lo, self.hi], "p": _num(self.p), "q": _num(self.q)}


@dataclass
class SamplerStory:
    """The first draw at a position whose outcome differs between the two traces."""

    position: int
    purpose: str
    a: DrawView
    b: DrawView
    prob_moved: float | None  # accept: q's change; else the A token's probability change (B - A)
    text: str
    uniform_differs: bool = False  # the two traces drew different u (another RNG or seed)

    @property
    def depends_on_draft(self) -> bool:
        """The draw's distribution involves the draft model's q (accept / residual / draft draws)."""
        return self.purpose != SAMPLE

    def to_json(self) -> dict:
        return {"position": self.position, "purpose": self.purpose, "a": self.a.to_json(), "b": self.b.to_json(),
                "prob_moved": self.prob_moved, "uniform_differs": self.uniform_differs, "text": self.text}


def _finite(x) -> bool:
    return x is not None and math.isfinite(float(x))


def _num(x):
    return float(x) if _finite(x) else None


def has_draws(trace) -> bool:
    return _table(trace) is not None


def _table(trace):
    """The trace's draws table as numpy columns, or None (traces before draws were recorded)."""
    cached = getattr(trace, "_sampler_draws", False)
    if cached is not False:
        return cached
    out = None
    reader = getattr(trace, "table", None)
    try:
        if reader is not None and getattr(trace, "has_table", lambda n: True)("draws"):
            t = reader("draws")
            out = t if len(t.get("step", ())) else None
    except KeyError:
        out = None
    try:
        trace._sampler_draws = out
    except AttributeError:
        pass
    return out


def draws_at(trace, request_id: str, position: int, until_step: int) -> dict[str, DrawView]:
    """purpose -> the latest draw of (request, position) at or before `until_step` (a
    position's draft proposal may be redrawn in later rounds; the last one counts)."""
    t = _table(trace)
    if t is None:
        return {}
    rid = trace.request_index(request_id)
    sel = np.flatnonzero((np.asarray(t["request"]) == rid) & (np.asarray(t["position"]) == position)
                         & (np.asarray(t["step"]) <= until_step))
    out: dict[str, DrawView] = {}
    purposes = t["purpose"]
    for i in sel[np.argsort(np.asarray(t["step"])[sel], kind="stable")]:
        purpose = purposes[i] if isinstance(purposes[i], str) else DRAW_PURPOSES[int(purposes[i])]
        out[purpose] = DrawView(int(t["step"][i]), purpose, float(t["value"][i]), int(t["token"][i]),
                                float(t["lo"][i]), float(t["hi"][i]), int(t["prev_token"][i]),
                                float(t["prev_lo"][i]), int(t["next_token"][i]), float(t["next_hi"][i]),
                                float(t["p"][i]), float(t["q"][i]))
    return out


def sampler_story(a, b, request_id: str, position: int, step_a: int, step_b: int,
                  label_a: str = "A", label_b: str = "B", piece=None) -> SamplerStory | None:
    """The first draw deciding `position` whose outcome differs, or None when either trace
    recorded no draws there (greedy requests, traces before draws were recorded)."""
    da, db = draws_at(a, request_id, position, step_a), draws_at(b, request_id, position, step_b)
    if not da or not db:
        return None
    name = piece or (lambda t: f"token {t}")
    for purpose in ORDER:
        x, y = da.get(purpose), db.get(purpose)
        if x is None and y is None:
            continue
        if x is None or y is None:  # one side drew it, the other never got there
            got, missing, lab = (x, label_b, label_a) if y is None else (y, label_a, label_b)
            text = (f"{lab} drew u = {got.u:.5f} for the {purpose} of position {position}, which "
                    f"{missing} never drew: an earlier decision differed")
            return SamplerStory(position, purpose, x or y, y or x, None, text)
        if x.outcome == y.outcome:
            continue
        return _story(position, purpose, x, y, label_a, label_b, name)
    return None


def _story(position, purpose, x: DrawView, y: DrawView, la: str, lb: str, name) -> SamplerStory:
    differs = x.u != y.u
    u = f"u = {x.u:.5f}" if not differs else f"u = {x.u:.5f} in {la} but {y.u:.5f} in {lb}"
    if purpose == ACCEPT:
        a_ok, b_ok = x.accepted, y.accepted
        ta, tb = x.threshold, y.threshold
        moved = (y.q - x.q) if _finite(x.q) and _finite(y.q) else None
        text = (f"{u} (the accept test of the draft's {name(x.token)} at position {position}) fell "
                f"{'below' if a_ok else 'above'} min(1, p/q) = {ta:.4f} in {la} ({'accepted' if a_ok else 'rejected'}) "
                f"and {'below' if b_ok else 'above'} {tb:.4f} in {lb} ({'accepted' if b_ok else 'rejected'})")
        if moved is not None:
            text += f"; the draft's q moved by {moved:+.2g} ({x.q:.4f} -> {y.q:.4f})"
            if _finite(x.p) and _finite(y.p):
                text += (f", the target's p {'equal' if x.p == y.p else f'moved by {y.p - x.p:+.2g}'}"
                         f" ({x.p:.4f})")
        return SamplerStory(position, purpose, x, y, moved, text, differs)
    what = {RESIDUAL: "the residual draw after a rejection", DRAFT: "the draft's proposal",
            SAMPLE: "the sample"}[purpose]
    text = (f"{u} ({what} at position {position}) fell in {name(x.token)}'s interval "
            f"[{x.lo:.4f}, {x.hi:.4f}) in {la} and in {name(y.token)}'s [{y.lo:.4f}, {y.hi:.4f}) in {lb}")
    moved = None
    other = y.interval_of(x.token)
    if other is not None:
        moved = (other[1] - other[0]) - (x.hi - x.lo)
        text += f"; {name(x.token)}'s probability moved by {moved:+.2g}"
    else:
        text += f"; {name(x.token)}'s slice in {lb} is not next to {name(y.token)}'s (the distribution moved further)"
    return SamplerStory(position, purpose, x, y, moved, text, differs)
