"""A run as check_rerun compares it: a Trace, or a replay recorded in memory (RunRecord),
read into one RunView (schedule, step plans, kernel labels, K/V cells)."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..core.events import Observer
from ..core.labels import kernel_label


class RunRecord(Observer):
    """An in-memory record of a replay (its schedule, step plans, kernels and K/V writes),
    for check_rerun: pass it among a Replayer.run's observers."""

    wants_kernels = True

    def __init__(self, kv_hashes: bool = True):
        self.wants_kv_hashes = kv_hashes
        self.schedule = None
        self.plans: dict = {}
        self.kernel_rows: list = []  # (step, model, layer, op, expert, rows, label)
        self.kv: list = []

    def on_run_start(self, info) -> None:
        self.schedule = info.schedule

    def on_step(self, event) -> None:
        self.plans[event.plan.index] = event.plan

    def on_kernel(self, c) -> None:
        self.kernel_rows.append((c.step, c.model, c.layer, c.op, c.expert, c.rows, kernel_label(c.kernel, c.splits)))

    def on_kv_write(self, w) -> None:
        self.kv.append(w)


class TracePlans(Mapping):
    """A trace's step plans by index, each read when first asked for (a sparse replay and its
    re-run check read the steps they ran, not the whole trace)."""

    def __init__(self, trace):
        self.trace = trace
        self.index = np.sort(np.asarray(trace.steps["index"], np.int64))
        self._have: dict = {}

    def __getitem__(self, i):
        if i not in self._have:
            if not self.index.size or self.index[min(np.searchsorted(self.index, i), self.index.size - 1)] != i:
                raise KeyError(i)
            self._have[i] = self.trace.step_plan(int(i))
        return self._have[i]

    def between(self, first: int, last: int) -> list:
        """The plans of steps first..last, in step order."""
        return [self[i] for i in self.index[(self.index >= first) & (self.index <= last)].tolist()]

    def __iter__(self):
        return iter(self.index.tolist())

    def __len__(self) -> int:
        return int(self.index.size)


class RunView:
    """The parts of a run check_rerun compares: of a Trace or of a RunRecord. A trace's plans
    and kernel rows are read per step, when asked for."""

    def __init__(self, run):
        self.run = run
        self.is_trace = not isinstance(run, RunRecord)
        self._by_step: dict = {}
        if self.is_trace:
            self.schedule = run.meta.get("schedule")
            self.plans = TracePlans(run)
            self.has_kv = bool(run.has_kv_hashes)
            ks = run.kernels()
            steps = np.asarray(ks["step"], np.int64)
            order = np.argsort(steps, kind="stable")
            self._ks, self._order, self._steps = ks, order, steps[order]
        else:
            self.schedule, self.plans, self.has_kv = run.schedule, run.plans, run.wants_kv_hashes
            for row in run.kernel_rows:
                self._by_step.setdefault(row[0], []).append(row[1:])

    def kernels(self, step: int) -> list:
        """(model, layer, op, expert, rows, label) of the step, in recorded order."""
        if self.is_trace and step not in self._by_step:
            ks = self._ks
            rows = self._order[np.searchsorted(self._steps, step, "left"):np.searchsorted(self._steps, step, "right")]
            self._by_step[step] = [(str(ks["model"][i]), int(ks["layer"][i]), str(ks["op"][i]), int(ks["expert"][i]),
                                    int(ks["rows"][i]), kernel_label(str(ks["kernel"][i]), int(ks["splits"][i])))
                                   for i in rows.tolist()]
        return self._by_step.get(step, [])

    def kv_cells(self, before: int, *, since: int = 0, only=None) -> list:
        """Sorted (step, model, request, layer, position, k, v) of every K/V write in steps
        [since, before), of the requests `only` (None: all)."""
        if not self.is_trace:
            out = []
            for w in self.run.kv:
                if since <= w.step < before and (only is None or w.request_id in only):
                    out += [(int(w.step), str(w.model), str(w.request_id), int(w.layer), int(w.start) + i, int(k),
                             int(v)) for i, (k, v) in enumerate(zip(w.k_hashes.tolist(), w.v_hashes.tolist()))]
            return sorted(out)
        t = self.run
        w, h = t.kv_writes(), t.kv_hashes()
        models, ids = t.codes("models"), [r.id for r in t.requests]
        steps = np.asarray(w["step"])
        keep = (steps < before) & (steps >= since)
        if only is not None:
            keep &= np.isin(np.asarray(w["request"]), [i for i, r in enumerate(ids) if r in only])
        sel = np.flatnonzero(keep)
        kh = np.asarray(h["k_hash"]).astype(np.uint64)
        vh = np.asarray(h["v_hash"]).astype(np.uint64)
        out = []
        for i in sel.tolist():
            off, n, start = int(w["hash_offset"][i]), int(w["count"][i]), int(w["start"][i])
            head = (int(w["step"][i]), models[int(w["model"][i])], ids[int(w["request"][i])], int(w["layer"][i]))
            out += [(*head, start + j, int(kh[off + j]), int(vh[off + j])) for j in range(n)]
        return sorted(out)


_VIEWS: list = []  # (trace, its view): B is checked against every re-run of one bisect


def view(run) -> RunView:
    """What check_rerun reads of a Trace or RunRecord (a trace's view is kept for its next check)."""
    if isinstance(run, RunView):
        return run
    if isinstance(run, RunRecord):
        return RunView(run)
    for t, v in _VIEWS:
        if t is run:
            return v
    v = RunView(run)
    _VIEWS.append((run, v))
    del _VIEWS[:-4]
    return v
