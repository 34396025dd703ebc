"""Anything that is not a readable trace is one clear TraceError (the CLI: exit 2)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from divergence import Trace
from divergence.cli.main import main
from divergence.errors import TraceError
from divergence.trace import schema as S
from divergence.trace.writer import TraceWriter

from .synthetic import emit_run


def _trace(path):
    with TraceWriter(path, top_k=4) as w:
        emit_run(w, steps=2)
    return path


def test_missing_and_directory(tmp_path):
    with pytest.raises(TraceError, match="no such trace"):
        Trace.open(tmp_path / "none.h5")
    with pytest.raises(TraceError, match="directory"):
        Trace.open(tmp_path)


def test_corrupt_file(tmp_path):
    p = tmp_path / "bad.h5"
    p.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(TraceError, match="not an HDF5"):
        Trace.open(p)
    good = _trace(tmp_path / "good.h5")
    raw = bytearray(good.read_bytes())
    trunc = tmp_path / "trunc.h5"
    trunc.write_bytes(bytes(raw[: len(raw) // 3]))
    with pytest.raises(TraceError):
        Trace.open(trunc)


def test_foreign_hdf5(tmp_path):
    p = tmp_path / "foreign.h5"
    with h5py.File(p, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(TraceError, match="not a divergence trace"):
        Trace.open(p)


def test_newer_schema(tmp_path):
    p = _trace(tmp_path / "new.h5")
    with h5py.File(p, "r+") as f:
        f.attrs["schema_version"] = S.SCHEMA_VERSION + 1
    with pytest.raises(TraceError, match=f"schema {S.SCHEMA_VERSION + 1}, newer .* upgrade divergence") as e:
        Trace.open(p)
    assert "\n" not in str(e.value)


def test_damaged_trace(tmp_path):
    p = _trace(tmp_path / "t.h5")
    with h5py.File(p, "r+") as f:
        del f["kv/hashes"]
    with pytest.raises(TraceError, match="damaged trace: /kv/hashes is missing"):
        Trace.open(p)
    with h5py.File(p, "r+") as f:
        del f.attrs["schema_version"]
    with pytest.raises(TraceError, match="no valid schema_version"):
        Trace.open(p)


UNFINISHED = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from divergence.trace.writer import TraceWriter
    from trace.synthetic import emit_run
    w = TraceWriter({path!r}, top_k=4, flush_seconds=0)
    emit_run(w, steps=50, end=False)
    os._exit(0)  # like a kill: the file stays marked open for SWMR writing
""")

OPEN = textwrap.dedent("""
    import sys
    from divergence import Trace
    from divergence.errors import TraceError
    try:
        with Trace.open(sys.argv[1]) as t:
            t.steps, t.kv_hashes(), t.tokens("r1")
        print("opened")
    except TraceError as e:
        print("TraceError:", e)
""")


def test_damaged_file_of_a_killed_run_is_refused_not_hung(tmp_path):
    """SWMR reads skip HDF5's end-of-file check and retry bad checksums: a cut or
    scribbled file of a killed run must still fail fast with a TraceError."""
    import os

    path = tmp_path / "killed.h5"
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", UNFINISHED.format(tests=tests, path=str(path))], check=True, timeout=60)
    raw = path.read_bytes()
    cut, scribbled = tmp_path / "cut.h5", tmp_path / "scribbled.h5"
    cut.write_bytes(raw[: len(raw) // 3])
    rng = np.random.default_rng(1)
    scribbled.write_bytes(raw[:96] + rng.bytes(len(raw) - 96))
    for p, want in ((path, "opened"), (cut, "TraceError: cannot read"), (scribbled, "TraceError: cannot read")):
        out = subprocess.run([sys.executable, "-c", OPEN, str(p)], capture_output=True, text=True, timeout=60)
        assert out.stdout.startswith(want), (p.name, out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize("cmd", ["diff", "bisect"])
def test_cli_exit_2_with_one_line(tmp_path, capsys, cmd):
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"nope")
    good = _trace(tmp_path / "good.h5")
    assert main([cmd, str(good), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an HDF5" in err[0]
    assert main([cmd, str(tmp_path), str(good)]) == 2
    assert main(["replay", str(tmp_path / "missing.h5")]) == 2
