"""The replay confirmer bisect_traces asks for each cause: it climbs the rungs."""
from __future__ import annotations

from ..confirmation import BaseConfirmer, Confirmation
from .case import Case
from .replays import ForcingRefused, NotARerun, share_replay, step_of_token
from .rungs import DRAW_RUNGS, RUNGS, climb, unconfirmed


class ReplayConfirmer(BaseConfirmer):
    """This engine's replay of B, forced step by step toward A (a Confirmer of
    analysis.confirmation); the Confirmation says how the replay forced B (Confirmation.by).

    What must match: A's tokens up to the flip; where only the logits differ (--bitwise),
    A's logits bit for bit up to the first position where they differed. The rungs, in
    order (RUNGS): the cause step run as A ran it (rung_kernels); every suspect step forced
    (rung_suspects); those steps each request alone with A's rows (rung_solo); the prompt
    in A's prefill passes (rung_prefill). A sampler cause (the draft's q) is proved at the
    draw (DRAW_RUNGS); any sampled token under speculative decoding forces the draft's steps.
    """

    def __init__(self, a, b, replayer, label_a: str = "A", label_b: str = "B"):
        self.a, self.b, self.replayer, self.label_a, self.label_b = a, b, replayer, label_a, label_b

    def _case(self, cause, rd) -> Case:
        return Case(self.a, self.b, self.replayer, cause, rd, self.label_a, self.label_b)

    def confirm(self, cause, rd) -> Confirmation:
        if cause.kind == "sampler" and cause.model != "draft":
            return Confirmation(None, "a sampler cause with equal logits and no draft involved has no kernel to force")
        case = self._case(cause, rd)
        try:
            got, tried = climb(case, DRAW_RUNGS if cause.kind == "sampler" and cause.sampler is not None else RUNGS)
        except ForcingRefused as e:
            return Confirmation(False, f"the replay refused a forcing it needed ({e})", case.by_tried)
        except NotARerun as e:
            return Confirmation(False, f"not a valid re-run of {self.label_b}: {e}", case.by_tried)
        if got is None:
            got = unconfirmed(tried)
        why = case.full_because()
        return Confirmation(got.confirmed, f"{got.detail} (replayed in full: {why})" if why else got.detail, got.by)

    def prepare(self, pairs) -> None:
        """Before the causes are confirmed one by one: requests whose first forcing is the same
        (the same step forced the same way) get one sparse replay for all of them, which each
        one's confirmation then reads (analysis/confirm/replays.share_replay)."""
        groups: dict = {}
        for cause, rd in pairs:
            if cause.kind == "sampler":
                continue
            case = self._case(cause, rd)
            if case.at_draw:
                continue
            try:
                forced = {cause.b.step: case.force(cause.a.step, cause.b.step, cause.positions, cause.layer)}
            except (KeyError, ValueError):  # the rung itself will say why
                continue
            key = tuple(sorted((int(k), str(v)) for k, v in forced.items()))
            groups.setdefault(key, (forced, {}))[1][rd.id] = step_of_token(self.b, rd.id, case.n)
        for forced, until in groups.values():
            if len(until) > 1:
                share_replay(self.replayer, self.b, forced, until)
