"""One cause of one request to confirm: what the rungs share and ask of the traces and the engine."""
from __future__ import annotations

from ..bisect import draft_step
from ..forcing import force_like_a, forcing_words, prefill_as_a
from .replays import decides_like, draw_of, replay_kind, replay_matches
from .suspects import draft_pairs, is_greedy, suspect_steps


class Case:
    """One cause of one request to confirm, and what its rungs share: the replayer, what must
    match (A's tokens up to the flip, or with --bitwise A's logits bit for bit up to the first
    difference), the suspect steps and the sentences. The rungs reach the engine through
    `force`, `check`, `decision`, `suspects`, `passes` only (a test can stand in for them)."""

    def __init__(self, a, b, replayer, cause, rd, label_a: str = "A", label_b: str = "B"):
        self.a, self.b, self.replayer, self.cause, self.rd = a, b, replayer, cause, rd
        self.label_a, self.label_b = label_a, label_b
        self.replays = 0
        self.scopes: list = []  # each replay's result: its sparse window, or why it ran in full
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

    def full_because(self) -> str | None:
        """Why a replay of this case ran the whole trace where a sparse one was asked for."""
        return next((g.full_because for g in self.scopes if getattr(g, "full_because", None)), None)

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
        return replay_matches(self.a, self.b, self.replayer, self.rd.id, forced, n, self.scopes)

    def decision(self, forced: dict, position: int, purpose: str, until: int) -> dict:
        """The replay's own draw of (request, position, purpose) with these steps forced."""
        self._replayed(forced)
        return draw_of(self.b, self.replayer, forced, self.rd.id, position, purpose, until, self.scopes)

    def check(self, forced: dict) -> tuple[bool, str, int | None]:
        """(B replayed with `forced` matches A as it must, the words of how exactly, where it
        first differs)."""
        story, tok = self.story, self.tok
        if self.at_draw:  # B's plans carry B's proposals: match up to the flip, then the draw itself
            same, bitwise, first = self.matches(forced, self.n - 1)
            decided = same and decides_like(story, self.decision(forced, story.position, story.purpose,
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
            da, db = draft_step(a, rd.id, self.pos, self.step_a), draft_step(b, rd.id, self.pos, self.step_b)
            pairs = suspect_steps(a, b, rd.id, self.pos, da, db, "draft") if da is not None and db is not None \
                else {}
        elif tok is not None or self.logits_only:
            pairs = suspect_steps(a, b, rd.id, self.pos, self.step_a, self.step_b)
        else:
            pairs = {}
        pairs[cause.b.step] = cause.a.step
        if tok is not None and not is_greedy(b, rd.id):
            # a sampled token under speculative decoding also hangs on the draft's q: its steps too
            pairs.update({sb: sa for sb, sa in draft_pairs(a, b, rd.id, tok.step_a, tok.step_b).items()
                          if sb not in pairs})
        self._pairs = pairs
        return pairs

    def draw_suspects(self) -> dict[int, int]:
        """A sampler cause's steps to force: the draft steps whose K/V the draw's q read differently."""
        a, b, rd, cause, tok = self.a, self.b, self.rd, self.cause, self.rd.first_divergent_token
        da, db = draft_step(a, rd.id, tok.position, tok.step_a), draft_step(b, rd.id, tok.position, tok.step_b)
        pairs = suspect_steps(a, b, rd.id, tok.position, da, db, "draft") if da is not None and db is not None else {}
        pairs[cause.b.step] = cause.a.step
        return pairs

    def passes(self) -> dict:
        """B's steps that compute the request's prompt in A's prefill passes (prefill_as_a)."""
        return prefill_as_a(self.a, self.b, self.rd.id, self.step_b + 1)
