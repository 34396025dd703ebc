"""A request as the user states it: prompt tokens, length, arrival and sampling."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PromptError
from .names import WARMUP_PREFIX  # noqa: F401  (re-exported)
from .rules import at_least_one


SEED_SPACE = 2**63  # seeds the engine takes (and a trace's int64 holds): 0 .. 2**63 - 1


def engine_seed(seed: int) -> int:
    """Any integer seed (the OpenAI API takes any) in the engine's seed space: seed mod 2**63,
    as Python's % gives it (-1 -> 2**63 - 1; 2**63 -> 0). Seeds already in 0 .. 2**63 - 1 are
    kept as they are. The mapped seed is the one a trace records and a re-run uses."""
    return int(seed) % SEED_SPACE


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request. temperature == 0 means greedy. seed: any integer,
    kept as engine_seed(seed)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.seed < SEED_SPACE:
            object.__setattr__(self, "seed", engine_seed(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class Request:
    """What a user asks for: a prompt (as token ids) and how much to generate."""

    id: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int = 64
    arrival: int = 0  # engine step at which it arrives (concurrent schedule)
    sampling: Sampling = Sampling()
    prompt_text: str | None = None

    def __post_init__(self):
        if not self.id:
            raise PromptError("a request needs a non-empty id")
        if len(self.prompt_tokens) == 0:
            raise PromptError(f"request {self.id!r}: the prompt is empty")
        at_least_one(f"request {self.id!r}: max_tokens", self.max_tokens)
        if self.arrival < 0:
            raise PromptError(f"request {self.id!r}: arrival must be >= 0, got {self.arrival}")
