"""What a trace recorded, per request and per step: tokens, step plans, kernel choices, KV
writes, all-reduces, MoE routing. Trace (reader.py) gets these views from RecordViews; they read
only through its snapshot (`_visible`, `steps`, `requests`, `request_index`, `codes`, `_decode`,
`_once`), so every view of one snapshot agrees."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.events import SeqSlice, StepPlan
from . import live


class TokenRecords(NamedTuple):
    positions: np.ndarray
    tokens: np.ndarray
    steps: np.ndarray
    spec: np.ndarray
    topk_ids: np.ndarray
    topk_logits: np.ndarray
    logit: np.ndarray | None = None  # float32 [n]: the chosen token's own logit (NaN where not recorded)
    prob: np.ndarray | None = None  # float32 [n]: its probability under the sampler (NaN where not recorded)


class RecordViews:
    """Per-request and per-step views over a Trace's tables (mixed into Trace)."""

    @property
    def _tokens(self) -> dict[str, np.ndarray]:
        return self._visible("tokens")

    def tokens(self, request_id: str) -> TokenRecords:
        t = self._tokens
        sel = np.flatnonzero(t["request"] == self.request_index(request_id))
        sel = sel[np.argsort(t["position"][sel], kind="stable")]
        return TokenRecords(t["position"][sel], t["token"][sel], t["step"][sel], t["spec"][sel],
                            t["topk_ids"][sel], t["topk_logits"][sel], t["logit"][sel], t["prob"][sel])

    @property
    def _slices(self) -> dict[str, np.ndarray]:
        def load():
            t = dict(self._visible("slices"))
            t["input_tokens"] = self._visible("slice_tokens")["value"]
            t["logit_rows"] = self._visible("slice_logit_rows")["value"]
            return t
        return self._once("slices", load)

    def step_plan(self, index: int) -> StepPlan:
        st = self.steps
        i = np.flatnonzero(st["index"] == index)
        if not i.size:
            raise KeyError(f"no step {index} in {self.path}")
        i = int(i[0])
        sl = self._slices
        lo, n = int(st["slice_offset"][i]), int(st["slice_count"][i])
        return StepPlan(int(index), self.codes("models")[int(st["model"][i])],
                        tuple(self._slice(sl, j) for j in range(lo, lo + n)))

    def _slice(self, sl, j: int) -> SeqSlice:
        to, c = int(sl["token_offset"][j]), int(sl["count"][j])
        lo, lc = int(sl["logit_offset"][j]), int(sl["logit_count"][j])
        return SeqSlice(self.requests[int(sl["request"][j])].id, self.codes("phases")[int(sl["phase"][j])],
                        int(sl["start"][j]), c, int(sl["row_offset"][j]),
                        tuple(int(x) for x in sl["input_tokens"][to: to + c]),
                        tuple(int(x) for x in sl["logit_rows"][lo: lo + lc]))

    def iter_plans(self):
        for idx in self.steps["index"]:
            yield self.step_plan(int(idx))

    def kernels(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Kernel choices (all, or of one step), with op / kernel / model as names."""
        t = self._visible("kernels")
        if step is not None:
            sel = t["step"] == step
            t = {k: v[sel] for k, v in t.items()}
        return self._decode("kernels", t)

    def kv_writes(self) -> dict[str, np.ndarray]:
        """KV write records, codes as stored (model: index into codes('models'))."""
        return self._visible("kv_writes")

    def kv_hashes(self) -> dict[str, np.ndarray]:
        return self._visible("kv_hashes")

    def live_kv(self, request_id: str, *, model: str = "target", at_step: int | None = None) -> dict[str, np.ndarray]:
        """For every (layer, position) of a request, the write live at `at_step` (the
        latest with step <= at_step: later writes overwrite rolled-back positions).
        Arrays layer, position, step, k_hash, v_hash, sorted by (layer, position)."""
        w = self.kv_write_rows(request_id, model=model, at_step=at_step)
        return live.kv_cells(w, self.kv_hashes(), np.arange(len(w["step"])))

    def kv_write_rows(self, request_id: str, *, model: str = "target", at_step: int | None = None) -> dict:
        """A request's K/V write records of one model (with step <= at_step), in record order,
        codes as stored; a prefix hit's inherited writes among them, named by the step that wrote them."""
        w = self.kv_writes()
        sel = (w["request"] == self.request_index(request_id)) & (w["model"] == self.codes("models").index(model))
        if at_step is not None:
            sel &= w["step"] <= at_step
        idx = np.flatnonzero(sel)
        return {k: v[idx] for k, v in w.items()}

    def allreduces(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Tensor-parallel all-reduce records (all, or of one step), op / model / backend
        as names; empty for traces of one device (or written before the table existed)."""
        t = self._visible("allreduce")
        if step is not None:
            sel = t["step"] == step
            t = {k: v[sel] for k, v in t.items()}
        return self._decode("allreduce", t)

    @property
    def has_routing(self) -> bool:
        """Whether the trace holds MoE routing (its model has expert layers)."""
        return len(self._visible("routing")["step"]) > 0

    def routing(self, request_id: str, *, model: str = "target", at_step: int | None = None) -> dict[str, np.ndarray]:
        """A request's MoE routing, one row per (layer, position): the record live at
        `at_step` (the latest with step <= at_step; all steps when None), sorted by
        (position, layer). Arrays layer, position, step, runner_up, runner_up_score,
        input_hash [n], experts int [n, k], scores float32 [n, k]."""
        t = self._visible("routing")
        sel = (t["request"] == self.request_index(request_id)) & (t["model"] == self.codes("models").index(model))
        if at_step is not None:
            sel &= t["step"] <= at_step
        return live.routing_cells(t, self._visible("routing_choices"), np.flatnonzero(sel))

    def finish_step(self, request_id: str) -> int | None:
        t = self._visible("request_events")
        sel = (t["request"] == self.request_index(request_id)) & \
              (t["kind"] == self.codes("kinds").index("finished"))
        return int(t["step"][sel][0]) if sel.any() else None
