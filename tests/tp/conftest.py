"""Tensor-parallel tests: real ranks (two processes over 127.0.0.1, MLX's ring), each
command under a hard timeout so a broken group fails the test instead of hanging CI."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 240  # seconds per command: two ranks load MLX on a shared 2-core machine


def cli(*args, cwd=None, timeout=TIMEOUT):
    """`divergence ARGS` in a fresh process (the launcher starts the ranks itself)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "divergence", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def fixture_dir():
    from divergence.cli.common import default_model_dirs

    return default_model_dirs()[0]
