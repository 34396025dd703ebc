"""The rungs of a confirmation, strongest claim first: each forces B a little more like A and
says what it found (RungResult); `climb` tries them in order."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...core.policy import SOLO, RelayoutStep, SoloStep
from ..cause import BY_REPLAY_PREFILL, BY_REPLAY_SOLO
from .case import Case
from .replays import decides_like, replay_kind


@dataclass
class RungResult:
    """What one rung of a confirmation found. confirmed None: the rung did not apply (nothing
    to force beyond an earlier rung's). forced: the forcing B was replayed with (B step ->
    forcing); replays: the checks it ran; first: where the request still differed (a generated
    index, or a position's offset from the prompt's end with --bitwise); by: how it confirmed
    (a CONFIRMED_BY name of analysis.cause)."""

    rung: str
    confirmed: bool | None
    detail: str = ""
    forced: dict = field(default_factory=dict)
    replays: int = 0
    first: int | None = None
    by: str | None = None


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
    passes = case.passes()
    if not passes:
        return RungResult("prefill", None, "the prompt was computed in A's passes already")
    forced = {**{sb: SOLO for sb in case.suspects()}, **passes}
    n0 = case.replays
    ok, exact, first = case.check(forced)
    what = f"replaying {case.label_b} with {case.words(forced)}"
    detail = (f"{what} {case.goal}{exact}, where {in_a_passes_words(case.rd.id, len(passes), case.label_a, case.label_b)})"
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
    ok = decides_like(story, case.decision(forced, story.position, story.purpose, tok.step_b))
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
    ok = decides_like(story, case.decision(forced, story.position, story.purpose, tok.step_b))
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


def in_a_passes_words(rid: str, n: int, label_a: str, label_b: str) -> str:
    """Why a confirmation computed the request's prompt in A's prefill passes (prefill_as_a)."""
    return (f"{rid}'s prompt had to be computed in {label_a}'s {n} prefill passes (its chunks in {label_b} "
            f"straddle them")
