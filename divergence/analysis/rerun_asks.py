"""What a confirmation asks of a re-run at its forced step (a split, kernels, a relayout,
any change), as check_rerun reads it; this engine's forcings translated into those asks."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.policy import KernelPolicy, RelayoutStep, SoloStep


@dataclass(frozen=True)
class Split:
    """Asked: the step's requests split out. requests None: every request of the step alone."""

    requests: frozenset | None = None


@dataclass(frozen=True)
class Kernels:
    """Asked: these ops of the step on these kernel labels (op -> label, e.g. 'gemv', 'gemm/4').
    or_split: a re-run that split the step instead counts too (a user's engine, told A's
    kernel, may run the request alone to get it); others: the other ops may also run on an
    asked label (an engine that runs the whole step on it)."""

    ops: dict = field(default_factory=dict)
    or_split: bool = False
    others: bool = False


@dataclass(frozen=True)
class Relayout:
    """Asked (this engine's RelayoutStep): each request alone, and `request`'s slice covering
    its positions from `start` in one pass."""

    request: str
    start: int


@dataclass(frozen=True)
class AnyChange:
    """Asked: some change of the step, unnamed (a command that uses none of {force} {requests}):
    a split or other kernels both count."""


@dataclass(frozen=True)
class Unchecked:
    """A forcing this check does not read (tensor-parallel unsharding, a threshold policy)."""

    words: str = ""


def asked_of_forcing(forced: dict) -> dict:
    """This engine's forcing ({step: SOLO | RelayoutStep | KernelPolicy | {op: KernelPolicy}})
    as what check_rerun checks at each step."""
    out = {}
    for step, f in forced.items():
        if isinstance(f, RelayoutStep):
            out[step] = Relayout(f.request_id, f.start)
        elif isinstance(f, SoloStep):
            out[step] = Split(None)
        elif isinstance(f, dict) and all(isinstance(p, KernelPolicy) and p.threshold is None for p in f.values()):
            out[step] = Kernels({op: label_policy_to_label(p) for op, p in f.items()})
        else:
            out[step] = Unchecked("")
    return out


def label_policy_to_label(policy) -> str:
    """A forcible policy ('gemm:4') as the label its kernel records ('gemm/4')."""
    return str(policy).replace(":", "/", 1) if str(policy).startswith("gemm:") else str(policy)
