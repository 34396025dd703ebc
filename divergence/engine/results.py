"""What a run returns: per-request outputs and run totals."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    id: str
    prompt_tokens: list[int]
    tokens: list[int]  # generated tokens
    text: str
    finish_reason: str
    error: str = ""
    topk_ids: list = field(default_factory=list)  # per generated token, np.int32 [k]
    topk_logits: list = field(default_factory=list)  # per generated token, np.float32 [k]
    proposed: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


@dataclass
class RunResult:
    schedule: str
    policy: str
    outputs: dict[str, RequestOutput]
    steps: int  # forward passes (target + draft)
    target_steps: int
    seconds: float
    blocks_in_use: int = 0  # KV blocks still held after the run (target + draft): 0, or a leak
    prefix_hits: int = 0  # prompt tokens served from the prefix cache

    @property
    def generated_tokens(self) -> int:
        return sum(len(o.tokens) for o in self.outputs.values())
