"""Tensor parallelism in the analysis: which traces ran sharded, what a TP=1 vs TP=N
cause is (the sharded ops and their all-reduces), and its proof by replay: the TP
side re-run with its sharded-to-all ops unsharded (one device's sum, no all-reduce),
then, if that is not enough, every sharded op unsharded. Numpy only; replays go
through analysis.replayer (the one door to the engine), or, in a process that is no
rank of the trace's degree (the pytest plugin, the API), through `divergence replay`
in a child process, which starts the ranks."""
from __future__ import annotations

import tempfile

import numpy as np

from ..core.names import SHARDED_TO_ALL, TP_SHARDING
from ..core.policy import UNSHARDED
from ..errors import RanksNeededError
from ..trace.reader import Trace
from .cause import BY_REPLAY_UNSHARDED
from .confirmation import BaseConfirmer, Confirmation
from .environment_confirm import replay_in_child

SHARDED_TO_ALL_OPS = tuple(op for op, mode in TP_SHARDING.items() if mode == SHARDED_TO_ALL)


def degree(trace) -> int:
    return trace.tp_degree


def degrees(a, b) -> tuple[int, int]:
    return degree(a), degree(b)


def allreduce_summary(trace, step: int) -> dict:
    """The all-reduces of one step: count, ops, bytes per rank, backend, ranks."""
    t = trace.allreduces(step=step)
    if not len(t["step"]):
        return {}
    return {"count": int(len(t["step"])), "ops": sorted(set(str(o) for o in t["op"])),
            "bytes": int(np.sum(t["bytes"])), "backend": str(t["backend"][0]), "ranks": int(t["ranks"][0])}


def shard_shapes(trace, step: int) -> dict:
    """op -> [n, k] of the first layer where it ran in that step (the shard's shape under TP)."""
    ks = trace.kernels(step=step)
    out: dict = {}
    for op, n, k in zip(ks["op"], ks["n"], ks["k"]):
        if str(op) in TP_SHARDING:
            out.setdefault(str(op), [int(n), int(k)])
    return out


def describe(a, b, cause) -> dict | None:
    """What tensor parallelism did at the cause step, for a pair whose degrees differ:
    the degrees, the sharded-to-all ops whose partial sums an all-reduce adds, the
    all-reduces of the TP side's step and the ops' shard shapes on both sides."""
    da, db = degrees(a, b)
    if da == db:
        return None
    tp_side, step = (b, cause.b.step) if db > 1 else (a, cause.a.step)
    return {"degrees": [da, db], "sharded_to_all": list(SHARDED_TO_ALL_OPS),
            "allreduce": allreduce_summary(tp_side, step),
            "shapes_a": shard_shapes(a, cause.a.step), "shapes_b": shard_shapes(b, cause.b.step)}


def header_note(a, b) -> str | None:
    da, db = degrees(a, b)
    if da == db:
        return None
    return (f"tensor-parallel degrees differ: A TP={da}, B TP={db} (sharded ops see 1/{max(da, db)} of their "
            f"features; o_proj / down_proj partial sums are added by an all-reduce)")


class TensorParallelConfirmer(BaseConfirmer):
    """Proves causes of a pair of different TP degrees (a Confirmer of analysis.confirmation):
    replay the TP side with every step's sharded-to-all ops unsharded (then every sharded
    op) and compare with the other side, bit for bit. Replays are shared by all requests (at
    most two per bisect)."""

    def __init__(self, a, b, replayer, label_a: str = "A", label_b: str = "B"):
        self.replayer = replayer
        self.tp_side, self.ref, self.tp_label, self.ref_label = \
            (b, a, label_b, label_a) if degree(b) > 1 else (a, b, label_a, label_b)
        steps = [int(s) for s in self.tp_side.steps["index"]]
        self.s2a = ", ".join(SHARDED_TO_ALL_OPS)
        self.forcings = [
            (f"its sharded-to-all ops ({self.s2a}) unsharded at every step (one device's sum, no all-reduce)",
             {s: {op: UNSHARDED for op in SHARDED_TO_ALL_OPS} for s in steps}),
            ("every sharded op unsharded at every step", {s: UNSHARDED for s in steps}),
        ]
        self.cache: dict[int, object] = {}

    def outputs(self, i: int):
        if i not in self.cache:
            forced = self.forcings[i][1]
            try:
                self.cache[i] = self.replayer.run(self.tp_side, forced=forced).outputs
            except RanksNeededError:
                self.cache[i] = replay_in_ranks(self.tp_side, forced, model_dir=self.replayer.model_dir,
                                                draft_dir=self.replayer.draft_dir)
        return self.cache[i]

    def matches(self, out, rid: str, n: int) -> tuple[bool, bool]:
        got = out[rid]
        tr = self.ref.tokens(rid)
        same = [int(t) for t in got.tokens[:n]] == [int(t) for t in tr.tokens[:n]]
        la = np.asarray(tr.topk_logits[:n], np.float32).view(np.uint32)
        lb = np.asarray(got.topk_logits[:n], np.float32).reshape(-1, la.shape[1] if la.ndim == 2 else 1)
        bitwise = same and la.shape == lb.shape and bool((la == lb.view(np.uint32)).all())
        return same, bitwise

    def confirm(self, cause, rd) -> Confirmation:
        tok = rd.first_divergent_token
        n = (tok.generated_index + 1) if tok is not None else rd.compared
        tried = []
        for i, (words, _) in enumerate(self.forcings):
            same, bitwise = self.matches(self.outputs(i), rd.id, n)
            if bitwise or (same and tok is not None):
                exact = ", bit for bit" if bitwise else " (tokens; some logits still differ)"
                first = (f"; unsharding only {self.s2a} was not enough: the all-to-sharded shards' kernels "
                         f"change the bits too") if tried else ""
                return Confirmation(True, f"replaying {self.tp_label} with {words} makes {rd.id} match "
                                          f"{self.ref_label}{' up to the divergence' if tok else ''}{exact}{first}",
                                    BY_REPLAY_UNSHARDED)
            tried.append(i)
        return Confirmation(False, f"replaying {self.tp_label} with every sharded op unsharded still leaves {rd.id} "
                                   f"different from {self.ref_label}: something besides the sharding differs",
                            BY_REPLAY_UNSHARDED)


def replay_in_ranks(trace, forced: dict, *, model_dir=None, draft_dir=None) -> dict:
    """request id -> its replayed tokens (TokenRecords: tokens, topk_logits), by `divergence
    replay` in a child process, which starts the trace's ranks (this process is none)."""
    with tempfile.TemporaryDirectory(prefix="divergence-tp-replay-") as work:
        out = replay_in_child(trace, forced=forced, model_dir=model_dir, draft_dir=draft_dir, workdir=work)
        with Trace.open(out) as t:
            return {r.id: t.tokens(r.id) for r in t.requests}
