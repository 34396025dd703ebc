"""Anything that is not a readable trace is one clear TraceError (the CLI: exit 2)."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from divergence import Trace
from divergence.cli.main import main
from divergence.errors import TraceError
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
        f.attrs["schema_version"] = 99
    with pytest.raises(TraceError, match="newer"):
        Trace.open(p)


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
