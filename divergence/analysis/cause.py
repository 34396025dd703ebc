"""What bisect finds: a RootCause per diverged request (its kind, the two steps), built once
and never changed; the BisectReport of a pair, which holds each cause's confirmation and
first op beside it (a Finding reads the three together); and a replay bisector's answer
(ReplayBisection)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .confirmation import Confirmation
from .diff import DiffReport
from .ops import FirstOp
from .sampler import SamplerStory
from .step_view import StepView, native_class_changes


CACHE_CONTAMINATION = "cache_contamination"
STEP_COMPUTE = "step_compute"
SAMPLER = "sampler"
ENVIRONMENT = "environment"  # the same step, laid out alike, computed under another BLAS / core / device


# How a cause's confirmation was run (Confirmation.by, `confirmed_by` in the JSON): each
# confirmer says one of these names; CONFIRMED_BY words them for the text report and the HTML page.
BY_REPLAY = "replay"  # this engine's replay of B, the step's ops on A's kernels
BY_REPLAY_SOLO = "replay_solo"  # ... the step run request by request, as A ran it
BY_REPLAY_PREFILL = "replay_prefill"  # ... the request's prompt computed in A's prefill passes
BY_REPLAY_UNSHARDED = "replay_unsharded"  # ... the TP side's sharded ops unsharded
BY_COMMAND = "command"  # the user's engine, re-run by --confirm-cmd
BY_ENVIRONMENT = "environment"  # B replayed under A's recorded environment
CONFIRMED_BY = {
    BY_REPLAY: "this engine's replay of B with the step's kernels forced to A's (--confirm)",
    BY_REPLAY_SOLO: "this engine's replay of B with the step run request by request (solo), as A ran it (--confirm)",
    BY_REPLAY_PREFILL: "this engine's replay of B with the request's prompt computed in A's prefill passes, "
                       "each request alone (--confirm)",
    BY_REPLAY_UNSHARDED: "this engine's replay of the TP side with its sharded ops unsharded (--confirm)",
    BY_COMMAND: "your engine, re-run by your command with the step changed (--confirm-cmd)",
    BY_ENVIRONMENT: "this engine's replay of B under A's recorded environment (--confirm)",
}


@dataclass(frozen=True)
class RootCause:
    """The lead bisect found for one diverged request: what kind of cause, the two steps (A's
    and B's) and what the traces say about them. Built once (bisect.find_root_cause, then
    bisect.complete_cause); what proving it found lives beside it (BisectReport)."""

    kind: str
    layer: int | None
    positions: list[int]  # positions of the earliest differing write (B side)
    a: StepView
    b: StepView
    co_batched_b: list[str]
    finished_before_divergence: dict = field(default_factory=dict)  # co-batched id -> finish step
    op: str | None = None  # the op whose kernel differs between the two steps
    routing_flip: object = None  # analysis.routing.RoutingFlip on the path to the divergence (MoE models)
    tensor_parallel: dict | None = None  # TP=1 vs TP=N pairs: see analysis.tp.describe
    sampler: SamplerStory | None = None  # where the flip's uniform draw fell in each trace
    model: str = "target"  # the model whose steps a and b are (draft: a sampler cause's q)
    env_diff: dict | None = None  # an environment cause: recorded field -> (A's, B's)

    @property
    def native_class_changes(self) -> dict[str, tuple[int, int]]:
        """op -> (rows in A, rows in B) for the natively run ops whose probed kernel class
        differs between the two steps: the backend computed those rows another way."""
        return native_class_changes(self.a, self.b)

    def to_json(self, confirmation: Confirmation | None = None, first_op: FirstOp | None = None) -> dict:
        """The JSON's `root_cause`; the confirmation and the first op, found beside the cause,
        keep their places in it (DESIGN.md's contract)."""
        return {
            "kind": self.kind, "layer": self.layer, "positions": self.positions, "op": self.op,
            "step_a": self.a.step, "step_b": self.b.step, "rows_a": self.a.rows, "rows_b": self.b.rows,
            "kernel_a": self.a.kernel, "kernel_b": self.b.kernel, "co_batched_b": self.co_batched_b,
            "composition_a": self.a.composition, "composition_b": self.b.composition,
            "kernels_a": self.a.kernels, "kernels_b": self.b.kernels,
            "finished_before_divergence": self.finished_before_divergence,
            "native_class_changes": {op: {"rows_a": ra, "rows_b": rb}
                                     for op, (ra, rb) in self.native_class_changes.items()},
            "confirm_detail": confirmation.detail if confirmation else "",
            "confirmed_by": confirmation.by if confirmation else None,
            "routing_flip": self.routing_flip.to_json() if self.routing_flip is not None else None,
            "tensor_parallel": self.tensor_parallel,
            "model": self.model,
            "first_op": first_op.difference.to_json() if first_op and first_op.difference is not None else None,
            "first_op_detail": first_op.detail if first_op else "",
            "sampler": self.sampler.to_json() if self.sampler else None,
            "env_diff": {k: list(v) for k, v in self.env_diff.items()} if self.env_diff else None,
        }


@dataclass(frozen=True)
class Finding:
    """One request's cause read with what was found beside it: its confirmation (None: none
    ran) and the first op that differed (None: not looked for). A view; it changes nothing."""

    cause: RootCause
    confirmation: Confirmation | None = None
    first_op: FirstOp | None = None

    @property
    def confirmed(self) -> bool | None:
        return self.confirmation.confirmed if self.confirmation is not None else None

    def to_json(self) -> dict:
        return self.cause.to_json(self.confirmation, self.first_op)


@dataclass
class ReplayBisection:
    """What a replay bisector (analysis.confirm.make_replay_bisector) found for one request:
    the cause or None, the replays it ran, why none was found, and the cause's confirmation
    (the search's own replays prove it)."""

    cause: RootCause | None
    replays: int = 0
    why_not_found: str | None = None
    confirmation: Confirmation | None = None


@dataclass
class BisectReport:
    diff: DiffReport
    causes: dict[str, RootCause]  # request id -> root cause
    mode: str = "kv-hashes"  # or "replay" when the traces had no KV hashes
    confirm_requested: bool = False
    unexplained: dict[str, str] = field(default_factory=dict)  # request id -> why no cause was found
    confirmations: dict[str, Confirmation] = field(default_factory=dict)  # request id -> its cause's proof
    first_ops: dict[str, FirstOp] = field(default_factory=dict)  # request id -> the first op that differed

    def finding(self, rid: str) -> Finding | None:
        """The request's cause with its confirmation and first op; None without a cause."""
        c = self.causes.get(rid)
        return Finding(c, self.confirmations.get(rid), self.first_ops.get(rid)) if c is not None else None

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
            f = self.finding(r["id"])
            r["root_cause"] = f.to_json() if f else None
            if r["id"] in self.unexplained:
                r["root_cause_not_found"] = self.unexplained[r["id"]]
            r["confirmed"] = (f.confirmed if f else None) if self.confirm_requested else None
        j["groups"] = [{"kind": k[0], "step_b": k[1], "requests": v} for k, v in self.groups().items()]
        return j
