"""The one assembly of a pair's analysis: every front end (bisect, report --html, the pytest
plugin, browse) asks this module, with the same options, and renders the BisectReport it
returns. It picks, from the traces and the options:

- the lead: KV hashes, or (without them) the replay bisection;
- the confirmer: this engine's replay (TP pairs: the TP side unsharded), the user's command
  (--confirm-cmd), and, for an environment cause, B replayed under A's environment;
- the first op whose bits differ (--ops, on with --confirm), each side under its own
  environment.
Only replays import the engine, and only when asked (browse asks for none).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

from ..errors import DivergenceInputError
from .bisect import bisect_traces
from .cause import ENVIRONMENT, BisectReport
from .confirm import ReplayConfirmer, make_replay_bisector
from .confirm_command import CommandConfirmer
from .confirmation import ByKind, Confirmer
from .diff import pair_labels
from .environment import environment_differs
from .environment_confirm import EnvironmentConfirmer
from .tp import TensorParallelConfirmer


@dataclass
class AnalysisOptions:
    confirm: bool = False  # prove each cause by replay
    confirm_cmd: str | None = None  # ... or through the user's engine
    ops: bool | None = None  # the first op that differed (None: with confirm)
    bitwise: bool = False  # equal tokens with other logits count as diverged
    model_dir: str | None = None
    draft_dir: str | None = None
    replay: bool = True  # False: never run the engine (browse): leads from the traces alone
    make_replayer: Callable | None = None  # (model_dir, draft_dir) -> Replayer (the plugin memoises)
    labels: tuple | None = None  # (A's, B's); default the traces' schedule labels
    keep: bool = False  # keep the re-runs' temporary traces (--confirm-cmd), named in the report
    requests: list | None = None  # the request ids to find and confirm causes of (None: every diverged one)
    note: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr))

    @classmethod
    def from_args(cls, args) -> "AnalysisOptions":
        """The options of `divergence bisect` / `report` (their shared arguments)."""
        return cls(confirm=bool(args.confirm), confirm_cmd=getattr(args, "confirm_cmd", None),
                   ops=getattr(args, "ops", None), bitwise=bool(args.bitwise), model_dir=args.model,
                   draft_dir=args.draft, keep=bool(getattr(args, "keep", False)))


def foreign(a, b) -> bool:
    """Recorded by another engine: this engine cannot replay them."""
    return any(t.meta.get("settings", {}).get("engine") for t in (a, b))


def analyze_pair(a, b, opts: AnalysisOptions | None = None) -> BisectReport:
    """The BisectReport of two open traces under `opts`."""
    opts = opts or AnalysisOptions()
    labels = opts.labels or pair_labels(a, b)
    if opts.confirm and opts.confirm_cmd:
        raise DivergenceInputError("--confirm replays with divergence's engine, --confirm-cmd with yours: give one")
    ops = opts.confirm if opts.ops is None else opts.ops
    sharded = max(a.tp_degree, b.tp_degree) > 1
    if opts.confirm_cmd or foreign(a, b) or sharded:
        if opts.ops:  # nothing of ours to replay op by op (another engine's traces, sharded runs)
            why = ("they are another engine's" if opts.confirm_cmd or foreign(a, b) else
                   f"a TP={max(a.tp_degree, b.tp_degree)} run is sharded")
            opts.note(f"note: --ops replays one device op by op with divergence's engine, and {why}: the first op "
                      f"that differed is not looked for")
        ops = False
    confirmer: Confirmer | None = None
    bisector = op_finder = None
    if opts.confirm_cmd:  # the user's engine confirms (traces of other engines)
        confirmer = CommandConfirmer(a, b, opts.confirm_cmd, *labels, keep=opts.keep)
    elif opts.replay and (opts.confirm or ops or not (a.has_kv_hashes and b.has_kv_hashes) and not foreign(a, b)):
        # (--confirm on another engine's traces: check_replayable refuses them, in one line)
        from .replayer import Replayer, check_replayable, make_op_finder  # (lazy: the engine's door loads a BLAS)

        if opts.confirm or ops:
            check_replayable(a)
            check_replayable(b)
        make = opts.make_replayer or (lambda m, d: Replayer(model_dir=m, draft_dir=d))
        replayer = make(opts.model_dir, opts.draft_dir)
        # TP=1 vs TP=N: proven by replaying the TP side unsharded
        confirmer = TensorParallelConfirmer(a, b, replayer, *labels) if a.tp_degree != b.tp_degree else \
            ReplayConfirmer(a, b, replayer, *labels)
        if opts.confirm and environment_differs(a, b):
            # an environment cause is proved by B replayed under A's environment; the pair's other causes as above
            confirmer = ByKind(confirmer, {ENVIRONMENT: EnvironmentConfirmer(
                a, b, model_dir=opts.model_dir, draft_dir=opts.draft_dir, label_a=labels[0], label_b=labels[1])})
        bisector = make_replay_bisector(a, b, replayer, *labels)
        if ops:
            op_finder = make_op_finder(a, b, replayer, *labels)
    try:
        return bisect_traces(a, b, confirm=opts.confirm or bool(opts.confirm_cmd), confirmer=confirmer,
                             replay_bisector=bisector, bitwise=opts.bitwise, op_finder=op_finder,
                             only=None if opts.requests is None else set(opts.requests))
    finally:
        if confirmer is not None:
            confirmer.close()
