"""The engine's state of one request: the scheduler writes it, the step loop reads it."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...core.request import Request

@dataclass
class Sequence:
    """The engine's state of one request. The scheduler writes it, the runner reads it."""

    request: Request
    tokens: list[int] = field(default_factory=list)  # prompt + generated, as committed
    num_cached: int = 0  # positions whose K/V are in the target cache
    draft_cached: int = 0  # positions whose K/V are in the draft cache
    finished: bool = False
    finish_reason: str = ""
    # speculative decoding bookkeeping
    proposed: int = 0
    accepted: int = 0
    # positions the prefill computes: the whole prompt (its last row's logits give token 1),
    # or all but the last prompt token, which is then the first decode step's input, as
    # mlx-lm does (scheduler.PREFILL_LAYOUTS)
    prefill_end: int = -1

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.request.prompt_tokens)
        if self.prefill_end < 0:
            self.prefill_end = self.prompt_len

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
        return self.num_cached < self.prefill_end
