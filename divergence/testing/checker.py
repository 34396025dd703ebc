"""What the `divergence_check` fixture and the `reproducible` marker do: run
`assert_reproducible` with the session's settings (ini keys, options), with the
traces of each check in a folder named after the test, kept when it fails."""
from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest

from ..errors import DivergenceInputError
from .assertions import ReproducibilityError, assert_reproducible, assert_traces_equal
from .settings import Settings, artifact_name, check_marker_args

MARKER = "reproducible"
MARKER_ARGS = ("prompts", "model", "draft", "schedules", "policy", "spec_k", "max_tokens", "top_k",
               "token_budget", "dtype", "stop_at_eos", "confirm", "bitwise")


class ReproducibilityChecker:
    """Callable: `divergence_check(prompts, policy=..., ...)` is `assert_reproducible` with this
    session's defaults. After a call, `report` is its BisectReport and `traces` its trace paths
    (gone once a check passes, unless keep=True)."""

    def __init__(self, settings: Settings, nodeid: str, base_dir: Path):
        self.settings = settings
        self.nodeid = nodeid
        self.base_dir = base_dir  # artifacts dir, or a pytest temp dir
        self.calls = 0
        self.report = None
        self.traces: dict = {}

    def __call__(self, prompts, *, model=None, policy=None, max_tokens=None, top_k=None, confirm=None,
                 draft=None, keep: bool = False, bitwise=None, **kw):
        __tracebackhide__ = True
        s = self.settings
        # An Engine keeps its own policy and top-k unless they are given here.
        engine = model is not None and not isinstance(model, (str, os.PathLike))
        out = self._next_dir()
        try:
            self.report = assert_reproducible(
                model if model is not None else s.model, prompts,
                policy=policy if policy is not None or engine else s.policy,
                max_tokens=max_tokens if max_tokens is not None else s.max_tokens,
                top_k=top_k if top_k is not None or engine else s.top_k,
                confirm=confirm if confirm is not None else s.confirm,
                # the session's draft goes with the session's model, not with a model given here
                draft=draft if draft is not None else (s.draft if model is None else None),
                out_dir=out, keep=keep, bitwise=s.bitwise if bitwise is None else bool(bitwise), **kw)
        except ReproducibilityError as e:
            self.report, self.traces = e.report, e.traces
            raise
        self.traces = {p.stem: str(p) for p in out.glob("*.h5")} if keep else {}
        return self.report

    def traces_equal(self, a, b, *, confirm=None, model=None, draft=None, bitwise=None):
        """`assert_traces_equal` with this session's confirm and bitwise settings."""
        __tracebackhide__ = True
        c = self.settings.confirm if confirm is None else confirm
        bw = self.settings.bitwise if bitwise is None else bool(bitwise)
        self.report = assert_traces_equal(a, b, confirm=c, model=model, draft=draft, bitwise=bw)
        return self.report

    def _next_dir(self) -> Path:
        self.calls += 1
        name = artifact_name(self.nodeid) + (f"__{self.calls}" if self.calls > 1 else "")
        out = self.base_dir / name
        if out.is_dir():  # a previous session's traces of this test
            for p in out.glob("*.h5"):
                p.unlink()
        return out


def _failure(msg: str, *, report=None, traces=None):
    """pytest's own Failed, shown as its message alone (a marker has no test line to point at);
    it carries the report and the traces like a ReproducibilityError."""
    exc = pytest.fail.Exception(msg, pytrace=False)
    exc.report = report
    exc.traces = dict(traces or {})
    return exc


def run_marker(item, checker: ReproducibilityChecker) -> None:
    """Run the check that `@pytest.mark.reproducible(...)` asks for (closest marks win);
    fail with the report, or with one line for bad arguments."""
    __tracebackhide__ = True
    try:
        _run_marker(item, checker)
    except ReproducibilityError as e:
        raise _failure(str(e), report=e.report, traces=e.traces) from None
    except DivergenceInputError as e:
        raise _failure(f"divergence: @pytest.mark.{MARKER}: {e}") from None


def _run_marker(item, checker: ReproducibilityChecker) -> None:
    kwargs: dict = {}
    for mark in reversed(list(item.iter_markers(MARKER))):
        if len(mark.args) > 1:
            raise DivergenceInputError("prompts is the one positional argument")
        if mark.args:
            kwargs["prompts"] = mark.args[0]
        kwargs.update(mark.kwargs)
    # A parametrised test's arguments fill what the marks leave out:
    # @pytest.mark.parametrize("policy", [...]) + @pytest.mark.reproducible(prompts=[...]).
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name in MARKER_ARGS:
        if name not in kwargs and name in params:
            kwargs[name] = params[name]
    unknown = sorted(set(kwargs) - set(MARKER_ARGS))
    if unknown:
        raise DivergenceInputError(f"unknown argument(s) {', '.join(unknown)} (expected {', '.join(MARKER_ARGS)})")
    if "prompts" not in kwargs:
        raise DivergenceInputError(f"needs prompts, e.g. @pytest.mark.{MARKER}(prompts=['Return the number of'])")
    prompts = kwargs.pop("prompts")
    checker(prompts, **check_marker_args(kwargs))


def keep_artifacts(settings: Settings, nodeid: str, exc) -> list[str]:
    """Copy a failed check's traces into the artifacts folder (when they are elsewhere,
    e.g. a direct `assert_reproducible` call), with an HTML page of the report beside them.
    Returns the kept paths."""
    traces = getattr(exc, "traces", None)
    if settings.artifacts is None or not traces:
        return []
    dest = settings.artifacts / artifact_name(nodeid)
    kept = {}
    for label, src in traces.items():
        src = Path(src)
        if settings.artifacts.resolve() in src.resolve().parents:
            kept[label] = str(src)  # written there already
            continue
        if src.exists():
            dest.mkdir(parents=True, exist_ok=True)
            target = dest / f"{artifact_name(label)}.h5"
            shutil.copyfile(src, target)
            kept[label] = str(target)
    point_at_copies(exc, {str(traces[k]): v for k, v in kept.items()})
    return list(kept.values()) + (write_pages(getattr(exc, "report", None), kept) if kept else [])


def point_at_copies(exc, moved: dict) -> bool:
    """The failure's text ('To reproduce: ...') names the kept copies, not the temporary traces
    (copied away and soon deleted). True when it changed the text."""
    moved = {src: dst for src, dst in moved.items() if src != dst}
    if not moved:
        return False

    def sub(text: str) -> str:
        for src, dst in sorted(moved.items(), key=lambda kv: -len(kv[0])):  # longest first: no partial hits
            text = text.replace(shlex.quote(src), shlex.quote(dst)).replace(src, dst)
        return text

    changed = False
    if isinstance(getattr(exc, "msg", None), str):  # pytest's Failed (a marker's check)
        new = sub(exc.msg)
        changed |= new != exc.msg
        exc.msg = new
    if exc.args and isinstance(exc.args[0], str):  # ReproducibilityError (an AssertionError)
        new = sub(exc.args[0])
        changed |= new != exc.args[0]
        exc.args = (new, *exc.args[1:])
    return changed


def write_pages(report, paths: dict) -> list[str]:
    """The HTML page of each diverged pair, beside its kept traces: report.html (with more
    than two schedules, report-<schedule>.html per comparison). Returns what it wrote."""
    from ..analysis.html import write_html  # (lazy: loads numpy and matplotlib; the plugin imports this module)
    from ..trace.reader import Trace  # (lazy: loads h5py; the plugin imports this module)

    reports = report if isinstance(report, dict) else {None: report}
    out = []
    for key, rep in reports.items():
        if rep is None or not hasattr(rep, "diff") or rep.identical:
            continue
        d = rep.diff
        pa, pb = paths.get(d.label_a, d.path_a), paths.get(d.label_b, d.path_b)
        name = "report.html" if len(reports) == 1 else f"report-{artifact_name(str(key))}.html"
        try:
            with Trace.open(pa) as a, Trace.open(pb) as b:
                out.append(str(write_html(rep, a, b, Path(pb).parent / name)))
        except Exception as e:  # the page is extra: it must never hide the failure it explains
            out.append(f"(html report not written: {type(e).__name__}: {e})")
    return out
