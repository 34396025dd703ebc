"""What proving a cause by a re-run gives (Confirmation), and what every confirmer is (the
Confirmer protocol): this engine's replay (analysis.confirm.ReplayConfirmer: forced
kernels, solo, prefill passes), the TP side unsharded (analysis.tp), the user's command
(analysis.confirm_command) and B under A's environment (analysis.environment_confirm).
bisect_traces asks a Confirmer; a confirmation lives beside the cause (BisectReport.
confirmations), never inside it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .cause import RootCause
    from .diff import RequestDiff


@dataclass(frozen=True)
class Confirmation:
    """What confirming one cause found.

    confirmed: True, the re-run matched A; False, it did not (or was no valid re-run of B);
    None, nothing could be tried (no kernel to force, an environment this machine cannot
    reproduce). by: how the re-run was made, a CONFIRMED_BY name of analysis.cause (None:
    none ran, or it failed before saying how). detail: the sentence the report prints.
    artifacts: what the re-run left to look at (the traces --keep kept)."""

    confirmed: bool | None
    detail: str = ""
    by: str | None = None
    artifacts: tuple[str, ...] = ()

    def __post_init__(self):
        if self.confirmed is None and self.by is not None:
            raise ValueError(f"a confirmation that ran nothing cannot say how it ran ({self.by})")


@runtime_checkable
class Confirmer(Protocol):
    """Proves causes by a re-run, one request at a time."""

    def prepare(self, pairs: list[tuple[RootCause, RequestDiff]]) -> None:
        """Before the causes are confirmed one by one: work they can share (one replay)."""

    def confirm(self, cause: RootCause, rd: RequestDiff) -> Confirmation:
        """The confirmation of one request's cause."""

    def close(self) -> None:
        """Release what the re-runs hold (temporary directories, open traces)."""


class BaseConfirmer:
    """A confirmer with no work to share and nothing to release."""

    def prepare(self, pairs) -> None:
        return None

    def close(self) -> None:
        return None


class ByKind(BaseConfirmer):
    """One confirmer for some cause kinds, another for the rest: an environment cause is
    proved by B replayed under A's environment, the pair's other causes as they would be."""

    def __init__(self, default: Confirmer, by_kind: dict[str, Confirmer]):
        self.default, self.by_kind = default, by_kind

    def _for(self, cause) -> Confirmer:
        return self.by_kind.get(cause.kind, self.default)

    def prepare(self, pairs) -> None:
        for confirmer in (self.default, *self.by_kind.values()):
            confirmer.prepare([(c, rd) for c, rd in pairs if self._for(c) is confirmer])

    def confirm(self, cause, rd) -> Confirmation:
        return self._for(cause).confirm(cause, rd)

    def close(self) -> None:
        for confirmer in (self.default, *self.by_kind.values()):
            confirmer.close()
