"""Confirmation by replay: force B's root-cause step (then every suspect step) to run as
A's ran it, and check that B then matches A up to the divergence (each replay first checked
to be B with only that change: analysis.rerun_check). Forcing means A's
kernels, or each request of the step alone (SOLO), or A's very rows (RelayoutStep)
where the backend's kernels depend on the row count; a sampled flip that the draft
decided is proven at that draw. Engine-free: it drives a `Replayer` (analysis.replayer)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .forcing import force_like_a, forcing_words, prefill_as_a, rows_per_op
from .rerun_check import RunRecord, asked_of_forcing, check_rerun


def _suspect_steps(a, b, rid: str, pos: int, step_a: int, step_b: int, model: str = "target") -> dict[int, int]:
    """B step -> A step: the step that computed the divergent row (predicting `pos`), and
    every step that wrote K/V it read differently from A's (their rows or kernels differ)."""
    from .bisect import step_kernels

    pairs: dict[int, int] = {step_b: step_a}
    la = a.live_kv(rid, model=model, at_step=step_a)
    lb = b.live_kv(rid, model=model, at_step=step_b)
    a_cell = {(int(l), int(p)): (int(s), int(k), int(v))
              for l, p, s, k, v in zip(la["layer"], la["position"], la["step"], la["k_hash"], la["v_hash"]) if p < pos}
    for l, p, s, k, v in zip(lb["layer"], lb["position"], lb["step"], lb["k_hash"], lb["v_hash"]):
        got = a_cell.get((int(l), int(p)))
        if p < pos and got is not None and (got[1], got[2]) != (int(k), int(v)):
            pairs.setdefault(int(s), got[0])
    # native labels hide row-count classes: a native step whose rows differ is a suspect too
    return {sb: sa for sb, sa in sorted(pairs.items())
            if step_kernels(a, sa) != step_kernels(b, sb) or rows_per_op(a, sa) != rows_per_op(b, sb)
            or sb == step_b}


def _greedy(trace, rid: str) -> bool:
    return next(r for r in trace.requests if r.id == rid).sampling.greedy


def _draft_pairs(a, b, rid: str, until_a: int, until_b: int) -> dict[int, int]:
    """B draft step -> A draft step, for B's draft steps of the request up to the flip, each
    paired with A's latest draft step that predicted the same position (its q)."""
    from .bisect import draft_step, step_kernels

    out: dict[int, int] = {}
    for plan in b.iter_plans():
        if plan.model != "draft" or plan.index >= until_b:
            continue
        for s in plan.slices:
            if s.request_id == rid:
                sa = draft_step(a, rid, s.start + s.count, until_a)
                if sa is not None and (step_kernels(a, sa) != step_kernels(b, plan.index)
                                       or rows_per_op(a, sa) != rows_per_op(b, plan.index)):
                    out[plan.index] = sa
    return out


@dataclass
class RungResult:
    """What one rung of a confirmation found. confirmed None: the rung did not apply (nothing
    to force beyond an earlier rung's). forced: the forcing B was replayed with (B step ->
    forcing); replays: the checks it ran; first: where the request still differed (a generated
    index, or a position's offset from the prompt's end with --bitwise); by: how it confirmed
    (a CONFIRMED_BY name of analysis.bisect)."""

    rung: str
    confirmed: bool | None
    detail: str = ""
    forced: dict = field(default_factory=dict)
    replays: int = 0
    first: int | None = None
    by: str | None = None


def replay_kind(forced: dict) -> str:
    """How a forcing replays B (a CONFIRMED_BY name): every forced step run as A ran it
    (request by request, A's rows) or, where any step runs on A's kernels, A's kernels."""
    from ..core.policy import RelayoutStep, SoloStep
    from .bisect import BY_REPLAY, BY_REPLAY_SOLO

    return BY_REPLAY_SOLO if forced and all(isinstance(v, (SoloStep, RelayoutStep)) for v in forced.values()) \
        else BY_REPLAY


class Case:
    """One cause of one request to confirm, and what its rungs share: the replayer, what must
    match (A's tokens up to the flip, or with --bitwise A's logits bit for bit up to the first
    difference), the suspect steps and the sentences. The rungs reach the engine through
    `force`, `check`, `decision`, `suspects`, `passes` only (a test can stand in for them)."""

    def __init__(self, a, b, replayer, cause, rd, label_a: str = "A", label_b: str = "B"):
        self.a, self.b, self.replayer, self.cause, self.rd = a, b, replayer, cause, rd
        self.label_a, self.label_b = label_a, label_b
        self.replays = 0
        self.by_tried: str | None = None  # how the first replay forced B (for a refused forcing)
        tok, num = rd.first_divergent_token, rd.first_numeric_divergence
        self.tok = tok
        self.logits_only = tok is None and num is not None
        if self.logits_only:  # tokens equal, logits not (--bitwise): prove it on the bits
            self.n, self.pos, self.step_a, self.step_b = num.position - rd.prompt_len + 1, num.position, \
                num.step_a, num.step_b
        else:
            self.n = (tok.generated_index + 1) if tok is not None else rd.compared
            self.pos, self.step_a, self.step_b = (tok.position, tok.step_a, tok.step_b) if tok else (0, 0, 0)
        self.goal = (f"makes {rd.id}'s logits equal {label_a}'s bit for bit up to position {self.pos}, where they "
                     f"first differed") if self.logits_only else f"makes {rd.id} match {label_a} up to the divergence"
        self.story = cause.sampler if tok is not None else None
        self.at_draw = self.story is not None and self.story.depends_on_draft  # the flip was the draft's own draw
        if self.at_draw:
            self.goal = f"makes {rd.id} match {label_a}"

    # -- what the rungs ask of the traces and the engine
    def force(self, step_a: int, step_b: int, positions=None, layer=None, *, alone: bool = False):
        return force_like_a(self.a, step_a, self.b, step_b, self.rd.id, positions, layer, alone=alone)

    def words(self, forced: dict) -> str:
        return forcing_words(forced, self.label_a)

    def where(self, i) -> str:
        return f"position {self.rd.prompt_len + i}" if self.logits_only else f"generated #{i}"

    def _replayed(self, forced: dict) -> None:
        self.replays += 1
        if self.by_tried is None:
            self.by_tried = replay_kind(forced)

    def matches(self, forced: dict, n: int) -> tuple[bool, bool, int | None]:
        self._replayed(forced)
        return _replay_matches(self.a, self.b, self.replayer, self.rd.id, forced, n)

    def decision(self, forced: dict, position: int, purpose: str, until: int) -> dict:
        """The replay's own draw of (request, position, purpose) with these steps forced."""
        self._replayed(forced)
        return _draw_of(self.b, self.replayer, forced, self.rd.id, position, purpose, until)

    def check(self, forced: dict) -> tuple[bool, str, int | None]:
        """(B replayed with `forced` matches A as it must, the words of how exactly, where it
        first differs)."""
        story, tok = self.story, self.tok
        if self.at_draw:  # B's plans carry B's proposals: match up to the flip, then the draw itself
            same, bitwise, first = self.matches(forced, self.n - 1)
            decided = same and _decides_like(story, self.decision(forced, story.position, story.purpose,
                                                                  tok.step_b))
            exact = (f" up to the flip, and there the {story.purpose} draw decides as in {self.label_a}"
                     + (", bit for bit" if bitwise else " (some logits still differ)"))
            return decided, exact, (first if not same else tok.generated_index)
        same, bitwise, first = self.matches(forced, self.n)
        ok = bitwise if self.logits_only else same
        exact = "" if self.logits_only else (", bit for bit" if bitwise else " (tokens; some logits still differ)")
        return ok, exact, first

    def suspects(self) -> dict[int, int]:
        """B step -> A step of every step to force beyond the cause's: the divergent row's, those
        whose K/V writes it read differently and, for a sampled token, the draft's steps."""
        if getattr(self, "_pairs", None) is not None:
            return self._pairs
        a, b, rd, cause, tok = self.a, self.b, self.rd, self.cause, self.tok
        if cause.model == "draft":
            from .bisect import draft_step

            da, db = draft_step(a, rd.id, self.pos, self.step_a), draft_step(b, rd.id, self.pos, self.step_b)
            pairs = _suspect_steps(a, b, rd.id, self.pos, da, db, "draft") if da is not None and db is not None \
                else {}
        elif tok is not None or self.logits_only:
            pairs = _suspect_steps(a, b, rd.id, self.pos, self.step_a, self.step_b)
        else:
            pairs = {}
        pairs[cause.b.step] = cause.a.step
        if tok is not None and not _greedy(b, rd.id):
            # a sampled token under speculative decoding also hangs on the draft's q: its steps too
            pairs.update({sb: sa for sb, sa in _draft_pairs(a, b, rd.id, tok.step_a, tok.step_b).items()
                          if sb not in pairs})
        self._pairs = pairs
        return pairs

    def draw_suspects(self) -> dict[int, int]:
        """A sampler cause's steps to force: the draft steps whose K/V the draw's q read differently."""
        from .bisect import draft_step

        a, b, rd, cause, tok = self.a, self.b, self.rd, self.cause, self.rd.first_divergent_token
        da, db = draft_step(a, rd.id, tok.position, tok.step_a), draft_step(b, rd.id, tok.position, tok.step_b)
        pairs = _suspect_steps(a, b, rd.id, tok.position, da, db, "draft") if da is not None and db is not None else {}
        pairs[cause.b.step] = cause.a.step
        return pairs

    def passes(self) -> dict:
        """B's steps that compute the request's prompt in A's prefill passes (prefill_as_a)."""
        return prefill_as_a(self.a, self.b, self.rd.id, self.step_b + 1)


def _others(pairs: dict) -> str:
    n = len(pairs) - 1
    return f"{n} other {'steps differ' if n > 1 else 'step differs'} too"


def rung_kernels(case: Case, tried: list) -> RungResult:
    """The strong claim: B with only the root-cause step run as A ran it (A's kernels, or
    request by request where both are `native`)."""
    c = case.cause
    forced = {c.b.step: case.force(c.a.step, c.b.step, c.positions, c.layer)}
    n0 = case.replays
    ok, exact, first = case.check(forced)
    what = f"replaying {case.label_b} with {case.words(forced)}"
    detail = f"{what} {case.goal}{exact}" if ok else \
        f"{what}: {case.rd.id} still differs from {case.label_a} at {case.where(first)}"
    return RungResult("kernels", ok, detail, forced, case.replays - n0, first, replay_kind(forced))


def rung_suspects(case: Case, tried: list) -> RungResult:
    """The weaker claim, where other steps differ too: B with every suspect step forced (the
    cause's as in rung_kernels)."""
    c, pairs = case.cause, case.suspects()
    if len(pairs) <= 1:
        return RungResult("suspects", None, "no other step differs")
    first_try = _result(tried, "kernels")
    forced = {sb: case.force(sa, sb) for sb, sa in pairs.items()}
    forced[c.b.step] = first_try.forced[c.b.step]
    n0 = case.replays
    ok, exact, first = case.check(forced)
    if ok:
        detail = (f"replaying {case.label_b} with {case.words(forced)} {case.goal}{exact} (step {c.b.step} alone "
                  f"does not: {_others(pairs)})")
    else:
        detail = (f"replaying {case.label_b} with {case.words(first_try.forced)}: {case.rd.id} still differs at "
                  f"{case.where(first_try.first)}; with {case.words(forced)} it differs at {case.where(first)}")
    return RungResult("suspects", ok, detail, forced, case.replays - n0, first, replay_kind(forced))


def rung_solo(case: Case, tried: list) -> RungResult:
    """A's kernels were not enough (e.g. the engine's own gemm is built of native matmuls
    whose rows depend on the row count, as fp32 on OpenBLAS): the suspect steps run as A ran
    them, each request alone with A's rows, whatever the kernels."""
    from ..core.policy import RelayoutStep, SoloStep
    from .bisect import BY_REPLAY_SOLO

    c, pairs = case.cause, case.suspects()
    last = _last_forcing(tried)
    if not any(not isinstance(v, (SoloStep, RelayoutStep)) for v in last.values()):
        return RungResult("solo", None, "the steps already ran as A ran them")
    forced = {sb: case.force(sa, sb, c.positions if sb == c.b.step else None, c.layer, alone=True)
              for sb, sa in pairs.items()}
    n0 = case.replays
    ok, exact, first = case.check(forced)
    extra = f" (step {c.b.step} alone does not: {_others(pairs)})" if len(pairs) > 1 else ""
    what = f"replaying {case.label_b} with {case.words(forced)}"
    detail = (f"{what} {case.goal}{exact}, where {case.label_a}'s kernels alone were not enough{extra}" if ok else
              f"{what}: {case.rd.id} still differs from {case.label_a} at {case.where(first)}")
    return RungResult("solo", ok, detail, forced, case.replays - n0, first, BY_REPLAY_SOLO)


def rung_prefill(case: Case, tried: list) -> RungResult:
    """The prefill's chunk boundaries differ (B's chunks straddle A's): no step alone has A's
    rows; B with the request's whole prompt computed in A's passes, every suspect step alone."""
    from ..core.policy import SOLO
    from .bisect import BY_REPLAY_PREFILL

    passes = case.passes()
    if not passes:
        return RungResult("prefill", None, "the prompt was computed in A's passes already")
    forced = {**{sb: SOLO for sb in case.suspects()}, **passes}
    n0 = case.replays
    ok, exact, first = case.check(forced)
    what = f"replaying {case.label_b} with {case.words(forced)}"
    detail = (f"{what} {case.goal}{exact}, where {_in_a_passes(case.rd.id, len(passes), case.label_a, case.label_b)})"
              if ok else f"{what}: {case.rd.id} still differs from {case.label_a} at {case.where(first)}")
    return RungResult("prefill", ok, detail, forced, case.replays - n0, first, BY_REPLAY_PREFILL)


def _draw_words(case: Case) -> tuple[str, str]:
    story = case.cause.sampler
    want = story.a
    what_a = (("accept" if want.accepted else "reject") + f" token {want.token}" if story.purpose == "accept"
              else f"draw token {want.token}")
    name = "accept test" if story.purpose == "accept" else f"{story.purpose} draw"
    return name, f"makes the {name} of {case.rd.id} at position {story.position} {what_a}, as in {case.label_a}"


def rung_draw(case: Case, tried: list) -> RungResult:
    """A sampler cause: B's plans carry B's own proposals (teacher-forced), so the proof is at
    the decision itself: with the draft's step run as A ran it, the draw that decided
    differently (proposal, accept test, residual) decides as it did in A."""
    c, story, tok = case.cause, case.cause.sampler, case.rd.first_divergent_token
    forced = {c.b.step: case.force(c.a.step, c.b.step, c.positions, c.layer)}
    n0 = case.replays
    ok = _decides_like(story, case.decision(forced, story.position, story.purpose, tok.step_b))
    _, goal = _draw_words(case)
    detail = (f"replaying {case.label_b} with {case.words(forced)} {goal}" if ok else
              f"replaying {case.label_b} with {case.words(forced)}: the {story.purpose} draw of {case.rd.id} at "
              f"position {story.position} still decides otherwise than in {case.label_a}")
    return RungResult("draw", ok, detail, forced, case.replays - n0, None, replay_kind(forced))


def rung_draw_suspects(case: Case, tried: list) -> RungResult:
    """The draw again, with every draft step whose K/V its q read differently forced too."""
    c, story, tok = case.cause, case.cause.sampler, case.rd.first_divergent_token
    pairs = case.draw_suspects()
    if len(pairs) <= 1:
        return RungResult("draw_suspects", None, "no other draft step differs")
    forced = {sb: case.force(sa, sb) for sb, sa in pairs.items()}
    forced[c.b.step] = _result(tried, "draw").forced[c.b.step]
    n0 = case.replays
    ok = _decides_like(story, case.decision(forced, story.position, story.purpose, tok.step_b))
    _, goal = _draw_words(case)
    detail = (f"replaying {case.label_b} with {case.words(forced)} {goal} (step {c.b.step} alone does not: "
              f"{_others(pairs)})" if ok else
              f"replaying {case.label_b} with {case.words(forced)}: the {story.purpose} draw of {case.rd.id} at "
              f"position {story.position} still decides otherwise than in {case.label_a}")
    return RungResult("draw_suspects", ok, detail, forced, case.replays - n0, None, replay_kind(forced))


RUNGS = (rung_kernels, rung_suspects, rung_solo, rung_prefill)  # in order: the first that confirms wins
DRAW_RUNGS = (rung_draw, rung_draw_suspects)


def _result(tried: list, rung: str) -> RungResult | None:
    return next((r for r in tried if r.rung == rung), None)


def _last_forcing(tried: list) -> dict:
    """The forcing of the latest rung that applied."""
    return next(r.forced for r in reversed(tried) if r.confirmed is not None)


def climb(case: Case, rungs) -> tuple[RungResult | None, list]:
    """Try the rungs in order: (the first that confirmed or None, every result)."""
    tried: list = []
    for rung in rungs:
        got = rung(case, tried)
        tried.append(got)
        if got.confirmed:
            return got, tried
    return None, tried


def unconfirmed(tried: list) -> RungResult:
    """The result that says why no rung confirmed: the draw's, else the suspect steps' (it
    names the cause step's forcing too), else the cause step's. The later fallbacks (each
    request alone, A's prefill passes) failing adds nothing to that sentence."""
    for name in ("draw", "suspects", "kernels"):
        got = _result(tried, name)
        if got is not None and got.confirmed is False:
            return got
    return tried[0]


def make_confirmer(a, b, replayer, label_a: str = "A", label_b: str = "B"):
    """Returns confirm(cause, request_diff) -> (confirmed, detail) for bisect_traces; it sets
    cause.confirmed_by (how the replay forced B) where a replay ran.

    What must match: A's tokens up to the flip; where only the logits differ (--bitwise),
    A's logits bit for bit up to the first position where they differed. The rungs, in
    order (RUNGS): the cause step run as A ran it (rung_kernels); every suspect step forced
    (rung_suspects); those steps each request alone with A's rows (rung_solo); the prompt
    in A's prefill passes (rung_prefill). A sampler cause (the draft's q) is proved at the
    draw (DRAW_RUNGS); any sampled token under speculative decoding forces the draft's steps.
    """

    def confirm(cause, rd):
        if cause.kind == "sampler" and cause.model != "draft":
            return None, "a sampler cause with equal logits and no draft involved has no kernel to force", None
        case = Case(a, b, replayer, cause, rd, label_a, label_b)
        try:
            got, tried = climb(case, DRAW_RUNGS if cause.kind == "sampler" and cause.sampler is not None else RUNGS)
        except _ForcingRefused as e:
            return False, f"the replay refused a forcing it needed ({e})", case.by_tried
        except NotARerun as e:
            return False, f"not a valid re-run of {label_b}: {e}", case.by_tried
        if got is None:
            got = unconfirmed(tried)
        return got.confirmed, got.detail, got.by

    def confirm_and_say_how(cause, rd):
        ok, detail, by = confirm(cause, rd)
        cause.confirmed_by = by if ok is not None else None
        return ok, detail

    return confirm_and_say_how


def _draw_of(b, replayer, forced: dict, rid: str, position: int, purpose: str, until: int) -> dict:
    """B replayed with `forced` (checked to be a re-run of B): its draw of (request, position,
    purpose) up to step `until`, as recorded, or {}."""
    from ..core.events import Observer

    class Draws(Observer):
        wants_records = True

        def __init__(self):
            self.got = {}

        def on_record(self, table, **c):
            if table == "draws" and c["request"] == rid and c["position"] == position \
                    and c["purpose"] == purpose and c["step"] <= until:
                self.got = c

    rec = Draws()
    record = RunRecord(kv_hashes=b.has_kv_hashes)
    try:
        replayer.run(b, forced=forced, observers=[rec, record])
    except ValueError as e:
        raise _ForcingRefused(str(e)) from e
    _check_replay(b, record, forced)
    return rec.got


def _decides_like(story, got) -> bool:
    """The replay's draw `got` (its record) decides as A's draw of the story did."""
    if not got:
        return False
    if story.purpose == "accept":
        return (got["value"] < min(1.0, got["p"] / max(got["q"], 1e-30))) == story.a.accepted
    return int(got["token"]) == story.a.token


class _ForcingRefused(Exception):
    """A forced replay that could not run (its relayout does not fit the recorded plans)."""


class NotARerun(Exception):
    """A replay that is not B with only the forced change (analysis.rerun_check): its
    tokens prove nothing; the message is the first difference."""


def _check_replay(b, record, forced: dict) -> None:
    """Raise NotARerun unless the recorded replay is B with only `forced` changed."""
    got = check_rerun(b, record, min(forced) if forced else None, asked_of_forcing(forced))
    if not got.valid:
        raise NotARerun(got.first_difference)


def _replay(replayer, b, forced: dict):
    """Replay B with `forced`, checked to be B with only that change; memoised per replayer
    (the check records the replay, so a memoising replayer would not memoise it)."""
    memo = getattr(replayer, "_checked_replays", None)
    if memo is None:
        memo = {}
        try:
            replayer._checked_replays = memo
        except AttributeError:
            pass
    key = (id(b), tuple(sorted((int(k), str(v)) for k, v in forced.items())))
    if key in memo and memo[key][0] is b:
        return memo[key][1]
    record = RunRecord(kv_hashes=b.has_kv_hashes)
    try:
        got = replayer.run(b, forced=forced, observers=[record])
    except ValueError as e:  # a forcing the replay cannot lay out: this cause stays unconfirmed
        raise _ForcingRefused(str(e)) from e
    _check_replay(b, record, forced)
    memo[key] = (b, got)
    del_keys = list(memo)[:-16]
    for k in del_keys:
        del memo[k]
    return got


def _replay_matches(a, b, replayer, rid: str, forced: dict, n: int) -> tuple[bool, bool, int | None]:
    """Replay B with `forced`: (its first n tokens of `rid` are A's, and bit for bit with their
    top-k logits, the first of them that differs or None). Raises _ForcingRefused where the
    replay cannot lay the forcing out."""
    got = _replay(replayer, b, forced).outputs[rid]
    ta = a.tokens(rid)
    want = [int(t) for t in ta.tokens[:n]]
    same = list(got.tokens[:n]) == want
    la = np.asarray(ta.topk_logits[:n], np.float32).view(np.uint32)
    lb = np.asarray(got.topk_logits[:n], np.float32).reshape(-1, la.shape[1]).view(np.uint32)
    bitwise = same and la.shape == lb.shape and bool((la == lb).all())
    first = next((i for i, (x, y) in enumerate(zip(got.tokens, want)) if int(x) != y), None)
    if first is None and not bitwise and la.shape == lb.shape:
        bad = np.flatnonzero((la != lb).any(axis=1))
        first = int(bad[0]) if bad.size else None
    return same, bitwise, first


def _in_a_passes(rid: str, n: int, label_a: str, label_b: str) -> str:
    """Why a confirmation computed the request's prompt in A's prefill passes (prefill_as_a)."""
    return (f"{rid}'s prompt had to be computed in {label_a}'s {n} prefill passes (its chunks in {label_b} "
            f"straddle them")


def make_replay_bisector(a, b, replayer, label_a: str = "A", label_b: str = "B"):
    """For traces recorded without KV hashes: binary search over B's steps. Returns
    bisect_one(request_diff) -> ReplayBisection (analysis.bisect): the cause or None, the
    replays run, why none was found or None.

    f(m) = "replaying B with its target steps < m (those holding the request) run on
    the kernels of A's step that computed the same positions makes the request match
    A up to the flip". The smallest m with f(m) true names the latest step that had
    to be forced: O(log steps) replays, each one a proof rather than a correlation.
    """
    from ..core.policy import SOLO
    from .bisect import (BY_REPLAY_PREFILL, CACHE_CONTAMINATION, STEP_COMPUTE, ReplayBisection, RootCause, co_batched,
                         finished_before, step_views)

    def a_step_for(rid: str, until: int) -> dict[int, int]:
        """position -> A's target step that last computed it (up to `until`)."""
        out: dict[int, int] = {}
        for p in a.iter_plans():
            if p.index > until or p.model != "target":
                continue
            for s in p.slices:
                if s.request_id == rid:
                    for pos in range(s.start, s.start + s.count):
                        out[pos] = p.index
        return out

    def bisect_one(rd):
        try:
            return search(rd)
        except _ForcingRefused as e:
            return ReplayBisection(None, 0, f"not found by replay: the replay refused a forcing it needed ({e})")
        except NotARerun as e:
            return ReplayBisection(None, 0, f"not found by replay: a replay was not a valid re-run of {label_b}: {e}")

    def search(rd):
        tok, num = rd.first_divergent_token, rd.first_numeric_divergence
        if tok is not None:
            n, pos, until_a, until_b, bitwise = tok.generated_index + 1, tok.position, tok.step_a, tok.step_b, False
        elif num is not None:  # tokens equal, logits not (--bitwise): the search is on the bits
            n, pos, until_a, until_b, bitwise = num.position - rd.prompt_len + 1, num.position, num.step_a, \
                num.step_b, True
        else:
            return ReplayBisection(None, 0, None)
        a_of = a_step_for(rd.id, until_a)
        b_steps = [(p.index, s.start) for p in b.iter_plans() if p.model == "target" and p.index <= until_b
                   for s in p.slices if s.request_id == rd.id and s.start in a_of]
        replays = 0

        def found(kind: str, step_a: int, step_b: int, who: str, detail: str, by: str):
            """The confirmed cause: `who`'s slice of B's step_b, against A's step_a."""
            va, vb, op = step_views(a, b, step_a, step_b)
            sl = next(s for s in b.step_plan(step_b).slices if s.request_id == who)
            co = co_batched(b, step_b, who)
            cause = RootCause(kind, None, list(range(sl.start, sl.start + sl.count)), va, vb, co,
                              finished_before(b, co, until_b), op=op)
            cause.confirmed, cause.confirm_detail, cause.confirmed_by = True, detail, by
            return ReplayBisection(cause, replays, None)

        def forcing(k: int) -> dict:  # the first k of b_steps, each as A's step of the same positions
            return {sb: force_like_a(a, a_of[start], b, sb) for sb, start in b_steps[:k]}

        def fixed(k: int) -> bool:
            return matches(forcing(k))

        def matches(forced: dict) -> bool:
            nonlocal replays
            replays += 1
            same, exact, _ = _replay_matches(a, b, replayer, rd.id, forced, n)
            return exact if bitwise else same

        if not b_steps:
            return ReplayBisection(None, replays,
                                   f"no step of {label_b} up to {until_b} computed positions {label_a} computed too")
        goal = (f"makes {rd.id}'s logits equal {label_a}'s bit for bit up to position {pos}" if bitwise
                else f"makes {rd.id} match {label_a} up to the divergence")
        if not fixed(len(b_steps)):
            # a prefill chunked otherwise (B's chunks straddle A's): the prompt in A's passes
            passes = prefill_as_a(a, b, rd.id, until_b + 1)
            if passes and matches({**{sb: SOLO for sb, _ in b_steps}, **passes}):
                step_b = min(passes)
                first = passes[step_b]
                return found(CACHE_CONTAMINATION, a_of.get(first.start, a_of[min(a_of)]), step_b, first.request_id,
                             f"replaying {label_b} with {forcing_words(passes, label_a)} {goal}, where "
                             f"{_in_a_passes(rd.id, len(passes), label_a, label_b)}; {replays} replays)",
                             BY_REPLAY_PREFILL)
            return ReplayBisection(None, replays, (
                f"not found by replay: {rd.id}'s {len(b_steps)} steps up to {until_b}, every one run as in "
                f"{label_a}, still do not make it match (record KV hashes for a bisection by the cache)"))
        lo, hi = 0, len(b_steps)  # fixed(hi) holds; find the smallest such k
        while lo < hi:
            mid = (lo + hi) // 2
            if fixed(mid):
                hi = mid
            else:
                lo = mid + 1
        if lo == 0:
            return ReplayBisection(None, replays,
                                   f"not found by replay: {label_b} replayed with nothing forced already matches")
        step_b, start = b_steps[lo - 1]
        return found(STEP_COMPUTE if step_b == until_b else CACHE_CONTAMINATION, a_of[start], step_b, rd.id,
                     f"replaying {label_b} with its steps up to {step_b} run as in {label_a} {goal}, and without "
                     f"step {step_b} it does not ({replays} replays)", replay_kind(forcing(lo)))

    return bisect_one






