"""A request as the user states it, and the engine's per-request state."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PromptError

# Ids of the requests that pre-fill the prefix cache in the `warm` schedule.
WARMUP_PREFIX = "warmup/"


@dataclass(frozen=True)
class Sampling:
    """Sampling settings of one request. temperature == 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

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
        if self.max_tokens < 1:
            raise PromptError(f"request {self.id!r}: max_tokens must be >= 1, got {self.max_tokens}")
        if self.arrival < 0:
            raise PromptError(f"request {self.id!r}: arrival must be >= 0, got {self.arrival}")


@dataclass
class Sequence:
    """The engine's state of one request. The scheduler writes it, the runner reads it."""

    request: Request
    tokens: list[int] = field(default_factory=list)  # prompt + generated, as committed
    num_cached: int = 0  # positions whose K/V are in the target cache
    draft_cached: int = 0  # positions whose K/V are in the draft cache
    finished: bool = False
    finish_reason: str = ""
    error: str = ""
    # speculative decoding bookkeeping
    proposed: int = 0
    accepted: int = 0
    pending_draft: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.request.prompt_tokens)

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_tokens)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def in_prefill(self) -> bool:
        # The last prompt token is fed in the prefill too: its logits give token 1.
        return self.num_cached < self.prompt_len
