"""The engine: models, settings, and runs of request lists (the loop is in run.py).

    engine = Engine(load_model(path), policy="native")
    result = engine.run([Request("r1", tuple(engine.encode("Hello")), max_tokens=32)], schedule="concurrent")
    result.outputs["r1"].text

`Engine.from_settings(trace.meta["settings"], model=trace.meta["model"], ...)`
rebuilds the engine a trace was recorded with (what replay and the runner use).
"""
from __future__ import annotations

from ..core.events import Observer
from ..core.names import LOGITS, TOPK_VALUES
from ..core.request import Request
from ..core.rules import at_least_one, check_schedule
from ..core.settings import DEFAULT_BLOCK_SIZE, DEFAULT_TOKEN_BUDGET, DEFAULT_TOP_K, ENGINE_KEYS, EngineSettings
from ..errors import PromptError, ReplayError
from .kernels.dispatch import KernelPolicy
from .kernels.environment import environment
from .model.forward import PackedForward
from .model.loading import LoadedModel, load_cached
from .results import RequestOutput, RunResult
from .run import Run
from .speculative import draft_width
from .vocab import pieces as vocab_pieces
from .sched.scheduler import PREFILL_LAYOUTS, WHOLE

__all__ = ["Engine", "RequestOutput", "RunResult", "Run", "environment"]


class Engine:
    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None = None,
        *,
        policy="native",
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        spec_k: int = 0,
        top_k: int = DEFAULT_TOP_K,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        prefix_caching: bool = False,
        stop_at_eos: bool = True,
        observers: list[Observer] | tuple = (),
        tp=None,
        prefill: str = WHOLE,
        overlap: bool = True,
        topk_values: str = LOGITS,
        compiled_step: bool | None = None,
    ):
        """tp: the parallel.group.TensorParallel of this process's group (None: one device).
        prefill: where the prompt's last token is computed, "whole" (in the prefill) or
        "mlx-lm" (in the first decode step, as mlx-lm does: at one request the engine's
        numbers are then mlx-lm's on any backend; see scheduler.PREFILL_LAYOUTS).
        overlap: queue the next step while one computes (results are bitwise the same;
        off only to measure what it buys).
        topk_values: what the top-k records hold, "logits" or mlx-lm's "logprobs" (a replay of
        a BatchGenerator trace compares with its log-probs).
        compiled_step: run plain native decode steps as compiled graphs (the same bits;
        None: where proved, model/compiled_step.py)."""
        self.target = target
        self.draft = draft if spec_k > 0 else None
        if spec_k > 0 and draft is None:
            raise PromptError("speculative decoding (spec_k > 0) needs a draft model")
        if spec_k < 0:
            raise PromptError(f"spec_k must be >= 0, got {spec_k}")
        self.policy = KernelPolicy.parse(policy)
        self.spec_k = spec_k
        if token_budget < spec_k + 1:
            raise PromptError(f"token budget {token_budget} is smaller than one verify ({spec_k + 1} rows)")
        at_least_one("top_k", top_k)
        if prefill not in PREFILL_LAYOUTS:
            raise PromptError(f"unknown prefill layout {prefill!r} (expected {' or '.join(PREFILL_LAYOUTS)})")
        if topk_values not in TOPK_VALUES:
            raise PromptError(f"unknown topk_values {topk_values!r} (expected {' or '.join(TOPK_VALUES)})")
        self.topk_values = topk_values
        self.prefill = prefill
        self.token_budget = token_budget
        self.top_k = top_k
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.stop_at_eos = stop_at_eos
        self.observers = list(observers)
        self.overlap = overlap
        self._target_fwd = PackedForward(target, compiled=compiled_step)
        self._draft_fwd = PackedForward(self.draft, compiled=compiled_step) if self.draft else None
        # the columns the draft proposes from (its head may be padded otherwise than the target's)
        self.draft_width = None
        if self._draft_fwd is not None:
            self.draft_width = draft_width(target, self.draft, self._target_fwd.head.n, self._draft_fwd.head.n)
        # tensor parallel: both models sharded for this rank (their dispatchers then
        # record each all-reduce like a kernel choice)
        self.tp = tp if tp is not None and tp.size > 1 else None
        if self.tp is not None:
            for fwd in (self._target_fwd, self._draft_fwd):
                if fwd is not None:
                    self.tp.shard(fwd)
        eos = getattr(target.tokenizer, "eos_token_ids", None) or []
        self.eos_ids = set(int(t) for t in eos)
        self.vocab = self._target_fwd.head.n
        self._vocab: list[str] | None = None

    @classmethod
    def from_settings(cls, settings: dict, *, model: dict | None = None, draft: dict | None = None,
                      model_dir=None, draft_dir=None, observers=(), **kw) -> "Engine":
        """The engine a trace's settings describe. model / draft: the trace's model records
        (path, dtype, weights_hash); model_dir / draft_dir load from elsewhere, and the
        weights must still hash as recorded. Models come from one per-process cache."""
        dtype = settings.get("dtype")
        target = _load(model_dir, model, dtype, "model")
        d = None
        if settings.get("spec_k") and (draft_dir or draft):
            d = _load(draft_dir, draft, (draft or {}).get("dtype", dtype), "draft")
        opts = {k: settings[k] for k in ENGINE_KEYS if k in settings}  # (core/settings.py)
        return cls(target, d, observers=list(observers), **opts, **kw)

    # -- convenience -------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.target.encode(text)

    def decode(self, tokens) -> str:
        return self.target.decode(tokens)

    def vocab_pieces(self) -> list[str]:
        """Each token id decoded alone: traces store it so readers need no tokenizer. Built on
        first use, once per loaded model: every engine over that model (a sweep's, a bench's,
        a replay's) shares it."""
        if self._vocab is None:
            memo = self.target.info.setdefault("_vocab_pieces", {})  # the info dict rides with the model
            if self.vocab not in memo:
                memo[self.vocab] = vocab_pieces(self.target, self.vocab)
            self._vocab = memo[self.vocab]
        return self._vocab

    def settings(self) -> dict:
        s = EngineSettings(str(self.policy), self.token_budget, self.spec_k, self.top_k, self.block_size,
                           self.prefix_caching, self.stop_at_eos, self.prefill, self.target.dtype, self.topk_values)
        return {**s.to_dict(), **({"tp": self.tp.describe()} if self.tp is not None else {})}

    def check(self, req: Request) -> str:
        """Why a request cannot run ('' when it can)."""
        if any(t < 0 or t >= self.vocab for t in req.prompt_tokens):
            return f"request {req.id!r}: prompt has token ids outside the vocabulary (0..{self.vocab - 1})"
        ctx = self.target.context_length
        need = len(req.prompt_tokens) + req.max_tokens + self.spec_k
        if ctx and need > ctx:
            return (f"request {req.id!r}: prompt ({len(req.prompt_tokens)} tokens) + max_tokens ({req.max_tokens})"
                    f" exceeds the model's context of {ctx} tokens")
        return ""

    # -- runs ------------------------------------------------------------------------
    def run(self, requests: list[Request], schedule: str = "serial", *, strict: bool = True) -> RunResult:
        """Run requests under a schedule. strict: a bad request raises PromptError;
        otherwise it is reported in its output and the others run."""
        check_schedule(schedule)
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise PromptError("request ids must be unique")
        if not requests:
            raise PromptError("no requests to run")
        errors = {r.id: self.check(r) for r in requests}
        bad = {k: v for k, v in errors.items() if v}
        if bad and strict:
            raise PromptError(next(iter(bad.values())))
        return Run(self, requests, schedule, bad=bad).execute()

    def recorded_run(self, requests: list[Request], schedule: str, *, forced: dict | None = None) -> Run:
        """A run that replay drives with a trace's recorded plans (see replay.step_recorded);
        `forced`: step -> kernel policy (or SOLO), as `replay --force` parses them."""
        return Run(self, requests, schedule, forced=forced, recorded=True)

    # -- events -------------------------------------------------------------------------
    def emit(self, event: str, *args, only: str | None = None, **columns) -> None:
        """The engine's one way out: call `event` (a core.events.Observer method name) on
        each observer; `only`: on those whose attribute of that name is true (on_record goes
        to observers that want records)."""
        for ob in self.observers:
            if only is None or getattr(ob, only, False):
                getattr(ob, event)(*args, **columns)

    def wants(self, attr: str) -> bool:
        """Whether an observer asks for the work `attr` names (Observer.wants_kv_hashes, ...)."""
        return any(getattr(ob, attr, False) for ob in self.observers)



def _load(path, info: dict | None, dtype, what: str) -> LoadedModel:
    if path is None and not info:
        raise ReplayError(f"no {what} to load: the settings name none and no directory was given")
    from pathlib import Path

    if path is None and not Path(info["path"]).exists():
        raise ReplayError(f"the trace's {what} {info['path']} does not exist here (pass --{what} DIR)")
    m = load_cached(path or info["path"], dtype=dtype if dtype else (info or {}).get("dtype"))
    want = (info or {}).get("weights_hash")
    if want and m.weights_hash != want:
        raise ReplayError(f"model weights at {m.path} differ from the ones the trace was recorded with "
                          f"({m.weights_hash[:12]} vs {str(want)[:12]})")
    return m
