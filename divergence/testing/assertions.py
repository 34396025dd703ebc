"""Reproducibility assertions: run the same requests under several schedules, and
when the outputs differ, fail with the bisect report (root cause, replay-confirmed).

    from divergence.testing import assert_reproducible
    assert_reproducible(None, ["Return the number of", "If the object"], policy="batch-invariant")

Nothing here imports MLX until a check runs.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ..core.names import BASE_SCHEDULES
from ..core.request import Request
from ..core.rules import at_least_one, schedules as parse_schedules
from ..errors import DivergenceInputError, ModelLoadError, PolicyError, PromptError
from .failure import Comparison, RunSummary, failure_text
from .settings import DEFAULT_MAX_TOKENS, DEFAULT_POLICY, DEFAULT_TOP_K, check_policy

DEFAULT_TOKEN_BUDGET = 256


class ReproducibilityError(AssertionError):
    """Raised when compared runs differ. The message is the report; `report` is the
    BisectReport (or {schedule: BisectReport} for more than two schedules), `traces`
    maps each schedule to its trace file (kept for the user to inspect)."""

    def __init__(self, text: str, *, report, traces: dict):
        super().__init__(text)
        self.report = report
        self.traces = dict(traces)


ReproducibilityError.__module__ = "divergence.testing"  # what pytest prints in front of the report


def assert_traces_equal(a, b, *, confirm: bool = False, model=None, draft=None, bitwise: bool = False):
    """Assert that two traces (paths or open `Trace`s) hold the same tokens (with `bitwise`,
    the same tokens and top-k logits, bit for bit).

    On a difference, raises ReproducibilityError with the bisect report (root cause
    from the KV hashes; with `confirm`, replayed to prove it, loading the model the
    trace names or `model` / `draft` if they moved). Returns the BisectReport."""
    __tracebackhide__ = True
    from ..trace.reader import Trace  # (lazy: loads h5py; the plugin imports this module)

    opened = []
    try:
        ta = _as_trace(a, opened, Trace)
        tb = _as_trace(b, opened, Trace)
        comparison = _compare(ta, tb, confirm=confirm, model_dir=model, draft_dir=draft, bitwise=bitwise)
    finally:
        for t in opened:
            t.close()
    if not comparison.report.identical:
        raise ReproducibilityError(failure_text([comparison]), report=comparison.report,
                                   traces={comparison.label_a: comparison.path_a,
                                           comparison.label_b: comparison.path_b})
    return comparison.report


def assert_reproducible(model, prompts, *, schedules=BASE_SCHEDULES, policy=None, spec_k=None,
                        max_tokens: int = DEFAULT_MAX_TOKENS, draft=None, top_k=None, token_budget=None,
                        dtype: str | None = None, stop_at_eos=None, confirm: bool = True, out_dir=None,
                        keep: bool = False, bitwise: bool = False):
    """Run `prompts` under each schedule with tracing; assert every schedule gives the first one's
    tokens (with `bitwise`, its tokens and top-k logits bit for bit).

    model: a model directory, an `Engine`, or None for the embedded fixture model
      (with spec_k > 0 the default draft is the fixture draft).
    prompts: strings, token-id lists, `Request`s or prompt-file dicts ({"prompt": ..., "arrival": 3}).
    policy / spec_k / top_k / token_budget / stop_at_eos: default native / 0 / 8 / 256 / True,
      or the Engine's own.
    confirm: replay each root-cause step with the other schedule's kernel to prove it.
    bitwise: equal tokens with other logits fail too (the standard of vLLM's determinism tests).
    out_dir: where the traces go (default: a temporary folder). They are deleted when
      the check passes (unless `keep`) and kept, and named in the message, when it fails.

    Raises ReproducibilityError (an AssertionError) whose text is the bisect report;
    bad arguments raise a DivergenceInputError. Returns the BisectReport (for more than
    two schedules, {schedule: BisectReport} against the first)."""
    __tracebackhide__ = True
    schedules = _check_schedules(schedules)
    items = _check_prompts(prompts)
    max_tokens = _positive("max_tokens", max_tokens)
    if top_k is not None:
        top_k = _positive("top_k", top_k)
    if token_budget is not None:
        token_budget = _positive("token_budget", token_budget)
    if spec_k is not None and (not isinstance(spec_k, int) or spec_k < 0):
        raise PromptError(f"spec_k must be an integer >= 0, got {spec_k!r}")
    if policy is not None:
        policy = _policy(policy)

    from ..engine.engine import Engine  # (lazy: loads MLX)

    if isinstance(model, Engine):
        subject = _EngineSubject(model, policy=policy, spec_k=spec_k, top_k=top_k, token_budget=token_budget,
                                 stop_at_eos=stop_at_eos)
        if draft is not None or dtype is not None:
            raise PromptError("draft and dtype are the Engine's own: pass them when constructing it")
    else:
        subject = _DirSubject(model, draft, policy=policy, spec_k=spec_k, top_k=top_k,
                              token_budget=token_budget, dtype=dtype, stop_at_eos=stop_at_eos)
    requests = _requests(items, subject.encode, max_tokens)
    subject.check(requests)

    made_dir = out_dir is None or not Path(out_dir).exists()
    out = Path(tempfile.mkdtemp(prefix="divergence-check-")) if out_dir is None else Path(out_dir)
    if out_dir is None:
        SCRATCH.append(out)  # kept when the check fails (its error names the traces); the plugin removes it
    out.mkdir(parents=True, exist_ok=True)
    try:
        paths, comparisons = _run_and_compare(subject, requests, schedules, out, confirm=confirm,
                                               bitwise=bitwise)
    except BaseException:
        if out_dir is None:  # nobody knows this folder: don't leave it behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    reports = {s: c.report for s, c in zip(schedules[1:], comparisons)}
    result = reports[schedules[1]] if len(schedules) == 2 else reports
    if not all(c.report.identical for c in comparisons):
        text = failure_text(comparisons, subject.summary(max_tokens))
        raise ReproducibilityError(text, report=result, traces={s: str(p) for s, p in paths.items()})
    if not keep:
        for p in paths.values():
            Path(p).unlink(missing_ok=True)
        if made_dir and not any(out.iterdir()):
            out.rmdir()
    return result


SCRATCH: list = []  # divergence-check-* folders made by checks in this process (testing.plugin removes them)


def _run_and_compare(subject, requests, schedules, out: Path, *, confirm: bool, bitwise: bool = False):
    """Run every schedule into out/<schedule>.h5; compare each against the first."""
    from ..trace.reader import Trace  # (lazy: loads h5py; the plugin imports this module)

    paths = subject.run(requests, schedules, out)
    comparisons = []
    with Trace.open(paths[schedules[0]]) as base:
        for s in schedules[1:]:
            with Trace.open(paths[s]) as other:
                comparisons.append(_compare(base, other, confirm=confirm, bitwise=bitwise))
    return paths, comparisons


# -- the subject: a model directory or a user's Engine -----------------------------------


class _DirSubject:
    """Models loaded (and cached per process) from directories, run through divergence.workloads.runner."""

    def __init__(self, model, draft, *, policy, spec_k, top_k, token_budget, dtype, stop_at_eos):
        __tracebackhide__ = True
        from ..workloads.runner import RunConfig, load_models  # (lazy: the plugin imports no workloads module)

        spec_k = spec_k or 0
        model_dir = _model_dir(model, "model", default="TARGET")
        draft_dir = _model_dir(draft, "draft", default="DRAFT") if spec_k else None
        if dtype is not None and dtype not in ("float32", "float16", "bfloat16"):
            raise PromptError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
        self.cfg = RunConfig(model=model_dir, draft=draft_dir, dtype=dtype, policy=policy or DEFAULT_POLICY,
                             spec_k=spec_k, token_budget=token_budget or DEFAULT_TOKEN_BUDGET,
                             top_k=top_k or DEFAULT_TOP_K,
                             stop_at_eos=True if stop_at_eos is None else bool(stop_at_eos))
        self.target, self.draft = load_models(self.cfg)

    def encode(self, text: str) -> list[int]:
        return self.target.encode(text)

    def check(self, requests) -> None:
        __tracebackhide__ = True
        from ..workloads.runner import make_engine, validate  # (lazy: the plugin imports no workloads module)

        self._engine = make_engine(self.cfg)  # refuses a bad budget / spec_k
        validate(self._engine, requests, top_k_name="top_k")  # the rules `divergence run` applies, once

    def run(self, requests, schedules, out: Path) -> dict:
        from ..workloads.runner import run_schedules  # (lazy: the plugin imports no workloads module)

        run_schedules(self.cfg, self.target, self.draft, requests, schedules, out,
                      engine=getattr(self, "_engine", None))
        return {s: out / f"{s}.h5" for s in schedules}

    def summary(self, max_tokens: int) -> RunSummary:
        return RunSummary(str(self.cfg.model), self.cfg.policy, self.cfg.spec_k, max_tokens)


class _EngineSubject:
    """A user's Engine, run as it is configured (policy / top_k / token_budget may be overridden
    for the check and are restored after); a TraceWriter is added to its observers per schedule."""

    def __init__(self, engine, *, policy, spec_k, top_k, token_budget, stop_at_eos):
        __tracebackhide__ = True
        self.engine = engine
        if spec_k is not None and spec_k != engine.spec_k:
            raise PromptError(f"spec_k={spec_k} but the Engine was built with spec_k={engine.spec_k} "
                              "(speculative decoding needs its draft model: build the Engine with it)")
        self.overrides = {}
        if policy is not None:
            from ..engine.kernels.dispatch import KernelPolicy  # (lazy: loads MLX)

            self.overrides["policy"] = KernelPolicy.parse(policy)
        if top_k is not None:
            self.overrides["top_k"] = top_k
        if stop_at_eos is not None:
            self.overrides["stop_at_eos"] = bool(stop_at_eos)
        if token_budget is not None:
            if token_budget < engine.spec_k + 1:
                raise PromptError(f"token budget {token_budget} is smaller than one verify "
                                  f"({engine.spec_k + 1} rows)")
            self.overrides["token_budget"] = token_budget

    def encode(self, text: str) -> list[int]:
        return self.engine.encode(text)

    def check(self, requests) -> None:
        __tracebackhide__ = True
        top_k, vocab = self.overrides.get("top_k", self.engine.top_k), getattr(self.engine, "vocab", None)
        if vocab and top_k > vocab:
            raise PromptError(f"top_k {top_k} is larger than the model's vocabulary ({vocab} tokens)")
        for r in requests:
            msg = self.engine.check(r)
            if msg:
                raise PromptError(msg)

    def run(self, requests, schedules, out: Path) -> dict:
        from ..trace.writer import TraceWriter  # (lazy: loads h5py; the plugin imports this module)

        e = self.engine
        saved = {k: getattr(e, k) for k in self.overrides}
        observers = list(e.observers)
        paths = {}
        try:
            for k, v in self.overrides.items():
                setattr(e, k, v)
            for s in schedules:
                path = out / f"{s}.h5"
                with TraceWriter(path, top_k=e.top_k, kv_hashes=True) as writer:
                    e.observers = observers + [writer]
                    e.run(requests, s)
                paths[s] = path
        finally:
            e.observers = observers
            for k, v in saved.items():
                setattr(e, k, v)
        return paths

    def summary(self, max_tokens: int) -> RunSummary:
        e = self.engine
        policy = str(self.overrides.get("policy", e.policy))
        return RunSummary(str(getattr(e.target, "path", "?")), policy, e.spec_k, max_tokens)


# -- comparing ---------------------------------------------------------------------------


def _compare(a, b, *, confirm: bool, model_dir=None, draft_dir=None, bitwise: bool = False) -> Comparison:
    # the same analysis as `divergence bisect` (analysis.pipeline), replays memoised
    from ..analysis.diff import pair_labels  # (lazy: loads numpy; the plugin imports this module)
    from ..analysis.pipeline import AnalysisOptions, analyze_pair  # (lazy: loads numpy; the plugin imports this module)

    label_a, label_b = pair_labels(a, b)
    opts = AnalysisOptions(confirm=confirm, bitwise=bitwise, model_dir=model_dir, draft_dir=draft_dir,
                           make_replayer=_memo_replayer, labels=(label_a, label_b))
    report = analyze_pair(a, b, opts)
    return Comparison(str(a.path), str(b.path), report, a.vocab, label_a, label_b)


def _memo_replayer(model_dir, draft_dir):
    """A Replayer that replays each (trace, forced steps) once: requests that share a
    root-cause step share its replay."""
    from ..analysis.replayer import Replayer  # (lazy: loads the BLAS)

    class MemoReplayer(Replayer):
        def __init__(self, **kw):
            super().__init__(**kw)
            self._runs: dict = {}

        def run(self, trace, *, forced=None, observers=(), **kw):
            if observers or kw:  # a recording replay, a tap, another environment: not memoised
                return super().run(trace, forced=forced, observers=observers, **kw)
            key = (id(trace), tuple(sorted((int(k), str(v)) for k, v in (forced or {}).items())))
            if key not in self._runs:
                self._runs[key] = super().run(trace, forced=forced)
            return self._runs[key]

    return MemoReplayer(model_dir=model_dir, draft_dir=draft_dir)


def _as_trace(x, opened: list, Trace):
    if isinstance(x, (str, os.PathLike)):
        t = Trace.open(x)
        opened.append(t)
        return t
    if not hasattr(x, "meta") or not hasattr(x, "tokens"):
        raise DivergenceInputError(f"expected a trace path or an open Trace, got {type(x).__name__}")
    return x


# -- argument checks: each a one-line DivergenceInputError -------------------------------


def _check_schedules(schedules) -> tuple:
    __tracebackhide__ = True
    return parse_schedules(schedules, to_compare=True)


def _check_prompts(prompts) -> list:
    __tracebackhide__ = True
    if isinstance(prompts, (str, dict)) or _is_token_list(prompts):
        prompts = [prompts]  # one prompt given bare
    try:
        items = list(prompts)
    except TypeError:
        raise PromptError(f"prompts must be a list of strings or token lists, got {type(prompts).__name__}") from None
    if not items:
        raise PromptError("prompts is empty: give at least one prompt (a string or a list of token ids)")
    return items


def _is_token_list(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(t, int) for t in x)


def _requests(items, encode, max_tokens: int) -> list:
    __tracebackhide__ = True
    from ..workloads.prompts import request_from_dict  # (lazy: the plugin imports no workloads module)

    out = []
    for i, p in enumerate(items, 1):
        rid = f"r{i}"
        where = f"prompt #{i}"
        if isinstance(p, Request):
            out.append(p)
        elif isinstance(p, dict):
            out.append(request_from_dict({"id": rid, "max_tokens": max_tokens, **p}, encode, where))
        elif isinstance(p, str):
            if not p:
                raise PromptError(f"{where} is an empty string")
            out.append(Request(rid, tuple(encode(p)), max_tokens=max_tokens, prompt_text=p))
        elif _is_token_list(p):
            out.append(Request(rid, tuple(int(t) for t in p), max_tokens=max_tokens))
        else:
            raise PromptError(f"{where}: expected a string or a non-empty list of token ids, got {p!r:.60}")
    ids = [r.id for r in out]
    if len(set(ids)) != len(ids):
        raise PromptError("request ids must be unique")
    return out


def _positive(name: str, value) -> int:
    __tracebackhide__ = True
    return at_least_one(name, value)


def _policy(policy) -> str:
    __tracebackhide__ = True
    try:
        return check_policy(policy)
    except DivergenceInputError as e:
        raise PolicyError(str(e)) from None


def _model_dir(value, what: str, *, default: str) -> Path:
    """A model directory, or the embedded fixture (TARGET / DRAFT) when value is None."""
    __tracebackhide__ = True
    if value is None:
        from .models import fixture_dirs  # (lazy: the plugin imports this module)

        return fixture_dirs()[("TARGET", "DRAFT").index(default)]
    if not isinstance(value, (str, os.PathLike)):
        raise ModelLoadError(f"{what} must be a model directory, an Engine or None, got {type(value).__name__}")
    path = Path(value).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{what} directory not found: {path}")
    return path
