"""B replayed with a forcing, checked to be B with only that change (analysis.rerun_check)
before its tokens or its draws are trusted."""
from __future__ import annotations

import numpy as np

from ...core.events import Observer
from ...core.policy import RelayoutStep, SoloStep
from ..cause import BY_REPLAY, BY_REPLAY_SOLO
from ..rerun_asks import asked_of_forcing
from ..rerun_check import check_rerun
from ..run_view import RunRecord


def replay_kind(forced: dict) -> str:
    """How a forcing replays B (a CONFIRMED_BY name): every forced step run as A ran it
    (request by request, A's rows) or, where any step runs on A's kernels, A's kernels."""
    return BY_REPLAY_SOLO if forced and all(isinstance(v, (SoloStep, RelayoutStep)) for v in forced.values()) \
        else BY_REPLAY


class ForcingRefused(Exception):
    """A forced replay that could not run (its relayout does not fit the recorded plans)."""


class NotARerun(Exception):
    """A replay that is not B with only the forced change (analysis.rerun_check): its
    tokens prove nothing; the message is the first difference."""


def check_replay(b, record, forced: dict, window=None, until: int | None = None) -> None:
    """Raise NotARerun unless the recorded replay is B with only `forced` changed (a sparse
    replay: on the steps it ran, for the requests it gives exactly; a replay that stopped after
    step `until` with nothing forced: up to that step)."""
    first = min(forced) if forced else (until + 1 if until is not None else None)
    got = check_rerun(b, record, first, asked_of_forcing(forced), window=window)
    if not got.valid:
        raise NotARerun(got.first_difference)


def _run_checked(replayer, b, forced: dict, focus, until, observers=()):
    """B replayed with `forced` for `focus`'s bits up to step `until`, checked to be B with
    only that change. A sparse replay (analysis/sparse.py) that cannot lay the window out or
    fails the check is not trusted: the replay runs again in full (its result then says why)."""
    if any(isinstance(v, RelayoutStep) for v in forced.values()):
        until = None  # a relayout moves the request's token sites (and may drop some): run to the end
    elif until is not None and forced:  # every forced step runs (the check reads each), a later draft step too
        until = max(until, max(int(s) for s in forced))
    why = None
    if focus is not None:
        record = RunRecord(kv_hashes=b.has_kv_hashes)
        try:
            got = replayer.run(b, forced=forced, observers=[*observers, record], focus=focus, stop_after=until)
        except ValueError as e:
            why = f"the sparse replay refused: {e}"
        else:
            if getattr(got, "window", None) is None:  # it ran the whole trace already (sparse off, or not known faithful here)
                check_replay(b, record, forced, until=until)
                return got
            try:
                check_replay(b, record, forced, got.window, until)
                return got
            except NotARerun as e:
                why = f"the sparse replay failed its re-run check: {e}"
    record = RunRecord(kv_hashes=b.has_kv_hashes)
    try:
        got = replayer.run(b, forced=forced, observers=[*observers, record], stop_after=until)
    except ValueError as e:  # a forcing the replay cannot lay out: this cause stays unconfirmed
        raise ForcingRefused(str(e)) from e
    check_replay(b, record, forced, until=until)
    got.full_because = why
    return got


def _memo(replayer) -> dict:
    """The replayer's checked replays (a replayer that takes no attributes: a fresh dict)."""
    memo = getattr(replayer, "_checked_replays", None)
    if memo is None:
        memo = {}
        try:
            replayer._checked_replays = memo
        except AttributeError:
            pass
    return memo


def checked_replay(replayer, b, forced: dict, *, focus=None, until: int | None = None):
    """Replay B with `forced`, checked to be B with only that change; memoised per replayer
    (the check records the replay, so a memoising replayer would not memoise it). focus,
    until: the requests whose bits are asked for, and the last step they are asked at (a
    sparse replay: analysis/sparse.py)."""
    memo = _memo(replayer)
    key = _memo_key(b, forced, focus, until)
    if key in memo and memo[key][0] is b:
        return memo[key][1]
    got = _run_checked(replayer, b, forced, focus, until)
    _remember(memo, key, b, got)
    return got


def _memo_key(b, forced: dict, focus, until) -> tuple:
    return (id(b), tuple(sorted((int(k), str(v)) for k, v in forced.items())),
            None if focus is None else tuple(sorted(focus)), until)


def _remember(memo: dict, key, b, got) -> None:
    memo[key] = (b, got)
    for k in list(memo)[:-64]:
        del memo[k]


def share_replay(replayer, b, forced: dict, until: dict) -> None:
    """One checked replay of B with `forced` for every request of `until` (request -> the last
    step its check reads), remembered as each one's own: their confirmations then replay
    nothing for this forcing. A sparse replay's bits of a request do not depend on which other
    requests it also gives (tests/analysis/test_sparse_replay.py), and its re-run check covers
    them all."""
    memo = _memo(replayer)
    steps = [s for s in until.values() if s is not None]
    got = _run_checked(replayer, b, forced, set(until), max(steps) if len(steps) == len(until) else None)
    for rid, last in until.items():
        _remember(memo, _memo_key(b, forced, {rid}, last), b, got)


def step_of_token(b, rid: str, n: int) -> int | None:
    """The B step that committed `rid`'s n-th generated token (the last a check reads)."""
    steps = b.tokens(rid).steps
    return int(steps[min(n, len(steps)) - 1]) if len(steps) and n > 0 else None


def replay_matches(a, b, replayer, rid: str, forced: dict, n: int,
                   scopes: list | None = None) -> tuple[bool, bool, int | None]:
    """Replay B with `forced`: (its first n tokens of `rid` are A's, and bit for bit with their
    top-k logits, the first of them that differs or None). Raises ForcingRefused where the
    replay cannot lay the forcing out. scopes: gets the replay's result (its window, or why
    it ran in full)."""
    got = checked_replay(replayer, b, forced, focus={rid}, until=step_of_token(b, rid, n))
    if scopes is not None:
        scopes.append(got)
    got = got.outputs[rid]
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


def draw_of(b, replayer, forced: dict, rid: str, position: int, purpose: str, until: int,
            scopes: list | None = None) -> dict:
    """B replayed with `forced` (checked to be a re-run of B): its draw of (request, position,
    purpose) up to step `until`, as recorded, or {}."""
    class Draws(Observer):
        wants_records = True

        def __init__(self):
            self.got = {}

        def on_run_start(self, info):  # a sparse replay retried in full starts again
            self.got = {}

        def on_record(self, table, **c):
            if table == "draws" and c["request"] == rid and c["position"] == position \
                    and c["purpose"] == purpose and c["step"] <= until:
                self.got = c

    rec = Draws()
    got = _run_checked(replayer, b, forced, {rid}, until, observers=[rec])
    if scopes is not None:
        scopes.append(got)
    return rec.got


def decides_like(story, got) -> bool:
    """The replay's draw `got` (its record) decides as A's draw of the story did."""
    if not got:
        return False
    if story.purpose == "accept":
        return (got["value"] < min(1.0, got["p"] / max(got["q"], 1e-30))) == story.a.accepted
    return int(got["token"]) == story.a.token
