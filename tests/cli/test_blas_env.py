"""DIVERGENCE_BLAS that names nothing loadable: `divergence run` says so in one line, exit 2
(importing divergence.engine.kernels.blas never raises)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(env_value, tmp_path, *extra):
    env = {**os.environ, "DIVERGENCE_BLAS": env_value}
    return subprocess.run([sys.executable, "-m", "divergence", "run", "--out", str(tmp_path / "out"), *extra],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.skipif(sys.platform != "linux", reason="DIVERGENCE_BLAS is read on Linux")
@pytest.mark.parametrize("value", ["bogus", "/no/such/libblas.so.3", "__DIR__"])
def test_bogus_blas_is_one_line_exit_2(tmp_path, value):
    if value == "__DIR__":
        value = str(tmp_path)  # exists, but is no library
    p = _run(value, tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2, p.stderr
    assert len(lines) == 1 and lines[0].startswith("divergence run: error: DIVERGENCE_BLAS="), lines
    assert "Traceback" not in p.stderr and not (tmp_path / "out").exists()


@pytest.mark.skipif(sys.platform != "linux", reason="DIVERGENCE_BLAS is read on Linux")
def test_import_never_raises_and_reference_is_fine():
    code = "import divergence.engine.kernels.blas as b; print(repr(b.blas_problem()))"
    for value, want in (("bogus", "DIVERGENCE_BLAS='bogus'"), ("reference", "None"), ("", "None")):
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "DIVERGENCE_BLAS": value})
        assert p.returncode == 0 and want in p.stdout, (value, p.stdout, p.stderr)
