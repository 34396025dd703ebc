"""Digests of every recorded column of a trace (timing aside), so a refactor or a speed change
that alters what the engine records is caught: the demo and a `--tp 2` run are pinned in
pinned_traces.json.

They are pinned under MLX's bundled reference BLAS (DIVERGENCE_BLAS=reference): it and libmlx
are compiled for baseline x86-64 (SSE2 only, no runtime kernel dispatch), so the recorded
numbers are the same on every x86-64 CPU. Under OpenBLAS they would depend on the core it picks.
MLX's own kernels may change between releases, so the pins name the MLX version they hold for.

    python -m tests.trace.pinned --write   # re-pin, after a change that is meant to alter traces
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
PINS = Path(__file__).with_name("pinned_traces.json")
TIMING = {("steps", "duration")}  # wall-clock columns: the only ones a faithful rerun may change
# name -> `divergence` arguments (each writes serial.h5 and concurrent.h5 into --out)
RUNS = {"demo": ["run"], "tp2": ["run", "--tp", "2", "--max-tokens", "16"]}


def where() -> dict:
    """What the pins depend on besides the code: MLX's release and the CPU architecture."""
    return {"mlx": importlib.metadata.version("mlx"), "machine": platform.machine()}


def digest(path) -> dict[str, str]:
    """table -> digest of its columns (name, dtype, shape, bytes); plus the requests and settings."""
    from divergence.trace import schema as S
    from divergence.trace.reader import Trace

    out = {}
    with Trace.open(path) as t:
        for name in S.TABLES:
            cols = t.table(name, raw=True)
            h = hashlib.sha256()
            for col in sorted(cols):
                if (name, col) not in TIMING:
                    a = np.ascontiguousarray(cols[col])
                    h.update(f"{col}:{a.dtype.str}:{a.shape}".encode())
                    h.update(a.tobytes())
            out[name] = h.hexdigest()[:16]
        out["requests"] = hashlib.sha256(repr(t.requests).encode()).hexdigest()[:16]
        out["settings"] = hashlib.sha256(json.dumps(t.meta["settings"], sort_keys=True).encode()).hexdigest()[:16]
    return out


def record(name: str, out: Path, timeout: float = 300) -> dict[str, dict[str, str]]:
    """Run RUNS[name] in a fresh process on the reference BLAS; schedule -> digest."""
    env = {**os.environ, "DIVERGENCE_BLAS": "reference",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "divergence", *RUNS[name], "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"divergence {' '.join(RUNS[name])} exited {p.returncode}: {p.stderr.strip()[-2000:]}")
    return {s: digest(out / f"{s}.h5") for s in ("serial", "concurrent")}


def main() -> None:
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.trace.pinned --write")
    pins = {"where": where(), "runs": {}}
    with tempfile.TemporaryDirectory() as d:
        for name in RUNS:
            pins["runs"][name] = record(name, Path(d) / name)
    tmp = PINS.with_suffix(".tmp")
    tmp.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
    tmp.replace(PINS)
    print(f"pinned {', '.join(RUNS)} under {pins['where']} -> {PINS}")


if __name__ == "__main__":
    main()
