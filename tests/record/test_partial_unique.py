"""The import writes its trace under a name unique to the process (`PATH.<pid>-<random>.partial`),
renamed to PATH once whole, removed on failure: another import's partial file is never touched."""
from __future__ import annotations

import os

import numpy as np
import pytest

from divergence import Trace
from divergence.record.jsonl import import_records
from divergence.trace.writer import TraceWriter

from .test_recorder import script, write_jsonl


def test_partial_name_is_unique_and_failure_removes_only_its_own(tmp_path, monkeypatch):
    d = write_jsonl(tmp_path / "in", script(np.random.default_rng(0)))
    out = tmp_path / "t.h5"
    other = tmp_path / "t.h5.partial"  # what another process writing the same PATH had used
    other.write_bytes(b"another import, still writing")
    seen = []
    real_start = TraceWriter.on_run_start

    def start(self, info):
        seen.append(self.path)
        real_start(self, info)
    monkeypatch.setattr(TraceWriter, "on_run_start", start)
    import_records(d, out)
    assert len(seen) == 1 and seen[0] != other and seen[0].name.startswith(f"t.h5.{os.getpid()}-")
    assert seen[0].name.endswith(".partial") and not seen[0].exists()
    with Trace.open(out) as t:
        assert t.completed
    assert other.read_bytes() == b"another import, still writing"

    def fail(self, completed):
        raise OSError("disk full")
    monkeypatch.setattr(TraceWriter, "on_run_end", fail)
    with pytest.raises(OSError):
        import_records(d, tmp_path / "u.h5")
    assert not (tmp_path / "u.h5").exists()
    assert sorted(p.name for p in tmp_path.glob("*.partial")) == ["t.h5.partial"]
    assert other.read_bytes() == b"another import, still writing"
