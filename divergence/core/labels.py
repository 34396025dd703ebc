"""Text the report, bisect, replay and the TUI share: kernel labels and step compositions."""
from __future__ import annotations

from .names import GEMM


def kernel_label(kernel: str, splits: int = 1) -> str:
    """'gemm/8' for a gemm with 8 split-K partitions, else the kernel's name."""
    return f"{kernel}/{splits}" if kernel == GEMM else kernel


def label_policy(label: str) -> str:
    """A recorded kernel label ('gemv', 'gemm/4', 'native') as a forcible policy ('gemm:4')."""
    kind, _, splits = label.partition("/")
    return f"{kind}:{splits}" if kind == GEMM and splits else label


def compact_labels(labels) -> str:
    """'gemm/2', 'gemm/4', 'gemv' -> 'gemm/2,4 gemv': every kernel once, split-K counts merged."""
    kinds: dict[str, list[str]] = {}
    for lab in labels:
        kind, _, splits = lab.partition("/")
        kinds.setdefault(kind, [])
        if splits:
            kinds[kind].append(splits)
    return " ".join(k + ("/" + ",".join(v) if v else "") for k, v in kinds.items())


def slice_text(request_id: str, phase: str, start: int, count: int) -> str:
    """'r2 prefill[0:154]'."""
    return f"{request_id} {phase}[{start}:{start + count}]"


def composition_text(slices) -> str:
    """'r1 verify[9:13] + r2 prefill[0:154]' for SeqSlice-like objects or dicts."""
    parts = []
    for s in slices:
        if isinstance(s, dict):
            parts.append(slice_text(s["request_id"], s["phase"], s["start"], s["count"]))
        else:
            parts.append(slice_text(s.request_id, s.phase, s.start, s.count))
    return " + ".join(parts)


def span_text(positions, *, most: int = 8) -> str:
    """'9-12' for a run, '3, 5, 9' for scattered positions (the first `most`, then ' ...'), '-' for none."""
    p = [int(x) for x in positions]
    if not p:
        return "-"
    if p == list(range(p[0], p[-1] + 1)):
        return f"{p[0]}-{p[-1]}" if len(p) > 1 else str(p[0])
    return ", ".join(map(str, p[:most])) + (" ..." if len(p) > most else "")
