"""Kernel policies: which kernel a row count gets. Part of the numpy-only core, so
the pytest plugin and the analysis parse policies without loading a backend."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import PolicyError
from .names import (  # noqa: F401  (re-exported)
    ATTENTION_KERNELS, BATCH_INVARIANT, BATCHED, GEMM, GEMV, KERNELS, NATIVE, PADDED, PER_SEQ,
)

POLICY_HELP = "native | batch-invariant | threshold:N | gemv | gemm | gemm:SPLITS (attention: per-seq | batched | padded)"


@dataclass(frozen=True)
class KernelPolicy:
    """`threshold` is None except for threshold:N (rows <= N -> gemv, else gemm);
    `splits` pins gemm's split-K (gemm:S), which replay uses to reproduce a recorded gemm."""

    name: str
    threshold: int | None = None
    splits: int | None = None

    @classmethod
    def parse(cls, text: "str | KernelPolicy") -> "KernelPolicy":
        if isinstance(text, KernelPolicy):
            return text
        t = str(text).strip().lower()
        if t in (NATIVE, BATCH_INVARIANT, GEMV, GEMM) or t in ATTENTION_KERNELS:
            return cls(t)
        if t.startswith("gemm:"):
            n = _int_after_colon(t)
            if n < 1:
                raise PolicyError(f"bad kernel {text!r}: gemm:S needs an integer split count S >= 1")
            return cls(GEMM, splits=n)
        if t.startswith("threshold:"):
            n = _int_after_colon(t)
            if n < 1:
                raise PolicyError(f"bad kernel policy {text!r}: threshold:N needs an integer N >= 1")
            return cls("threshold", n)
        raise PolicyError(f"unknown kernel policy {text!r} (expected {POLICY_HELP})")

    def __str__(self) -> str:
        if self.threshold is not None:
            return f"threshold:{self.threshold}"
        return f"gemm:{self.splits}" if self.splits else self.name

    def kernel_for(self, rows: int) -> str:
        """The linear-op kernel at this row count (an attention-only policy leaves them native)."""
        if self.threshold is not None:
            return GEMV if rows <= self.threshold else GEMM
        return NATIVE if self.name in ATTENTION_KERNELS else self.name

    def attention_kernel(self, decode_slices: int) -> str:
        """The attention kernel of a step holding this many decode / verify slices.

        `native`, `threshold:N` and `gemm` batch them whenever there are several: that is
        what batched engines do, and on GPUs a masked batched SDPA takes other kernels
        than a single sequence's. `batch-invariant` and `gemv` (one row at a time, the
        serial shape) keep each sequence alone. Forced `batched` batches even one slice
        (the masked call at B=1), so replay can ask whether the mask alone changes bits.
        """
        if self.name == PADDED:  # prefill included: BatchGenerator's calls
            return PADDED
        if self.name in (BATCH_INVARIANT, GEMV, PER_SEQ) or decode_slices < 1:
            return PER_SEQ
        if self.name == BATCHED:
            return BATCHED
        return BATCHED if decode_slices >= 2 else PER_SEQ


@dataclass(frozen=True)
class SoloStep:
    """Replay forcing for a whole step: run each request of the step in its own forward
    pass, as if it had been alone in the step (the serial schedule's shape), under the
    run's own policy. Every op sees the request's own row count, norms, elementwise ops
    and attention included, so it proves a batching cause whichever op carried it: on
    a real backend (`native`) the kernels that depend on the row count are not ours."""

    def __str__(self) -> str:
        return SOLO_NAME


SOLO_NAME = "solo"
SOLO = SoloStep()


@dataclass(frozen=True)
class UnshardedStep:
    """Replay forcing for a whole step of a tensor-parallel trace: every sharded op runs
    on the full, unsharded weights on every rank (input gathered for sharded-to-all ops,
    no all-reduce; own columns cut from the full product for all-to-sharded ops), so the
    step computes what one device computes: how a TP=1 vs TP=N cause is confirmed."""

    def __str__(self) -> str:
        return UNSHARDED_NAME


UNSHARDED_NAME = "unsharded"
UNSHARDED = UnshardedStep()


def _int_after_colon(text: str) -> int:
    try:
        return int(text.split(":", 1)[1])
    except ValueError:
        return -1




@dataclass(frozen=True)
class RelayoutStep:
    """Replay forcing for a whole step: besides running each request alone (as SOLO),
    compute one request's positions [start, end) in this step's pass, as the other trace
    computed them in one pass: earlier positions again, later ones ahead of time (their
    own later steps then skip them). What proves a cause that is the row layout itself,
    e.g. a prefill split by the prefix cache or by chunking, where the backend's kernels
    depend on the row count and no kernel choice can stand in for the missing rows."""

    request_id: str
    start: int
    end: int
    # further passes of the same request after [start, end), run one after the other in this
    # step: the other trace computed those positions in more passes than this step's one
    then: tuple[tuple[int, int], ...] = ()

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return ((self.start, self.end), *self.then)

    def __str__(self) -> str:
        passes = " then ".join(f"[{a}:{b}]" for a, b in self.spans)
        return f"{SOLO_NAME}, {self.request_id}{passes} in {'one pass' if not self.then else 'these passes'}"
