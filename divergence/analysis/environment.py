"""A run's numeric environment: which recorded fields change bits, which differ between
two traces, and what a process on this machine needs to run under a recorded one.

The BLAS library and its core are chosen when the library loads, before MLX: a process
cannot switch them. So a replay under another BLAS environment runs in a child process
started with that environment (`DIVERGENCE_BLAS`, `OPENBLAS_CORETYPE`); the thread count is
set in-process (blas.using_blas_threads). What no process here can change (another device,
another MLX) is named, never silently ignored: a replay there would report a false mismatch.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..core.host import BLAS_ENV as ENV, CORE_ENV, CORE_FLAGS, is_reference, missing_flags

# What a run's environment says that changes its numbers (versions and platform aside).
NUMERIC_ENVIRONMENT = ("backend", "device", "device_name", "blas", "blas_core", "blas_threads", "mlx")
# the fields a process on this machine can take on: the BLAS and its core by a child
# process's environment variables, the thread count in-process
BLAS_FIELDS = ("blas", "blas_core")
REEXEC_ENV = "DIVERGENCE_REEXEC"  # set in a child started for a recorded environment: never again


def recorded(trace) -> dict:
    return dict(trace.meta.get("environment") or {})


def environment_differs(a, b) -> dict:
    """key -> (a's, b's) for the NUMERIC_ENVIRONMENT keys both traces record and disagree on."""
    ea, eb = recorded(a), recorded(b)
    return {k: (ea[k], eb[k]) for k in NUMERIC_ENVIRONMENT if k in ea and k in eb and ea[k] != eb[k]}


@dataclass
class Reproduction:
    """How to run under a recorded environment here: `env` for a child process ({} when this
    process already runs under it), `missing` the fields this machine cannot reproduce."""

    env: dict = field(default_factory=dict)
    missing: list = field(default_factory=list)

    def describe(self) -> str:
        """'OPENBLAS_CORETYPE=SkylakeX' (what a child process is started with)."""
        return " ".join(f"{k}={v}" for k, v in sorted(self.env.items(), key=lambda kv: kv[0] != CORE_ENV))

    @property
    def needs_child(self) -> bool:
        return bool(self.env)


def reproduction(want: dict, here: dict) -> Reproduction:
    """What a process whose environment is `here` (analysis.replayer.this_process(); {} for a
    child told everything) needs to compute under `want` (a trace's recorded environment).
    Fields `want` does not record (traces of older versions, other engines) are not asked."""
    out = Reproduction()
    if "blas" in want and want["blas"] != here.get("blas"):
        if is_reference(want["blas"]):
            out.env[ENV] = "reference"
        elif is_reference(here.get("blas")) or str(want["blas"]).startswith("OpenBLAS"):
            path = _library_path(want["blas"])
            if path and os.path.exists(path):
                out.env[ENV] = path
            else:
                out.missing.append(f"blas: {want['blas']} is not on this machine")
        else:
            out.missing.append(f"blas: {want['blas']} (this process: {here.get('blas')})")
    core = want.get("blas_core")
    if core and core != here.get("blas_core"):
        problem = core_problem(core)
        if problem:
            out.missing.append(f"blas_core: {problem}")
        else:
            out.env[CORE_ENV] = core
    # another MLX or device is not reproduced: diff's environment note names it
    if out.missing:
        out.env = {}
    return out


def core_problem(core: str) -> str | None:
    """Why this process cannot be started with OpenBLAS core `core` (None: it can)."""
    lacks = missing_flags(core)
    if lacks is None:
        return f"not an OpenBLAS core this tool knows ({', '.join(CORE_FLAGS)})"
    if lacks:
        return f"this CPU cannot run OpenBLAS's {core} kernels (it lacks {', '.join(sorted(lacks))})"
    return None


def _library_path(blas: str) -> str | None:
    """'OpenBLAS (/usr/lib/.../libopenblasp-r0.3.21.so)' -> the path."""
    s = str(blas)
    return s[s.find("(") + 1: s.rfind(")")] if "(" in s and s.endswith(")") else None


def child_environment(rep: Reproduction) -> dict:
    """os.environ for a child process that runs under `rep` (and never re-executes again)."""
    env = dict(os.environ)
    env.update(rep.env)
    env[REEXEC_ENV] = "1"
    return env


def describe_blas(env: dict) -> str:
    core = env.get("blas_core")
    return str(env.get("blas")) + (f", core {core}" if core else "")
