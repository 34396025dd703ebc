"""`bisect --confirm-cmd CMD`: confirm a root cause by re-running the user's own engine.

Replay re-executes divergence's engine only; a trace another engine recorded is
confirmed by that engine. For each cause, bisect fills the command's placeholders
and runs it through the shell; the command re-runs B's schedule with the cause
step changed as told and writes a trace (or a directory of the contract's JSON
Lines, imported here) at {out}. The cause is confirmed when that run is B with only
the change asked (analysis.rerun_check: B's earlier steps, kernels and K/V hashes, B's
schedule, the step split or on the kernel asked) and its tokens match A's up to the
divergence, as for divergence's own replays.

Placeholders (values are shell-quoted):
  {trace}     B's trace          {step}   B's root-cause step
  {requests}  the requests co-batched with the diverged one in that step (comma-separated): split them out
  {request}   the diverged request
  {force}     A's kernel label for the op that differs, or "solo" where the labels are the same
              (run each request of the step alone, as A did)
  {out}       where the command writes the new trace
"""
from __future__ import annotations

import re
import shlex
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..errors import DivergenceInputError
from ..record.jsonl import import_records
from ..trace.reader import Trace
from .cause import BY_COMMAND
from .confirmation import BaseConfirmer, Confirmation
from .diff import check_comparable
from .rerun_asks import AnyChange, Kernels, Split
from .rerun_check import check_rerun

PLACEHOLDERS = ("trace", "step", "requests", "request", "force", "out")
SOLO = "solo"
_FIELD = re.compile(r"(?<!\$)\{(\w+)\}")  # ${VAR} stays the shell's


def check_template(template: str) -> None:
    names = _FIELD.findall(template)
    unknown = [n for n in names if n not in PLACEHOLDERS]
    if unknown:
        raise DivergenceInputError(f"--confirm-cmd: unknown placeholder {{{unknown[0]}}} "
                                   f"(known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)})")
    if "out" not in names:
        raise DivergenceInputError("--confirm-cmd: the command must write its trace to {out}")


def fill(template: str, values: dict) -> str:
    return _FIELD.sub(lambda m: shlex.quote(str(values[m.group(1)])), template)


def force_for(cause) -> str:
    """What the command should change at the step: A's kernel label where the labels of
    the cause's op differ, else split the step (the batch itself made the difference)."""
    a, b = cause.a.kernel, cause.b.kernel
    return a if a not in ("?", b) else SOLO


def asked_of(used: set, cause, force: str):
    """What the command was asked to change at the cause step (from the placeholders it
    uses), as analysis.rerun_check checks it."""
    if "force" in used:
        if force == SOLO:
            return Split(None)
        return Kernels({cause.op: force} if cause.op else {}, or_split=True, others=True)
    if "requests" in used and cause.co_batched_b:
        return Split(frozenset(cause.co_batched_b))
    return AnyChange()


class CommandConfirmer(BaseConfirmer):
    """Proves causes by re-running the user's engine (a Confirmer of analysis.confirmation),
    by BY_COMMAND. The re-runs go to workdir, else to a temporary directory removed by
    close() (bisect's end) unless keep; kept re-runs are the Confirmation's artifacts."""

    def __init__(self, a, b, template: str, label_a: str = "A", label_b: str = "B", *,
                 workdir=None, timeout: float | None = None, keep: bool = False):
        check_template(template)
        self.a, self.b, self.template, self.label_a, self.label_b = a, b, template, label_a, label_b
        self.timeout, self.kept = timeout, bool(keep or workdir)
        self.used = set(_FIELD.findall(template))
        self.scratch = None  # its finalizer removes the directory when the confirmer goes, if close() did not
        if workdir:
            self.work = Path(workdir)
        elif keep:
            self.work = Path(tempfile.mkdtemp(prefix="divergence-confirm-"))
        else:
            self.scratch = tempfile.TemporaryDirectory(prefix="divergence-confirm-")
            self.work = Path(self.scratch.name)
        self.runs: dict[str, Path] = {}  # filled command (without {out}) -> trace it wrote

    def run(self, cause, rid: str) -> tuple[Path, str]:
        values = {"trace": self.b.path, "step": cause.b.step, "requests": ",".join(cause.co_batched_b),
                  "request": rid, "force": force_for(cause)}
        key = fill(self.template, {**values, "out": "\0"})
        if key in self.runs:
            return self.runs[key], values["force"]
        out = self.work / f"step{cause.b.step}-{len(self.runs)}.h5"
        cmd = fill(self.template, {**values, "out": out})
        try:
            p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise DivergenceInputError(f"--confirm-cmd ran past {self.timeout:g} s: {cmd}") from None
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or [""])[-1]
            why = f" ({last.strip()[:200]})" if last.strip() else ""
            raise DivergenceInputError(f"--confirm-cmd exited {p.returncode}{why}: {cmd}")
        if out.is_dir():  # the contract's JSON Lines: import them
            trace = out.with_name(out.stem + ".imported.h5")
            import_records(out, trace)
            out = trace
        if not out.is_file():
            raise DivergenceInputError(f"--confirm-cmd wrote nothing at {{out}} ({out}): {cmd}")
        self.runs[key] = out
        return out, values["force"]

    def confirm(self, cause, rd) -> Confirmation:
        if cause.kind == "sampler":
            return Confirmation(None, "a sampler cause has no kernel to change")
        a, label_a, label_b = self.a, self.label_a, self.label_b
        path, force = self.run(cause, rd.id)
        tok = rd.first_divergent_token
        n = (tok.generated_index + 1) if tok is not None else rd.compared
        where = f" ({path})" if self.kept else ""
        kept = (str(path),) if self.kept else ()
        with Trace.open(path) as got:
            check_comparable(a, got)
            valid = check_rerun(self.b, got, cause.b.step, asked_of(self.used, cause, force))
            if not valid:
                return Confirmation(False, f"not a valid re-run of {label_b}: {valid.first_difference} "
                                           f"(--confirm-cmd){where}", BY_COMMAND, kept)
            ta, tg = a.tokens(rd.id), got.tokens(rd.id)
            want, have = [int(t) for t in ta.tokens[:n]], [int(t) for t in tg.tokens[:n]]
            la = np.asarray(ta.topk_logits[:n], np.float32).view(np.uint32)
            lg = np.asarray(tg.topk_logits[:n], np.float32).view(np.uint32)
        # what the re-run did at the step, read from its trace (not from the command line)
        what = f"re-running {label_b} with {valid.did} (--confirm-cmd)"
        if have == want:
            exact = ", bit for bit" if la.shape == lg.shape and bool((la == lg).all()) else \
                " (tokens; some logits still differ)"
            return Confirmation(True, f"{what} makes {rd.id} match {label_a} up to the divergence{exact}{where}",
                                BY_COMMAND, kept)
        first = next((i for i, (x, y) in enumerate(zip(have, want)) if x != y), min(len(have), len(want)))
        return Confirmation(False, f"{what}: {rd.id} still differs from {label_a} at generated #{first}{where}",
                            BY_COMMAND, kept)

    def close(self) -> None:
        if self.scratch is not None:
            self.scratch.cleanup()
