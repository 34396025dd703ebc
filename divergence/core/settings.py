"""The engine settings, once: what a trace records (Engine.settings), what
Engine.from_settings reads back, what a run config asks for and what a replay of
another engine's trace runs under are all an EngineSettings."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .names import LOGITS

# the defaults every front end takes from here (Engine, RunConfig, run's and serve's flags)
DEFAULT_TOKEN_BUDGET = 256  # rows per engine step
DEFAULT_TOP_K = 8  # top-k logits recorded per token
DEFAULT_BLOCK_SIZE = 16  # KV positions per cache block


@dataclass(frozen=True)
class EngineSettings:
    policy: str = "native"
    token_budget: int = DEFAULT_TOKEN_BUDGET
    spec_k: int = 0
    top_k: int = DEFAULT_TOP_K
    block_size: int = DEFAULT_BLOCK_SIZE
    prefix_caching: bool = False
    stop_at_eos: bool = True
    prefill: str = "whole"  # where the prompt's last token is computed (engine.sched.scheduler.PREFILL_LAYOUTS)
    dtype: str | None = None  # the models' dtype (None: as stored)
    topk_values: str = LOGITS  # what the top-k records hold: logits, or mlx-lm's log-probs

    def to_dict(self) -> dict:
        """As a trace's settings hold them (topk_values only where it is not the default)."""
        d = asdict(self)
        if d["topk_values"] == LOGITS:
            del d["topk_values"]
        return d


# the keys Engine.from_settings passes to the Engine (dtype picks the models instead)
ENGINE_KEYS = tuple(f.name for f in fields(EngineSettings) if f.name != "dtype")
