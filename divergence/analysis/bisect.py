"""Walk back from a divergent token to the batch step that caused it.

1. From the first numeric divergence, compare the KV writes that the divergent
   step actually read (the live write of every (layer, position), rollbacks
   and overwrites included) between the two traces.
2. The earliest differing (position, layer) names the write, and so the step,
   in each trace; those steps' rows, composition and kernels are the lead.
3. Classify: `sampler` (logits bitwise equal, token differs), `step_compute`
   (the cache the step read was identical: its own kernels differ),
   `cache_contamination` (an earlier write differs).
Replay (`confirm`) turns the lead into proof.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .diff import DIVERGED, DiffReport, RequestDiff, diff_traces

CACHE_CONTAMINATION = "cache_contamination"
STEP_COMPUTE = "step_compute"
SAMPLER = "sampler"
WRITE_OPS = ("k_proj", "v_proj")  # the ops whose output is written to the cache


@dataclass
class StepView:
    """What a step was: rows, who was in it, which kernels ran (for the ops that matter)."""

    step: int
    rows: int
    composition: list[dict]  # request_id, phase, start, count, row_offset
    kernel: str  # kernel of the ops that wrote the contaminated values, e.g. "gemm/4"
    kernels: dict  # op -> kernel label at the root-cause layer

    def to_json(self) -> dict:
        return {"step": self.step, "rows": self.rows, "composition": self.composition,
                "kernel": self.kernel, "kernels": self.kernels}


@dataclass
class RootCause:
    kind: str
    layer: int | None
    positions: list[int]  # positions of the earliest differing write (B side)
    a: StepView
    b: StepView
    co_batched_b: list[str]
    finished_before_divergence: dict = field(default_factory=dict)  # co-batched id -> finish step
    confirmed: bool | None = None
    confirm_detail: str = ""

    def to_json(self) -> dict:
        return {
            "kind": self.kind, "layer": self.layer, "positions": self.positions,
            "step_a": self.a.step, "step_b": self.b.step, "rows_a": self.a.rows, "rows_b": self.b.rows,
            "kernel_a": self.a.kernel, "kernel_b": self.b.kernel, "co_batched_b": self.co_batched_b,
            "composition_a": self.a.composition, "composition_b": self.b.composition,
            "kernels_a": self.a.kernels, "kernels_b": self.b.kernels,
            "finished_before_divergence": self.finished_before_divergence,
            "confirm_detail": self.confirm_detail,
        }


@dataclass
class BisectReport:
    diff: DiffReport
    causes: dict[str, RootCause]  # request id -> root cause
    mode: str = "kv-hashes"  # or "replay" when the traces had no KV hashes
    confirm_requested: bool = False

    @property
    def identical(self) -> bool:
        return self.diff.identical

    def groups(self) -> dict[tuple, list[str]]:
        """Requests that share one root-cause step (B side)."""
        out: dict[tuple, list[str]] = {}
        for rid, c in self.causes.items():
            out.setdefault((c.kind, c.b.step), []).append(rid)
        return out

    def to_json(self) -> dict:
        j = self.diff.to_json()
        j["mode"] = self.mode
        for r in j["requests"]:
            c = self.causes.get(r["id"])
            r["root_cause"] = c.to_json() if c else None
            r["confirmed"] = (c.confirmed if c else None) if self.confirm_requested else None
        j["groups"] = [{"kind": k[0], "step_b": k[1], "requests": v} for k, v in self.groups().items()]
        return j


def _kernel_label(kernel: str, splits: int) -> str:
    return f"{kernel}/{splits}" if kernel == "gemm" else kernel


def step_view(trace, step: int, layer: int | None) -> StepView:
    plan = trace.step_plan(step)
    comp = [{"request_id": s.request_id, "phase": s.phase, "start": s.start, "count": s.count,
             "row_offset": s.row_offset} for s in plan.slices]
    ks = trace.kernels(step=step)
    kernels: dict[str, str] = {}
    for i in range(len(ks["op"])):
        if layer is None or int(ks["layer"][i]) == layer:
            kernels.setdefault(str(ks["op"][i]), _kernel_label(str(ks["kernel"][i]), int(ks["splits"][i])))
    main = [kernels[o] for o in WRITE_OPS if o in kernels] or list(kernels.values()) or ["?"]
    return StepView(step, plan.rows, comp, main[0], kernels)


def find_root_cause(a, b, d: RequestDiff) -> RootCause | None:
    """The lead for one diverged request, from KV hashes alone."""
    num = d.first_numeric_divergence
    tok = d.first_divergent_token
    if num is None:
        if tok is None:
            return None
        # Every stored logit is bitwise equal, yet the token differs: the sampler did it.
        return RootCause(SAMPLER, None, [tok.position], step_view(a, tok.step_a, None), step_view(b, tok.step_b, None),
                         _co_batched(b, tok.step_b, d.id))
    pos = num.position  # its logits came from the row at pos - 1, in steps num.step_a / num.step_b
    la = a.live_kv(d.id, model="target", at_step=num.step_a)
    lb = b.live_kv(d.id, model="target", at_step=num.step_b)
    ka = _cells(la, pos)
    kb = _cells(lb, pos)
    common = np.intersect1d(ka["key"], kb["key"])
    ia = np.searchsorted(ka["key"], common)
    ib = np.searchsorted(kb["key"], common)
    differ = (ka["k"][ia] != kb["k"][ib]) | (ka["v"][ia] != kb["v"][ib])
    if not differ.any():
        return RootCause(STEP_COMPUTE, None, [pos - 1], step_view(a, num.step_a, None),
                         step_view(b, num.step_b, None), _co_batched(b, num.step_b, d.id))
    # common is sorted by (position, layer): the first differing cell is the earliest.
    ja, jb = ia[differ][0], ib[differ][0]
    layer = int(kb["layer"][jb])
    step_a, step_b = int(ka["step"][ja]), int(kb["step"][jb])
    kind = STEP_COMPUTE if step_b == num.step_b and step_a == num.step_a else CACHE_CONTAMINATION
    # All differing positions written by that same B step at that layer.
    sel = (kb["step"][ib[differ]] == step_b) & (kb["layer"][ib[differ]] == layer)
    positions = sorted(int(p) for p in kb["position"][ib[differ]][sel])
    co = _co_batched(b, step_b, d.id)
    finished = {}
    for rid in co:
        fs = _finish_step(b, rid)
        if fs is not None and fs < (d.first_divergent_token.step_b if d.first_divergent_token else num.step_b):
            finished[rid] = fs
    return RootCause(kind, layer, positions, step_view(a, step_a, layer), step_view(b, step_b, layer), co, finished)


def _cells(live, pos: int) -> dict:
    """Live writes for positions < pos (what the row at pos - 1 read), keyed (position, layer)."""
    position = np.asarray(live["position"])
    keep = position < pos
    layer = np.asarray(live["layer"])[keep]
    position = position[keep]
    key = position.astype(np.int64) * 4096 + layer
    order = np.argsort(key, kind="stable")
    return {"key": key[order], "layer": layer[order], "position": position[order],
            "step": np.asarray(live["step"])[keep][order],
            "k": np.asarray(live["k_hash"])[keep][order], "v": np.asarray(live["v_hash"])[keep][order]}


def _co_batched(trace, step: int, rid: str) -> list[str]:
    return sorted({s.request_id for s in trace.step_plan(step).slices} - {rid})


def _finish_step(trace, rid: str) -> int | None:
    t = trace.tokens(rid)
    return int(t.steps[-1]) if len(t.steps) else None


def bisect_traces(a, b, *, confirm: bool = False, replayer=None) -> BisectReport:
    """a, b: open Traces. With confirm, `replayer(cause, request_diff)` -> (bool, detail)
    replays B with the root-cause step forced to A's kernels (see analysis.replay)."""
    d = diff_traces(a, b)
    causes: dict[str, RootCause] = {}
    mode = "kv-hashes"
    for rd in d.requests:
        if rd.status != DIVERGED or (rd.first_divergent_token is None and rd.first_numeric_divergence is None):
            continue
        cause = find_root_cause(a, b, rd)
        if cause is not None:
            causes[rd.id] = cause
    if confirm and replayer is not None:
        for rid, cause in causes.items():
            cause.confirmed, cause.confirm_detail = replayer(cause, next(r for r in d.requests if r.id == rid))
    return BisectReport(d, causes, mode, confirm)
