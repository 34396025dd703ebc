"""Run a replaying command under the BLAS environment its traces were recorded in.

OpenBLAS picks its core (and divergence its BLAS library) when the library loads, before
MLX, so one process cannot switch them. A command that replays traces recorded under
another core (`replay`, `bisect --confirm`/`--ops`, `report --confirm`) is run again in a
child process started with that core; where this CPU cannot run it, one line and exit 2.
A pair recorded in two environments runs under B's (its forced replays need it); the
analysis replays A's side, and B under A's environment, in children of their own.
"""
from __future__ import annotations

import os
import subprocess
import sys

from ..analysis.environment import (BLAS_FIELDS, REEXEC_ENV, Reproduction, child_environment, core_problem, recorded,
                                    reproduction)
from ..core.host import CORE_ENV
from ..errors import EnvironmentMismatchError


def replayed_traces(args) -> list[str]:
    """The traces this command will replay with divergence's engine (none: it replays nothing)."""
    if args.command == "replay":
        return [args.trace]
    if args.command in ("bisect", "report") and not getattr(args, "confirm_cmd", None):
        if args.confirm or getattr(args, "ops", None):
            return [args.a, args.b]
    return []


def run_under_recorded_environment(args, argv) -> int | None:
    """The child's exit code when the command had to run in a child process; None when this
    process already runs under the traces' environment (or the command replays nothing)."""
    paths = replayed_traces(args)
    if not paths or os.environ.get(REEXEC_ENV):
        return None
    from ..analysis.replayer import this_process  # (lazy: loads the BLAS)
    from ..trace.reader import Trace  # (lazy: loads numpy and h5py; the parser imports every command)

    if args.command == "replay" and getattr(args, "environment_of", None):
        paths = [args.environment_of]  # the environment asked for, not the trace's own
    envs = []
    for p in paths:
        try:
            with Trace.open(p) as t:
                envs.append(recorded(t))
        except Exception:  # the command itself reports a trace it cannot open, in its own words
            return None
    # B's environment, the one its forced replays need; in an environment pair A's side runs
    # in children under A's (analysis/environment_confirm.py)
    want = envs[-1]
    rep = reproduction(want, this_process())
    if rep.missing:
        pair = any({k: e.get(k) for k in BLAS_FIELDS} != {k: want.get(k) for k in BLAS_FIELDS} for e in envs)
        if pair:
            return None  # the pipeline says, per cause, what this machine could not reproduce
        raise EnvironmentMismatchError(f"{paths[-1]} cannot be replayed on this machine: {rep.missing[0]} "
                                       f"(a replay here would differ for that reason alone)")
    if not rep.needs_child:
        return None
    code = call_child([sys.executable, "-m", "divergence", *argv], env=child_environment(rep))
    if code != 2:  # (bad input: the child's one line is all there is to say)
        print(f"note: replayed under the recorded BLAS environment ({rep.describe()}) in a child process",
              file=sys.stderr)
    return code


def run_under_requested_core(args, argv) -> int | None:
    """`run --blas-core CORE`: OpenBLAS takes its core when it loads. Before that, setting
    OPENBLAS_CORETYPE is enough; after (a caller in the same process loaded it), the run goes
    to a child process. The child's exit code, or None to run here."""
    core = getattr(args, "blas_core", None)
    if args.command != "run" or not core:
        return None

    problem = core_problem(core)
    if problem:
        raise EnvironmentMismatchError(f"--blas-core {core}: {problem}")
    if "divergence.engine.kernels.blas" not in sys.modules:
        os.environ[CORE_ENV] = core  # read when the library loads, just below
        return None
    from ..engine.kernels.blas import blas_core  # (lazy: loads the BLAS)

    if (blas_core() or "").lower() == core.lower() or os.environ.get(REEXEC_ENV):
        return None
    return call_child([sys.executable, "-m", "divergence", *argv],
                      env=child_environment(Reproduction(env={CORE_ENV: core})))


def call_child(cmd: list, env: dict) -> int:
    """Run the command's child; its exit code. Its output goes where this process's sys.stdout and
    sys.stderr go: their file descriptors where they have them (a terminal keeps its progress
    line), else through them (main() called in-process with its output captured or redirected:
    the caller reads the child's report as it would this process's)."""
    streams = {name: getattr(sys, name) for name in ("stdout", "stderr")}
    piped = {name: _fd(s) is None for name, s in streams.items()}
    for s in streams.values():
        s.flush()
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE if piped["stdout"] else None,
                       stderr=subprocess.PIPE if piped["stderr"] else None)
    for name, s in streams.items():
        data = getattr(p, name)
        if piped[name] and data:
            s.write(data.decode("utf-8", "replace"))
            s.flush()
    return p.returncode


def _fd(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None
