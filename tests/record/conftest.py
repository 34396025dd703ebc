"""The engine-neutral example's pair of imported traces, made once per session."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[2] / "examples" / "toy_engine.py"


def example(out, *args):
    subprocess.run([sys.executable, str(EXAMPLE), "--out", str(out), *args], check=True, timeout=120)
    return out


def toy_pair(d, schedules=("serial", "concurrent")):
    """(serial.h5, concurrent.h5) in d, imported from examples/toy_engine.py's JSON Lines."""
    from divergence.cli.main import main

    for schedule in schedules:
        example(d / schedule, "--schedule", schedule)
        assert main(["import", str(d / schedule), "--out", str(d / f"{schedule}.h5")]) == 0
    return tuple(d / f"{s}.h5" for s in schedules)


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """(serial.h5, concurrent.h5) imported from examples/toy_engine.py's JSON Lines."""
    return toy_pair(tmp_path_factory.mktemp("example"))


@pytest.fixture(scope="session")
def anyio_backend():
    return "asyncio"


@pytest.fixture(autouse=True)
def _confirm_runs_in_tmp_path(tmp_path, monkeypatch):
    """bisect --confirm-cmd keeps each re-run in a temp dir (named in its detail): here, under tmp_path."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
