"""The sampler's side of a divergence, from recorded draws (pure numpy): where u fell in
each trace, which draw first decided differently, and how far a probability moved."""
from __future__ import annotations

import numpy as np

from divergence.analysis.sampler import sampler_story
from divergence.core.names import DRAW_PURPOSES


class FakeTrace:
    """Just what analysis.sampler reads: a draws table and request indices."""

    def __init__(self, rows):
        cols = ("step", "request", "position", "purpose", "value", "token", "lo", "hi", "prev_token", "prev_lo",
                "next_token", "next_hi", "p", "q")
        self._t = {c: np.array([r.get(c, -1 if c.endswith("token") else np.nan) for r in rows]) for c in cols}
        self._t["purpose"] = np.array([DRAW_PURPOSES.index(r["purpose"]) for r in rows])
        self.meta = {}

    def table(self, name):
        assert name == "draws"
        return self._t

    def request_index(self, rid):
        return 0


def _draw(**kw):
    return dict(dict(step=5, request=0, position=9), **kw)


def test_a_sample_that_fell_in_the_neighbour_says_how_far_the_probability_moved():
    a = FakeTrace([_draw(purpose="sample", value=0.41237, token=7, lo=0.4110, hi=0.4126, prev_token=3,
                         prev_lo=0.30, next_token=8, next_hi=0.50, p=0.0016)])
    b = FakeTrace([_draw(purpose="sample", value=0.41237, token=8, lo=0.4105, hi=0.52, prev_token=7,
                         prev_lo=0.31, next_token=9, next_hi=0.6, p=0.1095)])
    s = sampler_story(a, b, "r1", 9, 5, 5, "serial", "concurrent")
    assert s.purpose == "sample" and not s.depends_on_draft
    assert s.text.startswith("u = 0.41237 (the sample at position 9) fell in token 7's interval [0.4110, 0.4126) "
                             "in serial and in token 8's [0.4105, 0.5200) in concurrent")
    # token 7's slice in B is [0.31, 0.4105): 0.1005, against 0.0016 in A
    assert abs(s.prob_moved - ((0.4105 - 0.31) - (0.4126 - 0.4110))) < 1e-12
    assert "token 7's probability moved by +0.099" in s.text


def test_the_accept_test_is_the_first_differing_draw_when_the_drafts_q_moved():
    same_draft = _draw(step=3, purpose="draft", value=0.2, token=7, lo=0.1, hi=0.3)
    a = FakeTrace([same_draft, _draw(purpose="accept", value=0.43, token=7, lo=0.0, hi=0.45, p=0.09, q=0.2)])
    b = FakeTrace([same_draft, _draw(purpose="accept", value=0.43, token=7, lo=0.40, hi=1.0, p=0.09, q=0.225),
                   _draw(purpose="residual", value=0.6, token=2, lo=0.5, hi=0.7)])
    s = sampler_story(a, b, "r1", 9, 5, 5)
    assert s.purpose == "accept" and s.depends_on_draft
    assert "fell below min(1, p/q) = 0.4500 in A (accepted) and above 0.4000 in B (rejected)" in s.text
    assert "the draft's q moved by +0.025" in s.text and "the target's p equal" in s.text


def test_no_story_without_draws_or_when_every_draw_agrees():
    d = [_draw(purpose="sample", value=0.5, token=4, lo=0.4, hi=0.6)]
    assert sampler_story(FakeTrace(d), FakeTrace(d), "r1", 9, 5, 5) is None
    assert sampler_story(FakeTrace(d), FakeTrace(d), "r1", 10, 5, 5) is None  # nothing drawn there
