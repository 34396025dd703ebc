"""Proving an environment cause: B's run, replayed under A's environment, is A's.

Two traces of one schedule made under different BLAS libraries or OpenBLAS cores differ
for that reason alone. A process cannot switch its BLAS core, so each replay runs in a
`divergence replay` child process started with the environment it needs
(analysis/environment.py): B replayed under A's environment for the confirmation, and each
trace's root-cause step tapped op by op under its own environment for the first op.
"""
from __future__ import annotations

import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..errors import ReplayError
from ..trace.reader import Trace
from .cause import BY_ENVIRONMENT
from .confirmation import BaseConfirmer, Confirmation
from .environment import child_environment, recorded, reproduction
from .force_spec import force_args


def replay_in_child(trace, *, under=None, out=None, tap: tuple | None = None, forced: dict | None = None,
                    model_dir=None, draft_dir=None, workdir) -> Path:
    """Run `divergence replay` on an open trace in a child process under the recorded environment
    of `under` (another open trace; default: the trace's own), forcing `forced` (step -> policy,
    as parse_force gives). The child starts a TP trace's ranks itself. Writes the replayed trace
    (tap None) or the tapped step's op rows (tap = (step, request)) under workdir; returns that path."""
    trace_path = trace.path
    cmd = [sys.executable, "-m", "divergence", "replay", str(trace_path), "--json", *force_args(forced or {})]
    if under is not None:
        cmd += ["--environment-of", str(under.path)]
    if model_dir:
        cmd += ["--model", str(model_dir)]
    if draft_dir:
        cmd += ["--draft", str(draft_dir)]
    if tap is not None:
        out = Path(workdir) / f"tap-{Path(trace_path).stem}-{tap[0]}-{tap[1]}.pkl"
        cmd += ["--tap", f"{tap[0]}:{tap[1]}", "--tap-out", str(out)]
    else:
        out = Path(out or Path(workdir) / f"{Path(trace_path).stem}.under.h5")
        cmd += ["--out", str(out)]
    source = under if under is not None else trace
    rep = reproduction(recorded(source), {})  # a child told every field, whatever this process runs
    if rep.missing:
        raise ReplayError(f"this machine cannot reproduce the environment of {source.path}: {rep.missing[0]}")
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_environment(rep))
    # a replay under another environment is meant to differ from its trace: 1 (not faithful) is fine
    if done.returncode not in (0, 1) or not out.exists():
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise ReplayError(f"the replay of {trace_path} in a child process failed: {why}")
    return out


def load_tap(path):
    with open(path, "rb") as f:
        return pickle.load(f)


def save_tap(rows, path) -> None:
    with open(path, "wb") as f:
        pickle.dump(rows, f)


class EnvironmentConfirmer(BaseConfirmer):
    """Proves an `environment` cause (a Confirmer of analysis.confirmation), by BY_ENVIRONMENT:
    B's run replayed (unforced: its own plans, tokens and draws) under A's recorded
    environment must give A's tokens and top-k logits for the request, bit for bit, up to
    the divergence. One replay, in a child process, serves every request; close() releases it."""

    def __init__(self, a, b, *, model_dir=None, draft_dir=None, label_a: str = "A", label_b: str = "B"):
        self.a, self.b, self.model_dir, self.draft_dir = a, b, model_dir, draft_dir
        self.label_a, self.label_b = label_a, label_b
        self.work = tempfile.TemporaryDirectory(prefix="divergence-env-")
        self.state: dict = {}
        self.cause_fields: list = []  # the recorded fields the first environment cause names

    def replayed(self):
        state = self.state
        if "trace" not in state:
            state["trace"] = None
            try:  # (a field this machine cannot reproduce is the ReplayError's line)
                path = replay_in_child(self.b, under=self.a, model_dir=self.model_dir, draft_dir=self.draft_dir,
                                       workdir=self.work.name)
            except ReplayError as e:
                state["why"] = str(e)
                return None
            state["trace"] = Trace.open(path)
            want = recorded(self.a)
            state["how"] = ", ".join(f"{k} {want[k]}" for k in (self.cause_fields or ("blas_core",)) if k in want)
        return state["trace"]

    def confirm(self, cause, rd) -> Confirmation:
        a, label_a, label_b = self.a, self.label_a, self.label_b
        if not self.cause_fields and cause.env_diff:
            self.cause_fields.extend(cause.env_diff)
        got = self.replayed()
        if got is None:
            return Confirmation(None, self.state["why"])
        tok = rd.first_divergent_token
        n = tok.generated_index + 1 if tok is not None else rd.compared
        ta, tg = a.tokens(rd.id), got.tokens(rd.id)
        same = [int(t) for t in ta.tokens[:n]] == [int(t) for t in tg.tokens[:n]]
        la = np.asarray(ta.topk_logits[:n], np.float32).view(np.uint32)
        lg = np.asarray(tg.topk_logits[:n], np.float32).view(np.uint32)
        bitwise = same and la.shape == lg.shape and bool((la == lg).all())
        upto = f"up to position {tok.position}, where it diverged" if tok is not None else \
            f"over its {n} compared tokens"
        how = self.state["how"]
        if bitwise:
            return Confirmation(True, f"replaying {label_b} under {label_a}'s recorded environment ({how}) gives "
                                      f"{rd.id} {label_a}'s tokens and logits bit for bit {upto}", BY_ENVIRONMENT)
        return Confirmation(False, f"replaying {label_b} under {label_a}'s environment ({how}) still differs from "
                                   f"{label_a} for {rd.id} {upto}: the recorded fields do not explain it",
                            BY_ENVIRONMENT)

    def close(self) -> None:
        if self.state.get("trace") is not None:
            self.state["trace"].close()
        self.work.cleanup()
