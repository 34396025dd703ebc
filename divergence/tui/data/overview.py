"""The overview's rows: one per request, the run metadata side by side, the totals."""
from __future__ import annotations

from dataclasses import dataclass

from ...analysis.cause import RootCause
from ...analysis.diff import DIVERGED, RequestDiff
from ...analysis.report import KIND_TEXT


@dataclass
class RequestRow:
    id: str
    prompt_len: int
    len_a: int | None  # None until the tokens are counted (count_tokens)
    len_b: int | None
    status: str  # identical | diverged | missing | "" (one trace) | "..." (not analysed yet)
    diff: RequestDiff | None = None
    cause: RootCause | None = None

    @property
    def diverged(self) -> bool:
        return self.status == DIVERGED

    def status_text(self) -> str:
        d = self.diff
        if d is None:
            return self.status
        if d.status == DIVERGED:
            t = d.first_divergent_token
            return f"diverged at {t.position} (#{t.generated_index})" if t else "diverged (length)"
        if d.first_numeric_divergence is not None:
            return f"{d.status}, logits differ"
        return d.status

    def numeric_text(self) -> str:
        n = self.diff.first_numeric_divergence if self.diff else None
        return "" if n is None else str(n.position)

    def cause_text(self) -> str:
        c = self.cause
        if c is None:
            return ""
        kind = KIND_TEXT.get(c.kind, c.kind)
        layer = f" L{c.layer}" if c.layer is not None else ""
        return f"{kind}{layer} @ step {c.b.step}"


def _name(path) -> str | None:
    """A model directory by its last part: ".../fixtures/target" -> "target"."""
    return None if not path else str(path).rstrip("/").rsplit("/", 1)[-1]


def meta_rows(traces) -> list[tuple[str, list[str]]]:
    """(name, [value of A, value of B]) for the run metadata shown side by side."""
    rows = []

    def add(name, get):
        vals = []
        for t in traces:
            try:
                v = get(t.meta)
            except (KeyError, TypeError, AttributeError):
                v = None
            vals.append("-" if v is None or v == "" else str(v))
        rows.append((name, vals))

    env = lambda m: m["environment"]  # noqa: E731
    add("schedule", lambda m: m["schedule"])
    add("policy", lambda m: m["policy"])
    add("model", lambda m: f"{_name(m['model'].get('path'))} · {str(m['model'].get('weights_hash'))[:8]} · "
                           f"{m['model'].get('dtype')}")
    add("draft", lambda m: _name((m["draft"] or {}).get("path")))
    add("settings", lambda m: f"spec k {m['settings'].get('spec_k')}, budget "
                              f"{m['settings'].get('token_budget')}, top-k {m.get('top_k')}")
    if any(t.tp_degree > 1 for t in traces):  # tensor-parallel traces: the degree side by side
        add("tensor parallel", lambda m: _tp(m["settings"].get("tp")))
    add("versions", lambda m: f"mlx {env(m).get('mlx', '?')} · mlx-lm {env(m).get('mlx_lm', '?')}")
    add("device", lambda m: env(m).get("device"))
    add("BLAS", lambda m: _blas(env(m)))
    add("created", lambda m: str(m.get("created", ""))[:19].replace("T", " "))
    add("completed", lambda m: "yes" if m.get("completed") else "NO (killed or still running)")
    return rows


def _blas(env: dict) -> str | None:
    """The BLAS and, where recorded, its thread count (it changes fp32 bits: divergence/engine/kernels/blas.py)."""
    n = env.get("blas_threads")
    blas = _short_blas(env.get("blas"))
    return blas if n is None else f"{blas} · {n} thread{'s' if n != 1 else ''}"


def _short_blas(blas) -> str | None:
    """'OpenBLAS (/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3)' -> 'OpenBLAS (…/openblas-pthread/
    libblas.so.3)': the library's folder and file tell one BLAS from another; the prefix rarely does."""
    if not isinstance(blas, str) or "(" not in blas or not blas.endswith(")"):
        return blas
    name, path = blas[:-1].split("(", 1)
    parts = path.strip().split("/")
    if len(parts) <= 3:
        return blas
    return f"{name}(…/{'/'.join(parts[-2:])})"


def _tp(tp) -> str:
    if not tp:
        return "TP=1 (one device)"
    return f"TP={tp.get('degree')} · {tp.get('backend')} · {tp.get('launcher')}"


def totals(traces, counts) -> list[tuple[str, list[str]]]:
    """(name, [value of A, value of B]) for the run's size; counts: generated tokens per request
    of each trace, None where not counted yet."""
    rows = []
    rows.append(("requests", [str(len(t.requests)) for t in traces]))
    rows.append(("tokens", ["…" if c is None else str(int(c.sum())) for c in counts]))
    rows.append(("steps", [str(t.num_steps) for t in traces]))
    rows.append(("max rows", [str(int(t.steps["rows"].max())) if t.num_steps else "0" for t in traces]))
    rows.append(("time", [f"{float(t.steps['duration'].sum()):.2f} s" for t in traces]))
    return rows
