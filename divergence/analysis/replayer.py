"""Replay a trace's exact schedule, optionally forcing kernels at chosen steps.

The one place where analysis reaches the engine: it loads the model the trace
names (refusing if its weights changed), re-executes every recorded step plan
teacher-forced, and reports fidelity against the original, bit for bit.
This is how `bisect --confirm` proves a root cause.
"""
from __future__ import annotations

import contextvars
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# the confirmation logic lives in analysis.confirm (engine-free); its names stay importable here
from .confirm import make_confirmer, make_replay_bisector  # noqa: F401
from .forcing import owner_of
from .relayout import admissions, relayout
from ..engine.kernels.blas import using_blas_threads
from ..core.names import BATCH_GENERATOR, LOGPROBS, REPLAYABLE_ENGINES
from ..errors import PolicyError, ReplayError
from .diff import DiffReport, diff_traces
from .environment import describe_blas, recorded, reproduction


@dataclass
class ReplayReport:
    source: str
    out: str | None
    forced: dict[int, str]
    faithful: bool
    tokens_equal: bool
    logits_equal: bool
    kv_equal: bool | None  # None when either trace has no KV hashes
    first_difference: dict | None  # {request, position} of the first token/logit difference
    kv_first_difference: dict | None
    seconds: float
    original_seconds: float
    diff: DiffReport | None = field(default=None, repr=False)
    draws_equal: bool | None = None  # the sampler's draws and their outcomes; None when either has none

    def to_json(self) -> dict:
        return {"source": self.source, "out": self.out, "forced": {str(k): v for k, v in self.forced.items()},
                "faithful": self.faithful, "tokens_equal": self.tokens_equal, "logits_equal": self.logits_equal,
                "kv_equal": self.kv_equal, "first_difference": self.first_difference,
                "kv_first_difference": self.kv_first_difference, "seconds": self.seconds,
                "original_seconds": self.original_seconds, "draws_equal": self.draws_equal}


def this_process() -> dict:
    """This process's numeric environment, without importing MLX (the BLAS loads, MLX does not)."""
    from importlib import metadata

    from ..engine.kernels.blas import blas_core, blas_in_use, blas_threads

    try:
        mlx = metadata.version("mlx")
    except metadata.PackageNotFoundError:  # pragma: no cover
        mlx = "unknown"
    return {"blas": blas_in_use(), "blas_core": blas_core(), "blas_threads": blas_threads(), "mlx": mlx}


def check_this_process(trace, want: dict | None = None) -> None:
    """Refuse to replay `trace` in this process when it is to run under another BLAS
    environment (`want`, default its recorded one): its bits would differ for that reason
    alone (a false mismatch). EnvironmentMismatchError, one line, saying what to do."""
    from ..errors import EnvironmentMismatchError

    want = recorded(trace) if want is None else want
    rep = reproduction(want, this_process())
    if rep.missing:
        raise EnvironmentMismatchError(f"{trace.path} cannot be replayed on this machine: {rep.missing[0]}")
    if rep.needs_child:
        raise EnvironmentMismatchError(
            f"{trace.path} was recorded under {describe_blas(want)}; this process runs "
            f"{describe_blas(this_process())}: replay it in a process started with {rep.describe()} "
            f"(the divergence CLI does so itself)")




def parse_force(items) -> dict:
    """['7:gemv', '12:gemm:4', '9:lm_head=gemv', '8:solo'] -> {step: policy, {op: policy}, or SOLO}.
    Checks the syntax, the op names and the kernels; `check_forced` checks them against a trace."""
    from ..core.names import ATTENTION, ATTENTION_KERNELS, OPS
    from ..core.policy import SOLO, SOLO_NAME, UNSHARDED, UNSHARDED_NAME

    out: dict = {}
    for item in items or ():
        step, sep, spec = str(item).partition(":")
        if not sep or not step.strip().isdigit():
            raise PolicyError(f"bad --force {item!r}: expected STEP:KERNEL or STEP:OP=KERNEL, e.g. 7:gemv")
        op, eq, kernel = spec.partition("=")
        if not eq:
            word = spec.strip().lower()
            if int(step) in out:
                raise PolicyError(f"bad --force {item!r}: step {int(step)} is already forced; force a step once "
                                  f"(one op at a time with STEP:OP=KERNEL)")
            out[int(step)] = SOLO if word == SOLO_NAME else UNSHARDED if word == UNSHARDED_NAME else _kernel(item, spec)
            continue
        if op not in OPS:
            raise PolicyError(f"bad --force {item!r}: unknown op {op!r} (ops: {', '.join(OPS)})")
        per_op = out.setdefault(int(step), {})
        if not isinstance(per_op, dict):
            raise PolicyError(f"bad --force {item!r}: step {step} is already forced as a whole")
        if kernel.strip().lower() == SOLO_NAME:
            raise PolicyError(f"bad --force {item!r}: solo applies to a whole step (STEP:solo), not to one op")
        if op in per_op:
            raise PolicyError(f"bad --force {item!r}: op {op} of step {step} is already forced; force it once")
        if kernel.strip().lower() == UNSHARDED_NAME:
            per_op[op] = UNSHARDED
            continue
        pol = _kernel(item, kernel)
        if (op == ATTENTION) != (pol.name in ATTENTION_KERNELS):
            raise PolicyError(f"bad --force {item!r}: attention takes {' or '.join(ATTENTION_KERNELS)}, "
                              f"the other ops linear kernels")
        per_op[op] = pol
    return out


def _kernel(item, text):
    from ..core.policy import KernelPolicy

    try:
        return KernelPolicy.parse(text)
    except PolicyError as e:
        raise PolicyError(f"bad --force {item!r}: {e}") from None


def check_forced(trace, forced: dict) -> None:
    """Refuse forcing that would silently do nothing: a step the trace does not have, or
    an op the trace's model never ran (e.g. lm_head=... on a draft step). PolicyError, one line."""
    if not forced:
        return
    steps = np.asarray(trace.steps["index"])
    have = set(int(x) for x in steps)
    span = f"steps {int(steps.min())}-{int(steps.max())}" if len(steps) else "no steps"
    from .tp import check_unsharded

    check_unsharded(trace, forced)
    for step, pol in sorted(forced.items()):
        if step not in have:
            raise PolicyError(f"--force {step}:{describe_forced({step: pol})[step]}: {trace.path} has no step "
                              f"{step} ({span})")
        if isinstance(pol, dict):
            ran = set(str(o) for o in trace.kernels(step=step)["op"])
            unknown = sorted(set(pol) - ran) if ran else []
            if unknown:
                raise PolicyError(f"--force {step}:{unknown[0]}=...: step {step} of {trace.path} ran no op "
                                  f"{unknown[0]!r} (it ran {', '.join(o for o in _op_order(ran))})")


def _op_order(ops) -> list[str]:
    from ..core.names import OPS

    return [o for o in OPS if o in ops] + sorted(o for o in ops if o not in OPS)


def describe_forced(forced: dict) -> dict[int, str]:
    return {step: (", ".join(f"{op}={p}" for op, p in pol.items()) if isinstance(pol, dict) else str(pol))
            for step, pol in forced.items()}


def check_replayable(trace) -> None:
    """Replay re-executes divergence's own engine: it takes traces of that engine, and of
    the engines it can stand in for (core.names.REPLAYABLE_ENGINES: mlx-lm's BatchGenerator,
    whose step plans it runs with BatchGenerator's prefill layout); others are refused."""
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
    return {"policy": "native", "token_budget": max(rows, s.get("token_budget") or 1), "spec_k": 0,
            "top_k": s.get("top_k") or trace.meta.get("top_k") or 8, "block_size": 16, "prefix_caching": False,
            "stop_at_eos": False, "prefill": "mlx-lm", "dtype": s.get("dtype"),
            "topk_values": s.get("topk_values", LOGPROBS)}


# A front end's progress display, (trace) -> engine Observer, set for the length of one command
# (cli/progress.py); every replay then reports its steps to it. None: no display.
REPLAY_PROGRESS: contextvars.ContextVar = contextvars.ContextVar("divergence_replay_progress", default=None)


class Replayer:
    """Replays traces; models come from the engine's one per-process cache."""

    def __init__(self, *, model_dir=None, draft_dir=None):
        self.model_dir = model_dir
        self.draft_dir = draft_dir

    def engine_for(self, trace, *, observers=()):
        from ..engine.engine import Engine

        check_replayable(trace)
        progress = REPLAY_PROGRESS.get()
        if progress is not None:
            observers = (*observers, progress(trace))
        meta = trace.meta
        from ..parallel.group import group_for

        return Engine.from_settings(engine_settings(trace), model=meta["model"], draft=meta.get("draft"),
                                    model_dir=self.model_dir, draft_dir=self.draft_dir, observers=observers,
                                    tp=group_for(trace))

    def run(self, trace, *, forced=None, observers=(), tap=None, stop_after: int | None = None,
            under: dict | None = None):
        """Replay in memory; returns the engine's RunResult. tap: an engine.replay.OpTap that
        records one step's op outputs for one request; stop_after: end after that step.
        under: the environment to run under (another trace's recorded one; default: its own)."""
        from ..engine.replay import TokenSite, recorded_draws, replay_plans

        check_forced(trace, forced or {})
        check_this_process(trace, under)  # another BLAS core would make every fp32 bit differ for that alone
        engine = self.engine_for(trace, observers=observers)
        sites = []
        for req in trace.requests:
            t = trace.tokens(req.id)
            sites += [TokenSite(int(st), req.id, int(p), int(sp)) for st, p, sp in zip(t.steps, t.positions, t.spec)]
        recorded = list(trace.iter_plans())
        forced = with_recorded_attention(trace, recorded, forced or {})
        plans, sites, forced = relayout(recorded, sites, forced, trace.requests)
        # under the recording's BLAS thread count: it is part of the fp32 numerics (engine/kernels/blas.py)
        env = under if under is not None else (trace.meta.get("environment") or {})
        with using_blas_threads(env.get("blas_threads")):
            return replay_plans(engine, list(trace.requests), plans, sites, schedule=trace.meta["schedule"],
                                forced=forced, draws=recorded_draws(trace), tap=tap, stop_after=stop_after,
                                admit_at=admissions(recorded, plans))

    def tap(self, trace, step: int, rid: str, *, under: dict | None = None):
        """One step's op output rows for one request (analysis.ops.OpRows), by a replay up to it."""
        from ..engine.replay import OpTap
        from .ops import OpRows

        tap = OpTap(step, rid)
        self.run(trace, tap=tap, stop_after=step, under=under)
        return OpRows(step, dict(tap.rows), tap.outputs, tap.order)

    def replay_to_file(self, trace, out, *, forced=None, under: dict | None = None) -> ReplayReport:
        from ..trace.reader import Trace
        from ..trace.writer import TraceWriter

        import os

        from ..core.atomic import temp_name

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


def with_recorded_attention(trace, plans, forced: dict) -> dict:
    """Every step not forced otherwise runs the attention kernel it recorded, so a replay
    stays bit for bit the recording when the rule that picks attention kernels changes;
    traces recorded before attention was a recorded op ran it per sequence."""
    from ..core.names import ATTENTION, PADDED, PER_SEQ
    from ..core.policy import KernelPolicy

    ks = trace.kernels()
    recorded: dict[int, str] = {}
    for step, op, kernel in zip(ks["step"], ks["op"], ks["kernel"]):
        if str(op) == ATTENTION:
            recorded.setdefault(int(step), str(kernel))
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


def fidelity(original, replayed, forced: dict, seconds: float, out: str | None) -> ReplayReport:
    d = diff_traces(original, replayed, bitwise=True)
    first = None
    tokens_equal = logits_equal = True
    for r in d.requests:
        if r.first_divergent_token is not None or r.len_a != r.len_b:
            tokens_equal = False
        if r.first_numeric_divergence is not None:
            logits_equal = False
            if first is None:
                first = {"request": r.id, "position": r.first_numeric_divergence.position}
    kv_equal, kv_first = None, None
    if original.has_kv_hashes and replayed.has_kv_hashes:
        kv_equal, kv_first = _compare_kv(original, replayed)
    draws_equal = _compare_draws(original, replayed)
    faithful = tokens_equal and logits_equal and kv_equal is not False and draws_equal is not False
    total = float(np.sum(original.steps["duration"])) if original.num_steps else 0.0
    return ReplayReport(str(original.path), out, describe_forced(forced), faithful, tokens_equal,
                        logits_equal, kv_equal, first, kv_first, seconds, total, d, draws_equal)


def _compare_draws(a, b) -> bool | None:
    """The same draws (step, request, position, purpose, u, token, outcome range), in any order."""
    from .sampler import has_draws

    if not (has_draws(a) and has_draws(b)):
        return None

    def rows(t):
        d = t.table("draws")
        ints = zip(*(np.asarray(d[c]).tolist() for c in ("step", "request", "position", "token")))
        bits = zip(*(np.asarray(d[c], np.float64).view(np.uint64).tolist() for c in ("value", "lo", "hi")))
        return sorted((i, str(p), f) for i, p, f in zip(ints, d["purpose"], bits))

    return rows(a) == rows(b)


def _compare_kv(a, b):
    """Every recorded K/V write, position by position, equal in both traces? Compared as
    sorted cells (step, model, request, layer, position, k, v): the order in which one
    step's writes were emitted, and how runs of positions were grouped, carry no meaning."""
    ca, cb = _kv_cells(a), _kv_cells(b)
    if len(ca) != len(cb):
        return False, {"reason": f"{len(ca)} vs {len(cb)} K/V positions written"}
    bad = np.flatnonzero((ca != cb).any(axis=1))
    if bad.size:
        step, model, req, layer, pos = (int(x) for x in cb[bad[0], :5])
        rid = b.requests[req].id if 0 <= req < len(b.requests) else str(req)
        return False, {"step": step, "request": rid, "layer": layer, "position": pos,
                       "reason": f"the K/V write of {rid} at step {step}, layer {layer}, position {pos} differs"}
    return True, None


def _kv_cells(trace) -> np.ndarray:
    w, h = trace.kv_writes(), trace.kv_hashes()
    count = np.asarray(w["count"], np.int64)
    if not count.size:
        return np.zeros((0, 7), np.uint64)
    rep = np.repeat(np.arange(count.size), count)
    within = np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)
    hrow = np.asarray(w["hash_offset"], np.int64)[rep] + within
    cols = [np.asarray(w["step"])[rep], np.asarray(w["model"])[rep], np.asarray(w["request"])[rep],
            np.asarray(w["layer"])[rep], np.asarray(w["start"])[rep] + within,
            np.asarray(h["k_hash"])[hrow], np.asarray(h["v_hash"])[hrow]]
    cells = np.stack([np.asarray(c).astype(np.int64).view(np.uint64) for c in cols], axis=1)
    return cells[np.lexsort(cells[:, ::-1].T)]


def replay(path, *, force=(), out=None, model_dir=None, draft_dir=None, environment_of=None,
           keep: bool = False) -> ReplayReport:
    """`divergence replay`: re-execute a trace, write the new trace, report fidelity.
    environment_of: another trace, whose recorded BLAS environment the replay runs under.
    Without `out` the new trace goes to a temporary directory that lives as long as the
    report (removed with it, or at exit), unless keep."""
    from ..trace.reader import Trace
    from .environment import recorded

    under = None
    if environment_of is not None:
        with Trace.open(environment_of) as other:
            under = recorded(other)
    forced = parse_force(force)
    with Trace.open(path) as trace:
        check_forced(trace, forced)
        if out is not None and trace.tp_degree > 1:
            from ..parallel.env import is_writer

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
    from .ops import first_op_difference

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
    from .environment_confirm import load_tap, replay_in_child

    with tempfile.TemporaryDirectory(prefix="divergence-tap-") as work:
        return load_tap(replay_in_child(trace, tap=(step, rid), model_dir=replayer.model_dir,
                                        draft_dir=replayer.draft_dir, workdir=work))
