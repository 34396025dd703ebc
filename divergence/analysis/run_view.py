"""A run as check_rerun compares it: a Trace, or a replay recorded in memory (RunRecord),
read into one RunView (schedule, step plans, kernel labels, K/V cells)."""
from __future__ import annotations

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


class RunView:
    """The parts of a run check_rerun compares: of a Trace or of a RunRecord."""

    def __init__(self, run):
        self.run = run
        self.is_trace = not isinstance(run, RunRecord)
        if self.is_trace:
            self.schedule = run.meta.get("schedule")
            self.plans = {p.index: p for p in run.iter_plans()}
            self.has_kv = bool(run.has_kv_hashes)
            ks = run.kernels()
            labels = [kernel_label(str(k), int(s)) for k, s in zip(ks["kernel"], ks["splits"])]
            self._k = list(zip((int(x) for x in ks["step"]), (str(x) for x in ks["model"]),
                               (int(x) for x in ks["layer"]), (str(x) for x in ks["op"]),
                               (int(x) for x in ks["expert"]), (int(x) for x in ks["rows"]), labels))
        else:
            self.schedule, self.plans, self.has_kv, self._k = run.schedule, run.plans, run.wants_kv_hashes, \
                run.kernel_rows
        self._by_step: dict = {}
        for row in self._k:
            self._by_step.setdefault(row[0], []).append(row[1:])

    def kernels(self, step: int) -> list:
        """(model, layer, op, expert, rows, label) of the step, in recorded order."""
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
