"""The text of a failed reproducibility assertion: what diverged, why, how to reproduce.

In the manner of pytest-regressions: counts first, then the first few
divergences in detail (from analysis.report, the CLI's own renderer), then the
commands that reproduce it.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field

MAX_REQUESTS = 10  # diverged requests shown in full; the rest are counted


@dataclass
class Comparison:
    """One compared pair of traces, its bisect report, and the names the text gives them."""

    path_a: str
    path_b: str
    report: object  # analysis.cause.BisectReport
    vocab: list | None = None
    label_a: str = "A"
    label_b: str = "B"


@dataclass
class RunSummary:
    """What was run, for the header line (all optional: traces compared as given have none)."""

    model: str | None = None
    policy: str | None = None
    spec_k: int | None = None
    max_tokens: int | None = None
    extra: dict = field(default_factory=dict)

    def text(self) -> str:
        parts = []
        if self.policy is not None:
            parts.append(f"policy {self.policy}")
        if self.spec_k:
            parts.append(f"spec_k {self.spec_k}")
        if self.max_tokens is not None:
            parts.append(f"max_tokens {self.max_tokens}")
        parts += [f"{k} {v}" for k, v in self.extra.items()]
        head = f"model {self.model}" if self.model else ""
        return head + (f" ({', '.join(parts)})" if parts else "")


def failure_text(comparisons: list[Comparison], run: RunSummary | None = None, *,
                 max_requests: int = MAX_REQUESTS) -> str:
    """The whole message: one block per diverged pair, then how to reproduce."""
    from ..analysis.report import request_lines  # (lazy: loads numpy; the plugin imports this module)

    bad = [c for c in comparisons if not c.report.identical]
    lines = []
    if len(bad) == 1:
        lines.append(f"{bad[0].label_a} and {bad[0].label_b} runs differ")
    else:
        lines.append("runs differ: " + ", ".join(f"{c.label_a} vs {c.label_b}" for c in bad))
    if run is not None and run.text():
        lines.append(run.text())
    for c in bad:
        d = c.report.diff
        diverged = d.diverged
        ids = ", ".join(r.id for r in diverged[:max_requests]) + (", ..." if len(diverged) > max_requests else "")
        lines.append("")
        if len(bad) > 1:
            lines.append(f"{c.label_a} vs {c.label_b}:")
        lines.append(f"Diverged requests: {len(diverged)} / {len(d.requests)} ({ids})")
        for p in d.incomplete:
            lines.append(f"note: {p} is incomplete (the run did not finish); compared up to where it ends")
        for r in diverged[:max_requests]:
            lines.append("")
            lines += request_lines(r, c.label_a, c.label_b, c.vocab, c.report.finding(r.id),
                                   c.report.confirm_requested)
        if len(diverged) > max_requests:
            lines.append(f"... and {len(diverged) - max_requests} more diverged requests (run the bisect below)")
        shared = [(k, v) for k, v in c.report.groups().items() if len(v) > 1]
        for (_kind, step), rids in shared:
            lines.append(f"shared root cause: {', '.join(sorted(rids))} trace back to the same {c.label_b} step {step}")
    lines += ["", "To reproduce:"]
    seen = set()
    for c in bad:
        for label, path in ((c.label_a, c.path_a), (c.label_b, c.path_b)):
            if path not in seen:
                seen.add(path)
                lines.append(f"    {label + ':':<12} {path}")
    for c in bad:
        bitwise = " --bitwise" if c.report.diff.bitwise else ""
        lines.append(f"    divergence bisect {_q(c.path_a)} {_q(c.path_b)} --confirm{bitwise}")
    for c in bad[:1]:
        lines.append(f"    divergence browse {_q(c.path_a)} {_q(c.path_b)}")
    return "\n".join(lines)


def _q(path: str) -> str:
    return shlex.quote(str(path))
