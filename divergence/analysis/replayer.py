"""Replay a trace's exact schedule, optionally forcing kernels at chosen steps.

The one place where analysis reaches the engine: it loads the model the trace
names (refusing if its weights changed), re-executes every recorded step plan
teacher-forced, and reports fidelity against the original, bit for bit.
This is how `bisect --confirm` proves a root cause.
"""
from __future__ import annotations

import os
import tempfile
from importlib import metadata
from pathlib import Path

from ..core.atomic import temp_name
from ..core.names import ATTENTION, BATCH_GENERATOR, LOGPROBS, PADDED, PER_SEQ, REPLAYABLE_ENGINES
from ..core.policy import KernelPolicy
from ..core.settings import EngineSettings
from ..engine.kernels.blas import blas_core, blas_in_use, blas_threads, using_blas_threads
from ..errors import EnvironmentMismatchError, PolicyError, ReplayError
from ..parallel.env import is_writer
from ..trace.reader import Trace
from ..trace.redact import is_redacted
from ..trace.writer import TraceWriter
# the confirmation logic lives in analysis.confirm, forcing's words in force_spec and the
# report in fidelity (all engine-free); their names stay importable from the replayer too
from .confirm import ReplayConfirmer, make_replay_bisector  # noqa: F401
from .environment import describe_blas, recorded, reproduction
from .environment_confirm import load_tap, replay_in_child
from .fidelity import ReplayReport, fidelity
from .force_spec import check_forced, parse_force
from .forcing import owner_of
from .ops import OpRows, first_op_difference
from .replay_progress import REPLAY_PROGRESS
from .relayout import admissions, relayout
from .run_view import TracePlans
from .sparse import SparseWindow, plan_window


def this_process() -> dict:
    """This process's numeric environment, without importing MLX (the BLAS loads, MLX does not)."""
    try:
        mlx = metadata.version("mlx")
    except metadata.PackageNotFoundError:  # pragma: no cover
        mlx = "unknown"
    return {"blas": blas_in_use(), "blas_core": blas_core(), "blas_threads": blas_threads(), "mlx": mlx}


def check_this_process(trace, want: dict | None = None) -> None:
    """Refuse to replay `trace` in this process when it is to run under another BLAS
    environment (`want`, default its recorded one): its bits would differ for that reason
    alone (a false mismatch). EnvironmentMismatchError, one line, saying what to do."""
    want = recorded(trace) if want is None else want
    rep = reproduction(want, this_process())
    if rep.missing:
        raise EnvironmentMismatchError(f"{trace.path} cannot be replayed on this machine: {rep.missing[0]}")
    if rep.needs_child:
        raise EnvironmentMismatchError(
            f"{trace.path} was recorded under {describe_blas(want)}; this process runs "
            f"{describe_blas(this_process())}: replay it in a process started with {rep.describe()} "
            f"(the divergence CLI does so itself)")


def check_replayable(trace) -> None:
    """Replay re-executes divergence's own engine: it takes traces of that engine, and of
    the engines it can stand in for (core.names.REPLAYABLE_ENGINES: mlx-lm's BatchGenerator,
    whose step plans it runs with BatchGenerator's prefill layout); others are refused, and so
    is a redacted trace (its token ids are not the model's)."""
    if is_redacted(trace):
        raise ReplayError(f"{trace.path} is redacted (divergence redact): its token ids are permuted, and a replay "
                          f"needs the real ones; replay, or bisect --confirm, the original traces")
    engine = trace.meta.get("settings", {}).get("engine")
    if engine and engine not in REPLAYABLE_ENGINES:
        raise ReplayError(f"{trace.path} was recorded by {engine}; replay (and bisect --confirm) re-runs "
                          f"divergence's own engine, so it cannot re-execute this trace (bisect without "
                          f"--confirm still finds the root cause; bisect --confirm-cmd CMD confirms it "
                          f"through that engine)")


def engine_settings(trace) -> dict:
    """The engine settings a replay of this trace runs under. A BatchGenerator trace: native
    kernels (mlx-lm picks none), its prefill layout (all but the last prompt token, that one
    with the first decode step: the recorded plans already say so), its log-prob top-k
    values, and room for its largest step."""
    s = dict(trace.meta["settings"])
    if s.get("engine") != BATCH_GENERATOR:
        return s
    rows = max((p.rows for p in trace.iter_plans()), default=1)
    return EngineSettings(policy="native", token_budget=max(rows, s.get("token_budget") or 1), spec_k=0,
                          top_k=s.get("top_k") or trace.meta.get("top_k") or 8, prefix_caching=False,
                          stop_at_eos=False, prefill="mlx-lm", dtype=s.get("dtype"),
                          topk_values=s.get("topk_values", LOGPROBS)).to_dict()


class Replayer:
    """Replays traces; models come from the engine's one per-process cache."""

    def __init__(self, *, model_dir=None, draft_dir=None, sparse: bool = True):
        self.model_dir = model_dir
        self.draft_dir = draft_dir
        self.sparse = sparse  # False: every replay runs the whole trace (the reference a test compares with)

    def engine_for(self, trace, *, observers=()):
        from ..engine.engine import Engine  # (lazy: loads MLX)
        from ..parallel.group import group_for  # (lazy: loads MLX)

        check_replayable(trace)
        progress = REPLAY_PROGRESS.get()
        if progress is not None:
            observers = (*observers, progress(trace))
        meta = trace.meta
        return Engine.from_settings(engine_settings(trace), model=meta["model"], draft=meta.get("draft"),
                                    model_dir=self.model_dir, draft_dir=self.draft_dir, observers=observers,
                                    tp=group_for(trace))

    def run(self, trace, *, forced=None, observers=(), tap=None, stop_after: int | None = None,
            under: dict | None = None, focus=None):
        """Replay in memory; returns the engine's RunResult. tap: an engine.replay.OpTap that
        records one step's op outputs for one request; stop_after: end after that step.
        under: the environment to run under (another trace's recorded one; default: its own).
        focus: the requests whose bits the replay must give (None: all): only the steps they
        need run (analysis/sparse.py), the others' rows as stand-ins, where that is known to
        be faithful; the result's `window` says which (a SparseWindow), or `full_because` why
        the whole trace ran."""
        from ..engine.replay import replay_plans  # (lazy: loads MLX)

        check_forced(trace, forced or {})
        check_this_process(trace, under)  # another BLAS core would make every fp32 bit differ for that alone
        engine = self.engine_for(trace, observers=observers)
        window = None
        if focus is not None and self.sparse:
            window = plan_window(trace, focus, stop_after, forced_steps=(forced or {}).keys(),
                                 plans_in=lambda lo, hi: self._plans(trace, lo, hi))
        requests = list(trace.requests)
        if isinstance(window, SparseWindow):
            recorded = self._plans(trace, window.first, window.last)
            sites = self._sites(trace, window.real)
            sites = [x for x in sites if window.first <= x.step <= window.last]
            stand_ins = window.stand_ins
            # only the window's requests: the cache is sized for them, not for the whole trace
            requests = [r for r in requests if r.id in window.real or r.id in stand_ins]
        else:
            recorded = self._plans(trace)
            sites = self._sites(trace, None)
            stand_ins = frozenset()
        forced = with_recorded_attention(trace, recorded, forced or {}, self._attention(trace))
        plans, sites, forced = relayout(recorded, sites, forced, requests)
        # under the recording's BLAS thread count: it is part of the fp32 numerics (engine/kernels/blas.py)
        env = under if under is not None else (trace.meta.get("environment") or {})
        with using_blas_threads(env.get("blas_threads")):
            got = replay_plans(engine, requests, plans, sites, schedule=trace.meta["schedule"],
                               forced=forced, draws=self._draws(trace), tap=tap, stop_after=stop_after,
                               admit_at=admissions(recorded, plans), stand_ins=stand_ins)
        got.window = window if isinstance(window, SparseWindow) else None
        got.full_because = window if isinstance(window, str) else None
        return got

    # -- what every replay of one trace reads from it, read once (a bisect replays B many times)
    def _once(self, trace, key: str, load):
        memo = self.__dict__.setdefault("_per_trace", {})
        got = memo.get((id(trace), key))
        if got is None or got[0] is not trace:
            got = memo[(id(trace), key)] = (trace, load())
            for k in [k for k in memo if memo[k][0] is not trace and len(memo) > 32]:
                del memo[k]
        return got[1]

    def _plans(self, trace, first: int | None = None, last: int | None = None) -> list:
        """The recorded plans (of steps first..last), each read from the trace once."""
        if first is None:
            return self._once(trace, "plans", lambda: list(trace.iter_plans()))
        return self._once(trace, "plans_by_index", lambda: TracePlans(trace)).between(first, last)

    def _draws(self, trace) -> dict:
        from ..engine.replay import recorded_draws  # (lazy: loads MLX)

        return self._once(trace, "draws", lambda: recorded_draws(trace))

    def _attention(self, trace) -> dict:
        return self._once(trace, "attention", lambda: recorded_attention(trace))

    def _sites(self, trace, only) -> list:
        from ..engine.replay import TokenSite  # (lazy: loads MLX)

        def load(rid):
            t = trace.tokens(rid)
            return [TokenSite(int(st), rid, int(p), int(sp)) for st, p, sp in zip(t.steps, t.positions, t.spec)]

        out = []
        for req in trace.requests:
            if only is None or req.id in only:
                out += self._once(trace, f"sites:{req.id}", lambda: load(req.id))
        return out

    def tap(self, trace, step: int, rid: str, *, under: dict | None = None):
        """One step's op output rows for one request (analysis.ops.OpRows), by a replay up to it."""
        from ..engine.replay import OpTap  # (lazy: loads MLX)

        tap = OpTap(step, rid)
        try:  # only the steps the request's rows need (analysis/sparse.py)
            self.run(trace, tap=tap, stop_after=step, under=under, focus={rid})
        except ValueError:  # a window the replay could not lay out: the whole trace up to the step
            tap = OpTap(step, rid)
            self.run(trace, tap=tap, stop_after=step, under=under)
        return OpRows(step, dict(tap.rows), tap.outputs, tap.order)

    def replay_to_file(self, trace, out, *, forced=None, under: dict | None = None) -> ReplayReport:
        s = trace.meta["settings"]
        has_kv = trace.has_kv_hashes
        out = Path(out)
        tmp = temp_name(out, "partial")  # an existing `out` is only replaced by a whole replay
        try:
            with TraceWriter(tmp, top_k=s["top_k"], kv_hashes=has_kv) as writer:
                result = self.run(trace, forced=forced, observers=[writer], under=under)
            os.replace(tmp, out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with Trace.open(out) as replayed:
            return fidelity(trace, replayed, forced or {}, result.seconds, str(out))


def recorded_attention(trace) -> dict[int, str]:
    """step -> the attention kernel the trace recorded there."""
    ks = trace.kernels()
    recorded: dict[int, str] = {}
    for step, op, kernel in zip(ks["step"], ks["op"], ks["kernel"]):
        if str(op) == ATTENTION:
            recorded.setdefault(int(step), str(kernel))
    return recorded


def with_recorded_attention(trace, plans, forced: dict, recorded: dict | None = None) -> dict:
    """Every step not forced otherwise runs the attention kernel it recorded, so a replay
    stays bit for bit the recording when the rule that picks attention kernels changes;
    traces recorded before attention was a recorded op ran it per sequence."""
    recorded = recorded_attention(trace) if recorded is None else recorded
    # another engine's trace records no attention kernels: a BatchGenerator trace gets its
    # calls (every slice of a step in one masked call), others the native rule
    engine = trace.meta.get("settings", {}).get("engine")
    default = PADDED if engine == BATCH_GENERATOR else None if recorded or engine else PER_SEQ
    out = dict(forced)
    for p in plans:
        kernel = recorded.get(p.index, default)
        if kernel is None or p.index in out:
            continue
        try:
            out[p.index] = {ATTENTION: KernelPolicy.parse(kernel)}
        except PolicyError:  # another engine's attention kernel name: nothing of ours to pin
            continue
    return out


def replay(path, *, force=(), out=None, model_dir=None, draft_dir=None, environment_of=None,
           keep: bool = False) -> ReplayReport:
    """`divergence replay`: re-execute a trace, write the new trace, report fidelity.
    environment_of: another trace, whose recorded BLAS environment the replay runs under.
    Without `out` the new trace goes to a temporary directory that lives as long as the
    report (removed with it, or at exit), unless keep."""
    under = None
    if environment_of is not None:
        with Trace.open(environment_of) as other:
            under = recorded(other)
    forced = parse_force(force)
    with Trace.open(path) as trace:
        check_forced(trace, forced)
        if out is not None and trace.tp_degree > 1:
            out = out if is_writer() else None  # tensor parallel: rank 0 alone writes where asked
        scratch = None
        if out is None:
            if keep:
                tmp = tempfile.mkdtemp(prefix="divergence-replay-")
            else:  # its finalizer removes it with the report (the CLI reads the trace first), or at exit
                scratch = tempfile.TemporaryDirectory(prefix="divergence-replay-")
                tmp = scratch.name
            out = Path(tmp) / (Path(path).stem + ".replay.h5")
        report = Replayer(model_dir=model_dir, draft_dir=draft_dir).replay_to_file(trace, out, forced=forced,
                                                                                   under=under)
        if scratch is not None:
            report._scratch = scratch
        return report


def make_op_finder(a, b, replayer: Replayer, label_a: str = "A", label_b: str = "B"):
    """Returns find(cause, request_diff) -> (OpDifference | None, detail) for bisect_traces.

    Replays each trace up to its root-cause step (unforced: bitwise the recording), with
    every op's output rows of that step recorded for the request whose K/V the cause
    names (a prefix-cache hit's owner where the request itself was not in the step), and
    compares them position by position: the first op whose bits differ."""
    seen: dict = {}

    def record(trace, step: int, rid: str):  # -> analysis.ops.OpRows
        key = (id(trace), step, rid)
        if key not in seen:
            if reproduction(recorded(trace), this_process()).needs_child:  # recorded under another BLAS core
                seen[key] = tap_in_child(trace, step, rid, replayer)
            else:
                seen[key] = replayer.tap(trace, step, rid)
        return seen[key]

    def find(cause, rd):
        ra = owner_of(a, cause.a.step, rd.id, cause.positions, cause.layer)
        rb = owner_of(b, cause.b.step, rd.id, cause.positions, cause.layer)
        if ra is None or rb is None:
            return None, "the root-cause steps do not both compute the request's rows"
        d = first_op_difference(record(a, cause.a.step, ra), record(b, cause.b.step, rb),
                                only=cause.positions)
        if d is None:
            return None, (f"every op's output rows are bitwise equal in {label_a} step {cause.a.step} and "
                          f"{label_b} step {cause.b.step} for the positions both computed")
        return d, ""

    return find


def tap_in_child(trace, step: int, rid: str, replayer: Replayer):
    """Replayer.tap in a `divergence replay` child process under the trace's own recorded
    environment (its OpenBLAS core, which this process cannot switch to)."""
    with tempfile.TemporaryDirectory(prefix="divergence-tap-") as work:
        return load_tap(replay_in_child(trace, tap=(step, rid), model_dir=replayer.model_dir,
                                        draft_dir=replayer.draft_dir, workdir=work))
