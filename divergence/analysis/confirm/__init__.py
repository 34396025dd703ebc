"""Confirmation by replay: force B's root-cause step (then every suspect step) to run as
A's ran it, and check that B then matches A up to the divergence (each replay first checked
to be B with only that change: analysis.rerun_check). Forcing means A's
kernels, or each request of the step alone (SOLO), or A's very rows (RelayoutStep)
where the backend's kernels depend on the row count; a sampled flip that the draft
decided is proven at that draw. Engine-free: it drives a `Replayer` (analysis.replayer).

suspects: which steps to force; replays: B replayed and checked; case: one cause to confirm;
rungs: the forcings in order; confirmer: ReplayConfirmer; replay_bisector: the search by
replays for traces without KV hashes."""
from __future__ import annotations

from .case import Case
from .confirmer import ReplayConfirmer
from .replay_bisector import make_replay_bisector
from .replays import ForcingRefused, NotARerun, replay_kind
from .rungs import (DRAW_RUNGS, RUNGS, RungResult, climb, rung_draw, rung_draw_suspects, rung_kernels, rung_prefill,
                    rung_solo, rung_suspects, unconfirmed)

__all__ = ["Case", "ReplayConfirmer", "make_replay_bisector", "ForcingRefused", "NotARerun", "replay_kind", "RUNGS",
           "DRAW_RUNGS", "RungResult", "climb", "unconfirmed", "rung_kernels", "rung_suspects", "rung_solo",
           "rung_prefill", "rung_draw", "rung_draw_suspects"]
