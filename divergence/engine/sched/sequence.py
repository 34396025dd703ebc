"""The engine's state of one request: the scheduler writes it, the step loop reads it."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...core.request import Request

# Where the prompt's last token is computed. "whole": inside the prefill, whose last row's
# logits give token 1 (as vLLM and SGLang do). "mlx-lm": the prefill computes all but the
# last prompt token, which is the first decode step's input (as mlx-lm's generate_step and
# BatchGenerator do); at one request the engine's step shapes are then mlx-lm's, which on
# a GPU (GEMV at one row, GEMM above) is what makes its numbers mlx-lm's bit for bit.
WHOLE, MLX_LM = "whole", "mlx-lm"
PREFILL_LAYOUTS = (WHOLE, MLX_LM)


@dataclass(eq=False)
class Sequence:
    """The engine's state of one request. Only the Scheduler writes it, through its named
    methods (admission, what a step computed, acceptance, tokens, finish, cancel); the
    step loop, the speculative round and serve read it. One object per request: equal
    only to itself (its top-k arrays have no truth value to compare)."""

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
    # mlx-lm does (PREFILL_LAYOUTS)
    prefill_end: int = -1
    # each generated token's recorded top-k: ids and values (logits, or mlx-lm's log-probs)
    topk_ids: list = field(default_factory=list)
    topk_logits: list = field(default_factory=list)

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.request.prompt_tokens)
        if self.prefill_end < 0:
            self.prefill_end = self.prompt_len

    @classmethod
    def of(cls, request: Request, prefill: str = WHOLE) -> "Sequence":
        """A new request's state under a prefill layout (PREFILL_LAYOUTS)."""
        seq = cls(request)
        if prefill == MLX_LM:
            seq.prefill_end = seq.prompt_len - 1
        return seq

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
