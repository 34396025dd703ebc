"""What the HTML page shows, read from two open traces and a bisect report.

Plain data (lists, dicts, numpy arrays) for plots.py and page.py; nothing here
knows HTML or matplotlib. Reads traces through divergence.trace only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...core.labels import compact_labels, kernel_label
from ...core.names import MODELS, TARGET
from ..kv_grid import divergent_read

# KV grid cell states (the heat map's colour index)
KV_ABSENT, KV_EQUAL, KV_DIFFER, KV_DIFFER_CAUSE = 0, 1, 2, 3
PROMPT_SHOWN = 160  # prompt tokens shown before the generated text (the tail; the rest elided)
TEXT_BEFORE_FLIP = 600  # generated tokens shown before the first divergent token (the rest elided)
TEXT_AFTER_FLIP = 200  # generated tokens shown past the first divergent token
PLOT_POINTS = 1500  # a margin curve longer than this is binned (min margin, max |Δ| per bin)
KV_COLUMNS = 1200  # KV grid positions beyond this are binned (the worst state per bin)
TIMELINE_WINDOW = 30  # target steps each side of the root-cause step in the timeline plot
TABLE_WINDOW = 4  # target steps each side of it in the step table


# -- run settings ------------------------------------------------------------------------

def _model_text(m: dict | None) -> str:
    if not m:
        return "none"
    quant = m.get("quantization")
    q = f", {quant.get('bits')}-bit" if isinstance(quant, dict) and quant.get("bits") else ""
    name = Path(str(m.get("path", "?"))).name
    return f"{name} ({m.get('model_type', '?')}, {m.get('num_layers', '?')} layers, {m.get('dtype', '?')}{q})"


def _tp(meta: dict) -> str:
    """'2 (ring, ranks on 127.0.0.1)' from settings.tp {degree, backend, world, ...}; '1' for one device."""
    tp = (meta.get("settings") or {}).get("tp")
    if isinstance(tp, dict):
        world = tp.get("world")
        hosts = (f"ranks on {', '.join(dict.fromkeys(map(str, world)))}" if isinstance(world, list) and world
                 else (f"world {world}" if world else None))
        extra = ", ".join(str(x) for x in (tp.get("backend"), hosts) if x)
        return f"{tp.get('degree', 1)}" + (f" ({extra})" if extra else "")
    return "1" if tp is None else str(tp)


def settings_rows(meta_a: dict, meta_b: dict) -> list[tuple[str, str, str]]:
    """(name, A, B) for the settings that explain a run, then every other recorded key
    (so settings added to traces later still show)."""

    def named(meta):
        s, e, m = meta.get("settings") or {}, meta.get("environment") or {}, meta.get("model") or {}
        device = " ".join(str(x) for x in (e.get("backend"), e.get("device_name") or e.get("device")) if x)
        versions = ", ".join(f"{k} {e[k]}" for k in ("divergence", "mlx", "mlx_lm", "python") if e.get(k))
        return {
            "schedule": str(meta.get("schedule", "?")),
            "model": _model_text(m),
            "weights hash": str(m.get("weights_hash", "?"))[:12],
            "draft": _model_text(meta.get("draft")) + (f", spec k={s['spec_k']}" if s.get("spec_k") else ""),
            "kernel policy": str(meta.get("policy", s.get("policy", "?"))),
            "TP degree": _tp(meta),
            "token budget": str(s.get("token_budget", "?")),
            "prefix cache": str(s.get("prefix_caching", "?")),
            "top-k recorded": str(meta.get("top_k", s.get("top_k", "?"))),
            "BLAS": str(e.get("blas", "?")),
            "device": device or "?",
            "versions": versions or "?",
            "platform": str(e.get("platform", "?")),
            "recorded": str(meta.get("created", "?")),
            "completed": str(meta.get("completed", "?")),
        }

    na, nb = named(meta_a), named(meta_b)
    rows = [(k, na[k], nb[k]) for k in na]
    shown = {"spec_k", "policy", "token_budget", "prefix_caching", "top_k", "tp",
             "blas", "backend", "device_name", "device", "divergence", "mlx", "mlx_lm", "python", "platform"}
    for group in ("settings", "environment"):
        ga, gb = meta_a.get(group) or {}, meta_b.get(group) or {}
        for k in sorted(set(ga) | set(gb)):
            if k not in shown:
                rows.append((k.replace("_", " "), _val(ga.get(k)), _val(gb.get(k))))
    return rows


def _val(v) -> str:
    return "-" if v is None else str(v)


# -- texts ---------------------------------------------------------------------------------

@dataclass
class Text:
    """One request on one side: prompt tail and generated pieces, the flip index marked."""

    prompt: list[str]
    prompt_elided: int  # prompt tokens not shown
    generated: list[str]
    flip: int | None  # index into generated of the first divergent token
    elided_after: int  # generated tokens not shown at the end
    elided_before: int = 0  # generated tokens not shown between the prompt and `generated`


def piece(vocab, token: int) -> str:
    if vocab is not None and 0 <= token < len(vocab):
        return vocab[token]
    return f"<{token}>"


def request_text(trace, rid: str, vocab, flip: int | None) -> Text:
    req = trace.requests[trace.request_index(rid)]
    prompt = list(req.prompt_tokens)
    toks = [int(t) for t in trace.tokens(rid).tokens]
    keep = min(len(toks), TEXT_BEFORE_FLIP + TEXT_AFTER_FLIP) if flip is None else \
        min(len(toks), flip + 1 + TEXT_AFTER_FLIP)
    first = 0 if flip is None else max(0, flip - TEXT_BEFORE_FLIP)
    shown_prompt = prompt[-PROMPT_SHOWN:]
    return Text([piece(vocab, t) for t in shown_prompt], len(prompt) - len(shown_prompt),
                [piece(vocab, t) for t in toks[first:keep]], None if flip is None else flip - first,
                len(toks) - keep, first)


# -- margins ---------------------------------------------------------------------------------

@dataclass
class MarginSeries:
    rid: str
    positions_a: np.ndarray
    margin_a: np.ndarray  # top-1 minus top-2 logit at each generated position
    positions_b: np.ndarray
    margin_b: np.ndarray
    delta_positions: np.ndarray  # positions compared (up to the flip: past it the contexts differ)
    delta: np.ndarray  # max |Δlogit| over the token ids both top-k lists hold
    first_numeric: int | None
    flip: int | None


def _margin(topk_logits) -> np.ndarray:
    lg = np.asarray(topk_logits, np.float64)
    if lg.ndim != 2 or lg.shape[1] < 2:
        return np.zeros(len(lg))
    return lg[:, 0] - lg[:, 1]


def _row_delta(ids_a, la, ids_b, lb) -> np.ndarray:
    if len(ids_a) == 0:
        return np.zeros(0)
    match = ids_a[:, :, None] == ids_b[:, None, :]
    d = np.abs(np.asarray(la, np.float64)[:, :, None] - np.asarray(lb, np.float64)[:, None, :])
    return np.where(match, d, 0.0).max(axis=(1, 2))


def margin_series(a, b, rid: str, flip_position: int | None, numeric_position: int | None) -> MarginSeries:
    ta, tb = a.tokens(rid), b.tokens(rid)
    n = min(len(ta.tokens), len(tb.tokens))
    end = n
    if flip_position is not None:
        hit = np.flatnonzero(np.asarray(ta.positions[:n]) == flip_position)
        end = int(hit[0]) + 1 if hit.size else n
    delta = _row_delta(np.asarray(ta.topk_ids[:end]), ta.topk_logits[:end],
                       np.asarray(tb.topk_ids[:end]), tb.topk_logits[:end])
    return MarginSeries(rid, *binned(np.asarray(ta.positions), _margin(ta.topk_logits), np.minimum),
                        *binned(np.asarray(tb.positions), _margin(tb.topk_logits), np.minimum),
                        *binned(np.asarray(ta.positions[:end]), delta, np.maximum), numeric_position, flip_position)


def binned(x: np.ndarray, y: np.ndarray, ufunc, n: int = PLOT_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """At most n points: per bin the first x and ufunc (np.minimum / np.maximum) of y, so a
    near-tie or a spike survives the thinning."""
    if len(x) <= n:
        return x, y
    starts = np.linspace(0, len(x), n + 1).astype(np.int64)[:-1]
    return x[starts], ufunc.reduceat(y, starts)


# -- KV grid --------------------------------------------------------------------------------

@dataclass
class KvGrid:
    rid: str
    cells: np.ndarray  # int8 [layers, positions]: KV_* states
    earliest: tuple[int, int] | None  # (layer, position) of the earliest differing cell
    cause_step_b: int | None
    read_at: tuple[int, int]  # (step_a, step_b) whose reads are compared
    n_differ: int = 0
    positions: int = 0  # positions covered (cells may be binned to fewer columns)
    n_cells: int = 0  # cells both traces hold


def kv_grid(a, b, rid: str, pos: int, step_a: int, step_b: int, cause_step_b: int | None,
            num_layers: int | None) -> KvGrid | None:
    """Every (layer, position < pos) the divergent step read, in both traces: equal, differing,
    or differing and written by the root-cause step. None without KV hashes."""
    if not (a.has_kv_hashes and b.has_kv_hashes):
        return None
    read = divergent_read(a, b, rid, pos, step_a, step_b, num_layers=num_layers)
    layers = max(len(read.layers), 1)
    cells = np.full((layers, max(pos, 1)), KV_ABSENT, np.int8)
    both, differ = read.both, read.differs
    L, P = both.shape
    view = cells[:L, :P]
    view[both] = KV_EQUAL
    view[differ] = KV_DIFFER
    if cause_step_b is not None:
        view[differ & (read.step[1] == cause_step_b)] = KV_DIFFER_CAUSE
    earliest = read.earliest()
    n_differ, n_cells = read.read_count(None)
    if cells.shape[1] > KV_COLUMNS:  # the raster stays small; the worst state of each bin shows
        starts = np.linspace(0, cells.shape[1], KV_COLUMNS + 1).astype(np.int64)[:-1]
        cells = np.maximum.reduceat(cells, starts, axis=1)
    return KvGrid(rid, cells, earliest, cause_step_b, (step_a, step_b), n_differ, pos, n_cells)


# -- step timeline ---------------------------------------------------------------------------

@dataclass
class StepRow:
    step: int
    rows: int
    slices: list[dict]  # request_id, phase, start, count
    kernels: dict = field(default_factory=dict)  # op -> label

    @property
    def kernel_text(self) -> str:
        return compact_labels(dict.fromkeys(self.kernels.values())) if self.kernels else "-"


def target_steps(trace) -> np.ndarray:
    st = trace.steps
    return np.asarray(st["index"])[np.asarray(st["model"]) == MODELS.index(TARGET)]


def step_row(trace, step: int, *, kernels: bool = True) -> StepRow:
    plan = trace.step_plan(step)
    sl = [{"request_id": s.request_id, "phase": s.phase, "start": s.start, "count": s.count} for s in plan.slices]
    ks: dict[str, str] = {}
    if kernels:
        k = trace.kernels(step=step)
        for op, kern, splits in zip(k["op"], k["kernel"], k["splits"]):
            ks.setdefault(str(op), kernel_label(str(kern), int(splits)))
    return StepRow(int(step), int(plan.rows), sl, ks)


def window(trace, center: int | None, half: int, *, kernels: bool) -> list[StepRow]:
    """The target steps within `half` target steps of `center` (or the first ones)."""
    steps = target_steps(trace)
    if not len(steps):
        return []
    i = int(np.searchsorted(steps, center)) if center is not None else 0
    lo, hi = max(0, i - half), min(len(steps), i + half + 1)
    if center is None:
        hi = min(len(steps), 2 * half + 1)
    return [step_row(trace, int(s), kernels=kernels) for s in steps[lo:hi]]
