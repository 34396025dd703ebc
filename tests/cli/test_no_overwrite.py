"""No command writes over a file it did not write (issue 49): every output option, each given an
existing file of another kind (a real trace, whatever its name, and a text file), refuses with one
line, exit 2, the file's bytes unchanged and nothing else written. A command's own earlier output,
unchanged since, is replaced; so is an HTML page by an HTML page."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from divergence.cli import own_outputs
from divergence.cli.main import SUBCOMMANDS, build_parser, main
from divergence.cli.paths import HTML, TRACE, file_kind, remember_outputs

TRACES = Path(__file__).parents[2] / "traces" / "v1"
TEXT = b"notes I wrote by hand\n"


@pytest.fixture
def pair(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    a, b = d / "serial.h5", d / "concurrent.h5"
    shutil.copy(TRACES / "serial.h5", a)
    shutil.copy(TRACES / "concurrent.h5", b)
    return a, b


@pytest.fixture
def records(tmp_path):
    d = tmp_path / "rec"
    d.mkdir()
    (d / "requests.jsonl").write_text('{"id": "r1", "prompt_tokens": [1, 2]}\n')
    return d


# (command, option) -> how the command is called with VICTIM as where that option writes: a file, or, for
# an option naming a directory (IN_A_DIR), victim.parent (the victim is then the file IN_A_DIR names there)
CASES = {
    ("report", "--html"): lambda a, b, rec, v: ["report", a, b, "--html", v],
    ("bisect", "--html"): lambda a, b, rec, v: ["bisect", a, b, "--html", v],
    ("replay", "--out"): lambda a, b, rec, v: ["replay", a, "--out", v],
    ("import", "--out"): lambda a, b, rec, v: ["import", rec, "--out", v],
    ("run", "--out"): lambda a, b, rec, v: ["run", "--out", v.parent, "--schedules", "serial", "--max-tokens", "2"],
    ("rerun", "--out"): lambda a, b, rec, v: ["rerun", a, "--out", v.parent],
    ("redact", "--out"): lambda a, b, rec, v: ["redact", a, b, "--out", v.parent],
    ("explain", "--html"): lambda a, b, rec, v: ["explain", _live(b), "r1", "--html", v],
    ("explain", "--out"): lambda a, b, rec, v: ["explain", _live(b), "r1", "--out", v.parent],
}
IN_A_DIR = {("run", "--out"): "serial.h5", ("rerun", "--out"): "serial.h5", ("redact", "--out"): "serial.h5",
            ("explain", "--out"): "serial.h5"}
# output options that never meet an existing file, and why
EXEMPT = {("serve", "--trace-dir"): "a directory; each live trace gets a new name (live-STAMP-N.h5)",
          ("replay", "--tap-out"): "internal: the parent process names a fresh temporary file"}


def _live(trace) -> Path:
    """A copy of `trace` beside it marked as a live server's (what explain takes)."""
    import h5py

    live = trace.with_name("live.h5")
    shutil.copy(trace, live)
    with h5py.File(live, "r+") as f:
        f["meta"].attrs["settings"] = json.dumps({**json.loads(f["meta"].attrs["settings"]), "serve": {}})
    return live


def _victim(tmp_path, case, content: bytes, name: str) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    v = d / IN_A_DIR.get(case, name)
    v.write_bytes(content)
    return v


def _call(argv, capsys):
    capsys.readouterr()
    rc = main([str(x) for x in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err


@pytest.mark.parametrize("case", list(CASES), ids=[" ".join(c) for c in CASES])
@pytest.mark.parametrize("victim, name", [("trace", "victim.h5"), ("trace", "notes.txt"), ("text", "victim.h5"),
                                          ("text", "page.html")])
def test_an_existing_file_of_another_kind_is_refused(tmp_path, pair, records, capsys, case, victim, name):
    content = (TRACES / "serial.h5").read_bytes() if victim == "trace" else TEXT
    v = _victim(tmp_path, case, content, name)
    before = sorted(v.parent.iterdir())
    rc, err = _call(CASES[case](*pair, records, v), capsys)
    assert rc == 2 and len(err) == 1, (rc, err)
    assert err[0].startswith(f"divergence {case[0]}: error: {case[1]} ") and str(v) in err[0], err
    assert ("is an existing trace" if victim == "trace" else "exists and is a file of another kind") in err[0], err
    assert v.read_bytes() == content, "the victim was changed"
    assert sorted(v.parent.iterdir()) == before, "something was written beside it"


def test_every_output_option_is_covered():
    """Each option of each command that names where output goes has a case above (or a reason not to)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    found = set()
    for name in SUBCOMMANDS:
        for action in sub.choices[name]._actions:
            if action.dest in ("out", "html", "trace_dir") or action.dest.endswith("_out"):
                found.add((name, max(action.option_strings, key=len)))
    assert found == set(CASES) | set(EXEMPT), found ^ (set(CASES) | set(EXEMPT))


def test_an_html_page_and_an_empty_file_are_replaced(tmp_path, pair, capsys):
    for content in (b"<!DOCTYPE html><p>last week's page", b"\xef\xbb\xbf\n  <html><body>old</body></html>", b""):
        page = tmp_path / "r.html"
        page.write_bytes(content)
        rc, err = _call(["report", *pair, "--html", page], capsys)
        assert rc in (0, 1), err
        assert page.read_text().startswith("<!DOCTYPE html>") and page.read_bytes() != content


def test_a_command_replaces_its_own_earlier_output_only(tmp_path, capsys):
    """run twice on one --out: the second replaces the first's traces. A trace copied over one, or
    another command's, is refused; so is the first's trace once changed."""
    out = tmp_path / "run"
    argv = ["run", "--out", out, "--schedules", "serial", "--max-tokens", "2"]
    rc, err = _call(argv, capsys)
    assert rc == 0, err
    first = (out / "serial.h5").stat()
    rc, err = _call(argv, capsys)
    assert rc == 0, err
    assert (out / "serial.h5").stat().st_ino != first.st_ino, "the first run's trace was replaced"
    # replay's own output at a path, then replay again to it
    r = tmp_path / "replayed.h5"
    for _ in range(2):
        rc, err = _call(["replay", out / "serial.h5", "--out", r, "--json"], capsys)
        assert rc == 0, err
    # run's trace is not replay's; replay's is not run's
    rc, err = _call(["replay", out / "serial.h5", "--out", tmp_path / "run" / "serial.h5"], capsys)
    assert rc == 2 and "inputs" in err[0], err
    shutil.copy(out / "serial.h5", tmp_path / "copy.h5")
    rc, err = _call(["replay", out / "serial.h5", "--out", tmp_path / "copy.h5"], capsys)
    assert rc == 2 and "is an existing trace this command did not write there" in err[0], err
    # a trace copied over run's own: no longer run's
    data = (TRACES / "serial.h5").read_bytes()
    shutil.copy(TRACES / "serial.h5", out / "serial.h5")
    rc, err = _call(argv, capsys)
    assert rc == 2 and len(err) == 1 and "is an existing trace" in err[0], err
    assert (out / "serial.h5").read_bytes() == data


def test_the_list_of_own_outputs(tmp_path):
    p = tmp_path / "t.h5"
    p.write_bytes(b"x" * 10)
    remember_outputs([p], command="replay")
    assert own_outputs.wrote(p, command="replay") and not own_outputs.wrote(p, command="import")
    assert own_outputs.wrote(tmp_path / "." / "t.h5", command="replay"), "one key per file, however named"
    os.utime(p, ns=(1, 1))  # the same bytes, touched: not as written
    assert not own_outputs.wrote(p, command="replay")
    remember_outputs([p], command="replay")
    p.write_bytes(b"y" * 10)  # rewritten in place (the same inode and size)
    assert not own_outputs.wrote(p, command="replay")


def test_an_unreadable_list_means_nothing_is_ones_own(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(own_outputs.CACHE_ENV, str(tmp_path / "cache"))
    p = tmp_path / "t.h5"
    p.write_bytes(b"x")
    assert remember_outputs([p], command="import") is None and own_outputs.wrote(p, command="import")
    own_outputs.ledger_path().write_text("{damaged")
    assert not own_outputs.wrote(p, command="import")
    assert own_outputs.remember([p], command="import") and own_outputs.wrote(p, command="import")


@pytest.mark.parametrize("offset", [0, 512, 2048])
def test_a_trace_is_known_by_its_signature_wherever_it_starts(tmp_path, offset):
    """HDF5's superblock may follow a user block of 512 * 2**n bytes; the name says nothing."""
    p = tmp_path / "notes.txt"
    p.write_bytes(b"\0" * offset + (TRACES / "serial.h5").read_bytes()[:4096])
    assert file_kind(p) == TRACE
    p.write_bytes(b"<!doctype HTML>")
    assert file_kind(p) == HTML
    p.write_bytes(b"\0" * 100 + b"\x89HDF\r\n\x1a\n")  # not where a superblock can start
    assert file_kind(p) is None
