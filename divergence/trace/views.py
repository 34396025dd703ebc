"""What a trace recorded, per request and per step: tokens, step plans, kernel choices, KV
writes, all-reduces, MoE routing. Trace (reader.py) gets these views from RecordViews; they read
only through its snapshot (`_visible`, `steps`, `requests`, `request_index`, `codes`, `_decode`,
`_once`, and a large trace's ranges: trace/ranged.py), so every view of one snapshot agrees,
whether it read whole tables or ranges of them."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core.events import SeqSlice, StepPlan
from . import live
from .ranged import RangedReads


class TokenRecords(NamedTuple):
    positions: np.ndarray
    tokens: np.ndarray
    steps: np.ndarray
    spec: np.ndarray
    topk_ids: np.ndarray
    topk_logits: np.ndarray
    logit: np.ndarray | None = None  # float32 [n]: the chosen token's own logit (NaN where not recorded)
    prob: np.ndarray | None = None  # float32 [n]: its probability under the sampler (NaN where not recorded)


class RecordViews(RangedReads):
    """Per-request and per-step views over a Trace's tables (mixed into Trace)."""

    @property
    def _tokens(self) -> dict[str, np.ndarray]:
        return self._visible("tokens")

    def tokens(self, request_id: str) -> TokenRecords:
        i = self.request_index(request_id)
        if self.ranged and self.selected is not None:  # some requests: their steps' rows
            t = self._request_rows("tokens", request_id)
            sel = np.arange(len(t["step"]))
        elif self.ranged:  # every request, in order (a diff of them all): a batch of requests' steps at a time
            t, order, starts = self._token_batch(i)
            sel = order[starts[i]:starts[i + 1]]
        else:  # the table, grouped by request once
            t = self._tokens
            order, starts = self._once("tokens_by_request", lambda: _group(t["request"], len(self.requests)))
            sel = order[starts[i]:starts[i + 1]]
        sel = sel[np.argsort(t["position"][sel], kind="stable")]
        return TokenRecords(t["position"][sel], t["token"][sel], t["step"][sel], t["spec"][sel],
                            t["topk_ids"][sel], t["topk_logits"][sel], t["logit"][sel], t["prob"][sel])

    TOKEN_BATCH = 1024  # requests whose tokens a ranged read of every request reads at once

    def _token_batch(self, i: int):
        """(rows, order, starts) of the steps the batch of requests holding request i lived: its
        tokens and its neighbours', grouped by request; the last batch is kept (memory: one batch)."""
        b = i // self.TOKEN_BATCH
        got = self._cache.get("token_batch")  # (the snapshot's: refresh() drops it)
        if got is None or got[0] != b:
            ids = [r.id for r in self.requests[b * self.TOKEN_BATCH:(b + 1) * self.TOKEN_BATCH]]
            spans = [self.lifetime(rid) for rid in ids]
            t = self._step_rows("tokens", min(a for a, _ in spans), max(z for _, z in spans))
            got = self._cache["token_batch"] = (b, t, *_group(t["request"], len(self.requests)))
        return got[1:]

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
        if self.ranged:
            return self._plans(i, i + 1)[0]
        sl = self._slices
        lo, n = int(st["slice_offset"][i]), int(st["slice_count"][i])
        return StepPlan(int(index), self.codes("models")[int(st["model"][i])],
                        tuple(self._slice(sl, j) for j in range(lo, lo + n)))

    def _slice(self, sl, j: int, to0: int = 0, lo0: int = 0) -> SeqSlice:
        """Slice row j of `sl` (its tokens and logit rows from to0 and lo0 in the tables: a range's)."""
        to, c = int(sl["token_offset"][j]) - to0, int(sl["count"][j])
        lo, lc = int(sl["logit_offset"][j]) - lo0, int(sl["logit_count"][j])
        return SeqSlice(self.requests[int(sl["request"][j])].id, self.codes("phases")[int(sl["phase"][j])],
                        int(sl["start"][j]), c, int(sl["row_offset"][j]),
                        tuple(int(x) for x in sl["input_tokens"][to: to + c]),
                        tuple(int(x) for x in sl["logit_rows"][lo: lo + lc]))

    def _plans(self, a: int, b: int) -> list[StepPlan]:
        """The plans of rows a..b-1 of /steps, from the ranges of /slices and its token tables they point at."""
        st, models = self.steps, self.codes("models")
        off, cnt = st["slice_offset"][a:b].astype(np.int64), st["slice_count"][a:b].astype(np.int64)
        lo, hi = (int(off.min()), int((off + cnt).max())) if b > a and cnt.sum() else (0, 0)
        sl = dict(self._range("slices", lo, hi)) if hi > lo else None
        to0 = lo0 = 0
        if sl is not None:
            ends = sl["token_offset"] + sl["count"], sl["logit_offset"] + sl["logit_count"]
            to0, lo0 = int(sl["token_offset"].min()), int(sl["logit_offset"].min())
            sl["input_tokens"] = self._range("slice_tokens", to0, int(ends[0].max()))["value"]
            sl["logit_rows"] = self._range("slice_logit_rows", lo0, int(ends[1].max()))["value"]
        return [StepPlan(int(st["index"][i]), models[int(st["model"][i])],
                         tuple(self._slice(sl, j - lo, to0, lo0) for j in range(int(o), int(o) + int(n))))
                for i, o, n in zip(range(a, b), off, cnt)]

    PLAN_BLOCK = 4096  # steps whose slices a ranged iter_plans reads at once

    def iter_plans(self):
        if self.ranged:
            n = self.num_steps
            for a in range(0, n, self.PLAN_BLOCK):
                yield from self._plans(a, min(n, a + self.PLAN_BLOCK))
            return
        for idx in self.steps["index"]:
            yield self.step_plan(int(idx))

    def kernels(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Kernel choices (all, or of one step), with op / kernel / model as names."""
        return self._decode("kernels", self._of_step("kernels", step))

    def _of_step(self, name: str, step: int | None) -> dict[str, np.ndarray]:
        """A by-step table's records (all, or of one step: a large trace reads only its rows)."""
        if step is not None and self.ranged:
            return self._step_rows(name, int(step), int(step))
        t = self._visible(name)
        if step is not None:
            sel = t["step"] == step
            t = {k: v[sel] for k, v in t.items()}
        return t

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
        if not self.ranged:
            return live.kv_cells(w, self.kv_hashes(), np.arange(len(w["step"])))
        h, first = self._pointed("kv_hashes", w["hash_offset"], w["count"])  # the hashes they point at
        return live.kv_cells({**w, "hash_offset": first}, h, np.arange(len(w["step"])))

    def kv_write_rows(self, request_id: str, *, model: str = "target", at_step: int | None = None) -> dict:
        """A request's K/V write records of one model (with step <= at_step), in record order,
        codes as stored; a prefix hit's inherited writes among them, named by the step that wrote them."""
        if self.ranged:
            return self._ranged_kv_writes(request_id, model, at_step)
        w = self.kv_writes()
        sel = (w["request"] == self.request_index(request_id)) & (w["model"] == self.codes("models").index(model))
        if at_step is not None:
            sel &= w["step"] <= at_step
        idx = np.flatnonzero(sel)
        return {k: v[idx] for k, v in w.items()}

    def allreduces(self, step: int | None = None) -> dict[str, np.ndarray]:
        """Tensor-parallel all-reduce records (all, or of one step), op / model / backend
        as names; empty for traces of one device (or written before the table existed)."""
        return self._decode("allreduce", self._of_step("allreduce", step))

    @property
    def has_routing(self) -> bool:
        """Whether the trace holds MoE routing (its model has expert layers)."""
        if self.ranged:
            return self._rows("routing") > 0
        return len(self._visible("routing")["step"]) > 0

    def routing(self, request_id: str, *, model: str = "target", at_step: int | None = None) -> dict[str, np.ndarray]:
        """A request's MoE routing, one row per (layer, position): the record live at
        `at_step` (the latest with step <= at_step; all steps when None), sorted by
        (position, layer). Arrays layer, position, step, runner_up, runner_up_score,
        input_hash [n], experts int [n, k], scores float32 [n, k]."""
        ranged = self.ranged
        t = self._request_rows("routing", request_id, at_step) if ranged else self._visible("routing")
        sel = (t["request"] == self.request_index(request_id)) & (t["model"] == self.codes("models").index(model))
        if at_step is not None:
            sel &= t["step"] <= at_step
        if not ranged:
            return live.routing_cells(t, self._visible("routing_choices"), np.flatnonzero(sel))
        t = {k: v[sel] for k, v in t.items()}
        ch, first = self._pointed("routing_choices", t["choice_offset"], t["k"])  # the choices they point at
        return live.routing_cells({**t, "choice_offset": first}, ch, np.arange(len(t["step"])))

    def finish_step(self, request_id: str) -> int | None:
        t = self._visible("request_events")
        sel = (t["request"] == self.request_index(request_id)) & \
              (t["kind"] == self.codes("kinds").index("finished"))
        return int(t["step"][sel][0]) if sel.any() else None


def _group(column: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, starts): rows of value i are order[starts[i]:starts[i + 1]], in row order."""
    v = column.astype(np.int64)
    order = np.argsort(v, kind="stable")
    return order, np.searchsorted(v[order], np.arange(n + 1))
