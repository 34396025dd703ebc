"""For traces recorded without KV hashes: the cause found by a binary search of replays."""
from __future__ import annotations

from ...core.policy import SOLO
from ..bisect import co_batched, finished_before
from ..cause import BY_REPLAY_PREFILL, CACHE_CONTAMINATION, STEP_COMPUTE, ReplayBisection, RootCause
from ..confirmation import Confirmation
from ..forcing import force_like_a, forcing_words, prefill_as_a
from ..step_view import step_views
from .replays import ForcingRefused, NotARerun, replay_kind, replay_matches
from .rungs import in_a_passes_words


def make_replay_bisector(a, b, replayer, label_a: str = "A", label_b: str = "B"):
    """For traces recorded without KV hashes: binary search over B's steps. Returns
    bisect_one(request_diff) -> ReplayBisection (analysis.cause): the cause or None, the
    replays run, why none was found or None, and the cause's Confirmation: the search's
    replays prove the cause they find.

    f(m) = "replaying B with its target steps < m (those holding the request) run on
    the kernels of A's step that computed the same positions makes the request match
    A up to the flip". The smallest m with f(m) true names the latest step that had
    to be forced: O(log steps) replays, each one a proof rather than a correlation.
    """

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
        except ForcingRefused as e:
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
            return ReplayBisection(cause, replays, None, Confirmation(True, detail, by))

        def forcing(k: int) -> dict:  # the first k of b_steps, each as A's step of the same positions
            return {sb: force_like_a(a, a_of[start], b, sb) for sb, start in b_steps[:k]}

        def fixed(k: int) -> bool:
            return matches(forcing(k))

        def matches(forced: dict) -> bool:
            nonlocal replays
            replays += 1
            same, exact, _ = replay_matches(a, b, replayer, rd.id, forced, n)
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
                             f"{in_a_passes_words(rd.id, len(passes), label_a, label_b)}; {replays} replays)",
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
