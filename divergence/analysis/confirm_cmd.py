"""`bisect --confirm-cmd CMD`: confirm a root cause by re-running the user's own engine.

Replay re-executes divergence's engine only; a trace another engine recorded is
confirmed by that engine. For each cause, bisect fills the command's placeholders
and runs it through the shell; the command re-runs B's schedule with the cause
step changed as told and writes a trace (or a directory of the contract's JSON
Lines, imported here) at {out}. The cause is confirmed when that run's tokens
match A's up to the divergence, as for divergence's own replays.

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
from .diff import check_comparable

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


def make_command_confirmer(a, b, template: str, label_a: str = "A", label_b: str = "B", *,
                           workdir=None, timeout: float | None = None):
    """confirm(cause, request_diff) -> (confirmed, detail), for bisect_traces(replayer=...)."""
    check_template(template)
    used = set(_FIELD.findall(template))
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="divergence-confirm-"))
    runs: dict[str, Path] = {}  # filled command (without {out}) -> trace it wrote

    def run(cause, rid: str) -> tuple[Path, str]:
        values = {"trace": b.path, "step": cause.b.step, "requests": ",".join(cause.co_batched_b),
                  "request": rid, "force": force_for(cause)}
        key = fill(template, {**values, "out": "\0"})
        if key in runs:
            return runs[key], values["force"]
        out = work / f"step{cause.b.step}-{len(runs)}.h5"
        cmd = fill(template, {**values, "out": out})
        try:
            p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DivergenceInputError(f"--confirm-cmd ran past {timeout:g} s: {cmd}") from None
        if p.returncode != 0:
            last = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or [""])[-1]
            why = f" ({last.strip()[:200]})" if last.strip() else ""
            raise DivergenceInputError(f"--confirm-cmd exited {p.returncode}{why}: {cmd}")
        if out.is_dir():  # the contract's JSON Lines: import them
            from ..record.jsonl import import_records

            trace = out.with_name(out.stem + ".imported.h5")
            import_records(out, trace)
            out = trace
        if not out.is_file():
            raise DivergenceInputError(f"--confirm-cmd wrote nothing at {{out}} ({out}): {cmd}")
        runs[key] = out
        return out, values["force"]

    def confirm(cause, rd):
        from ..trace.reader import Trace

        if cause.kind == "sampler":
            return None, "a sampler cause has no kernel to change"
        path, force = run(cause, rd.id)
        tok = rd.first_divergent_token
        n = (tok.generated_index + 1) if tok is not None else rd.compared
        with Trace.open(path) as got:
            check_comparable(a, got)
            ta, tg = a.tokens(rd.id), got.tokens(rd.id)
            want, have = [int(t) for t in ta.tokens[:n]], [int(t) for t in tg.tokens[:n]]
            la = np.asarray(ta.topk_logits[:n], np.float32).view(np.uint32)
            lg = np.asarray(tg.topk_logits[:n], np.float32).view(np.uint32)
        what = f"re-running {label_b} with {_change(used, cause, force)} (--confirm-cmd)"
        if have == want:
            exact = ", bit for bit" if la.shape == lg.shape and bool((la == lg).all()) else \
                " (tokens; some logits still differ)"
            return True, f"{what} makes {rd.id} match {label_a} up to the divergence{exact} ({path})"
        first = next((i for i, (x, y) in enumerate(zip(have, want)) if x != y), min(len(have), len(want)))
        return False, f"{what}: {rd.id} still differs from {label_a} at generated #{first} ({path})"

    return confirm


def _change(used: set, cause, force: str) -> str:
    """What the command was asked to change, in words (from the placeholders it uses)."""
    step = cause.b.step
    if "force" in used:
        return f"step {step} split, each request alone" if force == SOLO else f"step {step} on kernel {force}"
    if "requests" in used and cause.co_batched_b:
        return f"{', '.join(cause.co_batched_b)} split out of step {step}"
    return f"step {step} changed by the command"
