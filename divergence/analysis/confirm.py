"""Confirmation by replay: force B's root-cause step (then every suspect step) to run as
A's ran it, and check that B then matches A up to the divergence (each replay first checked
to be B with only that change: analysis.rerun_check). Forcing means A's
kernels, or each request of the step alone (SOLO), or A's very rows (RelayoutStep)
where the backend's kernels depend on the row count; a sampled flip that the draft
decided is proven at that draw. Engine-free: it drives a `Replayer` (analysis.replay)."""
from __future__ import annotations

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


def make_confirmer(a, b, replayer, label_a: str = "A", label_b: str = "B"):
    """Returns confirm(cause, request_diff) -> (confirmed, detail) for bisect_traces.

    What must match: A's tokens up to the flip; where only the logits differ (--bitwise),
    A's logits bit for bit up to the first position where they differed. First the strong
    claim: B with only the root-cause step run as A ran it (A's kernels, or request by
    request where both are `native`). If other steps also differ, the weaker one: B with
    every suspect step forced (the divergent row's step, and every step whose K/V writes
    it read differently). A sampler cause (the draft's q) forces the draft's steps, and so
    does any sampled token under speculative decoding. Where A's kernels do not reproduce
    A's numbers, the steps run as A ran them: each request alone, with A's rows.
    """
    from ..core.policy import RelayoutStep, SoloStep

    def matches(rid: str, forced: dict, n: int) -> tuple[bool, bool, int | None]:
        return _replay_matches(a, b, replayer, rid, forced, n)

    def decision(forced: dict, rid: str, position: int, purpose: str, until: int):
        """The replay's own draw of (request, position, purpose) with these steps forced."""
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

    def confirm_draw(cause, rd):
        """A sampler cause: B's plans carry B's own proposals (teacher-forced), so the proof is
        at the decision itself: with the draft's step run as A ran it, the draw that decided
        differently (proposal, accept test, residual) decides as it did in A."""
        story, tok = cause.sampler, rd.first_divergent_token
        want = story.a

        def same(got) -> bool:
            return _decides_like(story, got)

        what_a = (("accept" if want.accepted else "reject") + f" token {want.token}" if story.purpose == "accept"
                  else f"draw token {want.token}")
        forced = {cause.b.step: force_like_a(a, cause.a.step, b, cause.b.step, rd.id, cause.positions, cause.layer)}
        name = "accept test" if story.purpose == "accept" else f"{story.purpose} draw"
        goal = f"makes the {name} of {rd.id} at position {story.position} {what_a}, as in {label_a}"
        if same(decision(forced, rd.id, story.position, story.purpose, tok.step_b)):
            return True, f"replaying {label_b} with {forcing_words(forced, label_a)} {goal}"
        from .bisect import draft_step

        da, db = draft_step(a, rd.id, tok.position, tok.step_a), draft_step(b, rd.id, tok.position, tok.step_b)
        pairs = _suspect_steps(a, b, rd.id, tok.position, da, db, "draft") if da is not None and db is not None else {}
        pairs[cause.b.step] = cause.a.step
        if len(pairs) > 1:
            forced2 = {sb: force_like_a(a, sa, b, sb, rd.id) for sb, sa in pairs.items()}
            forced2[cause.b.step] = forced[cause.b.step]
            if same(decision(forced2, rd.id, story.position, story.purpose, tok.step_b)):
                return True, (f"replaying {label_b} with {forcing_words(forced2, label_a)} {goal} (step "
                              f"{cause.b.step} alone does not: {len(pairs) - 1} other "
                              f"{'steps differ' if len(pairs) > 2 else 'step differs'} too)")
        return False, (f"replaying {label_b} with {forcing_words(forced, label_a)}: the {story.purpose} draw of "
                       f"{rd.id} at position {story.position} still decides otherwise than in {label_a}")

    def confirm(cause, rd):
        tok, num = rd.first_divergent_token, rd.first_numeric_divergence
        if cause.kind == "sampler" and cause.model != "draft":
            return None, "a sampler cause with equal logits and no draft involved has no kernel to force"
        if cause.kind == "sampler" and cause.sampler is not None:
            return confirm_draw(cause, rd)
        logits_only = tok is None and num is not None
        if logits_only:  # tokens equal, logits not (--bitwise): prove it on the bits
            n, pos, step_a, step_b = num.position - rd.prompt_len + 1, num.position, num.step_a, num.step_b
        else:
            n = (tok.generated_index + 1) if tok is not None else rd.compared
            pos, step_a, step_b = (tok.position, tok.step_a, tok.step_b) if tok else (0, 0, 0)
        goal = (f"makes {rd.id}'s logits equal {label_a}'s bit for bit up to position {pos}, where they first "
                f"differed") if logits_only else f"makes {rd.id} match {label_a} up to the divergence"

        story = cause.sampler if tok is not None else None
        at_draw = story is not None and story.depends_on_draft  # the flip was the draft's own draw
        if at_draw:
            goal = f"makes {rd.id} match {label_a}"

        def check(forced):
            if at_draw:  # B's plans carry B's proposals: match up to the flip, then the draw itself
                same, bitwise, first = matches(rd.id, forced, n - 1)
                decided = same and _decides_like(story, decision(forced, rd.id, story.position, story.purpose,
                                                                 tok.step_b))
                exact = (f" up to the flip, and there the {story.purpose} draw decides as in {label_a}"
                         + (", bit for bit" if bitwise else " (some logits still differ)"))
                return decided, exact, (first if not same else tok.generated_index)
            same, bitwise, first = matches(rd.id, forced, n)
            ok = bitwise if logits_only else same
            exact = "" if logits_only else (", bit for bit" if bitwise else " (tokens; some logits still differ)")
            return ok, exact, first

        forced = {cause.b.step: force_like_a(a, cause.a.step, b, cause.b.step, rd.id, cause.positions, cause.layer)}
        what = f"replaying {label_b} with {forcing_words(forced, label_a)}"
        ok, exact, first = check(forced)
        if ok:
            return True, f"{what} {goal}{exact}"
        if cause.model == "draft":
            from .bisect import draft_step

            da, db = draft_step(a, rd.id, pos, step_a), draft_step(b, rd.id, pos, step_b)
            pairs = _suspect_steps(a, b, rd.id, pos, da, db, "draft") if da is not None and db is not None else {}
        elif tok is not None or logits_only:
            pairs = _suspect_steps(a, b, rd.id, pos, step_a, step_b)
        else:
            pairs = {}
        pairs[cause.b.step] = cause.a.step
        if tok is not None and not _greedy(b, rd.id):
            # a sampled token under speculative decoding also hangs on the draft's q: its steps too
            pairs.update({sb: sa for sb, sa in _draft_pairs(a, b, rd.id, tok.step_a, tok.step_b).items()
                          if sb not in pairs})
        where = (lambda i: f"position {rd.prompt_len + i}") if logits_only else (lambda i: f"generated #{i}")
        forced2 = forced
        if len(pairs) > 1:
            forced2 = {sb: force_like_a(a, sa, b, sb, rd.id) for sb, sa in pairs.items()}
            forced2[cause.b.step] = forced[cause.b.step]
            ok2, exact2, first2 = check(forced2)
            if ok2:
                return True, (f"replaying {label_b} with {forcing_words(forced2, label_a)} {goal}{exact2} "
                              f"(step {cause.b.step} alone does not: {len(pairs) - 1} other "
                              f"{'steps differ' if len(pairs) > 2 else 'step differs'} too)")
        # A's kernels were not enough (e.g. the engine's own gemm is built of native matmuls
        # whose rows depend on the row count, as fp32 on OpenBLAS): run the steps as A ran
        # them, each request alone with A's rows, whatever the kernels
        if any(not isinstance(v, (SoloStep, RelayoutStep)) for v in forced2.values()):
            forced3 = {sb: force_like_a(a, sa, b, sb, rd.id, cause.positions if sb == cause.b.step else None,
                                        cause.layer, alone=True) for sb, sa in pairs.items()}
            ok3, exact3, _ = check(forced3)
            if ok3:
                extra = (f" (step {cause.b.step} alone does not: {len(pairs) - 1} other "
                         f"{'steps differ' if len(pairs) > 2 else 'step differs'} too)") if len(pairs) > 1 else ""
                return True, (f"replaying {label_b} with {forcing_words(forced3, label_a)} {goal}{exact3}, where "
                              f"{label_a}'s kernels alone were not enough{extra}")
        # the prefill's chunk boundaries differ (B's chunks straddle A's): no step alone has A's
        # rows; B with the request's whole prompt computed in A's passes, every suspect step alone
        passes = prefill_as_a(a, b, rd.id, step_b + 1)
        if passes:
            from ..core.policy import SOLO

            forced4 = {**{sb: SOLO for sb in pairs}, **passes}
            ok4, exact4, _ = check(forced4)
            if ok4:
                return True, (f"replaying {label_b} with {forcing_words(forced4, label_a)} {goal}{exact4}, where "
                              f"{_in_a_passes(rd.id, len(passes), label_a, label_b)})")
        if len(pairs) > 1:
            return False, (f"{what}: {rd.id} still differs at {where(first)}; with "
                           f"{forcing_words(forced2, label_a)} it differs at {where(first2)}")
        return False, f"{what}: {rd.id} still differs from {label_a} at {where(first)}"

    def confirm_or_refused(cause, rd):
        try:
            return confirm(cause, rd)
        except _ForcingRefused as e:
            return False, f"the replay refused a forcing it needed ({e})"
        except NotARerun as e:
            return False, f"not a valid re-run of {label_b}: {e}"

    return confirm_or_refused


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
    bisect_one(request_diff) -> (cause or None, replays, why none was found or None).

    f(m) = "replaying B with its target steps < m (those holding the request) run on
    the kernels of A's step that computed the same positions makes the request match
    A up to the flip". The smallest m with f(m) true names the latest step that had
    to be forced: O(log steps) replays, each one a proof rather than a correlation.
    """
    from ..core.policy import SOLO
    from .bisect import CACHE_CONTAMINATION, STEP_COMPUTE, RootCause, co_batched, finished_before, step_views

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
            return None, 0, f"not found by replay: the replay refused a forcing it needed ({e})"
        except NotARerun as e:
            return None, 0, f"not found by replay: a replay was not a valid re-run of {label_b}: {e}"

    def search(rd):
        tok, num = rd.first_divergent_token, rd.first_numeric_divergence
        if tok is not None:
            n, pos, until_a, until_b, bitwise = tok.generated_index + 1, tok.position, tok.step_a, tok.step_b, False
        elif num is not None:  # tokens equal, logits not (--bitwise): the search is on the bits
            n, pos, until_a, until_b, bitwise = num.position - rd.prompt_len + 1, num.position, num.step_a, \
                num.step_b, True
        else:
            return None, 0, None
        a_of = a_step_for(rd.id, until_a)
        b_steps = [(p.index, s.start) for p in b.iter_plans() if p.model == "target" and p.index <= until_b
                   for s in p.slices if s.request_id == rd.id and s.start in a_of]
        replays = 0

        def found(kind: str, step_a: int, step_b: int, who: str, detail: str):
            """The confirmed cause: `who`'s slice of B's step_b, against A's step_a."""
            va, vb, op = step_views(a, b, step_a, step_b)
            sl = next(s for s in b.step_plan(step_b).slices if s.request_id == who)
            co = co_batched(b, step_b, who)
            cause = RootCause(kind, None, list(range(sl.start, sl.start + sl.count)), va, vb, co,
                              finished_before(b, co, until_b), op=op)
            cause.confirmed, cause.confirm_detail = True, detail
            return cause, replays, None

        def fixed(k: int) -> bool:  # force the first k of b_steps
            return matches({sb: force_like_a(a, a_of[start], b, sb) for sb, start in b_steps[:k]})

        def matches(forced: dict) -> bool:
            nonlocal replays
            replays += 1
            same, exact, _ = _replay_matches(a, b, replayer, rd.id, forced, n)
            return exact if bitwise else same

        if not b_steps:
            return None, replays, f"no step of {label_b} up to {until_b} computed positions {label_a} computed too"
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
                             f"{_in_a_passes(rd.id, len(passes), label_a, label_b)}; {replays} replays)")
            return None, replays, (f"not found by replay: {rd.id}'s {len(b_steps)} steps up to {until_b}, every one "
                                   f"run as in {label_a}, still do not make it match (record KV hashes for a "
                                   f"bisection by the cache)")
        lo, hi = 0, len(b_steps)  # fixed(hi) holds; find the smallest such k
        while lo < hi:
            mid = (lo + hi) // 2
            if fixed(mid):
                hi = mid
            else:
                lo = mid + 1
        if lo == 0:
            return None, replays, f"not found by replay: {label_b} replayed with nothing forced already matches"
        step_b, start = b_steps[lo - 1]
        return found(STEP_COMPUTE if step_b == until_b else CACHE_CONTAMINATION, a_of[start], step_b, rd.id,
                     f"replaying {label_b} with its steps up to {step_b} run as in {label_a} {goal}, and without "
                     f"step {step_b} it does not ({replays} replays)")

    return bisect_one






