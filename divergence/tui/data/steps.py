"""One trace's steps for the timeline: rows built on demand, kernels grouped by op class."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import xxhash

from ...core.labels import compact_labels, composition_text, kernel_label
from ...core.names import ATTENTION
from ...trace.reader import Trace
from ...trace.schema import KERNELS as KERNEL_NAMES
from .text import span_text

OP_CLASSES = (("attn", ("q_proj", "k_proj", "v_proj", "o_proj", ATTENTION)),
              ("mlp", ("gate_proj", "up_proj", "down_proj")), ("head", ("lm_head",)))


@dataclass
class StepRow:
    step: int
    model: str
    rows: int
    duration_ms: float
    composition: str
    requests: list[str]
    kernels: dict[str, str] | None  # op class -> labels; None until the kernel index is read


@dataclass
class KernelRow:
    op: str
    layers: str
    rows: int
    kernel: str
    m: int
    n: int
    k: int


@dataclass(frozen=True)
class StepMark:
    """Why a step matters to one request."""

    request_id: str
    kind: str  # ROOT_CAUSE_MARK | DIVERGENT_TOKEN_MARK
    text: str

    @property
    def root(self) -> bool:
        return self.kind == ROOT_CAUSE_MARK


ROOT_CAUSE_MARK, DIVERGENT_TOKEN_MARK = "root cause", "divergent token"


@dataclass
class StepDetail:
    side: int
    step: int
    model: str
    rows: int
    duration_ms: float
    slices: list[dict]
    kernels: list[KernelRow]
    marks: list[StepMark]


class _Lru(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or(self, key, make):
        if key in self:
            self.move_to_end(key)
            return self[key]
        v = self[key] = make()
        if len(self) > self.size:
            self.popitem(last=False)
        return v


def _tag(classes: np.ndarray) -> int:
    """4 hex digits for a set of native class signatures: steps whose ops fall into the
    same kernel classes show the same tag."""
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(np.sort(classes)).tobytes()) & 0xFFFF


class StepIndex:
    """One trace's steps, for a timeline of any length: columns read once, rows built on demand."""

    def __init__(self, trace: Trace):
        self.trace = trace
        st = trace.steps
        self.index = np.asarray(st["index"])
        self.model = np.asarray(st["model"])
        self.rows = np.asarray(st["rows"])
        self.duration = np.asarray(st["duration"])
        self._plans = _Lru(4096)
        self._kernels: dict | None = None
        self._bounds: tuple | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    def row_of_step(self, step: int) -> int | None:
        i = np.flatnonzero(self.index == step)
        return int(i[0]) if i.size else None

    def steps_of(self, request_id: str) -> np.ndarray:
        """Sorted step indexes whose batch held the request (from its KV writes and tokens)."""
        t = self.trace
        w = t.kv_writes()
        mine = np.asarray(w["step"])[np.asarray(w["request"]) == t.request_index(request_id)]
        return np.union1d(mine, t.tokens(request_id).steps)

    def plan(self, step: int):
        return self._plans.get_or(step, lambda: self.trace.step_plan(step))

    @property
    def kernels_ready(self) -> bool:
        return self._kernels is not None

    def load_kernels(self) -> None:
        """Read the kernel table (large: one record per op, layer and step). Thread-safe; call once."""
        with self._lock:
            if self._kernels is not None:
                return
            k = self.trace.kernels()
            order = None if np.all(np.diff(k["step"]) >= 0) else np.argsort(k["step"], kind="stable")
            if order is not None:
                k = {n: v[order] for n, v in k.items()}
            # a label per record ("gemm/4", "gemv"), built over unique (kernel, splits) pairs: 1e6 records are common
            kernel = k["kernel"]
            kinds = list(KERNEL_NAMES)
            kinv = np.full(len(kernel), -1, np.int64)
            for j, name in enumerate(kinds):
                kinv[kernel == name] = j
            rest = kinv < 0
            if rest.any():  # kernels this version does not know by name
                extra, extra_inv = np.unique(kernel[rest], return_inverse=True)
                kinv[rest] = len(kinds) + extra_inv
                kinds += [str(x) for x in extra]
            code, inv = np.unique(kinv * 65536 + k["splits"], return_inverse=True)
            names = np.array([kernel_label(kinds[c // 65536], c % 65536) for c in code.tolist()])
            k["label"] = names[inv]
            native = (kernel == "native") & (k["native_class"] != 0)
            if native.any():  # the probed kernel class: "native/3fa2" (4 hex digits of its signature)
                cls, cinv = np.unique(k["native_class"][native], return_inverse=True)
                k["label"] = k["label"].astype(object)
                k["label"][native] = np.array([f"native/{int(c) & 0xFFFF:04x}" for c in cls.tolist()])[cinv]
            self._bounds = (np.searchsorted(k["step"], self.index, "left"),
                            np.searchsorted(k["step"], self.index, "right"))
            self._kernels = k

    def _kernel_slice(self, row: int) -> dict | None:
        if self._kernels is None:
            return None
        lo, hi = int(self._bounds[0][row]), int(self._bounds[1][row])
        return {n: v[lo:hi] for n, v in self._kernels.items()}

    def kernel_summary(self, row: int) -> dict[str, str] | None:
        k = self._kernel_slice(row)
        if k is None:
            return None
        out = {}
        for name, ops in OP_CLASSES:
            sel = np.isin(k["op"], ops)
            # attention's kernel (per-seq | batched) is always named; its class is not a linear op's
            native = sel & (k["native_class"] != 0) & (k["op"] != ATTENTION)
            classes = np.unique(k["native_class"][native])
            if classes.size > 1:  # one op class's ops each have a signature: show one tag for the set
                labels = k["label"][sel & ~native].tolist() + [f"native/{_tag(classes):04x}"]
            else:
                labels = k["label"][sel].tolist()
            out[name] = compact_labels(dict.fromkeys(labels)) if labels else ""
        return out

    def kernel_widths(self, sample: int = 2000) -> dict[str, int]:
        """The widest kernel summary of each op class, over every step (or `sample` steps spread
        evenly over a longer trace): the timeline's kernel columns are this wide."""
        if self._kernels is None:
            return {}
        n = len(self.index)
        rows = range(n) if n <= sample else np.linspace(0, n - 1, sample).astype(np.int64).tolist()
        widths = {name: 0 for name, _ in OP_CLASSES}
        for r in rows:
            for name, text in (self.kernel_summary(int(r)) or {}).items():
                widths[name] = max(widths[name], len(text))
        return widths

    def kernel_rows(self, row: int) -> list[KernelRow] | None:
        k = self._kernel_slice(row)
        if k is None:
            return None
        out: list[KernelRow] = []
        groups: dict[tuple, list[int]] = {}
        for i in range(len(k["op"])):
            key = (str(k["op"][i]), int(k["rows"][i]), str(k["label"][i]), int(k["m"][i]), int(k["n"][i]),
                   int(k["k"][i]))
            groups.setdefault(key, []).append(int(k["layer"][i]))
        for (op, rows, label, m, n, kk), layers in groups.items():
            out.append(KernelRow(op, span_text(sorted(set(layers))), rows, label, m, n, kk))
        return out

    def row(self, row: int) -> StepRow:
        step = int(self.index[row])
        plan = self.plan(step)
        comp = composition_text(plan.slices)
        return StepRow(step, plan.model, int(self.rows[row]), float(self.duration[row]) * 1e3, comp,
                       list(dict.fromkeys(plan.request_ids)), self.kernel_summary(row))
