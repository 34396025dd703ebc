"""A trace damaged after it was written (edited with h5py, cut short, garbage in a column) that
still passes the checks at open: every reader says so on one line naming the table (and row),
the CLI exits 2, the Python API raises TraceError; none crashes or compares garbage.

The matrix: each edit of tests/trace/damage.py, made on a copy of a real run's trace, x each
reader (diff, bisect, replay, report --html, browse's data layer, the pytest plugin's assertion).
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from divergence.cli.main import main
from divergence.cli.paths import remember_outputs
from divergence.errors import TraceError

from .damage import EDITS, damage

COMMANDS = ["diff", "bisect", "replay", "report", "browse", "plugin"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("damaged") / "run"
    p = subprocess.run([sys.executable, "-m", "divergence", "run", "--out", str(d)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode in (0, 1), p.stderr
    return d


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, lines
    assert "Traceback" not in text
    return lines[0]


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("edit", list(EDITS))
def test_damaged_trace_is_one_line(run_dir, tmp_path, capsys, edit, cmd):
    a = run_dir / "serial.h5"
    b = damage(run_dir / "concurrent.h5", tmp_path / "damaged.h5", edit)
    capsys.readouterr()
    if cmd in ("browse", "plugin"):
        with pytest.raises(TraceError) as e:
            if cmd == "browse":
                from divergence.tui.data.session import BrowseData

                BrowseData.open(a, b).analyse()
            else:
                from divergence.testing.assertions import assert_traces_equal

                assert_traces_equal(a, b)
        line = _one_line(str(e.value))
    else:
        out = tmp_path / "out.h5"
        out.write_bytes(b"an earlier replay")
        remember_outputs([out], command="replay")  # an earlier replay's (else refused as another's file)
        argv = {"diff": ["diff", str(a), str(b)], "bisect": ["bisect", str(a), str(b)],
                "replay": ["replay", str(b), "--out", str(out)],
                "report": ["report", str(a), str(b), "--html", str(tmp_path / "r.html")]}[cmd]
        assert main(argv) == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(f"divergence {cmd}: error: ")
        assert out.read_bytes() == b"an earlier replay"  # nothing already written is lost
        assert not (tmp_path / "r.html").exists()
    assert f"{b} is a damaged trace: /" in line, line


def test_the_undamaged_pair_reads(run_dir):
    """The checks pass on the real traces the edits start from (else the matrix proves nothing)."""
    from divergence import Trace

    for name in ("serial", "concurrent"):
        with Trace.open(run_dir / f"{name}.h5") as t:
            t.check()
            assert t.completed and sum(len(t.tokens(r.id).tokens) for r in t.requests) == 257


def test_failed_replay_keeps_the_existing_out(run_dir, tmp_path, monkeypatch):
    """replay --out writes to a temporary name beside it, renamed at the end: a replay that fails
    half way leaves the earlier file as it was, and no partial file."""
    from divergence.analysis.replayer import Replayer
    from divergence.trace.writer import TraceWriter
    from divergence import Trace

    out = tmp_path / "replayed.h5"
    out.write_bytes(b"an earlier replay")
    real = TraceWriter.on_step
    calls = []

    def on_step(self, e):
        calls.append(e)
        if len(calls) == 20:
            raise OSError("the disk is full")
        real(self, e)
    monkeypatch.setattr(TraceWriter, "on_step", on_step)
    with Trace.open(run_dir / "serial.h5") as t, pytest.raises(OSError):
        Replayer().replay_to_file(t, out)
    assert len(calls) == 20
    assert out.read_bytes() == b"an earlier replay"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replayed.h5"]
    monkeypatch.setattr(TraceWriter, "on_step", real)
    with Trace.open(run_dir / "serial.h5") as t:
        rep = Replayer().replay_to_file(t, out)
    assert rep.faithful and sorted(p.name for p in tmp_path.iterdir()) == ["replayed.h5"]
    with Trace.open(out) as r:
        assert r.completed


@pytest.mark.parametrize("seed", range(2))
def test_garbage_bytes_are_one_line_trace_errors(run_dir, tmp_path, seed):
    """512 random bytes written over a trace, anywhere past the superblock, 40 times: each file
    reads whole or is one TraceError on one line (HDF5's own errors were OSErrors before)."""
    from divergence import Trace
    import numpy as np

    src = (run_dir / "serial.h5").read_bytes()
    rng = np.random.default_rng(seed)
    errors = 0
    for i in range(40):
        raw = bytearray(src)
        at = int(rng.integers(2048, len(raw) - 4096))
        raw[at: at + 512] = rng.bytes(512)
        p = tmp_path / f"garbage{i}.h5"
        p.write_bytes(bytes(raw))
        try:
            with Trace.open(p) as t:
                t.check()
        except TraceError as e:
            errors += 1
            assert "\n" not in str(e) and str(p) in str(e)
    assert errors > 0
