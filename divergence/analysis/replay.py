"""Replay a trace's exact schedule, optionally forcing kernels at chosen steps.

The one place where analysis reaches the engine: it loads the model the trace
names (refusing if its weights changed), re-executes every recorded step plan
teacher-forced, and reports fidelity against the original, bit for bit.
This is how `bisect --confirm` proves a root cause.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core.labels import label_policy
from ..errors import PolicyError, ReplayError
from .diff import DiffReport, diff_traces


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


def parse_force(items) -> dict:
    """['7:gemv', '12:gemm:4', '9:lm_head=gemv', '8:solo'] -> {step: policy, {op: policy}, or SOLO}.
    Checks the syntax, the op names and the kernels; `check_forced` checks them against a trace."""
    from ..core.names import ATTENTION, ATTENTION_KERNELS, OPS
    from ..core.policy import SOLO, SOLO_NAME, UNSHARDED, UNSHARDED_NAME, KernelPolicy

    out: dict = {}
    for item in items or ():
        step, sep, spec = str(item).partition(":")
        if not sep or not step.strip().isdigit():
            raise PolicyError(f"bad --force {item!r}: expected STEP:KERNEL or STEP:OP=KERNEL, e.g. 7:gemv")
        op, eq, kernel = spec.partition("=")
        if not eq:
            word = spec.strip().lower()
            out[int(step)] = SOLO if word == SOLO_NAME else UNSHARDED if word == UNSHARDED_NAME else _kernel(item, spec)
            continue
        if op not in OPS:
            raise PolicyError(f"bad --force {item!r}: unknown op {op!r} (ops: {', '.join(OPS)})")
        per_op = out.setdefault(int(step), {})
        if not isinstance(per_op, dict):
            raise PolicyError(f"bad --force {item!r}: step {step} is already forced as a whole")
        if kernel.strip().lower() == SOLO_NAME:
            raise PolicyError(f"bad --force {item!r}: solo applies to a whole step (STEP:solo), not to one op")
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
    """Replay re-executes divergence's own engine: traces another engine recorded (e.g.
    mlx-lm's BatchGenerator through divergence.mlxlm_batch) cannot be replayed."""
    engine = trace.meta.get("settings", {}).get("engine")
    if engine:
        raise ReplayError(f"{trace.path} was recorded by {engine}; replay (and bisect --confirm) re-runs "
                          f"divergence's own engine, so it cannot re-execute this trace (bisect without "
                          f"--confirm still finds the root cause; bisect --confirm-cmd CMD confirms it "
                          f"through that engine)")


class Replayer:
    """Replays traces; models come from the engine's one per-process cache."""

    def __init__(self, *, model_dir=None, draft_dir=None):
        self.model_dir = model_dir
        self.draft_dir = draft_dir

    def engine_for(self, trace, *, observers=()):
        from ..engine.engine import Engine

        check_replayable(trace)
        meta = trace.meta
        from ..engine.tp import group_for

        return Engine.from_settings(meta["settings"], model=meta["model"], draft=meta.get("draft"),
                                    model_dir=self.model_dir, draft_dir=self.draft_dir, observers=observers,
                                    tp=group_for(trace))

    def run(self, trace, *, forced=None, observers=(), tap=None, stop_after: int | None = None):
        """Replay in memory; returns the engine's RunResult. tap: an engine.replay.OpTap that
        records one step's op outputs for one request; stop_after: end after that step."""
        from ..engine.replay import TokenSite, recorded_draws, replay_plans

        check_forced(trace, forced or {})
        engine = self.engine_for(trace, observers=observers)
        sites = []
        for req in trace.requests:
            t = trace.tokens(req.id)
            sites += [TokenSite(int(st), req.id, int(p), int(sp)) for st, p, sp in zip(t.steps, t.positions, t.spec)]
        plans = list(trace.iter_plans())
        forced = with_recorded_attention(trace, plans, forced or {})
        return replay_plans(engine, list(trace.requests), plans, sites, schedule=trace.meta["schedule"],
                            forced=forced, draws=recorded_draws(trace), tap=tap, stop_after=stop_after)

    def replay_to_file(self, trace, out, *, forced=None) -> ReplayReport:
        from ..trace.reader import Trace
        from ..trace.writer import TraceWriter

        s = trace.meta["settings"]
        has_kv = trace.has_kv_hashes
        with TraceWriter(out, top_k=s["top_k"], kv_hashes=has_kv) as writer:
            result = self.run(trace, forced=forced, observers=[writer])
        with Trace.open(out) as replayed:
            return fidelity(trace, replayed, forced or {}, result.seconds, str(out))


def with_recorded_attention(trace, plans, forced: dict) -> dict:
    """Every step not forced otherwise runs the attention kernel it recorded, so a replay
    stays bit for bit the recording when the rule that picks attention kernels changes;
    traces recorded before attention was a recorded op ran it per sequence."""
    from ..core.names import ATTENTION, PER_SEQ
    from ..core.policy import KernelPolicy

    ks = trace.kernels()
    recorded: dict[int, str] = {}
    for step, op, kernel in zip(ks["step"], ks["op"], ks["kernel"]):
        if str(op) == ATTENTION:
            recorded.setdefault(int(step), str(kernel))
    default = None if recorded else PER_SEQ
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


def replay(path, *, force=(), out=None, model_dir=None, draft_dir=None) -> ReplayReport:
    """`divergence replay`: re-execute a trace, write the new trace, report fidelity."""
    from ..trace.reader import Trace

    forced = parse_force(force)
    with Trace.open(path) as trace:
        check_forced(trace, forced)
        if out is not None and trace.tp_degree > 1:
            from ..tp_launch import is_writer

            out = out if is_writer() else None  # tensor parallel: rank 0 alone writes where asked
        if out is None:
            tmp = tempfile.mkdtemp(prefix="divergence-replay-")
            out = Path(tmp) / (Path(path).stem + ".replay.h5")
        return Replayer(model_dir=model_dir, draft_dir=draft_dir).replay_to_file(trace, out, forced=forced)


def _as_a(a_step_kernels: dict, a_rows: dict | None = None) -> dict:
    """Force a B step to run every op with the kernel A's step used for it. A `native`
    op that A ran on one row is forced to `gemv` (the native op one row at a time): on
    a backend whose native kernel depends on the row count, that is A's kernel."""
    from ..core.policy import KernelPolicy

    out = {}
    for op, lbl in a_step_kernels.items():
        if lbl == "native" and a_rows is not None and a_rows.get(op) == 1:
            lbl = "gemv"
        out[op] = KernelPolicy.parse(label_policy(lbl))
    return out


def force_like_a(a, step_a: int, b, step_b: int, rid: str | None = None, positions=None, layer=None, *,
                 alone: bool = False):
    """How to make B's step compute what A's did. Where the kernel labels differ (the
    engine's own kernels), run each op on A's kernel. Where they are the same (`native`
    on both sides: a real backend whose kernels we do not choose), the difference is
    the batch itself, so run each request of the step alone (SOLO), as A's did; and so
    where A's experts ran on several kernels (one per expert's row count). Attention is
    left out of the comparison: a step alone runs it per sequence, as A's did. Where,
    besides, A's step computed the request's positions as another span (a prefill that
    B split by the prefix cache or by chunking), B's step computes A's span in one pass
    (RelayoutStep): on a backend whose kernels depend on the row count, only A's rows do.
    alone: run the step as A ran it (SOLO / RelayoutStep) whatever the kernel labels."""
    from ..core.names import ATTENTION
    from ..core.policy import SOLO, RelayoutStep
    from .bisect import step_kernels

    ka = step_kernels(a, step_a)
    kb = step_kernels(b, step_b)
    same = {o: k for o, k in ka.items() if o != ATTENTION} == {o: k for o, k in kb.items() if o != ATTENTION}
    if same or alone or _mixed_experts(a, step_a):
        if rid is not None and a.step_plan(step_a).model == b.step_plan(step_b).model:
            oa, ob = _owner(a, step_a, rid, positions, layer), _owner(b, step_b, rid, positions, layer)
            sa, sb = _slice_of(a, step_a, oa), _slice_of(b, step_b, ob)
            # a span that starts later than B's would need B's earlier positions from a cache it
            # never had: only spans that start as early or earlier (recomputing) are forced
            if sa is not None and sb is not None and (sa.start, sa.count) != (sb.start, sb.count) \
                    and sa.start <= sb.start and sa.start + sa.count <= _known_len(b, ob):
                return RelayoutStep(ob, sa.start, sa.start + sa.count)
        return SOLO
    return _as_a(ka, _rows_per_op(a, step_a))


def _known_len(trace, rid: str) -> int:
    """Positions whose input tokens the trace knows for a request: prompt and generated tokens."""
    req = next(r for r in trace.requests if r.id == rid)
    return len(req.prompt_tokens) + len(trace.tokens(rid).tokens)


def _slice_of(trace, step: int, rid: str | None):
    if rid is None:
        return None
    return next((s for s in trace.step_plan(step).slices if s.request_id == rid), None)


def _mixed_experts(trace, step: int) -> bool:
    """Did A's step run its experts on more than one kernel (threshold:N picks per expert
    from the rows it received)? No single kernel then reproduces it: SOLO does."""
    from ..core.names import EXPERTS

    ks = trace.kernels(step=step)
    sel = ks["op"] == EXPERTS
    return len({(str(k), int(s)) for k, s in zip(ks["kernel"][sel], ks["splits"][sel])}) > 1


def _forcing_words(forced: dict, label_a: str) -> str:
    from ..core.policy import RelayoutStep, SoloStep

    steps = sorted(forced)
    shown = ", ".join(map(str, steps[:6])) + (f" and {len(steps) - 6} more" if len(steps) > 6 else "")
    solo = [s for s in steps if isinstance(forced[s], (SoloStep, RelayoutStep))]
    noun = "step" if len(steps) == 1 else "steps"
    spans = [forced[s] for s in steps if isinstance(forced[s], RelayoutStep)]
    span = ""
    if spans:
        r = spans[0]
        more = f" (and {len(spans) - 1} more spans)" if len(spans) > 1 else ""
        span = f", {r.request_id}'s positions {r.start}-{r.end - 1} computed in one pass as {label_a} did{more}"
    if len(solo) == len(steps):
        return f"{noun} {shown} run request by request (each request alone, as in {label_a}){span}"
    if not solo:
        return f"{noun} {shown} run on {label_a}'s kernels"
    return (f"{noun} {shown} run as in {label_a} ({len(solo)} request by request, the rest on {label_a}'s "
            f"kernels){span}")


def _rows_per_op(trace, step: int) -> dict:
    ks = trace.kernels(step=step)
    out: dict = {}
    for op, rows in zip(ks["op"], ks["rows"]):
        out.setdefault(str(op), int(rows))
    return out


def _suspect_steps(a, b, rid: str, pos: int, step_a: int, step_b: int, model: str = "target") -> dict[int, int]:
    """B step -> A step: the step that computed the divergent row (predicting `pos`), and
    every step that wrote K/V it read differently from A's (their rows or kernels differ)."""
    from .bisect import step_kernels

    pairs: dict[int, int] = {step_b: step_a}
    la = a.live_kv(rid, model=model, at_step=step_a)
    lb = b.live_kv(rid, model=model, at_step=step_b)
    a_cell = {(int(l), int(p)): (int(s), int(k), int(v))
              for l, p, s, k, v in zip(la["layer"], la["position"], la["step"], la["k_hash"], la["v_hash"]) if p < pos}
    for l, p, s, k, v in zip(lb["layer"], lb["position"], lb["step"], lb["k_hash"], lb["v_hash"]):
        got = a_cell.get((int(l), int(p)))
        if p < pos and got is not None and (got[1], got[2]) != (int(k), int(v)):
            pairs.setdefault(int(s), got[0])
    # native labels hide row-count classes: a native step whose rows differ is a suspect too
    return {sb: sa for sb, sa in sorted(pairs.items())
            if step_kernels(a, sa) != step_kernels(b, sb) or _rows_per_op(a, sa) != _rows_per_op(b, sb)
            or sb == step_b}


def _greedy(trace, rid: str) -> bool:
    return next(r for r in trace.requests if r.id == rid).sampling.greedy


def _draft_pairs(a, b, rid: str, until_a: int, until_b: int) -> dict[int, int]:
    """B draft step -> A draft step, for B's draft steps of the request up to the flip, each
    paired with A's latest draft step that predicted the same position (its q)."""
    from .bisect import draft_step, step_kernels

    out: dict[int, int] = {}
    for plan in b.iter_plans():
        if plan.model != "draft" or plan.index >= until_b:
            continue
        for s in plan.slices:
            if s.request_id == rid:
                sa = draft_step(a, rid, s.start + s.count, until_a)
                if sa is not None and (step_kernels(a, sa) != step_kernels(b, plan.index)
                                       or _rows_per_op(a, sa) != _rows_per_op(b, plan.index)):
                    out[plan.index] = sa
    return out


def make_confirmer(a, b, replayer: Replayer, label_a: str = "A", label_b: str = "B"):
    """Returns confirm(cause, request_diff) -> (confirmed, detail) for bisect_traces.

    What must match: A's tokens up to the flip; where only the logits differ (--bitwise),
    A's logits bit for bit up to the first position where they differed. First the strong
    claim: B with only the root-cause step run as A ran it (A's kernels, or request by
    request where both are `native`). If other steps also differ, the weaker one: B with
    every suspect step forced (the divergent row's step, and every step whose K/V writes
    it read differently). A sampler cause (the draft's q) forces the draft's steps, and so
    does any sampled token under speculative decoding. Where A's kernels do not reproduce
    A's numbers, the steps run as A ran them: each request alone, with A's rows.
    """
    from ..core.policy import RelayoutStep, SoloStep

    def matches(rid: str, forced: dict, n: int) -> tuple[bool, bool, int | None]:
        got = replayer.run(b, forced=forced).outputs[rid]
        ta = a.tokens(rid)
        want = [int(t) for t in ta.tokens[:n]]
        same = list(got.tokens[:n]) == want
        la = np.asarray(ta.topk_logits[:n], np.float32).view(np.uint32)
        lb = np.asarray(got.topk_logits[:n], np.float32).reshape(-1, la.shape[1]).view(np.uint32)
        bitwise = same and la.shape == lb.shape and bool((la == lb).all())
        first = next((i for i, (x, y) in enumerate(zip(got.tokens, want)) if int(x) != y), None)
        if first is None and not bitwise and la.shape == lb.shape:
            bad = np.flatnonzero((la != lb).any(axis=1))
            first = int(bad[0]) if bad.size else None
        return same, bitwise, first

    def decision(forced: dict, rid: str, position: int, purpose: str, until: int):
        """The replay's own draw of (request, position, purpose) with these steps forced."""
        from ..core.events import Observer

        class Draws(Observer):
            wants_records = True

            def __init__(self):
                self.got = {}

            def on_record(self, table, **c):
                if table == "draws" and c["request"] == rid and c["position"] == position \
                        and c["purpose"] == purpose and c["step"] <= until:
                    self.got = c

        rec = Draws()
        replayer.run(b, forced=forced, observers=[rec])
        return rec.got

    def _decides_like(story, got) -> bool:
        """The replay's draw `got` (its record) decides as A's draw of the story did."""
        if not got:
            return False
        if story.purpose == "accept":
            return (got["value"] < min(1.0, got["p"] / max(got["q"], 1e-30))) == story.a.accepted
        return int(got["token"]) == story.a.token

    def confirm_draw(cause, rd):
        """A sampler cause: B's plans carry B's own proposals (teacher-forced), so the proof is
        at the decision itself: with the draft's step run as A ran it, the draw that decided
        differently (proposal, accept test, residual) decides as it did in A."""
        story, tok = cause.sampler, rd.first_divergent_token
        want = story.a

        def same(got) -> bool:
            return _decides_like(story, got)

        what_a = (("accept" if want.accepted else "reject") + f" token {want.token}" if story.purpose == "accept"
                  else f"draw token {want.token}")
        forced = {cause.b.step: force_like_a(a, cause.a.step, b, cause.b.step, rd.id, cause.positions, cause.layer)}
        name = "accept test" if story.purpose == "accept" else f"{story.purpose} draw"
        goal = f"makes the {name} of {rd.id} at position {story.position} {what_a}, as in {label_a}"
        if same(decision(forced, rd.id, story.position, story.purpose, tok.step_b)):
            return True, f"replaying {label_b} with {_forcing_words(forced, label_a)} {goal}"
        from .bisect import draft_step

        da, db = draft_step(a, rd.id, tok.position, tok.step_a), draft_step(b, rd.id, tok.position, tok.step_b)
        pairs = _suspect_steps(a, b, rd.id, tok.position, da, db, "draft") if da is not None and db is not None else {}
        pairs[cause.b.step] = cause.a.step
        if len(pairs) > 1:
            forced2 = {sb: force_like_a(a, sa, b, sb, rd.id) for sb, sa in pairs.items()}
            forced2[cause.b.step] = forced[cause.b.step]
            if same(decision(forced2, rd.id, story.position, story.purpose, tok.step_b)):
                return True, (f"replaying {label_b} with {_forcing_words(forced2, label_a)} {goal} (step "
                              f"{cause.b.step} alone does not: {len(pairs) - 1} other "
                              f"{'steps differ' if len(pairs) > 2 else 'step differs'} too)")
        return False, (f"replaying {label_b} with {_forcing_words(forced, label_a)}: the {story.purpose} draw of "
                       f"{rd.id} at position {story.position} still decides otherwise than in {label_a}")

    def confirm(cause, rd):
        tok, num = rd.first_divergent_token, rd.first_numeric_divergence
        if cause.kind == "sampler" and cause.model != "draft":
            return None, "a sampler cause with equal logits and no draft involved has no kernel to force"
        if cause.kind == "sampler" and cause.sampler is not None:
            return confirm_draw(cause, rd)
        logits_only = tok is None and num is not None
        if logits_only:  # tokens equal, logits not (--bitwise): prove it on the bits
            n, pos, step_a, step_b = num.position - rd.prompt_len + 1, num.position, num.step_a, num.step_b
        else:
            n = (tok.generated_index + 1) if tok is not None else rd.compared
            pos, step_a, step_b = (tok.position, tok.step_a, tok.step_b) if tok else (0, 0, 0)
        goal = (f"makes {rd.id}'s logits equal {label_a}'s bit for bit up to position {pos}, where they first "
                f"differed") if logits_only else f"makes {rd.id} match {label_a} up to the divergence"

        story = cause.sampler if tok is not None else None
        at_draw = story is not None and story.depends_on_draft  # the flip was the draft's own draw
        if at_draw:
            goal = f"makes {rd.id} match {label_a}"

        def check(forced):
            if at_draw:  # B's plans carry B's proposals: match up to the flip, then the draw itself
                same, bitwise, first = matches(rd.id, forced, n - 1)
                decided = same and _decides_like(story, decision(forced, rd.id, story.position, story.purpose,
                                                                 tok.step_b))
                exact = (f" up to the flip, and there the {story.purpose} draw decides as in {label_a}"
                         + (", bit for bit" if bitwise else " (some logits still differ)"))
                return decided, exact, (first if not same else tok.generated_index)
            same, bitwise, first = matches(rd.id, forced, n)
            ok = bitwise if logits_only else same
            exact = "" if logits_only else (", bit for bit" if bitwise else " (tokens; some logits still differ)")
            return ok, exact, first

        forced = {cause.b.step: force_like_a(a, cause.a.step, b, cause.b.step, rd.id, cause.positions, cause.layer)}
        what = f"replaying {label_b} with {_forcing_words(forced, label_a)}"
        ok, exact, first = check(forced)
        if ok:
            return True, f"{what} {goal}{exact}"
        if cause.model == "draft":
            from .bisect import draft_step

            da, db = draft_step(a, rd.id, pos, step_a), draft_step(b, rd.id, pos, step_b)
            pairs = _suspect_steps(a, b, rd.id, pos, da, db, "draft") if da is not None and db is not None else {}
        elif tok is not None or logits_only:
            pairs = _suspect_steps(a, b, rd.id, pos, step_a, step_b)
        else:
            pairs = {}
        pairs[cause.b.step] = cause.a.step
        if tok is not None and not _greedy(b, rd.id):
            # a sampled token under speculative decoding also hangs on the draft's q: its steps too
            pairs.update({sb: sa for sb, sa in _draft_pairs(a, b, rd.id, tok.step_a, tok.step_b).items()
                          if sb not in pairs})
        where = (lambda i: f"position {rd.prompt_len + i}") if logits_only else (lambda i: f"generated #{i}")
        forced2 = forced
        if len(pairs) > 1:
            forced2 = {sb: force_like_a(a, sa, b, sb, rd.id) for sb, sa in pairs.items()}
            forced2[cause.b.step] = forced[cause.b.step]
            ok2, exact2, first2 = check(forced2)
            if ok2:
                return True, (f"replaying {label_b} with {_forcing_words(forced2, label_a)} {goal}{exact2} "
                              f"(step {cause.b.step} alone does not: {len(pairs) - 1} other "
                              f"{'steps differ' if len(pairs) > 2 else 'step differs'} too)")
        # A's kernels were not enough (e.g. the engine's own gemm is built of native matmuls
        # whose rows depend on the row count, as fp32 on OpenBLAS): run the steps as A ran
        # them, each request alone with A's rows, whatever the kernels
        if any(not isinstance(v, (SoloStep, RelayoutStep)) for v in forced2.values()):
            forced3 = {sb: force_like_a(a, sa, b, sb, rd.id, cause.positions if sb == cause.b.step else None,
                                        cause.layer, alone=True) for sb, sa in pairs.items()}
            ok3, exact3, _ = check(forced3)
            if ok3:
                extra = (f" (step {cause.b.step} alone does not: {len(pairs) - 1} other "
                         f"{'steps differ' if len(pairs) > 2 else 'step differs'} too)") if len(pairs) > 1 else ""
                return True, (f"replaying {label_b} with {_forcing_words(forced3, label_a)} {goal}{exact3}, where "
                              f"{label_a}'s kernels alone were not enough{extra}")
        if len(pairs) > 1:
            return False, (f"{what}: {rd.id} still differs at {where(first)}; with "
                           f"{_forcing_words(forced2, label_a)} it differs at {where(first2)}")
        return False, f"{what}: {rd.id} still differs from {label_a} at {where(first)}"

    return confirm


def make_replay_bisector(a, b, replayer: Replayer, label_a: str = "A", label_b: str = "B"):
    """For traces recorded without KV hashes: binary search over B's steps.

    f(m) = "replaying B with its target steps < m (those holding the request) run on
    the kernels of A's step that computed the same positions makes the request match
    A up to the flip". The smallest m with f(m) true names the latest step that had
    to be forced: O(log steps) replays, each one a proof rather than a correlation.
    """
    from .bisect import CACHE_CONTAMINATION, STEP_COMPUTE, RootCause, co_batched, finished_before, step_views

    def a_step_for(rid: str, until: int) -> dict[int, int]:
        """position -> A's target step that last computed it (up to `until`)."""
        out: dict[int, int] = {}
        for p in a.iter_plans():
            if p.index > until or p.model != "target":
                continue
            for s in p.slices:
                if s.request_id == rid:
                    for pos in range(s.start, s.start + s.count):
                        out[pos] = p.index
        return out

    def bisect_one(rd):
        tok = rd.first_divergent_token
        if tok is None:
            return None, 0
        a_of = a_step_for(rd.id, tok.step_a)
        b_steps = [(p.index, s.start) for p in b.iter_plans() if p.model == "target" and p.index <= tok.step_b
                   for s in p.slices if s.request_id == rd.id and s.start in a_of]
        n = tok.generated_index + 1
        want = [int(t) for t in a.tokens(rd.id).tokens[:n]]
        replays = 0

        def fixed(k: int) -> bool:  # force the first k of b_steps
            nonlocal replays
            replays += 1
            forced = {sb: force_like_a(a, a_of[start], b, sb) for sb, start in b_steps[:k]}
            return list(replayer.run(b, forced=forced).outputs[rd.id].tokens[:n]) == want

        if not b_steps or not fixed(len(b_steps)):
            return None, replays
        lo, hi = 0, len(b_steps)  # fixed(hi) holds; find the smallest such k
        while lo < hi:
            mid = (lo + hi) // 2
            if fixed(mid):
                hi = mid
            else:
                lo = mid + 1
        if lo == 0:
            return None, replays
        step_b, start = b_steps[lo - 1]
        step_a = a_of[start]
        va, vb, op = step_views(a, b, step_a, step_b)
        kind = STEP_COMPUTE if step_b == tok.step_b else CACHE_CONTAMINATION
        sl = next(s for s in b.step_plan(step_b).slices if s.request_id == rd.id)
        co = co_batched(b, step_b, rd.id)
        cause = RootCause(kind, None, list(range(sl.start, sl.start + sl.count)), va, vb, co,
                          finished_before(b, co, tok.step_b), op=op)
        cause.confirmed = True
        cause.confirm_detail = (f"replaying {label_b} with its steps up to {step_b} on {label_a}'s kernels makes "
                                f"{rd.id} match {label_a} up to the divergence, and without step {step_b} it does not "
                                f"({replays} replays)")
        return cause, replays

    return bisect_one


def make_op_finder(a, b, replayer: Replayer, label_a: str = "A", label_b: str = "B"):
    """Returns find(cause, request_diff) -> (OpDifference | None, detail) for bisect_traces.

    Replays each trace up to its root-cause step (unforced: bitwise the recording), with
    every op's output rows of that step recorded for the request whose K/V the cause
    names (a prefix-cache hit's owner where the request itself was not in the step), and
    compares them position by position: the first op whose bits differ."""
    from ..engine.replay import OpTap
    from .ops import OpRows, first_op_difference

    seen: dict = {}

    def record(trace, step: int, rid: str) -> OpRows:
        key = (id(trace), step, rid)
        if key not in seen:
            tap = OpTap(step, rid)
            replayer.run(trace, tap=tap, stop_after=step)
            seen[key] = OpRows(step, dict(tap.rows), tap.outputs, tap.order)
        return seen[key]

    def find(cause, rd):
        ra = _owner(a, cause.a.step, rd.id, cause.positions, cause.layer)
        rb = _owner(b, cause.b.step, rd.id, cause.positions, cause.layer)
        if ra is None or rb is None:
            return None, "the root-cause steps do not both compute the request's rows"
        d = first_op_difference(record(a, cause.a.step, ra), record(b, cause.b.step, rb),
                                only=cause.positions)
        if d is None:
            return None, (f"every op's output rows are bitwise equal in {label_a} step {cause.a.step} and "
                          f"{label_b} step {cause.b.step} for the positions both computed")
        return d, ""

    return find


def _owner(trace, step: int, rid: str, positions, layer: int | None = None) -> str | None:
    """The request whose slice in `step` computed the cause's positions: the request itself,
    or (a prefix-cache hit) the request whose blocks it shares: the one whose write at that
    step holds the very bytes the request read."""
    slices = trace.step_plan(step).slices
    if any(s.request_id == rid for s in slices):
        return rid
    if not positions:
        return None
    p0, layer = positions[0], layer or 0
    cover = [s.request_id for s in slices if s.start <= p0 < s.start + s.count]
    if len(cover) <= 1:
        return cover[0] if cover else None
    check = list(positions)[:64]
    want = [_cell(trace, rid, layer, p, None) for p in check]
    for other in cover:  # slice order is registration order: the first match owns the shared blocks
        if all(w is not None and _cell(trace, other, layer, p, step) == w for p, w in zip(check, want)):
            return other
    return cover[0]


def _cell(trace, rid: str, layer: int, position: int, at_step) -> tuple | None:
    cells = _CELLS.get((id(trace), rid, at_step))
    if cells is None:
        live = trace.live_kv(rid, at_step=at_step)
        cells = {(int(l), int(p)): (int(k), int(v))
                 for l, p, k, v in zip(live["layer"], live["position"], live["k_hash"], live["v_hash"])}
        if len(_CELLS) > 64:
            _CELLS.clear()
        _CELLS[(id(trace), rid, at_step)] = cells
    return cells.get((layer, position))


_CELLS: dict = {}  # (trace, request, step) -> {(layer, position): (k, v)}: owners are looked up cell by cell
